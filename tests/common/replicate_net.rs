//! The model, the option cases and the equivalence checks shared by `tests/replicate.rs`
//! (CPU, Gloo, 2-3 ranks), `tests/wrap.rs` and `examples/gpu_check/` (CUDA, NCCL, one rank),
//! included by each with `#[path]`: an example cannot import test code, and the GPU run must
//! check what the tests check.

#![allow(dead_code)] // each includer uses part of it

use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};
use tch_dist::{replicate, Call, ProcessGroup, Shardable};

/// The whole batch; each rank trains on its `BATCH / world_size` rows.
pub const BATCH: i64 = 12;

#[derive(Debug, Shardable)]
pub struct Net {
    pub fc1: nn::Linear,
    pub fc2: nn::Linear,
    pub head: Option<nn::Linear>,
}

impl Module for Net {
    fn forward(&self, xs: &Tensor) -> Tensor {
        // `head` stays unused when present: the unused-parameter cases.
        self.fc2.call(&self.fc1.call(xs).tanh())
    }
}

pub fn net(vs: &nn::VarStore, hidden: i64, with_head: bool) -> Net {
    let root = vs.root();
    Net {
        fc1: nn::linear(&root / "fc1", 4, hidden, Default::default()),
        fc2: nn::linear(&root / "fc2", hidden, 3, Default::default()),
        head: with_head.then(|| nn::linear(&root / "head", 3, 3, Default::default())),
    }
}

/// The whole batch of `step` (inputs, targets), the same on every rank.
pub fn batch(step: usize, device: Device) -> (Tensor, Tensor) {
    tch::manual_seed(500 + step as i64);
    (
        Tensor::randn([BATCH, 4], (Kind::Float, device)),
        Tensor::randn([BATCH, 3], (Kind::Float, device)),
    )
}

/// This rank's rows of a whole batch.
pub fn slice(t: &Tensor, pg: &ProcessGroup) -> Tensor {
    let n = BATCH / pg.world_size() as i64;
    t.narrow(0, pg.rank() as i64 * n, n)
}

/// The loss of `model` on this rank's rows of `(x, y)`.
pub fn local_loss(model: &Net, (x, y): &(Tensor, Tensor), pg: &ProcessGroup) -> Tensor {
    model
        .call(&slice(x, pg))
        .mse_loss(&slice(y, pg), tch::Reduction::Mean)
}

pub fn max_diff(a: &nn::VarStore, b: &nn::VarStore) -> f64 {
    let (va, vb) = (a.variables(), b.variables());
    va.iter()
        .map(|(k, t)| (t - &vb[k]).abs().max().double_value(&[]))
        .fold(0.0, f64::max)
}

/// A reference model trained as one process on whole batches, and a replicated one, both from
/// rank 0's initial weights.
fn reference_and_replicated(
    pg: &ProcessGroup,
    device: Device,
    opts: replicate::Options,
    with_head: bool,
) -> ((nn::VarStore, Net), (nn::VarStore, Net)) {
    tch::manual_seed(3);
    let ref_vs = nn::VarStore::new(device);
    let reference = net(&ref_vs, 8, with_head);
    // Every rank starts from different weights: apply must broadcast rank 0's, which equal
    // the reference's (same seed).
    tch::manual_seed(3 + pg.rank() as i64 * 1000);
    let vs = nn::VarStore::new(device);
    let model = net(&vs, 8, with_head);
    replicate::apply(&model, opts).unwrap();
    ((ref_vs, reference), (vs, model))
}

/// Trains `steps` SGD steps replicated (each rank on its slice) and as one process on the
/// whole batch; returns the largest parameter difference.
pub fn train_both(
    pg: &ProcessGroup,
    device: Device,
    opts: replicate::Options,
    with_head: bool,
    steps: usize,
) -> f64 {
    let ((ref_vs, reference), (vs, model)) = reference_and_replicated(pg, device, opts, with_head);
    let mut opt = nn::Sgd::default().build(&vs, 0.1).unwrap();
    let mut ref_opt = nn::Sgd::default().build(&ref_vs, 0.1).unwrap();
    for step in 0..steps {
        let (x, y) = batch(step, device);
        ref_opt.backward_step(&reference.forward(&x).mse_loss(&y, tch::Reduction::Mean));
        opt.backward_step(&local_loss(&model, &(x, y), pg));
    }
    max_diff(&vs, &ref_vs)
}

/// `k` backward passes, all but the last inside `no_sync`, then one step, against one step on
/// the mean loss of the `k` whole batches; returns the largest parameter difference.
pub fn no_sync_vs_one_step(pg: &ProcessGroup, device: Device, k: usize) -> f64 {
    let ((ref_vs, reference), (vs, model)) =
        reference_and_replicated(pg, device, replicate::Options::default(), false);
    let mut opt = nn::Sgd::default().build(&vs, 0.1).unwrap();
    let mut ref_opt = nn::Sgd::default().build(&ref_vs, 0.1).unwrap();
    let mut total = Tensor::zeros([], (Kind::Float, device));
    for step in 0..k {
        let (x, y) = batch(step, device);
        total += reference.forward(&x).mse_loss(&y, tch::Reduction::Mean) / k as f64;
    }
    ref_opt.backward_step(&total);
    opt.zero_grad();
    replicate::no_sync(&model, || {
        for step in 0..k - 1 {
            (local_loss(&model, &batch(step, device), pg) / k as f64).backward();
        }
    })
    .unwrap();
    (local_loss(&model, &batch(k - 1, device), pg) / k as f64).backward();
    opt.step();
    max_diff(&vs, &ref_vs)
}

/// The FQNs and buckets (`bucket_cap_mb` 1e-9: one per parameter, reverse order) that
/// `replicate::state` reports for `net(.., 8, false)`.
pub const PARAM_FQNS: [&str; 4] = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"];
pub const BUCKETS_ONE_PER_PARAM: [&str; 4] = ["fc2.bias", "fc2.weight", "fc1.bias", "fc1.weight"];

/// One replicate option case of the equivalence checks.
pub struct Case {
    /// What the failure message names.
    pub name: &'static str,
    pub options: replicate::Options,
    /// Whether the model has the head that forward leaves unused.
    pub head: bool,
}

/// The option cases every replicate equivalence check runs (tests/replicate.rs,
/// tests/wrap.rs, gpu_check's pair of ranks; gpu_check's group of one adds its own):
/// defaults, a bucket per parameter (with and without `gradient_as_bucket_view`),
/// `find_unused_parameters` and `static_graph` (both with the unused head).
pub fn option_cases() -> Vec<Case> {
    let per_param = || replicate::Options {
        bucket_cap_mb: 1e-9,
        ..Default::default()
    };
    let case = |name, options, head| Case {
        name,
        options,
        head,
    };
    vec![
        case("defaults", replicate::Options::default(), false),
        case("a bucket per parameter", per_param(), false),
        case(
            "gradient_as_bucket_view",
            replicate::Options {
                gradient_as_bucket_view: true,
                ..per_param()
            },
            false,
        ),
        case(
            "find_unused_parameters",
            replicate::Options {
                find_unused_parameters: true,
                ..Default::default()
            },
            true,
        ),
        case(
            "static_graph",
            replicate::Options {
                static_graph: true,
                ..Default::default()
            },
            true,
        ),
    ]
}

/// [`train_both`] for each case, `steps` steps on `device`: the largest difference of all, or
/// the first case whose difference reaches `tolerance`, named.
pub fn each_case_against_plain(
    pg: &ProcessGroup,
    device: Device,
    cases: Vec<Case>,
    steps: usize,
    tolerance: f64,
) -> Result<f64, String> {
    let mut worst: f64 = 0.0;
    for Case {
        name,
        options,
        head,
    } in cases
    {
        let d = train_both(pg, device, options, head, steps);
        if d >= tolerance {
            return Err(format!("{name}: max |replicate - plain| = {d}"));
        }
        worst = worst.max(d);
    }
    Ok(worst)
}
