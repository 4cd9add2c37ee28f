//! Check 12, fault tolerance on the device: two replica groups of one rank each (this binary
//! again, `--ft-group` with `REPLICA_GROUP_ID` G, each a job of its own started by
//! `spawn_ranks`) with their parameters on `cuda:0`, at a
//! lighthouse this process serves. Group 1 starts from other weights and takes group 0's at
//! step 0 (`init_sync`: the live state sent through host memory over the quorum's Gloo
//! group, landing on the device); each step averages the two groups' gradients (the
//! average's buffer in host memory, the device's gradients copied in and out). Each group
//! ends equal to one process training group 0's weights on both groups' batches together.

use super::*;
use tch_dist::ft::{FtOptions, LighthouseOptions, LighthouseServer, Manager};

/// The committed steps each group trains.
const STEPS: i64 = 4;

/// The model: 8 -> 16, tanh, 16 -> 4.
fn model(vs: &nn::VarStore) -> impl Fn(&Tensor) -> Tensor {
    let fc1 = nn::linear(vs.root() / "fc1", 8, 16, Default::default());
    let fc2 = nn::linear(vs.root() / "fc2", 16, 4, Default::default());
    move |x| x.apply(&fc1).tanh().apply(&fc2)
}

/// Group `group`'s batch of step `step` on the device.
fn ft_batch(step: i64, group: i64) -> (Tensor, Tensor) {
    tch::manual_seed(100 * step + group);
    (
        Tensor::randn([16, 8], (Kind::Float, dev())),
        Tensor::randn([16, 4], (Kind::Float, dev())),
    )
}

fn sgd(vs: &nn::VarStore) -> Result<tch_dist::optim::Optimizer, String> {
    tch_dist::optim::Sgd {
        momentum: 0.9,
        ..Default::default()
    }
    .build(vs, 0.05)
    .map_err(|e| e.to_string())
}

pub(crate) fn check_ft_groups() -> Outcome {
    let lighthouse = LighthouseServer::start(LighthouseOptions {
        bind: "127.0.0.1:0".into(),
        ..LighthouseOptions::new(2)
    })
    .expect("a lighthouse");
    let address = lighthouse.address();
    // Each group a job of one rank of its own (its own store), both at once.
    let groups: Vec<Vec<(bool, String)>> = std::thread::scope(|s| {
        let running: Vec<_> = ["0", "1"]
            .map(|group| {
                let env = [
                    ("REPLICA_GROUP_ID", group),
                    ("TORCHFT_LIGHTHOUSE", address.as_str()),
                ];
                s.spawn(move || spawn_ranks("--ft-group", 1, &env))
            })
            .into_iter()
            .collect();
        running
            .into_iter()
            .map(|r| r.join().expect("a replica group's launch"))
            .collect()
    });
    for (group, ranks) in groups.iter().enumerate() {
        check_children(&format!("replica group {group}"), ranks);
        if let Some(line) = ranks[0].1.lines().find(|l| l.starts_with("ft group")) {
            println!("        {line}");
        }
    }
    Outcome::Pass
}

/// One replica group: `STEPS` fault-tolerant steps on the device against one process.
pub(crate) fn ft_group() -> Result<(), String> {
    let pg = init_process_group(Backend::Gloo).map_err(|e| e.to_string())?;
    let opts = FtOptions::from_env().map_err(|e| e.to_string())?;
    let group: i64 = std::env::var("REPLICA_GROUP_ID")
        .ok()
        .and_then(|g| g.parse().ok())
        .ok_or("no REPLICA_GROUP_ID")?;
    // The reference: group 0's weights, both groups' batches at once.
    tch::manual_seed(1);
    let ref_vs = nn::VarStore::new(dev());
    let reference = model(&ref_vs);
    let mut ref_opt = sgd(&ref_vs)?;
    // This group: its own weights (group 1's differ until it takes group 0's at step 0).
    tch::manual_seed(1 + group);
    let vs = nn::VarStore::new(dev());
    let net = model(&vs);
    let mut opt = sgd(&vs)?;
    let ref_vars = ref_vs.variables();
    let apart = vs.variables().iter().fold(0f64, |worst, (fqn, t)| {
        worst.max((t - &ref_vars[fqn]).abs().max().double_value(&[]))
    });
    if (group == 1) != (apart > 0.0) {
        return Err(format!(
            "group {group} starts {apart} from group 0's weights"
        ));
    }
    let mut ft = Manager::new(&pg, opts).map_err(|e| tch_dist::report(&e))?;
    let start = Instant::now();
    while ft.step() < STEPS {
        ft.start_quorum(&vs, &mut opt)
            .map_err(|e| tch_dist::report(&e))?;
        opt.zero_grad();
        let (x, y) = ft_batch(ft.step(), group);
        let loss = net(&x).mse_loss(&y, tch::Reduction::Mean);
        if group == 1 {
            // Group 1's chunks leave during backward: its hooks copy each device gradient
            // into the host buffer as it is accumulated; group 0's average waits.
            ft.prepare_for_backward(&vs, &mut opt)
                .map_err(|e| tch_dist::report(&e))?;
        }
        loss.backward();
        ft.allreduce_gradients(&vs, &mut opt)
            .map_err(|e| tch_dist::report(&e))?;
        if ft.should_commit().map_err(|e| tch_dist::report(&e))? {
            opt.step().map_err(|e| e.to_string())?;
        } else {
            return Err(format!(
                "step {} did not commit: {:?}",
                ft.step(),
                ft.errored()
            ));
        }
    }
    for step in 0..STEPS {
        let ((x0, y0), (x1, y1)) = (ft_batch(step, 0), ft_batch(step, 1));
        ref_opt.zero_grad();
        reference(&Tensor::cat(&[x0, x1], 0))
            .mse_loss(&Tensor::cat(&[y0, y1], 0), tch::Reduction::Mean)
            .backward();
        ref_opt.step().map_err(|e| e.to_string())?;
    }
    let mut worst = 0f64;
    for (fqn, t) in vs.variables() {
        if t.device() != dev() {
            return Err(format!("`{fqn}` left the device: {:?}", t.device()));
        }
        worst = worst.max((&t - &ref_vars[&fqn]).abs().max().double_value(&[]));
        let momentum = |o: &tch_dist::optim::Optimizer| {
            o.state(&fqn)
                .and_then(|s| s.get("momentum_buffer"))
                .map(|m| m.shallow_clone())
        };
        match (momentum(&opt), momentum(&ref_opt)) {
            (Some(m), Some(r)) if m.device() == dev() => {
                worst = worst.max((&m - &r).abs().max().double_value(&[]));
            }
            (m, _) => {
                return Err(format!(
                    "`{fqn}`'s momentum is {:?}, not on the device",
                    m.map(|m| m.device())
                ))
            }
        }
    }
    if worst >= 1e-5 {
        return Err(format!(
            "group {group}: differs from one process by {worst}"
        ));
    }
    println!(
        "ft group {group}: {STEPS} committed steps on {:?} in {:.1} ms from weights {apart:.2e} from group 0's, max |ft - one process| = {worst:.2e}",
        dev(),
        ms(start.elapsed()),
    );
    Ok(())
}
