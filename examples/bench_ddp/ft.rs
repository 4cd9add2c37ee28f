//! `--mode ft` and `--mode ft_baseline`: the cost of fault tolerance (`tch_dist::ft`)
//! without faults, and what a fault costs (bench/driver.py's `ft` part).
//!
//! - `ft_baseline` (`tch-dist-run --nproc-per-node 2`): the model under `replicate`, two
//!   ranks, tch-dist's SGD: plain data parallelism.
//! - `ft` (`tch-dist-run --replica-groups 2 --nproc-per-node 1 --lighthouse URL`): the same
//!   model in two replica groups of one rank each, the gradients averaged by the
//!   fault-tolerant manager (a quorum, the average, the commit vote per step), the same SGD;
//!   the average's chunks leave during backward (`Manager::prepare_for_backward`).
//! - `ft_after_backward`: the same without `prepare_for_backward` (the whole average after
//!   backward), to measure what the overlap buys.
//!   With `--exit-at STEP` (the launcher's first start of group 1 only) group 1 exits at that
//!   step: the survivor then reports `fault_to_commit_ms` (from the start of the step that
//!   met the failure to its next committed step), and the restarted group
//!   `rejoin_to_commit_ms` (from its process start to its first committed step).

use super::*;
use tch_dist::ft::{FtOptions, Manager};

pub(crate) fn ft<M: BenchModel>(
    args: &Args,
    pg: &ProcessGroup,
    exit_at: Option<i64>,
) -> Result<(), Box<dyn std::error::Error>> {
    let started = Instant::now();
    let with_ft = args.mode != "ft_baseline";
    let overlap = args.mode == "ft";
    tch::manual_seed(0);
    let vs = nn::VarStore::new(args.device);
    let model = M::build(&vs.root(), &args.model)?;
    if !with_ft {
        replicate::apply(&model, replicate::Options::default())?;
    }
    let mut opt = tch_dist::optim::Sgd::default().build(&vs, 0.01)?;
    let mut manager = if with_ft {
        let opts = FtOptions {
            timeout: std::time::Duration::from_secs(5),
            ..FtOptions::from_env()?
        };
        Some(Manager::new(pg, opts)?)
    } else {
        None
    };
    let group = std::env::var("REPLICA_GROUP_ID").unwrap_or_default();
    let first_start = std::env::var("TORCHELASTIC_RESTART_COUNT").map_or(true, |c| c == "0");
    let exit_at = exit_at.filter(|_| with_ft && group == "1" && first_start);
    let rank = pg.rank() + group.parse::<usize>().unwrap_or(0);
    tch::manual_seed(1 + rank as i64);
    let batch = if args.batch > 0 {
        args.batch
    } else {
        M::default_batch()
    };
    let (x, target) = M::batch(&args.model, batch, args.device)?;
    let mut steps = vec![];
    // Where a fault-tolerant step's time goes: the quorum, the average, the commit vote.
    let (mut quorum_ms, mut average_ms, mut commit_ms) = (vec![], vec![], vec![]);
    let (mut cpu0, mut busy0, mut wall0) = (0.0, 0.0, Instant::now());
    let total = (args.warmup + args.steps) as i64;
    let (mut failed_at, mut fault_to_commit_ms, mut rejoin_to_commit_ms) = (None, None, None);
    let mut done = 0i64;
    while done < total {
        if done == args.warmup as i64 && steps.is_empty() {
            (cpu0, busy0, wall0) = (cpu_ms(), machine_busy_ms(), Instant::now());
        }
        let t0 = Instant::now();
        if let Some(m) = manager.as_mut() {
            m.start_quorum(&vs, &mut opt)?;
        }
        let q = ms(t0);
        opt.zero_grad();
        let loss = M::loss(&args.model, &model.f_call_t(&x, true)?, &target);
        if let Some(m) = manager.as_mut().filter(|_| overlap) {
            // The average's chunks leave during backward (a group of one rank).
            m.prepare_for_backward(&vs, &mut opt)?;
        }
        loss.f_backward()?;
        let committed = match manager.as_mut() {
            Some(m) => {
                if exit_at == Some(m.step()) {
                    std::process::exit(3);
                }
                let t1 = Instant::now();
                m.allreduce_gradients(&vs, &mut opt)?;
                let a = ms(t1);
                let t2 = Instant::now();
                let c = m.should_commit()?;
                if done >= args.warmup as i64 {
                    quorum_ms.push(q);
                    average_ms.push(a);
                    commit_ms.push(ms(t2));
                }
                c
            }
            None => true,
        };
        if committed {
            opt.step()?;
            if let Some(at) = failed_at.take() {
                fault_to_commit_ms = Some(ms(at));
            }
            if rejoin_to_commit_ms.is_none() && !first_start {
                rejoin_to_commit_ms = Some(ms(started));
            }
            if done >= args.warmup as i64 {
                steps.push(ms(t0));
            }
            done = manager.as_ref().map_or(done + 1, |m| m.step());
        } else if failed_at.is_none() {
            failed_at = Some(t0);
        }
    }
    let window = Window {
        wall_ms: ms(wall0),
        cpu_ms: cpu_ms() - cpu0,
        machine_busy_ms: machine_busy_ms() - busy0,
    };
    let (peak, current) = rss_mib();
    let out = serde_json::json!({
        "cpu_ms": window.cpu_ms / args.steps as f64,
        "window": window.json(),
        "impl": "tch-dist",
        "mode": args.mode,
        "model": args.model,
        "rank": rank,
        "replica_group": group,
        "restarted": !first_start,
        "median_ms": median(&steps),
        "steps_ms": steps,
        "peak_rss_mib": peak,
        "rss_mib": current,
        "fault_to_commit_ms": fault_to_commit_ms,
        "quorum_ms": if quorum_ms.is_empty() { 0.0 } else { median(&quorum_ms) },
        "average_ms": if average_ms.is_empty() { 0.0 } else { median(&average_ms) },
        "commit_ms": if commit_ms.is_empty() { 0.0 } else { median(&commit_ms) },
        "rejoin_to_commit_ms": rejoin_to_commit_ms,
    });
    println!("BENCH {out}");
    Ok(())
}
