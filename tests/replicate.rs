//! `replicate::apply` end to end, ranks as real processes over 127.0.0.1: equivalence with
//! single-process training, no_sync, ignored modules, broadcast at apply, and the errors.

use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};
use tch_dist::testing::{run_ranks, run_ranks_with, Launch};
use tch_dist::{replicate, Backend, Call, ProcessGroup, Shardable};

#[derive(Debug, Shardable)]
struct Net {
    fc1: nn::Linear,
    fc2: nn::Linear,
    head: Option<nn::Linear>,
}

impl Module for Net {
    fn forward(&self, xs: &Tensor) -> Tensor {
        // `head` stays unused when present: the unused-parameter cases.
        self.fc2.call(&self.fc1.call(xs).tanh())
    }
}

fn net(vs: &nn::VarStore, hidden: i64, with_head: bool) -> Net {
    let root = vs.root();
    Net {
        fc1: nn::linear(&root / "fc1", 4, hidden, Default::default()),
        fc2: nn::linear(&root / "fc2", hidden, 3, Default::default()),
        head: with_head.then(|| nn::linear(&root / "head", 3, 3, Default::default())),
    }
}

const BATCH: i64 = 12;

fn batch(step: usize) -> (Tensor, Tensor) {
    tch::manual_seed(500 + step as i64);
    (
        Tensor::randn([BATCH, 4], (Kind::Float, Device::Cpu)),
        Tensor::randn([BATCH, 3], (Kind::Float, Device::Cpu)),
    )
}

fn slice(t: &Tensor, pg: &ProcessGroup) -> Tensor {
    let n = BATCH / pg.world_size() as i64;
    t.narrow(0, pg.rank() as i64 * n, n)
}

fn max_diff(a: &nn::VarStore, b: &nn::VarStore) -> f64 {
    let (va, vb) = (a.variables(), b.variables());
    va.iter()
        .map(|(k, t)| (t - &vb[k]).abs().max().double_value(&[]))
        .fold(0.0, f64::max)
}

/// Trains `steps` SGD steps replicated (each rank on its slice) and as one process on the
/// whole batch, from the same initial weights; returns the largest parameter difference.
fn train_both(pg: &ProcessGroup, opts: replicate::Options, with_head: bool, steps: usize) -> f64 {
    tch::manual_seed(3);
    let ref_vs = nn::VarStore::new(Device::Cpu);
    let reference = net(&ref_vs, 8, with_head);
    // Every rank starts from different weights: apply must broadcast rank 0's.
    tch::manual_seed(3 + pg.rank() as i64 * 1000);
    let vs = nn::VarStore::new(Device::Cpu);
    let model = net(&vs, 8, with_head);
    replicate::apply(&model, opts).unwrap();
    let mut opt = nn::Sgd::default().build(&vs, 0.1).unwrap();
    let mut ref_opt = nn::Sgd::default().build(&ref_vs, 0.1).unwrap();
    // Rank 0's initial weights equal the reference's (same seed).
    for step in 0..steps {
        let (x, y) = batch(step);
        ref_opt.backward_step(&reference.forward(&x).mse_loss(&y, tch::Reduction::Mean));
        opt.backward_step(
            &model
                .call(&slice(&x, pg))
                .mse_loss(&slice(&y, pg), tch::Reduction::Mean),
        );
    }
    max_diff(&vs, &ref_vs)
}

#[test]
fn replicate_matches_single_process_training() {
    run_ranks("replicate_matches_single_process_training", 3, |pg| {
        let d = train_both(&pg, replicate::Options::default(), false, 5);
        assert!(d < 1e-5, "defaults: {d}");
        let one_bucket = replicate::Options {
            bucket_cap_mb: 1e6,
            ..Default::default()
        };
        let d = train_both(&pg, one_bucket, false, 3);
        assert!(d < 1e-5, "one bucket: {d}");
        let per_param = replicate::Options {
            bucket_cap_mb: 1e-9,
            ..Default::default()
        };
        let d = train_both(&pg, per_param, false, 3);
        assert!(d < 1e-5, "a bucket per parameter: {d}");
        let views = replicate::Options {
            gradient_as_bucket_view: true,
            ..Default::default()
        };
        let d = train_both(&pg, views, false, 3);
        assert!(d < 1e-5, "gradient_as_bucket_view: {d}");
        let unused = replicate::Options {
            find_unused_parameters: true,
            ..Default::default()
        };
        let d = train_both(&pg, unused, true, 3);
        assert!(d < 1e-5, "find_unused_parameters: {d}");
    });
}

#[test]
fn state_reports_fqns_and_buckets() {
    run_ranks("state_reports_fqns_and_buckets", 2, |pg| {
        let vs = nn::VarStore::new(Device::Cpu);
        let model = net(&vs, 8, false);
        let opts = replicate::Options {
            bucket_cap_mb: 1e-9,
            process_group: Some(pg),
            ..Default::default()
        };
        replicate::apply(&model, opts).unwrap();
        let s = replicate::state(&model).unwrap();
        assert_eq!(
            s.param_fqns(),
            ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
        );
        assert_eq!(
            s.buckets(),
            vec![
                vec!["fc2.bias"],
                vec!["fc2.weight"],
                vec!["fc1.bias"],
                vec!["fc1.weight"]
            ]
        );
        assert_eq!(tch_dist::registry(&model), vec!["replicate"]);
        assert!(replicate::state(&model.fc1).is_none());
    });
}

/// k micro-steps under no_sync, then one synchronised step, equal one step on k× the batch.
#[test]
fn no_sync_accumulates_then_averages() {
    run_ranks("no_sync_accumulates_then_averages", 2, |pg| {
        tch::manual_seed(3);
        let ref_vs = nn::VarStore::new(Device::Cpu);
        let reference = net(&ref_vs, 8, false);
        tch::manual_seed(3);
        let vs = nn::VarStore::new(Device::Cpu);
        let model = net(&vs, 8, false);
        replicate::apply(&model, replicate::Options::default()).unwrap();
        let mut opt = nn::Sgd::default().build(&vs, 0.1).unwrap();
        let mut ref_opt = nn::Sgd::default().build(&ref_vs, 0.1).unwrap();
        let k = 3;
        // Reference: the mean loss over all k batches, one step.
        let mut total = Tensor::zeros([], (Kind::Float, Device::Cpu));
        for step in 0..k {
            let (x, y) = batch(step);
            total += reference.forward(&x).mse_loss(&y, tch::Reduction::Mean) / k as f64;
        }
        ref_opt.backward_step(&total);
        opt.zero_grad();
        replicate::no_sync(&model, || {
            for step in 0..k - 1 {
                let (x, y) = batch(step);
                (model
                    .call(&slice(&x, &pg))
                    .mse_loss(&slice(&y, &pg), tch::Reduction::Mean)
                    / k as f64)
                    .backward();
            }
        })
        .unwrap();
        let (x, y) = batch(k - 1);
        (model
            .call(&slice(&x, &pg))
            .mse_loss(&slice(&y, &pg), tch::Reduction::Mean)
            / k as f64)
            .backward();
        opt.step();
        let d = max_diff(&vs, &ref_vs);
        assert!(d < 1e-5, "no_sync: {d}");
    });
}

/// Parameters of ignored modules keep each rank's own gradient.
#[test]
fn ignored_modules_are_not_synchronised() {
    run_ranks("ignored_modules_are_not_synchronised", 2, |pg| {
        let vs = nn::VarStore::new(Device::Cpu);
        let model = net(&vs, 8, false);
        let opts = replicate::Options::default().ignore(&model.fc1).unwrap();
        replicate::apply(&model, opts).unwrap();
        assert_eq!(
            replicate::state(&model).unwrap().param_fqns(),
            ["fc2.weight", "fc2.bias"]
        );
        let (x, y) = batch(0);
        model
            .call(&slice(&x, &pg))
            .mse_loss(&slice(&y, &pg), tch::Reduction::Mean)
            .backward();
        let g1 = model.fc1.ws.grad();
        let g2 = model.fc2.ws.grad();
        let (a1, a2) = (g1.copy(), g2.copy());
        pg.all_reduce(&a1, tch_dist::ReduceOp::Avg).unwrap();
        pg.all_reduce(&a2, tch_dist::ReduceOp::Avg).unwrap();
        assert!(g2.allclose(&a2, 1e-6, 1e-7, false), "fc2 is synchronised");
        assert!(
            !g1.allclose(&a1, 1e-6, 1e-7, false),
            "fc1 (ignored) keeps the local gradient"
        );
    });
}

#[test]
fn shape_mismatch_fails_on_every_rank() {
    run_ranks("shape_mismatch_fails_on_every_rank", 2, |pg| {
        let vs = nn::VarStore::new(Device::Cpu);
        let model = net(&vs, 8 + pg.rank() as i64, false);
        let err = replicate::apply(&model, replicate::Options::default())
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            format!(
                "rank {}: replicate: parameters differ across ranks: `fc1.weight` has shape [8, 4] (Float) on rank 0 but shape [9, 4] (Float) on rank 1",
                pg.rank()
            )
        );
        // Nothing was registered: the module can still be replicated once fixed.
        assert!(tch_dist::registry(&model).is_empty());
    });
}

#[test]
fn unused_parameter_fails_the_next_iteration() {
    run_ranks("unused_parameter_fails_the_next_iteration", 2, |pg| {
        let vs = nn::VarStore::new(Device::Cpu);
        let model = net(&vs, 8, true);
        replicate::apply(&model, replicate::Options::default()).unwrap();
        let (x, y) = batch(0);
        model
            .call(&slice(&x, &pg))
            .mse_loss(&slice(&y, &pg), tch::Reduction::Mean)
            .backward();
        let err = replicate::prepare_forward(&model).unwrap_err().to_string();
        assert!(
            err.contains("Expected to have finished reduction in the prior iteration"),
            "{err}"
        );
        assert!(
            err.ends_with(&format!(
                "did not receive grad for rank {}: head.weight, head.bias",
                pg.rank()
            )),
            "{err}"
        );
        // The forward hook raises the same error, as PyTorch's forward does.
        let panic =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| model.call(&x))).unwrap_err();
        let msg = panic.downcast_ref::<String>().cloned().unwrap_or_default();
        assert!(msg.contains("Expected to have finished reduction"), "{msg}");
    });
}

#[test]
fn apply_twice_and_conflicts_are_refused() {
    run_ranks_with(
        &Launch::new("apply_twice_and_conflicts_are_refused", 2),
        Backend::Gloo,
        |pg| {
            tch_dist::testing::fully_shard::apply(&net(&nn::VarStore::new(Device::Cpu), 8, false))
                .unwrap();
            let vs = nn::VarStore::new(Device::Cpu);
            let model = net(&vs, 8, false);
            let opts = || replicate::Options {
                process_group: Some(pg.clone()),
                ..Default::default()
            };
            replicate::apply(&model, opts()).unwrap();
            let err = replicate::apply(&model, opts()).unwrap_err().to_string();
            assert!(
                err.contains("can only be applied to a module once")
                    && err.contains("replicate has already been applied"),
                "{err}"
            );

            let vs2 = nn::VarStore::new(Device::Cpu);
            let sharded = net(&vs2, 8, false);
            tch_dist::testing::fully_shard::apply(&sharded).unwrap();
            let err = replicate::apply(&sharded, opts()).unwrap_err().to_string();
            assert!(
                err.contains("fully_shard") && err.contains("replicate"),
                "{err}"
            );

            // A child managed by fully_shard is skipped by replicate.
            let vs3 = nn::VarStore::new(Device::Cpu);
            let partly = net(&vs3, 8, false);
            tch_dist::testing::fully_shard::apply(&partly.fc2).unwrap();
            replicate::apply(&partly, opts()).unwrap();
            assert_eq!(
                replicate::state(&partly).unwrap().param_fqns(),
                ["fc1.weight", "fc1.bias"]
            );
        },
    );
}
