//! `fully_shard` (FSDP2) end to end, ranks as real processes over 127.0.0.1: training equals
//! single-process training (AdamW, 1e-5) for one group and per-block groups with and without
//! `reshard_after_forward`, uneven shapes, more ranks than rows, ignored and frozen
//! parameters, gradient accumulation without sync; between steps each rank holds only its
//! shards; and the errors.
//!
//! | file | what it tests | PyTorch's counterpart |
//! | --- | --- | --- |
//! | `main.rs` | the model and fixtures; training parity, accumulation, frozen and ignored parameters | `test_fully_shard_training.py` |
//! | `errors.rs` | bypasses (memory, `unshard`, every grad mode), refusals, errors naming the FQN | `test_fully_shard_init.py`'s refusals |
//! | `composition.rs` | with `replicate` and `shard_module`, mixed precision, resharding to fewer ranks, the optimizer checkpoint, a frozen weight | `test_fully_shard_mixed_precision.py`, `test_fully_shard_state_dict.py` |
//! | `api.rs` | the rest of `FSDPModule`'s methods: `set_is_last_backward`, `set_requires_all_reduce` (HSDP), `set_gradient_divide_factor`, `set_all_reduce_hook`, `set_unshard_in_backward`, `unshard_async` | `test_fully_shard_training.py`'s gradient accumulation and `set_*` cases, `test_fully_shard_comm.py`'s explicit unshard |
//! | `two_d.rs` | FSDP x TP on a `dp` x `tp` mesh: training, the placement record, `clip_grad_norm` | `test_fully_shard_training.py`'s `TestFullyShard2DTraining` |

#[path = "../common/panic_text.rs"]
mod panic_text;
use panic_text::panic_text;
#[path = "../common/blocks.rs"]
mod blocks;
#[path = "../common/python.rs"]
mod python;
#[path = "../common/two_d_lm.rs"]
mod two_d_lm;
#[path = "../common/unchanged.rs"]
mod unchanged;
use blocks::{blocks, Blocks as Model};
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};
use tch_dist::fully_shard::{full_state_dict, FsdpError, FsdpProblem};
use tch_dist::testing::run_ranks;
use tch_dist::{fully_shard, Call, FsdpOptions, ProcessGroup, Shardable};

mod api;
mod composition;
mod errors;
mod two_d;

/// The whole batch; each rank trains on its `BATCH / world_size` rows.
const BATCH: i64 = 12;

/// Layer widths: weights (7, 15), (17, 7), (16, 17) and a head of 2 rows (fewer rows than
/// three ranks: one rank's shard is empty).
const DIMS: [i64; 5] = [15, 7, 17, 16, 2];

fn model(vs: &nn::VarStore) -> Model {
    blocks(&vs.root(), &DIMS)
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
    /// Per block, each block's forward prefetching the next block's parameters.
    Prefetching,
    /// One call on the root, weights sharded along their columns where the ranks divide
    /// them (`shard_placement_fn`).
    Columns,
    /// Per block, resharded after forward to groups of this many ranks.
    ToRanks(usize),
}

/// `shard_placement_fn` for [`Groups::Columns`].
fn by_columns(world: usize) -> fully_shard::ShardPlacementFn {
    fully_shard::ShardPlacementFn::new(move |_, t| {
        (t.dim() == 2 && t.size()[1] % world as i64 == 0).then_some(1)
    })
}

fn apply(m: &Model, groups: Groups, root: FsdpOptions) {
    if let Groups::ToRanks(n) = groups {
        for b in &m.blocks {
            let opts = FsdpOptions {
                reshard_after_forward: Some(n.into()),
                ..Default::default()
            };
            fully_shard(b, opts).unwrap();
        }
        fully_shard(m, root).unwrap();
        return;
    }
    if let Groups::Columns = groups {
        let world = tch_dist::default_group().unwrap().world_size();
        let opts = FsdpOptions {
            shard_placement_fn: Some(by_columns(world)),
            ..root
        };
        fully_shard(m, opts).unwrap();
        return;
    }
    if let Groups::Prefetching = groups {
        for b in &m.blocks {
            fully_shard(b, FsdpOptions::default()).unwrap();
        }
        let states: Vec<_> = m
            .blocks
            .iter()
            .map(|b| fully_shard::state(b).unwrap())
            .collect();
        for pair in states.windows(2) {
            pair[0].set_modules_to_forward_prefetch(&[&*pair[1]]);
        }
    }
    if let Groups::PerBlock {
        reshard_after_forward,
    } = groups
    {
        for b in &m.blocks {
            let opts = FsdpOptions {
                reshard_after_forward: Some(reshard_after_forward.into()),
                ..Default::default()
            };
            fully_shard(b, opts).unwrap();
        }
    }
    fully_shard(m, root).unwrap();
}

/// The largest difference between the full parameters of `m` and the reference's.
fn max_diff_full<M: Shardable>(m: &M, reference: &nn::VarStore) -> f64 {
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

/// The reference model (seed 3, the same on every rank) and the model to shard (seeded per
/// rank: its values must come from rank 0's broadcast), each with its `VarStore`.
fn twin(pg: &ProcessGroup) -> (nn::VarStore, Model, nn::VarStore, Model) {
    tch::manual_seed(3);
    let ref_vs = nn::VarStore::new(Device::Cpu);
    let reference = model(&ref_vs);
    tch::manual_seed(3 + pg.rank() as i64 * 1000);
    let vs = nn::VarStore::new(Device::Cpu);
    let m = model(&vs);
    (ref_vs, reference, vs, m)
}

/// One optimizer step of `reference` on the whole batch of `step` and of `m` on this rank's
/// rows of it.
fn step_both(
    reference: &Model,
    ref_opt: &mut nn::Optimizer,
    m: &Model,
    opt: &mut nn::Optimizer,
    step: usize,
    pg: &ProcessGroup,
) {
    let (x, y) = batch(step);
    ref_opt.backward_step(&reference.forward(&x).mse_loss(&y, tch::Reduction::Mean));
    let loss = m
        .call(&slice(&x, pg))
        .mse_loss(&slice(&y, pg), tch::Reduction::Mean);
    opt.backward_step(&loss);
}

/// Between steps every managed parameter holds this rank's rows and nothing is gathered.
fn assert_sharded(m: &Model, vs: &nn::VarStore, pg: &ProcessGroup) {
    let (world, rank) = (pg.world_size() as i64, pg.rank() as i64);
    let vars = vs.variables();
    let mut by_columns = false;
    for (prefix, sub) in m.named_modules() {
        if let Some(s) = fully_shard::state(sub) {
            assert!(s.is_sharded(), "`{prefix}` is sharded between steps");
            assert_eq!(s.gathered_bytes(), 0, "`{prefix}` holds no gathered memory");
            for info in s.shards() {
                let t = &vars[&info.fqn];
                assert_eq!(t.size(), info.local_shape, "{} on rank {rank}", info.fqn);
                by_columns |= info.dim != 0;
            }
        }
    }
    for (fqn, t) in vars {
        let full = vs_shape(&fqn);
        let mut expected = full.clone();
        if !by_columns {
            // torch.chunk's rows, counted here independently of the library.
            let chunk = (full[0] + world - 1) / world;
            expected[0] = (full[0] - rank * chunk).clamp(0, chunk);
            assert_eq!(t.size(), expected, "{fqn} on rank {rank}");
        }
        let g = t.grad();
        if g.defined() {
            assert_eq!(g.size(), t.size(), "grad of {fqn} on rank {rank}");
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
        step_both(&reference, &mut ref_opt, &m, &mut opt, step, pg);
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
        Groups::Prefetching,
        Groups::Columns,
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

/// `k` micro-batches: all but the last backward without gradient sync (each only local),
/// then one synchronised backward and one step; against one step on the mean loss of the `k`
/// whole batches.
fn accumulation(pg: &ProcessGroup, k: usize) -> f64 {
    tch::manual_seed(3);
    let ref_vs = nn::VarStore::new(Device::Cpu);
    let reference = model(&ref_vs);
    tch::manual_seed(3);
    let vs = nn::VarStore::new(Device::Cpu);
    let m = model(&vs);
    apply(
        &m,
        Groups::PerBlock {
            reshard_after_forward: true,
        },
        FsdpOptions::default(),
    );
    let root = fully_shard::state(&m).unwrap();
    let mut opt = nn::AdamW::default().build(&vs, 1e-2).unwrap();
    let mut ref_opt = nn::AdamW::default().build(&ref_vs, 1e-2).unwrap();
    let mut total = Tensor::zeros([], (Kind::Float, Device::Cpu));
    for step in 0..k {
        let (x, y) = batch(step);
        total += reference.forward(&x).mse_loss(&y, tch::Reduction::Mean) / k as f64;
    }
    ref_opt.backward_step(&total);
    opt.zero_grad();
    for step in 0..k {
        root.set_requires_gradient_sync(step == k - 1);
        let (x, y) = batch(step);
        let loss = m
            .call(&slice(&x, pg))
            .mse_loss(&slice(&y, pg), tch::Reduction::Mean);
        (loss / k as f64).backward();
        if step < k - 1 {
            // Nothing reduced yet: no shard has a gradient.
            for (fqn, t) in vs.variables() {
                assert!(!t.grad().defined(), "{fqn} has a gradient before the sync");
            }
        }
    }
    opt.step();
    assert_sharded(&m, &vs, pg);
    max_diff_full(&m, &ref_vs)
}

/// Frozen parameters are sharded and gathered but get no gradient; ignored ones stay whole,
/// on every rank, and are not synchronised.
fn frozen_and_ignored() {
    tch::manual_seed(3);
    let ref_vs = nn::VarStore::new(Device::Cpu);
    let reference = model(&ref_vs);
    tch::manual_seed(3);
    let vs = nn::VarStore::new(Device::Cpu);
    let m = model(&vs);
    for t in [&m.blocks[0].ws, &reference.blocks[0].ws] {
        let _ = t.set_requires_grad(false);
    }
    fully_shard(
        &m,
        FsdpOptions {
            ignored_params: vec!["head".into()],
            ..Default::default()
        },
    )
    .unwrap();
    let mut opt = nn::AdamW::default().build(&vs, 1e-2).unwrap();
    let mut ref_opt = nn::AdamW::default().build(&ref_vs, 1e-2).unwrap();
    // The head is not synchronised: every rank trains it on the whole batch, as the
    // reference does, so that the rest stays comparable.
    for step in 0..3 {
        let (x, y) = batch(step);
        ref_opt.backward_step(&reference.forward(&x).mse_loss(&y, tch::Reduction::Mean));
        let loss = m.call(&x).mse_loss(&y, tch::Reduction::Mean);
        opt.backward_step(&loss);
    }
    assert_eq!(m.head.ws.size(), [2, 16], "the ignored head is whole");
    assert!(
        !m.blocks[0].ws.grad().defined(),
        "a frozen parameter gets no gradient"
    );
    assert_ne!(
        m.blocks[0].ws.size(),
        [7, 15],
        "a frozen parameter is sharded"
    );
    let diff = max_diff_full(&m, &ref_vs);
    assert!(diff < 1e-5, "frozen and ignored: {diff}");
}

#[test]
fn accumulation_frozen_and_ignored_at_2_ranks() {
    run_ranks("accumulation_frozen_and_ignored_at_2_ranks", 2, |pg| {
        let diff = accumulation(&pg, 3);
        assert!(diff < 1e-5, "accumulation without sync: {diff}");
        frozen_and_ignored();
    });
}

/// A nested call's engine error names the parameter by its FQN from the root (issue 22,
/// item 8): applied bottom-up (`head`, then the root), a `.grad` of the wrong shape on the
/// head's weight fails backward naming `head.weight`, not `weight`.
#[test]
fn bottom_up_grad_shape_mismatch_names_the_full_fqn_at_2_ranks() {
    run_ranks(
        "bottom_up_grad_shape_mismatch_names_the_full_fqn_at_2_ranks",
        2,
        |pg| {
            let vs = nn::VarStore::new(Device::Cpu);
            let m = model(&vs);
            fully_shard(&m.head, FsdpOptions::default()).unwrap();
            fully_shard(&m, FsdpOptions::default()).unwrap();
            let (x, y) = batch(0);
            let loss = |m: &Model| {
                m.call(&slice(&x, &pg))
                    .mse_loss(&slice(&y, &pg), tch::Reduction::Mean)
            };
            loss(&m).backward();
            assert_eq!(m.head.ws.grad().size(), [1, DIMS[3]]);
            // `.grad` no longer the shard's shape: the next synchronised backward refuses it.
            let _ = tch::no_grad(|| m.head.ws.grad().resize_([3]));
            let err = loss(&m).f_backward().unwrap_err().to_string();
            assert!(
                err.contains(&format!(
                    "`.grad` of `head.weight` has shape [3], not its shard's [1, {}]",
                    DIMS[3]
                )),
                "{err}"
            );
        },
    );
}
