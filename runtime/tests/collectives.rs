//! Every collective against hand-computed values, as real processes over 127.0.0.1.
//!
//! Each `#[test]` re-executes this binary once per rank (see `tch_dist_runtime::testing`).

use tch::{Kind, Tensor};
use tch_dist_runtime::testing::run_ranks;
use tch_dist_runtime::{Backend, ProcessGroup, ReduceOp};

const KINDS: [Kind; 4] = [Kind::Float, Kind::Double, Kind::BFloat16, Kind::Int64];

fn t(values: &[f64], kind: Kind) -> Tensor {
    Tensor::from_slice(values).to_kind(kind)
}

/// `values` laid out as a 2 x n matrix read column-major: a non-contiguous tensor.
fn non_contiguous(values: &[f64], kind: Kind) -> Tensor {
    let n = values.len() / 2;
    let m = t(values, kind).reshape([n as i64, 2]).tr();
    assert!(!m.is_contiguous());
    m
}

fn as_f64(x: &Tensor) -> Vec<f64> {
    Vec::<f64>::try_from(x.to_kind(Kind::Double).contiguous().view(-1)).unwrap()
}

fn assert_values(x: &Tensor, expected: &[f64], what: &str) {
    assert_eq!(as_f64(x), expected, "{what}");
}

/// Rank r holds [r+1, -(r+1), 2, r+1]; world 3 gives the values below for every reduction.
#[test]
fn all_reduce_every_op_and_dtype() {
    run_ranks("all_reduce_every_op_and_dtype", 3, |pg| {
        let r = pg.rank() as f64 + 1.0;
        let input = [r, -r, 2.0, r];
        let cases = [
            (ReduceOp::Sum, [6.0, -6.0, 6.0, 6.0]),
            (ReduceOp::Avg, [2.0, -2.0, 2.0, 2.0]),
            (ReduceOp::Min, [1.0, -3.0, 2.0, 1.0]),
            (ReduceOp::Max, [3.0, -1.0, 2.0, 3.0]),
            (ReduceOp::Product, [6.0, -6.0, 8.0, 6.0]),
        ];
        for kind in KINDS {
            for (op, expected) in cases {
                let x = t(&input, kind);
                pg.all_reduce(&x, op).unwrap();
                assert_eq!(x.kind(), kind);
                assert_values(&x, &expected, &format!("{op:?} {kind:?}"));
                // Non-contiguous: the result lands in the caller's strided view.
                let y = non_contiguous(&input, kind);
                pg.all_reduce(&y, op).unwrap();
                let expected_t = non_contiguous(&expected, Kind::Double);
                assert_values(
                    &y,
                    &as_f64(&expected_t),
                    &format!("{op:?} {kind:?} strided"),
                );
            }
        }
        // Integer averages truncate like integer division.
        let x = Tensor::from_slice(&[pg.rank() as i64]);
        pg.all_reduce(&x, ReduceOp::Avg).unwrap();
        assert_eq!(i64::try_from(&x).unwrap(), 1);
    });
}

#[test]
fn async_all_reduce_and_broadcast() {
    run_ranks("async_all_reduce_and_broadcast", 2, |pg| {
        for kind in KINDS {
            let a = t(&[pg.rank() as f64 + 1.0; 3], kind);
            let b = t(&[10.0 * (pg.rank() as f64 + 1.0)], kind);
            let wa = pg.all_reduce_async(&a, ReduceOp::Sum).unwrap();
            let wb = pg.all_reduce_async(&b, ReduceOp::Max).unwrap();
            wb.wait().unwrap();
            wa.wait().unwrap();
            assert_values(&a, &[3.0, 3.0, 3.0], "async sum");
            assert_values(&b, &[20.0], "async max");

            let x = if pg.rank() == 1 {
                t(&[7.0, 8.0, 9.0, 10.0], kind)
            } else {
                t(&[0.0; 4], kind)
            };
            pg.broadcast(&x, 1).unwrap();
            assert_values(&x, &[7.0, 8.0, 9.0, 10.0], "broadcast");
            let y = if pg.rank() == 0 {
                non_contiguous(&[1.0, 2.0, 3.0, 4.0], kind)
            } else {
                non_contiguous(&[0.0; 4], kind)
            };
            pg.broadcast_async(&y, 0).unwrap().wait().unwrap();
            assert_values(&y, &[1.0, 3.0, 2.0, 4.0], "strided broadcast");
        }
        let err = pg
            .broadcast(&Tensor::zeros([1], (Kind::Float, tch::Device::Cpu)), 2)
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "rank {}: invalid argument to broadcast: source rank 2 is not in a group of size 2",
                pg.rank()
            )
        );
    });
}

#[test]
fn all_gather_list_and_flat() {
    run_ranks("all_gather_list_and_flat", 3, |pg| {
        let r = pg.rank() as f64;
        for kind in KINDS {
            let input = t(&[r, r + 10.0], kind);
            let outputs: Vec<Tensor> = (0..3).map(|_| t(&[-1.0, -1.0], kind)).collect();
            pg.all_gather(&outputs, &input).unwrap();
            for (i, o) in outputs.iter().enumerate() {
                assert_values(
                    o,
                    &[i as f64, i as f64 + 10.0],
                    &format!("all_gather {kind:?} from {i}"),
                );
            }
            // Flat: rows concatenated along dim 0; a non-contiguous input is fine.
            let input = non_contiguous(&[r, r + 10.0, r + 20.0, r + 30.0], kind); // [[r, r+20], [r+10, r+30]]
            let flat = Tensor::zeros([6, 2], (kind, tch::Device::Cpu));
            pg.all_gather_into_tensor(&flat, &input).unwrap();
            let mut expected = Vec::new();
            for i in 0..3 {
                let i = i as f64;
                expected.extend([i, i + 20.0, i + 10.0, i + 30.0]);
            }
            assert_values(
                &flat,
                &expected,
                &format!("all_gather_into_tensor {kind:?}"),
            );
        }
        let wrong = Tensor::zeros([5, 2], (Kind::Float, tch::Device::Cpu));
        let err = pg.all_gather_into_tensor(
            &wrong,
            &Tensor::zeros([2, 2], (Kind::Float, tch::Device::Cpu)),
        );
        assert!(err
            .unwrap_err()
            .to_string()
            .contains("all_gather_into_tensor"));
    });
}

#[test]
fn reduce_scatter_list_and_flat() {
    run_ranks("reduce_scatter_list_and_flat", 3, |pg| {
        let r = pg.rank() as f64 + 1.0; // 1, 2, 3: their sum is 6
        let me = pg.rank() as f64 + 1.0;
        for kind in KINDS {
            // inputs[j] = r * (j+1): rank j receives 6 * (j+1).
            let inputs: Vec<Tensor> = (0..3)
                .map(|j| t(&[r * (j as f64 + 1.0); 2], kind))
                .collect();
            let out = t(&[0.0, 0.0], kind);
            pg.reduce_scatter(&out, &inputs, ReduceOp::Sum).unwrap();
            assert_values(&out, &[6.0 * me; 2], &format!("reduce_scatter {kind:?}"));

            let flat = t(&[r, 2.0 * r, 3.0 * r, 4.0 * r, 5.0 * r, 6.0 * r], kind);
            let out = t(&[0.0, 0.0], kind);
            pg.reduce_scatter_tensor(&out, &flat, ReduceOp::Avg)
                .unwrap();
            let k = 2.0 * pg.rank() as f64;
            assert_values(
                &out,
                &[2.0 * (k + 1.0), 2.0 * (k + 2.0)],
                &format!("reduce_scatter_tensor avg {kind:?}"),
            );
            let out = t(&[0.0, 0.0], kind);
            pg.reduce_scatter_tensor(&out, &flat, ReduceOp::Max)
                .unwrap();
            assert_values(
                &out,
                &[3.0 * (k + 1.0), 3.0 * (k + 2.0)],
                &format!("reduce_scatter_tensor max {kind:?}"),
            );
        }
    });
}

#[test]
fn all_to_all_send_recv_barrier() {
    run_ranks("all_to_all_send_recv_barrier", 3, |pg| {
        let r = pg.rank();
        let w = pg.world_size();
        for kind in KINDS {
            let input = t(
                &(0..w).map(|j| (10 * r + j) as f64).collect::<Vec<_>>(),
                kind,
            );
            let output = t(&[0.0; 3], kind);
            pg.all_to_all_single(&output, &input).unwrap();
            let expected: Vec<f64> = (0..w).map(|j| (10 * j + r) as f64).collect();
            assert_values(&output, &expected, &format!("all_to_all {kind:?}"));

            // A ring: send to the next rank, receive from the previous one.
            let send = t(&[r as f64, 100.0], kind);
            let recv = t(&[0.0, 0.0], kind);
            let ws = pg.send_async(&send, (r + 1) % w, 7).unwrap();
            pg.recv(&recv, (r + w - 1) % w, 7).unwrap();
            ws.wait().unwrap();
            assert_values(
                &recv,
                &[((r + w - 1) % w) as f64, 100.0],
                &format!("recv {kind:?}"),
            );
        }
        pg.barrier().unwrap();
        pg.monitored_barrier(std::time::Duration::from_secs(30), true)
            .unwrap();
        let err = pg
            .send(&Tensor::zeros([1], (Kind::Float, tch::Device::Cpu)), r, 0)
            .unwrap_err();
        assert!(
            err.to_string()
                .contains("cannot send to or receive from itself"),
            "{err}"
        );
    });
}

/// Rank 2 never reaches the barrier: rank 0's monitored barrier names it.
#[test]
fn monitored_barrier_names_missing_rank() {
    run_ranks("monitored_barrier_names_missing_rank", 3, |pg| {
        let timeout = std::time::Duration::from_secs(2);
        match pg.rank() {
            0 => {
                let err = pg.monitored_barrier(timeout, true).unwrap_err();
                let msg = err.to_string();
                assert!(msg.starts_with("rank 0: monitored_barrier failed"), "{msg}");
                assert!(
                    msg.contains("Ranks 2 failed to pass monitoredBarrier"),
                    "{msg}"
                );
            }
            1 => {
                let _ = pg.monitored_barrier(timeout, true);
            }
            _ => std::thread::sleep(std::time::Duration::from_secs(4)),
        }
    });
}

/// The default group, a subgroup and a second subgroup alive at once.
#[test]
fn default_and_explicit_groups() {
    run_ranks("default_and_explicit_groups", 3, |pg: ProcessGroup| {
        let low = pg.new_group(&[0, 1], Backend::Gloo).unwrap();
        let high = pg.new_group(&[2, 1], Backend::Gloo).unwrap();
        assert_eq!(low.is_some(), pg.rank() < 2);
        assert_eq!(high.is_some(), pg.rank() >= 1);
        let x = Tensor::from_slice(&[pg.rank() as f32 + 1.0]);
        let mut works = Vec::new();
        let lx = x.copy();
        let hx = x.copy();
        if let Some(g) = &low {
            assert_eq!(g.world_size(), 2);
            assert_eq!(g.global_ranks(), &[0, 1]);
            works.push(g.all_reduce_async(&lx, ReduceOp::Sum).unwrap());
        }
        if let Some(g) = &high {
            // As in PyTorch, the ranks are sorted: {2, 1} is [1, 2].
            assert_eq!(g.global_ranks(), &[1, 2]);
            assert_eq!(g.rank(), if pg.rank() == 2 { 1 } else { 0 });
            works.push(g.all_reduce_async(&hx, ReduceOp::Sum).unwrap());
        }
        pg.all_reduce(&x, ReduceOp::Sum).unwrap();
        for w in works {
            w.wait().unwrap();
        }
        assert_values(&x, &[6.0], "default group");
        if low.is_some() {
            assert_values(&lx, &[3.0], "group {0,1}");
        }
        if high.is_some() {
            assert_values(&hx, &[5.0], "group {2,1}");
        }
        // Broadcast's source is a group rank: rank 1 of {2, 1} is global rank 2.
        if let Some(g) = &high {
            let b = Tensor::from_slice(&[pg.rank() as f32]);
            g.broadcast(&b, 1).unwrap();
            assert_values(&b, &[2.0], "subgroup broadcast");
        }
        let err = pg.new_group(&[0, 3], Backend::Gloo).unwrap_err();
        assert!(
            err.to_string()
                .contains("rank 3 is not in a group of size 3"),
            "{err}"
        );
    });
}

/// The process-wide default group, as `torch.distributed.init_process_group` makes it.
#[test]
fn default_group_from_env() {
    if let Some(w) = tch_dist_runtime::testing::worker() {
        if w != "default_group_from_env" {
            return;
        }
        assert!(matches!(
            tch_dist_runtime::default_group(),
            Err(tch_dist_runtime::DistError::NotInitialized)
        ));
        let pg = tch_dist_runtime::init_process_group(Backend::Gloo).unwrap();
        assert!(matches!(
            tch_dist_runtime::init_process_group(Backend::Gloo),
            Err(tch_dist_runtime::DistError::AlreadyInitialized)
        ));
        let x = Tensor::from_slice(&[1i64]);
        tch_dist_runtime::default_group()
            .unwrap()
            .all_reduce(&x, ReduceOp::Sum)
            .unwrap();
        assert_eq!(i64::try_from(&x).unwrap(), pg.world_size() as i64);
        tch_dist_runtime::destroy_process_group();
        assert!(!tch_dist_runtime::is_initialized());
        return;
    }
    let out = tch_dist_runtime::testing::Launch::new("default_group_from_env", 2).run();
    assert!(
        out.iter().all(|o| o.success()),
        "{}",
        tch_dist_runtime::testing::describe(&out)
    );
}

/// Slurm's variables (no RANK/WORLD_SIZE/MASTER_ADDR) start the same ranks.
#[test]
fn slurm_variables() {
    let launch = tch_dist_runtime::testing::Launch::new("slurm_variables", 2).slurm();
    tch_dist_runtime::testing::run_ranks_with(&launch, Backend::Gloo, |pg| {
        assert!(std::env::var("RANK").is_err());
        let x = Tensor::from_slice(&[pg.rank() as f32 + 1.0]);
        pg.all_reduce(&x, ReduceOp::Sum).unwrap();
        assert_values(&x, &[3.0], "slurm all_reduce");
    });
}

/// The differentiable all-to-all with uneven (and empty) splits at 3 ranks: rank i sends
/// `S[i][j]` rows to rank j, each row naming its source, destination and position; rank j
/// receives them in rank order and learns the counts; backward sends each row's gradient
/// back to where it came from. Bad splits or rows of another width on one rank are an
/// error on every rank, and the ranks stay in step.
#[test]
fn differentiable_all_to_all_with_uneven_splits() {
    use tch_dist_runtime::sharding::functional::all_to_all_single;
    use tch_dist_runtime::DistError;
    const S: [[i64; 3]; 3] = [[1, 2, 0], [0, 1, 3], [2, 0, 1]];
    run_ranks("differentiable_all_to_all_with_uneven_splits", 3, |pg| {
        let me = pg.rank();
        let row = |src: usize, dst: usize, k: i64| (100 * src + 10 * dst) as f64 + k as f64;
        let rows: Vec<f64> = (0..3)
            .flat_map(|j| (0..S[me][j]).flat_map(move |k| [row(me, j, k), -row(me, j, k)]))
            .collect();
        let n = rows.len() as i64 / 2;
        let x = Tensor::from_slice(&rows)
            .reshape([n, 2])
            .set_requires_grad(true);
        let (got, from_each) = all_to_all_single(&x, &S[me], &pg).unwrap();
        assert_eq!(from_each, (0..3).map(|i| S[i][me]).collect::<Vec<_>>());
        let expected: Vec<f64> = (0..3)
            .flat_map(|i| (0..S[i][me]).flat_map(move |k| [row(i, me, k), -row(i, me, k)]))
            .collect();
        assert_values(&got, &expected, "received rows");
        // d(sum(got * got.detach())) / dx: every row's gradient is the row itself, sent back.
        (&got * got.detach()).sum(Kind::Double).backward();
        assert_values(&x.grad(), &rows, "gradients sent back");
        // Under no_grad: the same rows, no graph.
        let (plain, _) = tch::no_grad(|| all_to_all_single(&x, &S[me], &pg)).unwrap();
        assert!(!plain.requires_grad());
        assert_values(&plain, &expected, "no_grad");
        // Rank 1's splits do not add up to its rows: every rank refuses, nothing moves.
        let bad = if me == 1 { [1, 1, 1] } else { S[me] };
        let cause = |r: Result<(Tensor, Vec<i64>), DistError>| match r {
            Err(DistError::Collective { cause, .. }) => cause,
            other => panic!("expected a refusal, got {other:?}"),
        };
        let c = cause(all_to_all_single(&x, &bad, &pg));
        match me {
            1 => assert_eq!(
                c,
                "input splits [1, 1, 1] add up to 3 rows; the input has 4"
            ),
            _ => assert_eq!(c, "ranks [1] refused their arguments"),
        }
        // Rank 2's rows are wider.
        let wide = if me == 2 {
            Tensor::zeros([n, 3], (Kind::Double, tch::Device::Cpu))
        } else {
            x.detach()
        };
        let c = cause(all_to_all_single(&wide, &S[me], &pg));
        assert!(c.starts_with("rows of "), "{c}");
        // Still in step.
        let (again, _) = all_to_all_single(&x.detach(), &S[me], &pg).unwrap();
        assert_values(&again, &expected, "after the refusals");
    });
}
