//! Hooked calls of several inputs and outputs (`call_with`): a block `forward(x, mask)` under
//! fully_shard (per-block groups), replicate and a sharder trains or computes as one
//! process does; mixed precision casts every floating input; a tuple output is hooked for
//! backward on each tensor; a bypass of the block is an error. Ranks are real processes
//! over 127.0.0.1. First, the hooks themselves in one process.

use std::sync::{Arc, Mutex};

use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};
use tch_dist::fully_shard::{full_state_dict, FsdpError, MixedPrecisionPolicy};
use tch_dist::hooks::{
    register_call_scope, register_fallible_forward_hook_n, register_forward_hook,
    register_forward_hook_n, register_forward_pre_hook, register_forward_pre_hook_n, CallError,
    CallScope,
};
use tch_dist::sharding::{shard_module, ColwiseLinear, RowwiseLinear, ShardError, ShardingPlan};
use tch_dist::testing::run_ranks;
use tch_dist::{
    fully_shard, replicate, Call, CallWith, Composition, ForwardError, FsdpOptions, OnRank,
    ProcessGroup, Shardable,
};

#[path = "common/unchanged.rs"]
mod unchanged;
use unchanged::named_values;

/// Model width, hidden width and sequence length.
const D: i64 = 6;
const HIDDEN: i64 = 8;
const T: i64 = 5;
/// The whole batch; each data-parallel rank takes `BATCH / world_size` sequences.
const BATCH: i64 = 4;

/// A transformer-like block of two inputs: attention over the sequence with an additive
/// (causal) mask, then an MLP; the MLP's layers are called with `call` so that a sharder
/// can hook them.
#[derive(Debug, Shardable)]
struct Block {
    up: nn::Linear,
    down: nn::Linear,
}

impl Block {
    fn forward(&self, x: &Tensor, mask: &Tensor) -> Tensor {
        self.forward_pair(x, mask).0
    }

    /// Two outputs: the block's output and the MLP's contribution, computed apart (the second
    /// does not go through the first in the graph).
    fn forward_pair(&self, x: &Tensor, mask: &Tensor) -> (Tensor, Tensor) {
        let scores = (x.matmul(&x.transpose(-2, -1)) / (D as f64).sqrt() + mask).softmax(-1, None);
        let h = scores.matmul(x);
        let a = self.up.call(&h).tanh();
        let mlp = self.down.call(&a);
        (&h + &mlp, mlp.sin())
    }
}

fn block(p: nn::Path) -> Block {
    Block {
        up: nn::linear(&p / "up", D, HIDDEN, Default::default()),
        down: nn::linear(&p / "down", HIDDEN, D, Default::default()),
    }
}

/// Two blocks and a head; each block is called with the shared mask through `call_with`.
#[derive(Debug, Shardable)]
struct Model {
    blocks: Vec<Block>,
    head: nn::Linear,
    #[shardable(skip)]
    mask: Tensor,
}

impl Module for Model {
    fn forward(&self, xs: &Tensor) -> Tensor {
        let h = self.blocks.iter().fold(xs.shallow_clone(), |h, b| {
            b.call_with([&h, &self.mask], |b, [x, mask]| b.forward(x, mask))
        });
        self.head.call(&h)
    }
}

/// A gated attention block of two inputs whose forward still runs on a shard of its gate
/// (2 rows, 1 per rank), so that a bypass reaches the check rather than a shape error.
#[derive(Debug, Shardable)]
struct Gate {
    fc: nn::Linear,
}

impl Gate {
    fn forward(&self, x: &Tensor, mask: &Tensor) -> Tensor {
        let h = (x.matmul(&x.transpose(-2, -1)) / (D as f64).sqrt() + mask)
            .softmax(-1, None)
            .matmul(x);
        let gate = self.fc.call(&h).sigmoid().sum_dim_intlist(-1, true, None);
        h * gate
    }
}

/// A model whose gate block is called with its `forward`, bypassing its hooks.
#[derive(Debug, Shardable)]
struct Bypassing {
    gate: Gate,
    head: nn::Linear,
    #[shardable(skip)]
    mask: Tensor,
}

impl Module for Bypassing {
    fn forward(&self, xs: &Tensor) -> Tensor {
        let h = self.gate.forward(xs, &self.mask);
        self.head.call(&h)
    }
}

/// A causal additive mask: 0 on and below the diagonal, -1e9 above.
fn causal_mask() -> Tensor {
    let ones = Tensor::ones([T, T], (Kind::Float, Device::Cpu));
    ones.triu(1) * -1e9
}

fn model(vs: &nn::VarStore) -> Model {
    let p = vs.root();
    Model {
        blocks: (0..2).map(|i| block(&p / "blocks" / i)).collect(),
        head: nn::linear(&p / "head", D, 2, Default::default()),
        mask: causal_mask(),
    }
}

/// The whole batch of `step`, the same on every rank.
fn batch(step: usize) -> (Tensor, Tensor) {
    tch::manual_seed(900 + step as i64);
    (
        Tensor::randn([BATCH, T, D], (Kind::Float, Device::Cpu)),
        Tensor::randn([BATCH, T, 2], (Kind::Float, Device::Cpu)),
    )
}

/// This rank's sequences of a whole batch.
fn slice(t: &Tensor, pg: &ProcessGroup) -> Tensor {
    let n = BATCH / pg.world_size() as i64;
    t.narrow(0, pg.rank() as i64 * n, n)
}

fn sgd(vs: &nn::VarStore) -> nn::Optimizer {
    nn::Sgd {
        momentum: 0.9,
        ..Default::default()
    }
    .build(vs, 0.1)
    .unwrap()
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.size(), b.size());
    (a - b).abs().max().double_value(&[])
}

/// How far training moved the parameters of `vs` from `initial`.
fn distance(initial: &[(String, Tensor)], vs: &nn::VarStore) -> f64 {
    initial
        .iter()
        .map(|(k, t)| max_diff(t, &vs.variables()[k]))
        .fold(0.0, f64::max)
}

// --- the hooks, one process ---

fn ones(shape: &[i64]) -> Tensor {
    Tensor::ones(shape, (Kind::Float, Device::Cpu))
}

#[test]
fn hooks_see_and_replace_every_input_and_output() {
    let vs = nn::VarStore::new(Device::Cpu);
    let b = block(vs.root());
    let seen: Arc<Mutex<Vec<String>>> = Arc::default();
    let log = seen.clone();
    // Replaces the mask with zeros (no masking), keeps x.
    let pre = register_forward_pre_hook_n(&b, move |_, xs| {
        log.lock().unwrap().push(format!("pre {}", xs.len()));
        Some(vec![xs[0].shallow_clone(), xs[1].zeros_like()])
    })
    .unwrap();
    let log = seen.clone();
    // Sees the replaced inputs and both outputs; doubles the second.
    let post = register_forward_hook_n(&b, move |_, xs, outs| {
        let mask_sum = xs[1].abs().sum(Kind::Float).double_value(&[]);
        log.lock()
            .unwrap()
            .push(format!("post {} {} {mask_sum}", xs.len(), outs.len()));
        Some(vec![outs[0].shallow_clone(), &outs[1] * 2.0])
    })
    .unwrap();
    tch::manual_seed(1);
    let x = Tensor::randn([1, T, D], (Kind::Float, Device::Cpu));
    let mask = causal_mask();
    let (y, z) = b.call_with([&x, &mask], |b, [x, mask]| b.forward_pair(x, mask));
    let (y_ref, z_ref) = b.forward_pair(&x, &mask.zeros_like());
    assert!(max_diff(&y, &y_ref) < 1e-6);
    assert!(max_diff(&z, &(&z_ref * 2.0)) < 1e-6);
    assert_eq!(*seen.lock().unwrap(), ["pre 2", "post 2 2 0"]);

    // A pre-hook returning another number of inputs, a forward hook another number of
    // outputs: errors naming the module, and `call_with` panics with the message.
    pre.remove();
    post.remove();
    let name = std::any::type_name::<Block>();
    let h = register_forward_pre_hook_n(&b, |_, xs| Some(vec![xs[0].shallow_clone()])).unwrap();
    let err = b
        .f_call_with([&x, &mask], |b, [x, mask]| b.forward(x, mask))
        .unwrap_err();
    assert_eq!(
        err.message(),
        format!("a forward pre-hook of `{name}` replaced its 2 inputs with 1")
    );
    assert_eq!(
        err.downcast_ref::<CallError>(),
        Some(&CallError::ReplacedInputs {
            module: name,
            expected: 2,
            got: 1
        })
    );
    h.remove();
    let h = register_forward_hook_n(&b, |_, _, outs| Some(vec![outs[0].shallow_clone()])).unwrap();
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        b.call_with([&x, &mask], |b, [x, mask]| b.forward_pair(x, mask))
    }))
    .unwrap_err();
    assert_eq!(
        panicked.downcast_ref::<String>().map(String::as_str),
        Some(format!("a forward hook of `{name}` replaced its 2 outputs with 1").as_str())
    );
    h.remove();
}

#[test]
fn one_tensor_hooks_refuse_calls_they_cannot_see() {
    let vs = nn::VarStore::new(Device::Cpu);
    let b = block(vs.root());
    let (x, mask) = (ones(&[1, T, D]), causal_mask());
    let name = std::any::type_name::<Block>();
    let pre = register_forward_pre_hook(&b, |_, x| Some(x * 0.0)).unwrap();
    let err = b
        .f_call_with([&x, &mask], |b, [x, mask]| b.forward(x, mask))
        .unwrap_err();
    assert_eq!(
        err.message(),
        format!(
            "a one-tensor forward pre-hook of `{name}` cannot see a call with 2 inputs; \
             register it with `register_forward_pre_hook_n`"
        )
    );
    // A call of one input and one output is still theirs.
    // The forward owns what it captures (it may run again during backward).
    let held = mask.shallow_clone();
    let y = b.call_with([&x], move |b, [x]| b.forward(x, &held));
    assert!(max_diff(&y, &b.forward(&(&x * 0.0), &mask)) < 1e-6);
    pre.remove();
    let post = register_forward_hook(&b, |_, _, out| Some(out * 0.0)).unwrap();
    let err = b
        .f_call_with([&x], {
            let held = mask.shallow_clone();
            move |b, [x]| b.forward_pair(x, &held)
        })
        .unwrap_err();
    assert_eq!(
        err.downcast_ref::<CallError>(),
        Some(&CallError::OneTensorHook {
            module: name,
            inputs: 1,
            outputs: 2
        })
    );
    assert_eq!(
        err.message(),
        format!(
            "a one-tensor forward hook of `{name}` cannot see a call with 1 inputs and 2 \
             outputs; register it with `register_forward_hook_n`"
        )
    );
    post.remove();
}

/// Records the mark and the output count at each exit.
#[derive(Default)]
struct Outputs(Mutex<Vec<(usize, usize)>>);

impl CallScope for Outputs {
    fn enter(&self, _m: &dyn Shardable, inputs: &[Tensor]) -> Result<u64, ForwardError> {
        Ok(inputs.len() as u64)
    }
    fn exit(&self, _m: &dyn Shardable, outputs: &[Tensor], mark: u64) -> Result<(), ForwardError> {
        self.0.lock().unwrap().push((mark as usize, outputs.len()));
        Ok(())
    }
}

#[test]
fn call_scopes_and_child_errors_of_multi_input_calls() {
    let vs = nn::VarStore::new(Device::Cpu);
    let b = block(vs.root());
    let (x, mask) = (ones(&[1, T, D]), causal_mask());
    let scope = Arc::new(Outputs::default());
    let handles = register_call_scope(&b, scope.clone()).unwrap();
    let _ = b.call_with([&x, &mask], |b, [x, mask]| b.forward_pair(x, mask));
    let _ = b.call_with([&x, &mask, &x], |b, [x, mask, _]| b.forward(x, mask));
    let _ = b.call(&x);
    assert_eq!(*scope.0.lock().unwrap(), [(2, 2), (3, 1), (1, 1)]);
    handles.iter().for_each(|h| {
        h.remove();
    });
    // A child's failing hook inside the block's forward comes back from `f_call_with`.
    register_fallible_forward_hook_n(&b.down, |_, _, _| {
        Err(ForwardError::new("rank 0: down refused"))
    })
    .unwrap();
    let err = b
        .f_call_with([&x, &mask], |b, [x, mask]| b.forward(x, mask))
        .unwrap_err();
    assert_eq!(err.message(), "rank 0: down refused");
}

impl Module for Block {
    /// One input: the block without a mask (for `call` in the scope test).
    fn forward(&self, xs: &Tensor) -> Tensor {
        Block::forward(self, xs, &Tensor::zeros([T, T], (Kind::Float, Device::Cpu)))
    }
}

// --- fully_shard ---

/// Per-block fully_shard (each resharded after forward) and the root; `mp` for both.
fn shard_per_block(m: &Model, mp: MixedPrecisionPolicy) {
    for b in &m.blocks {
        let opts = FsdpOptions {
            reshard_after_forward: Some(true.into()),
            mp_policy: mp,
            ..Default::default()
        };
        fully_shard(b, opts).unwrap();
    }
    let root = FsdpOptions {
        mp_policy: mp,
        ..Default::default()
    };
    fully_shard(m, root).unwrap();
}

/// The largest difference between the full parameters of `m` and the reference's.
fn max_diff_full<M: Shardable>(m: &M, reference: &nn::VarStore) -> f64 {
    let full = full_state_dict(m).unwrap();
    let vars = reference.variables();
    assert_eq!(full.len(), vars.len());
    full.iter()
        .map(|(fqn, t)| max_diff(t, &vars[fqn]))
        .fold(0.0, f64::max)
}

/// Four SGD-with-momentum steps of the per-block sharded model (each rank on its
/// sequences) and of one process on the whole batch, from rank 0's values.
fn fully_shard_parity(pg: &ProcessGroup) -> (f64, f64) {
    tch::manual_seed(5);
    let ref_vs = nn::VarStore::new(Device::Cpu);
    let reference = model(&ref_vs);
    let initial = named_values(&ref_vs);
    tch::manual_seed(5 + pg.rank() as i64 * 1000);
    let vs = nn::VarStore::new(Device::Cpu);
    let m = model(&vs);
    shard_per_block(&m, MixedPrecisionPolicy::default());
    let (mut opt, mut ref_opt) = (sgd(&vs), sgd(&ref_vs));
    for step in 0..4 {
        let (x, y) = batch(step);
        ref_opt.backward_step(&reference.forward(&x).mse_loss(&y, tch::Reduction::Mean));
        let out = m.call(&slice(&x, pg));
        opt.backward_step(&out.mse_loss(&slice(&y, pg), tch::Reduction::Mean));
        for b in &m.blocks {
            assert!(fully_shard::state(b).unwrap().is_sharded());
        }
    }
    (max_diff_full(&m, &ref_vs), distance(&initial, &ref_vs))
}

/// A root over one block called for its tuple output, the loss taken from the second
/// output only: its backward must gather the block's parameters (each output is hooked).
#[derive(Debug, Shardable)]
struct PairRoot {
    block: Block,
    #[shardable(skip)]
    mask: Tensor,
}

impl Module for PairRoot {
    fn forward(&self, xs: &Tensor) -> Tensor {
        let (_y, z) = self
            .block
            .call_with([xs, &self.mask], |b, [x, mask]| b.forward_pair(x, mask));
        z
    }
}

fn tuple_output_parity(pg: &ProcessGroup) -> (f64, f64) {
    let pair = |vs: &nn::VarStore| PairRoot {
        block: block(vs.root() / "block"),
        mask: causal_mask(),
    };
    tch::manual_seed(6);
    let ref_vs = nn::VarStore::new(Device::Cpu);
    let reference = pair(&ref_vs);
    let initial = named_values(&ref_vs);
    tch::manual_seed(6 + pg.rank() as i64 * 1000);
    let vs = nn::VarStore::new(Device::Cpu);
    let m = pair(&vs);
    let opts = FsdpOptions {
        reshard_after_forward: Some(true.into()),
        ..Default::default()
    };
    fully_shard(&m.block, opts).unwrap();
    let (mut opt, mut ref_opt) = (sgd(&vs), sgd(&ref_vs));
    for step in 0..3 {
        let (x, _) = batch(step);
        let target = Tensor::zeros([BATCH, T, D], (Kind::Float, Device::Cpu));
        ref_opt.backward_step(
            &reference
                .forward(&x)
                .mse_loss(&target, tch::Reduction::Mean),
        );
        let out = m.call(&slice(&x, pg));
        opt.backward_step(&out.mse_loss(&slice(&target, pg), tch::Reduction::Mean));
        assert!(fully_shard::state(&m.block).unwrap().is_sharded());
    }
    (max_diff_full(&m, &ref_vs), distance(&initial, &ref_vs))
}

/// Mixed precision casts both floating inputs of a block (not an integer one) and the
/// block's tuple outputs.
fn mixed_precision_casts(pg: &ProcessGroup) {
    let vs = nn::VarStore::new(Device::Cpu);
    let m = model(&vs);
    let mp = MixedPrecisionPolicy {
        param_dtype: Some(Kind::Double),
        output_dtype: Some(Kind::Half),
        ..Default::default()
    };
    shard_per_block(&m, mp);
    let (x, _) = batch(0);
    let x = slice(&x, pg);
    let positions = Tensor::arange(T, (Kind::Int64, Device::Cpu));
    let kinds = Arc::new(Mutex::new(Vec::new()));
    let seen = Arc::clone(&kinds);
    // No graph: no backward pass is left waiting for this call.
    let (y, z) = tch::no_grad(|| {
        m.blocks[0].call_with([&x, &m.mask, &positions], move |b, [x, mask, pos]| {
            *seen.lock().unwrap() = vec![x.kind(), mask.kind(), pos.kind()];
            b.forward_pair(x, mask)
        })
    });
    assert_eq!(
        *kinds.lock().unwrap(),
        [Kind::Double, Kind::Double, Kind::Int64]
    );
    assert_eq!((y.kind(), z.kind()), (Kind::Half, Kind::Half));
    // The f32 reference computes the same within f16's precision.
    let full = full_state_dict(&m).unwrap();
    let ref_vs = nn::VarStore::new(Device::Cpu);
    let reference = model(&ref_vs);
    tch::no_grad(|| {
        for (fqn, t) in &full {
            ref_vs.variables()[fqn].shallow_clone().copy_(t);
        }
    });
    let (y_ref, z_ref) = reference.blocks[0].forward_pair(&x, &m.mask);
    assert!(max_diff(&y.to_kind(Kind::Float), &y_ref) < 1e-2);
    assert!(max_diff(&z.to_kind(Kind::Float), &z_ref) < 1e-2);

    // A tuple holding an undefined tensor, as input and as output (issue 41, item 7: the
    // casts read its dtype and f_call_with panicked with `UnknownKind(46)`): the casts leave
    // it as it is, as PyTorch's leave a `None`.
    let (y, none) = tch::no_grad(|| {
        m.blocks[0].f_call_with([&x, &m.mask, &Tensor::new()], |b, [x, mask, empty]| {
            assert!(!empty.defined());
            (b.forward(x, mask), Tensor::new())
        })
    })
    .unwrap();
    assert_eq!(y.kind(), Kind::Half);
    assert!(!none.defined());
}

#[test]
fn fully_shard_manages_multi_input_blocks_at_2_ranks() {
    run_ranks(
        "fully_shard_manages_multi_input_blocks_at_2_ranks",
        2,
        |pg| {
            let (diff, moved) = fully_shard_parity(&pg);
            assert!(moved > 1e-2, "training moved the weights ({moved})");
            assert!(diff < 1e-5, "per-block fully_shard vs one process: {diff}");

            let (diff, moved) = tuple_output_parity(&pg);
            assert!(moved > 1e-3, "training moved the weights ({moved})");
            assert!(diff < 1e-5, "tuple output vs one process: {diff}");

            mixed_precision_casts(&pg);

            // The gate block called with `forward` inside the root's call: the root's forward
            // fails, naming the block, and nothing changes.
            let vs = nn::VarStore::new(Device::Cpu);
            let p = vs.root();
            let m = Bypassing {
                gate: Gate {
                    fc: nn::linear(&p / "gate" / "fc", D, 2, Default::default()),
                },
                head: nn::linear(&p / "head", D, 2, Default::default()),
                mask: causal_mask(),
            };
            fully_shard(&m.gate, FsdpOptions::default()).unwrap();
            fully_shard(&m, FsdpOptions::default()).unwrap();
            let before = named_values(&vs);
            let (x, _) = batch(0);
            let err = m.f_call(&slice(&x, &pg)).unwrap_err();
            let e = err.downcast_ref::<FsdpError>().expect("a typed error");
            assert!(
                matches!(
                    e.composition(),
                    Some(Composition::HooksBypassed { module, param, .. })
                        if module == "gate" && param == "gate.fc.weight"
                ),
                "{e}"
            );
            assert_eq!(
                err.message(),
                format!(
                    "rank {}: fully_shard: parameter `gate.fc.weight` of `gate` was used outside \
                     a call of the module through its hooks, where it holds only this rank's \
                     shard; call the module as `self.gate.call(&x)`, not `x.apply(&self.gate)` \
                     or `self.gate.forward(&x)`",
                    pg.rank()
                )
            );
            assert!(distance(&before, &vs) == 0.0);
            assert!(fully_shard::state(&m).unwrap().is_sharded());
            assert!(fully_shard::state(&m.gate).unwrap().is_sharded());
        },
    );
}

// --- replicate ---

#[test]
fn replicate_manages_a_multi_input_block_at_2_ranks() {
    run_ranks(
        "replicate_manages_a_multi_input_block_at_2_ranks",
        2,
        |pg| {
            tch::manual_seed(7);
            let ref_vs = nn::VarStore::new(Device::Cpu);
            let reference = block(ref_vs.root());
            let initial = named_values(&ref_vs);
            tch::manual_seed(7 + pg.rank() as i64 * 1000);
            let vs = nn::VarStore::new(Device::Cpu);
            let b = block(vs.root());
            replicate::apply(&b, replicate::Options::default()).unwrap();
            let mask = causal_mask();
            let (mut opt, mut ref_opt) = (sgd(&vs), sgd(&ref_vs));
            for step in 0..4 {
                let (x, _) = batch(step);
                let target = Tensor::ones([BATCH, T, D], (Kind::Float, Device::Cpu));
                let loss = reference
                    .forward(&x, &mask)
                    .mse_loss(&target, tch::Reduction::Mean);
                ref_opt.backward_step(&loss);
                let x = slice(&x, &pg);
                let out = b.call_with([&x, &mask], |b, [x, mask]| b.forward(x, mask));
                opt.backward_step(&out.mse_loss(&slice(&target, &pg), tch::Reduction::Mean));
            }
            let diff = named_values(&vs)
                .iter()
                .map(|(k, t)| max_diff(t, &ref_vs.variables()[k]))
                .fold(0.0, f64::max);
            assert!(distance(&initial, &ref_vs) > 1e-2);
            assert!(diff < 1e-5, "replicate vs one process: {diff}");
        },
    );
}

// --- sharding ---

/// The block with its up projection run without its hooks.
#[derive(Debug, Shardable)]
struct ApplyBlock {
    inner: Block,
}

impl ApplyBlock {
    fn forward(&self, x: &Tensor, mask: &Tensor) -> Tensor {
        let b = &self.inner;
        let h = (x.matmul(&x.transpose(-2, -1)) / (D as f64).sqrt() + mask)
            .softmax(-1, None)
            .matmul(x);
        &h + b.down.call(&h.apply(&b.up).tanh())
    }
}

#[test]
fn a_sharded_multi_input_block_matches_one_process_at_2_ranks() {
    run_ranks(
        "a_sharded_multi_input_block_matches_one_process_at_2_ranks",
        2,
        |pg| {
            tch::manual_seed(8);
            let ref_vs = nn::VarStore::new(Device::Cpu);
            let reference = block(ref_vs.root());
            tch::manual_seed(8 + pg.rank() as i64 * 1000);
            let vs = nn::VarStore::new(Device::Cpu);
            let mut b = block(vs.root());
            let plan = ShardingPlan::builder()
                .shard_module(Block::path().up(), ColwiseLinear::default())
                .shard_module(Block::path().down(), RowwiseLinear)
                .return_local_tensor(Block::path().up())
                .build();
            shard_module(&mut b, &plan, 0, &pg).unwrap();
            assert_eq!(b.up.ws.size(), [HIDDEN / 2, D]);
            let (x, _) = batch(0);
            let mask = causal_mask();
            let (y, z) = b.call_with([&x, &mask], |b, [x, mask]| b.forward_pair(x, mask));
            let (y_ref, z_ref) = reference.forward_pair(&x, &mask);
            assert!(max_diff(&y, &y_ref) < 1e-5, "first output");
            assert!(max_diff(&z, &z_ref) < 1e-5, "second output");
            (y.square().sum(Kind::Float) + z.sum(Kind::Float)).backward();
            (y_ref.square().sum(Kind::Float) + z_ref.sum(Kind::Float)).backward();
            let rows = HIDDEN / 2;
            let ref_up = reference
                .up
                .ws
                .grad()
                .narrow(0, pg.rank() as i64 * rows, rows);
            assert!(max_diff(&b.up.ws.grad(), &ref_up) < 1e-4, "up's gradient");
            let ref_down = reference
                .down
                .ws
                .grad()
                .narrow(1, pg.rank() as i64 * rows, rows);
            assert!(
                max_diff(&b.down.ws.grad(), &ref_down) < 1e-4,
                "down's gradient"
            );

            // The up projection bypassed inside the block's `call_with`: its forward fails on
            // every rank, naming the layer.
            let vs = nn::VarStore::new(Device::Cpu);
            let mut m = ApplyBlock {
                inner: block(vs.root() / "inner"),
            };
            let plan = ShardingPlan::builder()
                .shard_module(ApplyBlock::path().inner().up(), ColwiseLinear::default())
                .shard_module(ApplyBlock::path().inner().down(), RowwiseLinear)
                .return_local_tensor(ApplyBlock::path().inner().up())
                .build();
            shard_module(&mut m, &plan, 0, &pg).unwrap();
            let err = m
                .f_call_with([&x, &mask], |m, [x, mask]| m.forward(x, mask))
                .unwrap_err();
            assert!(
                matches!(
                    err.downcast_ref::<ShardError>(),
                    Some(ShardError::Composition(OnRank {
                        rank,
                        problem: Composition::HooksBypassed { module, param, .. },
                    })) if *rank == pg.rank() && module == "inner.up"
                            && param == "inner.up.weight"
                ),
                "{err:?}"
            );
        },
    );
}
