//! `fully_shard` (FSDP2) end to end, ranks as real processes over 127.0.0.1: training equals
//! single-process training (AdamW, 1e-5) for one group and per-block groups with and without
//! `reshard_after_forward`, uneven shapes, more ranks than rows, ignored and frozen
//! parameters, gradient accumulation without sync; between steps each rank holds only its
//! shards; and the errors.

use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};
use tch_dist::fully_shard::{full_state_dict, FsdpError};
use tch_dist::testing::run_ranks;
use tch_dist::{fully_shard, Call, FsdpOptions, ProcessGroup, Shardable};

/// The whole batch; each rank trains on its `BATCH / world_size` rows.
const BATCH: i64 = 12;

/// Layer widths: weights (7, 15), (17, 7), (16, 17) and a head of 2 rows (fewer rows than
/// three ranks: one rank's shard is empty).
const DIMS: [i64; 5] = [15, 7, 17, 16, 2];

#[derive(Debug, Shardable)]
struct Model {
    blocks: Vec<nn::Linear>,
    head: nn::Linear,
}

impl Module for Model {
    fn forward(&self, xs: &Tensor) -> Tensor {
        let h = self
            .blocks
            .iter()
            .fold(xs.shallow_clone(), |h, b| b.call(&h).tanh());
        self.head.call(&h)
    }
}

fn model(vs: &nn::VarStore) -> Model {
    let p = vs.root();
    let blocks = (0..DIMS.len() - 2)
        .map(|i| nn::linear(&p / "blocks" / i, DIMS[i], DIMS[i + 1], Default::default()))
        .collect();
    let n = DIMS.len();
    Model {
        blocks,
        head: nn::linear(&p / "head", DIMS[n - 2], DIMS[n - 1], Default::default()),
    }
}

/// The whole batch of `step`, the same on every rank.
fn batch(step: usize) -> (Tensor, Tensor) {
    tch::manual_seed(700 + step as i64);
    (
        Tensor::randn([BATCH, DIMS[0]], (Kind::Float, Device::Cpu)),
        Tensor::randn([BATCH, DIMS[DIMS.len() - 1]], (Kind::Float, Device::Cpu)),
    )
}

/// This rank's rows of a whole batch.
fn slice(t: &Tensor, pg: &ProcessGroup) -> Tensor {
    let n = BATCH / pg.world_size() as i64;
    t.narrow(0, pg.rank() as i64 * n, n)
}

/// How a case shards the model.
#[derive(Debug, Clone, Copy)]
enum Groups {
    /// One call, on the root.
    Root,
    /// One call per block, then the root.
    PerBlock { reshard_after_forward: bool },
}

fn apply(m: &Model, groups: Groups, root: FsdpOptions) {
    if let Groups::PerBlock {
        reshard_after_forward,
    } = groups
    {
        for b in &m.blocks {
            let opts = FsdpOptions {
                reshard_after_forward: Some(reshard_after_forward),
                ..Default::default()
            };
            fully_shard(b, opts).unwrap();
        }
    }
    fully_shard(m, root).unwrap();
}

/// The largest difference between the full parameters of `m` and the reference's.
fn max_diff_full(m: &Model, reference: &nn::VarStore) -> f64 {
    let full = full_state_dict(m).unwrap();
    let vars = reference.variables();
    assert_eq!(full.len(), vars.len());
    full.iter()
        .map(|(fqn, t)| {
            let r = &vars[fqn];
            assert_eq!(t.size(), r.size(), "{fqn}");
            (t - r).abs().max().double_value(&[])
        })
        .fold(0.0, f64::max)
}

/// Between steps every managed parameter holds this rank's rows and nothing is gathered.
fn assert_sharded(m: &Model, vs: &nn::VarStore, pg: &ProcessGroup) {
    let (world, rank) = (pg.world_size() as i64, pg.rank() as i64);
    for (fqn, t) in vs.variables() {
        let full = vs_shape(&fqn);
        let chunk = (full[0] + world - 1) / world;
        let rows = (full[0] - rank * chunk).clamp(0, chunk);
        let mut expected = full.clone();
        expected[0] = rows;
        assert_eq!(t.size(), expected, "{fqn} on rank {rank}");
        let g = t.grad();
        if g.defined() {
            assert_eq!(g.size(), expected, "grad of {fqn} on rank {rank}");
        }
    }
    for (prefix, sub) in m.named_modules() {
        if let Some(s) = fully_shard::state(sub) {
            assert!(s.is_sharded(), "`{prefix}` is sharded between steps");
            assert_eq!(s.gathered_bytes(), 0, "`{prefix}` holds no gathered memory");
        }
    }
}

/// The full shape of parameter `fqn` of [`model`].
fn vs_shape(fqn: &str) -> Vec<i64> {
    let vs = nn::VarStore::new(Device::Cpu);
    let _ = model(&vs);
    vs.variables()[fqn].size()
}

/// Trains `steps` AdamW steps sharded (each rank on its rows) and as one process on the
/// whole batch, both from rank 0's initial values (ranks start from other ones:
/// fully_shard must broadcast rank 0's). Returns the largest difference, and how far
/// training moved the reference.
fn train(pg: &ProcessGroup, groups: Groups, steps: usize) -> (f64, f64) {
    tch::manual_seed(3);
    let ref_vs = nn::VarStore::new(Device::Cpu);
    let reference = model(&ref_vs);
    let initial: Vec<(String, Tensor)> = ref_vs
        .variables()
        .into_iter()
        .map(|(k, t)| (k, t.detach().copy()))
        .collect();
    tch::manual_seed(3 + pg.rank() as i64 * 1000);
    let vs = nn::VarStore::new(Device::Cpu);
    let m = model(&vs);
    apply(&m, groups, FsdpOptions::default());
    assert_sharded(&m, &vs, pg);
    let mut opt = nn::AdamW::default().build(&vs, 1e-2).unwrap();
    let mut ref_opt = nn::AdamW::default().build(&ref_vs, 1e-2).unwrap();
    for step in 0..steps {
        let (x, y) = batch(step);
        ref_opt.backward_step(&reference.forward(&x).mse_loss(&y, tch::Reduction::Mean));
        let loss = m
            .call(&slice(&x, pg))
            .mse_loss(&slice(&y, pg), tch::Reduction::Mean);
        opt.backward_step(&loss);
        assert_sharded(&m, &vs, pg);
    }
    let moved = initial
        .iter()
        .map(|(k, t)| (t - &ref_vs.variables()[k]).abs().max().double_value(&[]))
        .fold(0.0, f64::max);
    (max_diff_full(&m, &ref_vs), moved)
}

fn parity_cases(pg: ProcessGroup) {
    for groups in [
        Groups::Root,
        Groups::PerBlock {
            reshard_after_forward: true,
        },
        Groups::PerBlock {
            reshard_after_forward: false,
        },
    ] {
        let (diff, moved) = train(&pg, groups, 4);
        assert!(
            moved > 1e-2,
            "{groups:?}: training moved the weights ({moved})"
        );
        assert!(
            diff < 1e-5,
            "{groups:?}: fully_shard vs one process: {diff}"
        );
    }
}

#[test]
fn equals_single_process_training_at_2_ranks() {
    run_ranks("equals_single_process_training_at_2_ranks", 2, parity_cases);
}

#[test]
fn equals_single_process_training_at_3_ranks() {
    run_ranks("equals_single_process_training_at_3_ranks", 3, parity_cases);
}

#[test]
fn refusals() {
    run_ranks("refusals", 2, |_pg| {
        let vs = nn::VarStore::new(Device::Cpu);
        let m = model(&vs);
        fully_shard(&m, FsdpOptions::default()).unwrap();
        let err = fully_shard(&m, FsdpOptions::default()).unwrap_err();
        assert!(matches!(err, FsdpError::Contract(_)), "{err}");
    });
}
