//! Activation checkpointing (`checkpoint_activations`): a checkpointed block's gradients and
//! training equal those without checkpointing, bit for bit on CPU with one thread (SGD with
//! momentum and AdamW alike); its forward runs again in backward (and only then); dropout
//! draws the same mask both times; multi-input blocks, nested blocks and frozen inputs;
//! misuse is an error (applied twice, a shape that changes between the runs, a bypass).
//! Then with the family at 2 ranks, ranks as real processes over 127.0.0.1: per-block
//! fully_shard, replicate around the model, and a tensor-parallel MLP inside the block, each
//! equal to the same setup without checkpointing.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};

use tch::nn::{self, Module, ModuleT, OptimizerConfig};
use tch::{Device, Kind, Tensor};
use tch_dist::activation_checkpoint::{
    checkpoint_activations, state, ActivationCheckpointError, CheckpointOptions, DeterminismCheck,
};
use tch_dist::sharding::{shard_module, ColwiseLinear, RowwiseLinear, ShardingPlan};
use tch_dist::testing::{run_ranks, run_ranks_with, Launch};
use tch_dist::{
    fully_shard, registry, replicate, Backend, Call, CallT, CallWith, FsdpOptions, ShallowClone,
    Shardable,
};

#[path = "common/unchanged.rs"]
mod unchanged;
use unchanged::named_values;

const D: i64 = 6;
const HIDDEN: i64 = 12;
const BATCH: i64 = 8;

/// The tests that draw random numbers or count forwards run one at a time (cargo runs tests
/// on several threads, which share the CPU generator).
fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    tch::set_num_threads(1);
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// How many times any `Block::forward` ran.
static FORWARDS: AtomicUsize = AtomicUsize::new(0);

/// A pre-norm MLP block with a residual; its layers are called with `call` (so that a
/// sharder can hook them).
#[derive(Debug, Shardable, ShallowClone)]
struct Block {
    ln: nn::LayerNorm,
    up: nn::Linear,
    down: nn::Linear,
    #[shardable(skip)]
    dropout: f64,
}

impl ModuleT for Block {
    fn forward_t(&self, x: &Tensor, train: bool) -> Tensor {
        FORWARDS.fetch_add(1, Ordering::SeqCst);
        let h = self.up.call(&x.apply(&self.ln)).gelu("none");
        let h = h.dropout(self.dropout, train);
        x + self.down.call(&h)
    }
}

impl Block {
    /// Two inputs: a gate scaling the residual branch.
    fn forward_gated(&self, x: &Tensor, gate: &Tensor) -> Tensor {
        x + self.forward_t(x, false) * gate.sigmoid() - x
    }
}

fn block(p: nn::Path, dropout: f64) -> Block {
    Block {
        ln: nn::layer_norm(&p / "ln", vec![D], Default::default()),
        up: nn::linear(&p / "up", D, HIDDEN, Default::default()),
        down: nn::linear(&p / "down", HIDDEN, D, Default::default()),
        dropout,
    }
}

#[derive(Debug, Shardable)]
struct Net {
    blocks: Vec<Block>,
    head: nn::Linear,
}

impl ModuleT for Net {
    fn forward_t(&self, x: &Tensor, train: bool) -> Tensor {
        let mut h = x.shallow_clone();
        for b in &self.blocks {
            h = b.call_t(&h, train);
        }
        self.head.call(&h)
    }
}

fn net(vs: &nn::VarStore, blocks: usize, dropout: f64) -> Net {
    let p = vs.root();
    Net {
        blocks: (0..blocks)
            .map(|i| block(&p / "blocks" / i, dropout))
            .collect(),
        head: nn::linear(&p / "head", D, 2, Default::default()),
    }
}

/// Two identical models (seeded alike).
fn twins(blocks: usize, dropout: f64) -> ((nn::VarStore, Net), (nn::VarStore, Net)) {
    let mut out = Vec::new();
    for _ in 0..2 {
        tch::manual_seed(11);
        let vs = nn::VarStore::new(Device::Cpu);
        let n = net(&vs, blocks, dropout);
        out.push((vs, n));
    }
    let b = out.pop().unwrap();
    let a = out.pop().unwrap();
    (a, b)
}

fn data(step: i64) -> (Tensor, Tensor) {
    tch::manual_seed(100 + step);
    let x = Tensor::randn([BATCH, D], (Kind::Float, Device::Cpu));
    let y = Tensor::randn([BATCH, 2], (Kind::Float, Device::Cpu));
    (x, y)
}

fn bitwise_equal(a: &nn::VarStore, b: &nn::VarStore) -> bool {
    named_values(a)
        .iter()
        .zip(named_values(b))
        .all(|((na, ta), (nb, tb))| *na == nb && ta.equal(&tb))
}

fn checkpoint_every_block(n: &Net) {
    for b in &n.blocks {
        checkpoint_activations(b, CheckpointOptions::default()).unwrap();
    }
}

/// Trains `steps` steps with `opt` on `n`, in training mode when `train`.
fn train<O: OptimizerConfig>(vs: &nn::VarStore, n: &Net, config: O, steps: i64, train: bool) {
    let mut opt = config.build(vs, 0.05).unwrap();
    for step in 0..steps {
        let (x, y) = data(step);
        tch::manual_seed(1000 + step);
        let loss = n.call_t(&x, train).mse_loss(&y, tch::Reduction::Mean);
        opt.backward_step(&loss);
    }
}

#[test]
fn training_equals_no_checkpointing_bit_for_bit_with_sgd_and_adamw() {
    let _s = serial();
    for adamw in [false, true] {
        let ((vs_a, a), (vs_b, b)) = twins(3, 0.0);
        checkpoint_every_block(&b);
        let before = named_values(&vs_b);
        if adamw {
            train(&vs_a, &a, nn::AdamW::default(), 4, true);
            train(&vs_b, &b, nn::AdamW::default(), 4, true);
        } else {
            let sgd = nn::Sgd {
                momentum: 0.9,
                ..Default::default()
            };
            train(&vs_a, &a, sgd, 4, true);
            train(&vs_b, &b, sgd, 4, true);
        }
        assert!(
            !named_values(&vs_b)[0].1.equal(&before[0].1),
            "training moved the weights"
        );
        assert!(
            bitwise_equal(&vs_a, &vs_b),
            "checkpointed training differs (adamw: {adamw})"
        );
        assert_eq!(registry(&b.blocks[0]), ["checkpoint"]);
        assert_eq!(
            state(&b.blocks[0]).unwrap().options(),
            CheckpointOptions::default()
        );
    }
}

#[test]
fn the_forward_runs_again_in_backward_only() {
    let _s = serial();
    let ((_va, a), (_vb, b)) = twins(1, 0.0);
    checkpoint_every_block(&b);
    let (x, _) = data(0);
    let runs = |f: &dyn Fn()| {
        let start = FORWARDS.load(Ordering::SeqCst);
        f();
        FORWARDS.load(Ordering::SeqCst) - start
    };
    assert_eq!(
        runs(&|| a.forward_t(&x, true).sum(Kind::Float).backward()),
        1
    );
    // Forward once; backward once more.
    let y = b.forward_t(&x, true).sum(Kind::Float);
    assert_eq!(runs(&|| y.backward()), 1);
    assert_eq!(runs(&|| drop(b.forward_t(&x, true))), 1);
    // Under no_grad nothing is kept and nothing runs again.
    assert_eq!(runs(&|| drop(tch::no_grad(|| b.forward_t(&x, true)))), 1);
}

#[test]
fn dropout_draws_the_same_mask_in_the_recomputation() {
    let _s = serial();
    let ((vs_a, a), (vs_b, b)) = twins(2, 0.5);
    checkpoint_every_block(&b);
    train(&vs_a, &a, nn::Sgd::default(), 3, true);
    train(&vs_b, &b, nn::Sgd::default(), 3, true);
    assert!(bitwise_equal(&vs_a, &vs_b), "dropout masks differed");

    // Without the RNG state the recomputation draws another mask: gradients differ.
    let ((vs_a, a), (vs_b, b)) = twins(1, 0.5);
    let opts = CheckpointOptions {
        preserve_rng_state: false,
        ..Default::default()
    };
    checkpoint_activations(&b.blocks[0], opts).unwrap();
    train(&vs_a, &a, nn::Sgd::default(), 1, true);
    train(&vs_b, &b, nn::Sgd::default(), 1, true);
    assert!(!bitwise_equal(&vs_a, &vs_b));
}

#[test]
fn multi_input_blocks_nested_blocks_and_inputs_without_grad() {
    let _s = serial();
    // call_with: a (x, gate) block.
    let ((vs_a, a), (vs_b, b)) = twins(1, 0.0);
    checkpoint_every_block(&b);
    let (x, _) = data(0);
    let gate = Tensor::randn([BATCH, D], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let gate_b = gate.detach().copy().set_requires_grad(true);
    let ya = a.blocks[0].call_with([&x, &gate], |m, [x, g]| m.forward_gated(x, g));
    let yb = b.blocks[0].call_with([&x, &gate_b], |m, [x, g]| m.forward_gated(x, g));
    assert!(ya.equal(&yb));
    ya.sum(Kind::Float).backward();
    yb.sum(Kind::Float).backward();
    assert!(gate.grad().equal(&gate_b.grad()), "the input's gradient");
    assert!(a.blocks[0].up.ws.grad().equal(&b.blocks[0].up.ws.grad()));
    drop((vs_a, vs_b));

    // A checkpointed model whose blocks are checkpointed too (nested), on an input that
    // does not require grad.
    let ((vs_a, a), (vs_b, b)) = twins(2, 0.0);
    let outer = Outer { net: b };
    checkpoint_every_block(&outer.net);
    checkpoint_activations(&outer, CheckpointOptions::default()).unwrap();
    let ref_outer = Outer { net: a };
    train_outer(&vs_a, &ref_outer);
    train_outer(&vs_b, &outer);
    assert!(bitwise_equal(&vs_a, &vs_b), "nested checkpoints differ");
}

#[derive(Debug, Shardable, ShallowClone)]
struct Outer {
    net: Net,
}

impl ShallowClone for Net {
    fn shallow_clone(&self) -> Self {
        Net {
            blocks: self.blocks.shallow_clone(),
            head: self.head.shallow_clone(),
        }
    }
}

impl Module for Outer {
    fn forward(&self, x: &Tensor) -> Tensor {
        self.net.forward_t(x, false)
    }
}

fn train_outer(vs: &nn::VarStore, o: &Outer) {
    let mut opt = nn::Sgd {
        momentum: 0.9,
        ..Default::default()
    }
    .build(vs, 0.05)
    .unwrap();
    for step in 0..3 {
        let (x, y) = data(step);
        let loss = o.call(&x).mse_loss(&y, tch::Reduction::Mean);
        opt.backward_step(&loss);
    }
}

/// A block whose output's shape changes on every run.
#[derive(Debug, Shardable, ShallowClone)]
struct Drifting {
    fc: nn::Linear,
}

static DRIFT: AtomicUsize = AtomicUsize::new(0);

impl Module for Drifting {
    fn forward(&self, x: &Tensor) -> Tensor {
        let n = DRIFT.fetch_add(1, Ordering::SeqCst) as i64;
        x.apply(&self.fc).narrow(0, 0, BATCH - n % 2)
    }
}

#[test]
fn misuse_is_an_error_and_changes_nothing() {
    let _s = serial();
    let vs = nn::VarStore::new(Device::Cpu);
    let (_, n) = (0, net(&vs, 1, 0.0));
    checkpoint_activations(&n.blocks[0], CheckpointOptions::default()).unwrap();
    // Applied twice.
    let e = checkpoint_activations(&n.blocks[0], CheckpointOptions::default()).unwrap_err();
    assert!(matches!(e, ActivationCheckpointError::Contract(_)), "{e}");
    assert_eq!(registry(&n.blocks[0]), ["checkpoint"]);

    // A bypass (`forward_t` instead of `call_t`): backward fails naming the parameter and
    // the fix; no gradient lands.
    let (x, _) = data(0);
    let y = n.blocks[0].forward_t(&x, false).sum(Kind::Float);
    let e = y.f_backward().unwrap_err().to_string();
    assert!(
        e.contains(
            "rank 0: checkpoint: parameter `ln.weight` of checkpointed `Block` was used \
                    outside the module's hooked call; call it with `.call(&x)`"
        ),
        "{e}"
    );
    assert!(!n.blocks[0].up.ws.grad().defined());

    // A forward whose output's shape changes between the runs: backward fails naming the
    // module; without the check it fails in the engine instead.
    let vs = nn::VarStore::new(Device::Cpu);
    let d = Drifting {
        fc: nn::linear(vs.root() / "fc", D, D, Default::default()),
    };
    checkpoint_activations(&d, CheckpointOptions::default()).unwrap();
    DRIFT.store(0, Ordering::SeqCst);
    let y = d.call(&x).sum(Kind::Float);
    let e = y.f_backward().unwrap_err().to_string();
    assert!(
        e.contains(
            "rank 0: checkpoint: the recomputation of `Drifting` differs from its first \
                    run: output 0 is [7, 6] Float cpu, was [8, 6] Float cpu"
        ),
        "{e}"
    );
    assert!(!d.fc.ws.grad().defined());

    // Inside a model, the errors name the block by its FQN.
    let vs = nn::VarStore::new(Device::Cpu);
    let holder = Holder {
        inner: Drifting {
            fc: nn::linear(vs.root() / "inner" / "fc", D, D, Default::default()),
        },
    };
    checkpoint_activations(&holder.inner, CheckpointOptions::default()).unwrap();
    DRIFT.store(0, Ordering::SeqCst);
    let e = holder
        .call(&x)
        .sum(Kind::Float)
        .f_backward()
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("rank 0: checkpoint: the recomputation of `inner` differs"),
        "{e}"
    );
    // Without the check, the engine's own shape check fails the backward instead.
    let vs = nn::VarStore::new(Device::Cpu);
    let unchecked = Drifting {
        fc: nn::linear(vs.root() / "fc", D, D, Default::default()),
    };
    let opts = CheckpointOptions {
        determinism_check: DeterminismCheck::None,
        ..Default::default()
    };
    checkpoint_activations(&unchecked, opts).unwrap();
    DRIFT.store(0, Ordering::SeqCst);
    assert!(unchecked.call(&x).sum(Kind::Float).f_backward().is_err());
    assert!(!unchecked.fc.ws.grad().defined());

    // An output tuple holding an undefined tensor (issue 41, item 7: reading its dtype
    // panicked with `UnknownKind(46)`): an error naming the block, not a panic.
    let vs = nn::VarStore::new(Device::Cpu);
    let n = net(&vs, 1, 0.0);
    checkpoint_activations(&n.blocks[0], CheckpointOptions::default()).unwrap();
    let e = n.blocks[0]
        .f_call_with([&x], |b, [x]| (b.forward_t(x, false), Tensor::new()))
        .unwrap_err();
    assert_eq!(
        e.message(),
        "rank 0: checkpoint: the forward of `Block` failed: the forward returned an undefined \
         tensor"
    );
}

#[derive(Debug, Shardable)]
struct Holder {
    inner: Drifting,
}

impl Module for Holder {
    fn forward(&self, x: &Tensor) -> Tensor {
        self.inner.call(x)
    }
}

// --- with the family, at 2 ranks ---

/// Per-block fully_shard (and the root), each block checkpointed, against the same without
/// checkpointing: equal to 1e-6 after 3 SGD-with-momentum steps.
fn fully_shard_parity() -> (f64, f64) {
    let mut runs = Vec::new();
    for checkpointed in [false, true] {
        tch::manual_seed(21);
        let vs = nn::VarStore::new(Device::Cpu);
        let n = net(&vs, 2, 0.0);
        for b in &n.blocks {
            if checkpointed {
                checkpoint_activations(b, CheckpointOptions::default()).unwrap();
            }
            fully_shard(b, FsdpOptions::default()).unwrap();
        }
        fully_shard(&n, FsdpOptions::default()).unwrap();
        let mut opt = nn::Sgd {
            momentum: 0.9,
            ..Default::default()
        }
        .build(&vs, 0.05)
        .unwrap();
        for step in 0..3 {
            let (x, y) = data(step);
            let loss = n.call_t(&x, true).mse_loss(&y, tch::Reduction::Mean);
            opt.backward_step(&loss);
            // The recomputation gathered nothing that outlives backward.
            for b in &n.blocks {
                let st = tch_dist::fully_shard::state(b).unwrap();
                assert!(st.is_sharded());
                assert_eq!(st.gathered_bytes(), 0);
            }
        }
        let full = tch_dist::fully_shard::full_state_dict(&n).unwrap();
        runs.push(full);
    }
    compare(&runs[0], &runs[1])
}

fn compare(a: &[(String, Tensor)], b: &[(String, Tensor)]) -> (f64, f64) {
    let mut diff = 0f64;
    let mut norm = 0f64;
    for ((na, ta), (nb, tb)) in a.iter().zip(b) {
        assert_eq!(na, nb);
        diff = diff.max((ta - tb).abs().max().double_value(&[]));
        norm = norm.max(ta.abs().max().double_value(&[]));
    }
    (diff, norm)
}

#[test]
fn fully_shard_and_replicate_compose_at_2_ranks() {
    run_ranks("fully_shard_and_replicate_compose_at_2_ranks", 2, |pg| {
        tch::set_num_threads(1);
        let (diff, norm) = fully_shard_parity();
        assert!(norm > 0.1, "the model has values ({norm})");
        assert!(
            diff < 1e-6,
            "fully_shard with and without checkpointing: {diff}"
        );

        // replicate around the model (each rank its own half of the batch), blocks
        // checkpointed, against replicate alone: with find_unused_parameters, and a
        // micro-step accumulated under no_sync before each synchronised one.
        let mut runs = Vec::new();
        for checkpointed in [false, true] {
            tch::manual_seed(31);
            let vs = nn::VarStore::new(Device::Cpu);
            let n = net(&vs, 2, 0.0);
            if checkpointed {
                checkpoint_every_block(&n);
            }
            let opts = replicate::Options {
                find_unused_parameters: true,
                ..Default::default()
            };
            replicate::apply(&n, opts).unwrap();
            let mut opt = nn::Sgd {
                momentum: 0.9,
                ..Default::default()
            }
            .build(&vs, 0.05)
            .unwrap();
            let half = BATCH / 2;
            let r = pg.rank() as i64;
            let local_loss = |step: i64| {
                let (x, y) = data(step);
                n.call_t(&x.narrow(0, r * half, half), true)
                    .mse_loss(&y.narrow(0, r * half, half), tch::Reduction::Mean)
            };
            for step in 0..3 {
                opt.zero_grad();
                replicate::no_sync(&n, || local_loss(10 + step).backward()).unwrap();
                local_loss(step).backward();
                opt.step();
            }
            runs.push(named_values(&vs));
        }
        let (diff, _) = compare(&runs[0], &runs[1]);

        // A checkpointed model whose blocks fully_shard manages on their own: refused at the
        // call on every rank, naming the block; nothing ran.
        let vs = nn::VarStore::new(Device::Cpu);
        let n = net(&vs, 2, 0.0);
        for b in &n.blocks {
            fully_shard(b, FsdpOptions::default()).unwrap();
        }
        checkpoint_activations(&n, CheckpointOptions::default()).unwrap();
        let (x, _) = data(0);
        let e = n.f_call_t(&x, true).unwrap_err();
        assert!(
            e.message()
                .contains("checkpoint: `Net` holds `blocks.0`, which fully_shard manages"),
            "{e}"
        );
        assert!(n
            .blocks
            .iter()
            .all(|b| tch_dist::fully_shard::state(b).unwrap().is_sharded()));
        assert!(
            diff < 1e-6,
            "replicate with and without checkpointing: {diff}"
        );
    });
}

#[test]
fn a_tensor_parallel_mlp_inside_a_checkpointed_block_at_2_ranks() {
    // Under DETAIL, so that the recomputation's collectives are checked across ranks too.
    let test = "a_tensor_parallel_mlp_inside_a_checkpointed_block_at_2_ranks";
    let launch = Launch::new(test, 2).env(tch_dist::DEBUG_ENV, "DETAIL");
    run_ranks_with(&launch, Backend::Gloo, |pg| {
        tch::set_num_threads(1);
        let mut runs = Vec::new();
        for checkpointed in [false, true] {
            tch::manual_seed(41);
            let vs = nn::VarStore::new(Device::Cpu);
            let mut n = net(&vs, 1, 0.0);
            let plan = ShardingPlan::builder()
                .shard_module("blocks.0.up", ColwiseLinear::default())
                .shard_module("blocks.0.down", RowwiseLinear)
                .build();
            shard_module(&mut n, &plan, 0, &pg).unwrap();
            if checkpointed {
                checkpoint_every_block(&n);
            }
            train(
                &vs,
                &n,
                nn::Sgd {
                    momentum: 0.9,
                    ..Default::default()
                },
                3,
                true,
            );
            runs.push(named_values(&vs));
        }
        let (diff, norm) = compare(&runs[0], &runs[1]);
        assert!(norm > 0.1);
        assert!(
            diff < 1e-6,
            "tensor parallel with and without checkpointing: {diff}"
        );
    });
}

/// A block with a BatchNorm, whose training forwards update its running statistics.
#[derive(Debug, Shardable, ShallowClone)]
struct NormedBlock {
    fc: nn::Linear,
    bn: nn::BatchNorm,
}

impl ModuleT for NormedBlock {
    fn forward_t(&self, x: &Tensor, train: bool) -> Tensor {
        x + self.bn.call_t(&self.fc.call(x), train).relu()
    }
}

/// A checkpointed block with a BatchNorm: after 3 training steps its running statistics
/// (and everything else) equal those without checkpointing, bit for bit (issue 41, item 5:
/// the recomputation counted as a second forward and updated them twice per step, as
/// PyTorch's does, silently).
#[test]
fn batch_norm_statistics_end_as_without_checkpointing() {
    let _s = serial();
    let normed = || {
        tch::manual_seed(5);
        let vs = nn::VarStore::new(Device::Cpu);
        let b = NormedBlock {
            fc: nn::linear(vs.root() / "fc", D, D, Default::default()),
            bn: nn::batch_norm1d(vs.root() / "bn", D, Default::default()),
        };
        (vs, b)
    };
    let ((vs_a, a), (vs_b, b)) = (normed(), normed());
    checkpoint_activations(&b, CheckpointOptions::default()).unwrap();
    let before = b.bn.running_mean.copy();
    for (vs, m) in [(&vs_a, &a), (&vs_b, &b)] {
        let mut opt = nn::Sgd {
            momentum: 0.9,
            ..Default::default()
        }
        .build(vs, 0.05)
        .unwrap();
        for step in 0..3 {
            let (x, _) = data(step);
            let loss = m.call_t(&x, true).square().mean(Kind::Float);
            opt.zero_grad();
            loss.backward();
            opt.step();
        }
    }
    assert!(!b.bn.running_mean.equal(&before), "the statistics moved");
    assert!(
        b.bn.running_mean.equal(&a.bn.running_mean) && b.bn.running_var.equal(&a.bn.running_var),
        "running statistics: {} / {} checkpointed, {} / {} not",
        b.bn.running_mean,
        b.bn.running_var,
        a.bn.running_mean,
        a.bn.running_var
    );
    assert!(bitwise_equal(&vs_a, &vs_b), "the parameters");
}
