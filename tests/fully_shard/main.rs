//! `fully_shard` (FSDP2) end to end, ranks as real processes over 127.0.0.1: training equals
//! single-process training (AdamW, 1e-5) for one group and per-block groups with and without
//! `reshard_after_forward`, uneven shapes, more ranks than rows, ignored and frozen
//! parameters, gradient accumulation without sync; between steps each rank holds only its
//! shards; and the errors.

#[path = "common/panic_text.rs"]
mod panic_text;
use panic_text::panic_text;
#[path = "common/blocks.rs"]
mod blocks;
use blocks::{blocks, Blocks as Model};
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

/// A model whose forward runs its head with `apply`, bypassing the head's hooks.
#[derive(Debug, Shardable)]
struct Bypassing {
    inner: Model,
}

impl Module for Bypassing {
    fn forward(&self, xs: &Tensor) -> Tensor {
        let h = self
            .inner
            .blocks
            .iter()
            .fold(xs.shallow_clone(), |h, b| b.call(&h).tanh());
        h.apply(&self.inner.head)
    }
}

/// Between the groups' hooks, at most the group being run (and the root, which keeps its
/// parameters until backward) holds gathered memory.
fn gathered_during_forward(pg: &ProcessGroup) {
    let vs = nn::VarStore::new(Device::Cpu);
    let m = model(&vs);
    apply(
        &m,
        Groups::PerBlock {
            reshard_after_forward: true,
        },
        FsdpOptions::default(),
    );
    let blocks: Vec<_> = m
        .blocks
        .iter()
        .map(|b| fully_shard::state(b).unwrap())
        .collect();
    let peak = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut handles = Vec::new();
    for (i, b) in m.blocks.iter().enumerate() {
        let (blocks, peak) = (blocks.clone(), peak.clone());
        // Registered after fully_shard's hooks: runs once block `i` is gathered.
        handles.push(
            tch_dist_core::hooks::register_forward_pre_hook(b, move |_, _| {
                let gathered: Vec<bool> = blocks.iter().map(|s| s.gathered_bytes() > 0).collect();
                peak.lock().unwrap().push((i, gathered));
                None
            })
            .unwrap(),
        );
    }
    let (x, y) = batch(0);
    let loss = m
        .call(&slice(&x, pg))
        .mse_loss(&slice(&y, pg), tch::Reduction::Mean);
    for (i, gathered) in peak.lock().unwrap().iter() {
        let expected: Vec<bool> = (0..blocks.len()).map(|j| j == *i).collect();
        assert_eq!(gathered, &expected, "while block {i} runs");
    }
    assert!(
        blocks.iter().all(|s| s.gathered_bytes() == 0),
        "freed after forward"
    );
    loss.backward();
    assert!(blocks
        .iter()
        .all(|s| s.is_sharded() && s.gathered_bytes() == 0));
}

#[test]
fn bypass_memory_and_unshard_at_2_ranks() {
    run_ranks("bypass_memory_and_unshard_at_2_ranks", 2, |pg| {
        // A bypassed head inside the root's call fails the root's forward.
        let vs = nn::VarStore::new(Device::Cpu);
        let m = Bypassing { inner: model(&vs) };
        fully_shard(&m.inner.head, FsdpOptions::default()).unwrap();
        fully_shard(&m, FsdpOptions::default()).unwrap();
        let before: Vec<Tensor> = vs.trainable_variables().iter().map(|t| t.copy()).collect();
        let (x, _) = batch(0);
        let err = m.f_call(&x).unwrap_err();
        let e = err.downcast_ref::<FsdpError>().expect("a typed error");
        assert!(
            matches!(e, FsdpError::HooksBypassed { module, param, .. }
                if module == "inner.head" && param == "inner.head.weight"),
            "{e}"
        );
        assert!(e.to_string().contains("self.head.call(&x)"), "{e}");
        let after = vs.trainable_variables();
        assert!(before.iter().zip(&after).all(|(a, b)| a.equal(b)));
        assert!(fully_shard::state(&m).unwrap().is_sharded());

        // Called directly (no enclosing call), the bypass fails backward before any
        // gradient lands.
        let head = nn::VarStore::new(Device::Cpu);
        let layer = nn::linear(head.root() / "head", 3, 4, Default::default());
        fully_shard(&layer, FsdpOptions::default()).unwrap();
        let out = Tensor::ones([2, 3], tch::kind::FLOAT_CPU).apply(&layer);
        let err = out.sum(Kind::Float).f_backward().unwrap_err().to_string();
        // Autograd's own check against the full shape comes first where the shard's
        // gradient cannot be the full one's; the guard's where it could.
        assert!(
            err.contains(".call(&x)") || err.contains("invalid gradient"),
            "{err}"
        );
        assert!(!layer.ws.grad().defined());

        gathered_during_forward(&pg);

        // A prefetch whose shards change before their use (an optimizer step, a load) is
        // gathered again, not used stale.
        let vs = nn::VarStore::new(Device::Cpu);
        let m = model(&vs);
        apply(&m, Groups::Prefetching, FsdpOptions::default());
        let x = Tensor::ones([2, DIMS[0]], tch::kind::FLOAT_CPU);
        let h = tch::no_grad(|| m.blocks[0].call(&x)); // starts block 1's gather
        tch::no_grad(|| {
            let _ = m.blocks[1].ws.shallow_clone().f_add_scalar_(1.0).unwrap();
        });
        let s = fully_shard::state(&m.blocks[1]).unwrap();
        s.unshard().unwrap();
        let full_after = m.blocks[1].ws.copy();
        s.reshard().unwrap();
        let gathered = full_state_dict(&m).unwrap();
        let expected = &gathered
            .iter()
            .find(|(n, _)| n == "blocks.1.weight")
            .unwrap()
            .1;
        assert!(full_after.equal(expected), "the prefetch was stale");
        let _ = h;

        // unshard / reshard: other methods than forward can use the full parameters.
        let vs = nn::VarStore::new(Device::Cpu);
        let m = model(&vs);
        fully_shard(&m, FsdpOptions::default()).unwrap();
        let s = fully_shard::state(&m).unwrap();
        s.unshard().unwrap();
        assert_eq!(m.blocks[1].ws.size(), [17, 7]);
        assert!(s.gathered_bytes() > 0);
        s.reshard().unwrap();
        assert_eq!(m.blocks[1].ws.size(), [9 - pg.rank() as i64, 7]);
        assert_eq!(s.gathered_bytes(), 0);
    });
}

/// A linear layer whose weight is another layer's (tied).
#[derive(Debug, Shardable)]
struct Tied {
    a: nn::Linear,
    b: nn::Linear,
}

#[test]
fn refusals_at_2_ranks() {
    run_ranks("refusals_at_2_ranks", 2, |pg| {
        let vs = nn::VarStore::new(Device::Cpu);
        let m = model(&vs);
        fully_shard(&m, FsdpOptions::default()).unwrap();
        let err = fully_shard(&m, FsdpOptions::default()).unwrap_err();
        assert!(matches!(err, FsdpError::Contract(_)), "{err}");
        let err = tch_dist::replicate::apply(&m, Default::default()).unwrap_err();
        assert!(err.to_string().contains("fully_shard"), "{err}");

        // A tied parameter used by two calls.
        let vs = nn::VarStore::new(Device::Cpu);
        let a = nn::linear(vs.root() / "a", 4, 4, Default::default());
        let b = nn::Linear {
            ws: a.ws.shallow_clone(),
            bs: None,
        };
        let tied = Tied { a, b };
        fully_shard(&tied.a, FsdpOptions::default()).unwrap();
        let err = fully_shard(&tied, FsdpOptions::default()).unwrap_err();
        assert!(
            matches!(&err, FsdpError::TiedParameter { fqn, other, .. } if fqn == "b.weight" && other == "weight"),
            "{err}"
        );
        // A child after its parent: refused, saying to go bottom-up.
        let vs = nn::VarStore::new(Device::Cpu);
        let m = model(&vs);
        fully_shard(&m, FsdpOptions::default()).unwrap();
        let err = fully_shard(&m.head, FsdpOptions::default()).unwrap_err();
        assert!(err.to_string().contains("bottom-up"), "{err}");
        // Tied within one call: managed once, equal under both names.
        let vs = nn::VarStore::new(Device::Cpu);
        let a = nn::linear(vs.root() / "a", 4, 4, Default::default());
        let b = nn::Linear {
            ws: a.ws.shallow_clone(),
            bs: None,
        };
        let tied = Tied { a, b };
        fully_shard(&tied, FsdpOptions::default()).unwrap();
        assert_eq!(tied.b.ws.size(), [2, 4]);
        let full = full_state_dict(&tied).unwrap();
        assert!(
            full[0].1.equal(&full[2].1),
            "{:?}",
            full.iter().map(|f| &f.0).collect::<Vec<_>>()
        );

        // Options that differ across ranks, a non-contiguous parameter, an unknown ignored
        // name: refused on every rank, nothing sharded.
        let vs = nn::VarStore::new(Device::Cpu);
        let m = model(&vs);
        let differ = FsdpOptions {
            reshard_after_forward: Some((pg.rank() == 0).into()),
            ..Default::default()
        };
        let err = fully_shard(&m.blocks[0], differ).unwrap_err();
        assert!(err.to_string().contains("reshard_after_forward"), "{err}");
        let unknown = FsdpOptions {
            ignored_params: vec!["nope".into()],
            ..Default::default()
        };
        let err = fully_shard(&m.blocks[1], unknown).unwrap_err();
        assert!(
            matches!(err, FsdpError::UnknownIgnoredParam { .. }),
            "{err}"
        );
        // Non-contiguous on rank 1 only: rank 1 names it, rank 0 learns that rank 1 failed.
        if pg.rank() == 1 {
            let mut w = m.blocks[2].ws.shallow_clone();
            tch::no_grad(|| w.set_data(&w.detach().tr().contiguous().tr()));
        }
        let err = fully_shard(&m.blocks[2], FsdpOptions::default()).unwrap_err();
        if pg.rank() == 1 {
            assert!(
                matches!(err, FsdpError::NonContiguous { ref fqn, .. } if fqn == "weight"),
                "{err}"
            );
        } else {
            assert!(err.to_string().contains("rank 1"), "{err}");
        }
        assert_eq!(m.blocks[0].ws.size(), [7, 15]);
        assert_eq!(m.blocks[1].ws.size(), [17, 7]);
        assert_eq!(m.blocks[2].ws.size(), [16, 17]);
    });
}

/// fully_shard on the blocks and `replicate` on the root (which then manages only the
/// head): equal to one process.
fn with_replicate(pg: &ProcessGroup) -> f64 {
    tch::manual_seed(3);
    let ref_vs = nn::VarStore::new(Device::Cpu);
    let reference = model(&ref_vs);
    tch::manual_seed(3 + pg.rank() as i64 * 1000);
    let vs = nn::VarStore::new(Device::Cpu);
    let m = model(&vs);
    for b in &m.blocks {
        fully_shard(b, FsdpOptions::default()).unwrap();
    }
    let r = tch_dist::replicate::apply(&m, Default::default()).unwrap();
    assert_eq!(r.param_fqns(), ["head.weight", "head.bias"]);
    let mut opt = nn::AdamW::default().build(&vs, 1e-2).unwrap();
    let mut ref_opt = nn::AdamW::default().build(&ref_vs, 1e-2).unwrap();
    for step in 0..3 {
        step_both(&reference, &mut ref_opt, &m, &mut opt, step, pg);
    }
    max_diff_full(&m, &ref_vs)
}

/// Tensor parallelism on blocks 1 and 2 (`shard_module`, column- then row-wise) and
/// fully_shard on the rest, over the same ranks (every rank on the whole batch, as tensor
/// parallelism needs); also `clip_grad_norm` over both kinds of shards: the norm is the
/// unsharded model's.
fn two_d(pg: &ProcessGroup) -> f64 {
    use tch_dist::sharding::{shard_module, ColwiseLinear, RowwiseLinear, ShardingPlan};
    tch::manual_seed(3);
    let ref_vs = nn::VarStore::new(Device::Cpu);
    let reference = model(&ref_vs);
    tch::manual_seed(3);
    let vs = nn::VarStore::new(Device::Cpu);
    let mut m = model(&vs);
    let plan = ShardingPlan::builder()
        .shard_module(Model::path().blocks().at(1), ColwiseLinear::default())
        .shard_module(Model::path().blocks().at(2), RowwiseLinear)
        .return_local_tensor(Model::path().blocks().at(1))
        .build();
    shard_module(&mut m, &plan, 0, pg).unwrap();
    fully_shard(&m.blocks[0], FsdpOptions::default()).unwrap();
    fully_shard(&m.head, FsdpOptions::default()).unwrap();
    fully_shard(&m, FsdpOptions::default()).unwrap();
    let mut opt = nn::AdamW::default().build(&vs, 1e-2).unwrap();
    let mut ref_opt = nn::AdamW::default().build(&ref_vs, 1e-2).unwrap();
    for step in 0..3 {
        let (x, y) = batch(step);
        ref_opt.zero_grad();
        reference
            .forward(&x)
            .mse_loss(&y, tch::Reduction::Mean)
            .backward();
        let ref_norm = tch_dist::utils::clip_grad_norm(&reference, 0.05, 2.0).unwrap();
        ref_opt.step();
        opt.zero_grad();
        m.call(&x).mse_loss(&y, tch::Reduction::Mean).backward();
        let norm = tch_dist::utils::clip_grad_norm(&m, 0.05, 2.0).unwrap();
        assert!(
            (norm - ref_norm).abs() < 1e-5 * ref_norm.max(1.0),
            "step {step}: clip_grad_norm {norm} vs one process {ref_norm}"
        );
        assert!(ref_norm > 0.05, "the clip applies ({ref_norm})");
        opt.step();
    }
    max_diff_full(&m, &ref_vs)
}

fn composition_cases(pg: ProcessGroup) {
    let diff = with_replicate(&pg);
    assert!(
        diff < 1e-5,
        "fully_shard + replicate vs one process: {diff}"
    );
    let diff = two_d(&pg);
    assert!(
        diff < 1e-5,
        "shard_module + fully_shard vs one process: {diff}"
    );
}

#[test]
fn composes_with_replicate_and_shard_module_at_2_ranks() {
    run_ranks(
        "composes_with_replicate_and_shard_module_at_2_ranks",
        2,
        composition_cases,
    );
}

#[test]
fn composes_with_replicate_and_shard_module_at_3_ranks() {
    run_ranks(
        "composes_with_replicate_and_shard_module_at_3_ranks",
        3,
        composition_cases,
    );
}

/// Mixed precision (bf16 parameters, f32 reduction, f32 output): shards, `.grad` and the
/// optimizer stay f32, gathered parameters are bf16, and training follows one f32 process
/// within bf16's precision.
fn mixed_precision(pg: &ProcessGroup) -> f64 {
    use tch_dist::fully_shard::MixedPrecisionPolicy;
    tch::manual_seed(3);
    let ref_vs = nn::VarStore::new(Device::Cpu);
    let reference = model(&ref_vs);
    tch::manual_seed(3);
    let vs = nn::VarStore::new(Device::Cpu);
    let m = model(&vs);
    let mp = MixedPrecisionPolicy {
        param_dtype: Some(Kind::BFloat16),
        reduce_dtype: Some(Kind::Float),
        ..Default::default()
    };
    for b in &m.blocks {
        let opts = FsdpOptions {
            mp_policy: mp,
            ..Default::default()
        };
        fully_shard(b, opts).unwrap();
    }
    let root = FsdpOptions {
        mp_policy: MixedPrecisionPolicy {
            output_dtype: Some(Kind::Float),
            ..mp
        },
        ..Default::default()
    };
    fully_shard(&m, root).unwrap();
    let s = fully_shard::state(&m.blocks[1]).unwrap();
    s.unshard().unwrap();
    assert_eq!(m.blocks[1].ws.kind(), Kind::BFloat16, "gathered in bf16");
    s.reshard().unwrap();
    // SGD: the difference scales with bf16's gradient error (AdamW's normalised steps
    // would turn a tiny gradient's rounding into a whole step).
    let mut opt = nn::Sgd::default().build(&vs, 0.2).unwrap();
    let mut ref_opt = nn::Sgd::default().build(&ref_vs, 0.2).unwrap();
    for step in 0..3 {
        let (x, y) = batch(step);
        ref_opt.backward_step(&reference.forward(&x).mse_loss(&y, tch::Reduction::Mean));
        let out = m.call(&slice(&x, pg));
        assert_eq!(out.kind(), Kind::Float, "output_dtype");
        opt.backward_step(&out.mse_loss(&slice(&y, pg), tch::Reduction::Mean));
        for (fqn, t) in vs.variables() {
            assert_eq!(t.kind(), Kind::Float, "{fqn}: the shard stays f32");
            assert_eq!(t.grad().kind(), Kind::Float, "{fqn}: .grad is f32");
        }
        assert_sharded(&m, &vs, pg);
    }
    max_diff_full(&m, &ref_vs)
}

#[test]
fn mixed_precision_at_2_ranks() {
    run_ranks("mixed_precision_at_2_ranks", 2, |pg| {
        let diff = mixed_precision(&pg);
        assert!(diff < 5e-3, "bf16 vs one f32 process: {diff}");
        assert!(diff > 0.0, "computed in bf16 indeed");
    });
}

#[test]
fn reshard_to_fewer_ranks_at_4_ranks() {
    run_ranks("reshard_to_fewer_ranks_at_4_ranks", 4, |pg| {
        let (diff, moved) = train(&pg, Groups::ToRanks(2), 3);
        assert!(moved > 1e-2, "training moved the weights ({moved})");
        assert!(
            diff < 1e-5,
            "reshard_after_forward=2 vs one process: {diff}"
        );
        // Between forward and backward each block keeps its shard over 2 ranks: half of
        // block 1's 17 x 7 + 17 (9 rows, padded) in f32.
        let vs = nn::VarStore::new(Device::Cpu);
        let m = model(&vs);
        apply(&m, Groups::ToRanks(2), FsdpOptions::default());
        let (x, y) = batch(0);
        let loss = m
            .call(&slice(&x, &pg))
            .mse_loss(&slice(&y, &pg), tch::Reduction::Mean);
        let b1 = fully_shard::state(&m.blocks[1]).unwrap();
        assert_eq!(b1.gathered_bytes(), 0);
        assert_eq!(b1.post_forward_bytes(), (9 * 7 + 9) * 4);
        loss.backward();
        assert_eq!(b1.post_forward_bytes(), 0);
        let vs = nn::VarStore::new(Device::Cpu);
        let m = model(&vs);
        let opts = FsdpOptions {
            reshard_after_forward: Some(3.into()),
            ..Default::default()
        };
        let err = fully_shard(&m.blocks[0], opts).unwrap_err();
        assert!(
            matches!(
                err,
                FsdpError::ReshardRanks {
                    ranks: 3,
                    world: 4,
                    ..
                }
            ),
            "{err}"
        );
    });
}

/// fully_shard with `tch_dist::optim::AdamW`: trained 2 steps by ranks 0 and 1, saved with
/// the optimizer's (sharded) state, loaded at 3 ranks and trained 2 more, equals 4 steps in
/// one process.
#[test]
fn optimizer_state_checkpoint_reshards_2_to_3() {
    run_ranks("optimizer_state_checkpoint_reshards_2_to_3", 3, |pg| {
        use tch_dist::{checkpoint, optim};
        let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("fsdp_optim");
        if pg.rank() == 0 {
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
        }
        pg.barrier().unwrap();
        let ckpt = dir.join("step-00000002");
        let train = |m: &Model, opt: &mut optim::Optimizer, group: &ProcessGroup, steps| {
            for step in steps {
                let (x, y) = batch(step);
                let loss = m
                    .call(&slice(&x, group))
                    .mse_loss(&slice(&y, group), tch::Reduction::Mean);
                opt.backward_step(&loss).unwrap();
            }
        };
        let sharded = |vs: &nn::VarStore, group: &ProcessGroup| {
            let m = model(vs);
            for b in &m.blocks {
                let opts = FsdpOptions {
                    process_group: Some(group.clone()),
                    ..Default::default()
                };
                fully_shard(b, opts).unwrap();
            }
            let opts = FsdpOptions {
                process_group: Some(group.clone()),
                ..Default::default()
            };
            fully_shard(&m, opts).unwrap();
            m
        };
        let pair = pg.new_group(&[0, 1], tch_dist::Backend::Gloo).unwrap();
        if let Some(pair) = &pair {
            tch::manual_seed(3);
            let vs = nn::VarStore::new(Device::Cpu);
            let m = sharded(&vs, pair);
            let mut opt = optim::AdamW::default().build(&vs, 1e-2).unwrap();
            train(&m, &mut opt, pair, 0..2);
            let opts = checkpoint::SaveOptions::default();
            checkpoint::save_with_optimizer(&ckpt, &m, &opt, pair, &opts).unwrap();
        }
        pg.barrier().unwrap();
        tch::manual_seed(50 + pg.rank() as i64);
        let vs = nn::VarStore::new(Device::Cpu);
        let m = sharded(&vs, &pg);
        let mut opt = optim::AdamW::default().build(&vs, 1e-2).unwrap();
        checkpoint::load_with_optimizer(&ckpt, &m, &mut opt, &pg).unwrap();
        train(&m, &mut opt, &pg, 2..4);
        // The reference: one process, 4 steps.
        tch::manual_seed(3);
        let ref_vs = nn::VarStore::new(Device::Cpu);
        let reference = model(&ref_vs);
        let mut ref_opt = optim::AdamW::default().build(&ref_vs, 1e-2).unwrap();
        for step in 0..4 {
            let (x, y) = batch(step);
            ref_opt
                .backward_step(&reference.forward(&x).mse_loss(&y, tch::Reduction::Mean))
                .unwrap();
        }
        let diff = max_diff_full(&m, &ref_vs);
        assert!(diff < 1e-5, "saved at 2, resumed at 3: {diff}");
    });
}

/// A block whose weight is frozen and whose bias trains, inside a graph whose input needs
/// a gradient: its bias's gradient can arrive before autograd has used the frozen weight
/// for the input's gradient, so the group must not free its weight then. Against one
/// process, per-block groups, both resharding modes.
#[test]
fn frozen_weight_trained_bias_at_2_ranks() {
    run_ranks("frozen_weight_trained_bias_at_2_ranks", 2, |pg| {
        for reshard_after_forward in [true, false] {
            tch::manual_seed(3);
            let ref_vs = nn::VarStore::new(Device::Cpu);
            let reference = model(&ref_vs);
            tch::manual_seed(3);
            let vs = nn::VarStore::new(Device::Cpu);
            let m = model(&vs);
            for w in [
                &m.blocks[1].ws,
                &m.blocks[2].ws,
                &reference.blocks[1].ws,
                &reference.blocks[2].ws,
            ] {
                let _ = w.set_requires_grad(false);
            }
            apply(
                &m,
                Groups::PerBlock {
                    reshard_after_forward,
                },
                FsdpOptions::default(),
            );
            let mut opt = nn::AdamW::default().build(&vs, 1e-2).unwrap();
            let mut ref_opt = nn::AdamW::default().build(&ref_vs, 1e-2).unwrap();
            for step in 0..3 {
                step_both(&reference, &mut ref_opt, &m, &mut opt, step, &pg);
            }
            let diff = max_diff_full(&m, &ref_vs);
            assert!(
                diff < 1e-5,
                "frozen weights (reshard {reshard_after_forward}): {diff}"
            );
        }
    });
}

/// An embedding the root's forward runs with `forward`, bypassing its hooks.
#[derive(Debug, Shardable)]
struct Embedder {
    emb: nn::Embedding,
    head: nn::Linear,
}

impl Module for Embedder {
    fn forward(&self, ids: &Tensor) -> Tensor {
        self.head.call(&self.emb.forward(ids))
    }
}

/// Whether [`Stack3`] bypasses its middle layer.
static BYPASS_MIDDLE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// Three layers; the middle one run with `forward` while [`BYPASS_MIDDLE`] is set (with its
/// shard's 8 / 2 rows, the last layer's input would have the wrong width).
#[derive(Debug, Shardable)]
struct Stack3 {
    fc1: nn::Linear,
    fc2: nn::Linear,
    fc3: nn::Linear,
}

impl Module for Stack3 {
    fn forward(&self, xs: &Tensor) -> Tensor {
        let h = self.fc1.call(xs).relu();
        let h = if BYPASS_MIDDLE.load(std::sync::atomic::Ordering::Relaxed) {
            self.fc2.forward(&h)
        } else {
            self.fc2.call(&h)
        };
        self.fc3.call(&h.relu())
    }
}

/// The bypass error of `param` in `module` (a field of its parent) on `rank`, pinned.
fn bypass_message(rank: usize, module: &str, param: &str) -> String {
    let field = module.rsplit('.').next().unwrap();
    format!(
        "rank {rank}: fully_shard: parameter `{param}` of `{module}` was used outside a call \
         of the module through its hooks, where it holds only this rank's shard; call the \
         module as `self.{field}.call(&x)`, not `x.apply(&self.{field})` or \
         `self.{field}.forward(&x)`"
    )
}

/// `err` is the typed bypass error of `param` in `module` on `rank`.
fn assert_bypassed(err: &tch_dist::ForwardError, rank: usize, module: &str, param: &str) {
    assert_eq!(err.message(), bypass_message(rank, module, param));
    assert!(
        matches!(
            err.downcast_ref::<FsdpError>(),
            Some(FsdpError::HooksBypassed { rank: r, module: m, param: p })
                if *r == rank && m == module && p == param
        ),
        "{err:?}"
    );
}

/// The model's trainable values, copied.
fn values(vs: &nn::VarStore) -> Vec<Tensor> {
    vs.trainable_variables().iter().map(|t| t.copy()).collect()
}

fn unchanged(vs: &nn::VarStore, before: &[Tensor]) -> bool {
    before
        .iter()
        .zip(vs.trainable_variables())
        .all(|(a, b)| a.equal(&b) && !b.grad().defined())
}

#[test]
fn bypass_is_an_error_in_every_grad_mode_at_2_ranks() {
    run_ranks(
        "bypass_is_an_error_in_every_grad_mode_at_2_ranks",
        2,
        |pg| {
            let rank = pg.rank();
            // 1. A managed embedding run with `forward` inside the root's forward: under
            // no_grad (an evaluation loop) and with grad, an error on every rank, nothing changed.
            let vs = nn::VarStore::new(Device::Cpu);
            let m = Embedder {
                emb: nn::embedding(vs.root() / "emb", 8, 4, Default::default()),
                head: nn::linear(vs.root() / "head", 4, 4, Default::default()),
            };
            fully_shard(&m.emb, FsdpOptions::default()).unwrap();
            fully_shard(&m, FsdpOptions::default()).unwrap();
            let before = values(&vs);
            // Rows every rank's shard has: without the check, rank 0 returned its (right) rows
            // and rank 1 its own (wrong) ones, Ok.
            let ids = Tensor::from_slice(&[0i64, 1, 2, 3]);
            let err = tch::no_grad(|| m.f_call(&ids)).unwrap_err();
            assert_bypassed(&err, rank, "emb", "emb.weight");
            let err = m.f_call(&ids).unwrap_err();
            assert_bypassed(&err, rank, "emb", "emb.weight");
            // `call` panics with the same message.
            let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                tch::no_grad(|| m.call(&ids))
            }));
            assert_eq!(
                panic_text(panicked.unwrap_err()),
                bypass_message(rank, "emb", "emb.weight")
            );
            assert!(unchanged(&vs, &before));
            for s in [fully_shard::state(&m), fully_shard::state(&m.emb)] {
                assert!(s.unwrap().is_sharded(), "back on the shards");
            }

            // 2. A bypassed managed head (it returned [4, 2] of [4, 4] before) under no_grad.
            let vs = nn::VarStore::new(Device::Cpu);
            let m = Bypassing { inner: model(&vs) };
            fully_shard(&m.inner.head, FsdpOptions::default()).unwrap();
            fully_shard(&m, FsdpOptions::default()).unwrap();
            let (x, _) = batch(0);
            let err = tch::no_grad(|| m.f_call(&x)).unwrap_err();
            assert_bypassed(&err, rank, "inner.head", "inner.head.weight");

            // 3. A bypassed middle layer: an error naming it, not a shape panic in the next
            // layer, with and without grad; then the model works again, equal to one process.
            let vs = nn::VarStore::new(Device::Cpu);
            let m = Stack3 {
                fc1: nn::linear(vs.root() / "fc1", 3, 16, Default::default()),
                fc2: nn::linear(vs.root() / "fc2", 16, 8, Default::default()),
                fc3: nn::linear(vs.root() / "fc3", 8, 2, Default::default()),
            };
            for l in [&m.fc1, &m.fc2, &m.fc3] {
                fully_shard(l, FsdpOptions::default()).unwrap();
            }
            fully_shard(&m, FsdpOptions::default()).unwrap();
            let before = values(&vs);
            let x = Tensor::from_slice(&[0.5f32, -1.0, 2.0, 1.5, 0.25, -0.5]).view([2, 3]);
            let err = m.f_call(&x).unwrap_err();
            assert_bypassed(&err, rank, "fc2", "fc2.weight");
            let err = tch::no_grad(|| m.f_call(&x)).unwrap_err();
            assert_bypassed(&err, rank, "fc2", "fc2.weight");
            assert!(unchanged(&vs, &before));
            BYPASS_MIDDLE.store(false, std::sync::atomic::Ordering::Relaxed);
            let full: std::collections::HashMap<String, Tensor> =
                full_state_dict(&m).unwrap().into_iter().collect();
            let dense = |h: &Tensor, l: &str| {
                h.linear(
                    &full[&format!("{l}.weight")],
                    Some(&full[&format!("{l}.bias")]),
                )
            };
            let expected = dense(&dense(&dense(&x, "fc1").relu(), "fc2").relu(), "fc3");
            let out = tch::no_grad(|| m.f_call(&x)).unwrap();
            assert!(
                out.allclose(&expected, 1e-6, 1e-6, false),
                "{out} {expected}"
            );
            assert!(unchanged(&vs, &before));
        },
    );
}

#[test]
fn errors_name_the_module_fqn() {
    let source = || tch_dist::DistError::Collective {
        rank: 1,
        op: "all_gather",
        cause: "connection reset".into(),
    };
    let nested = FsdpError::Hooked {
        rank: 1,
        module: "blocks.3".into(),
        source: source(),
    };
    assert_eq!(
        nested.to_string(),
        format!("fully_shard: the hook of `blocks.3` failed: {}", source())
    );
    let root = FsdpError::Hooked {
        rank: 1,
        module: String::new(),
        source: source(),
    };
    assert_eq!(
        root.to_string(),
        format!(
            "fully_shard: the hook of the root module failed: {}",
            source()
        )
    );
    let bypassed = FsdpError::HooksBypassed {
        rank: 0,
        module: "blocks.3.fc2".into(),
        param: "blocks.3.fc2.weight".into(),
    };
    assert_eq!(
        bypassed.to_string(),
        bypass_message(0, "blocks.3.fc2", "blocks.3.fc2.weight")
    );
}
