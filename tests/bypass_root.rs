//! A root run with no hooked call at all (`model.forward(&x)`: the root's and every child's
//! hooks bypassed), under no_grad (an evaluation loop) and with grad, at 2 ranks as real
//! processes: the shard fences' watch refuses the first op that applies a sharded weight, on
//! every rank, naming the parameter, for fully_shard and tensor parallelism alike; nothing
//! changes, and the same model called through its hooks is right afterwards. Before the
//! watch, fully_shard's embedding returned rank 1's rows as if they were rows 0-3, Ok.

#[path = "common/panic_text.rs"]
mod panic_text;
#[path = "common/unchanged.rs"]
mod unchanged;
use std::sync::atomic::{AtomicBool, Ordering};

use panic_text::panic_text;
use tch::nn::{self, Module};
use tch::{Device, Tensor};
use tch_dist::fully_shard::full_state_dict;
use tch_dist::sharding::{shard_module, MegatronPlanner, ShardingPlanner};
use tch_dist::testing::{describe, run_ranks, run_ranks_with, worker, Launch, RankOutput};
use tch_dist::{fully_shard, Backend, Call, FsdpOptions, Shardable};
use unchanged::{unchanged, values};

/// Whether [`Embedder`]'s and [`Mlp`]'s forwards call their layers through their hooks.
static HOOKED: AtomicBool = AtomicBool::new(false);

fn hooked() -> bool {
    HOOKED.load(Ordering::Relaxed)
}

#[derive(Debug, Shardable)]
struct Embedder {
    emb: nn::Embedding,
    head: nn::Linear,
}

impl Module for Embedder {
    fn forward(&self, ids: &Tensor) -> Tensor {
        if hooked() {
            self.head.call(&self.emb.call(ids))
        } else {
            self.head.forward(&self.emb.forward(ids))
        }
    }
}

#[derive(Debug, Shardable)]
struct Mlp {
    fc1: nn::Linear,
    fc2: nn::Linear,
}

impl Module for Mlp {
    fn forward(&self, xs: &Tensor) -> Tensor {
        if hooked() {
            self.fc2.call(&self.fc1.call(xs).relu())
        } else {
            self.fc2.forward(&self.fc1.forward(xs).relu())
        }
    }
}

/// The error message `f` panicked with inside tch (which unwraps libtorch's error in a
/// layer's `forward`); `f` must panic.
fn panics(f: impl FnOnce() -> Tensor) -> String {
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    let text = panic_text(panicked.expect_err("the bypassed root computed a value"));
    let inner = text
        .strip_prefix("called `Result::unwrap()` on an `Err` value: Torch(\"")
        .and_then(|t| t.strip_suffix("\")"))
        .unwrap_or_else(|| panic!("not a libtorch error: {text}"));
    inner.to_string()
}

/// `f` under no_grad, restored also when `f` panics (`tch::no_grad` restores grad mode
/// only when `f` returns).
fn without_grad(f: impl FnOnce() -> Tensor) -> Tensor {
    let _no_grad = tch::no_grad_guard();
    f()
}

#[test]
fn a_root_run_without_any_hooked_call_is_refused_at_2_ranks() {
    run_ranks(
        "a_root_run_without_any_hooked_call_is_refused_at_2_ranks",
        2,
        |pg| {
            let rank = pg.rank();
            HOOKED.store(false, Ordering::Relaxed);

            // fully_shard: the embedding's own group and the root's (the head).
            let vs = nn::VarStore::new(Device::Cpu);
            let m = Embedder {
                emb: nn::embedding(vs.root() / "emb", 8, 4, Default::default()),
                head: nn::linear(vs.root() / "head", 4, 4, Default::default()),
            };
            fully_shard(&m.emb, FsdpOptions::default()).unwrap();
            fully_shard(&m, FsdpOptions::default()).unwrap();
            let before = values(&vs);
            let ids = Tensor::from_slice(&[0i64, 1, 2, 3]);
            let emb_refused = format!(
                "rank {rank}: fully_shard: parameter `emb.weight` of `emb` was used outside a \
                 call of the module through its hooks, where it holds only this rank's shard; \
                 call the module as `self.emb.call(&x)`, not `x.apply(&self.emb)` or \
                 `self.emb.forward(&x)`"
            );
            assert_eq!(panics(|| without_grad(|| m.forward(&ids))), emb_refused);
            assert_eq!(panics(|| m.forward(&ids)), emb_refused);
            // The root bypassed, the embedding called through its hooks: the head (in the
            // root's group) is refused.
            HOOKED.store(true, Ordering::Relaxed);
            let head_refused = panics(|| without_grad(|| m.forward(&ids)));
            assert!(
                head_refused.starts_with(&format!(
                    "rank {rank}: fully_shard: parameter `head.weight`"
                )),
                "{head_refused}"
            );
            assert!(unchanged(&vs, &before));
            // Through the root's hooks: the whole model's value.
            let full: std::collections::HashMap<String, Tensor> =
                full_state_dict(&m).unwrap().into_iter().collect();
            let expected = full["emb.weight"]
                .index_select(0, &ids)
                .linear(&full["head.weight"], Some(&full["head.bias"]));
            let out = tch::no_grad(|| m.f_call(&ids)).unwrap();
            assert!(
                out.allclose(&expected, 1e-6, 1e-6, false),
                "{out} {expected}"
            );
            assert!(unchanged(&vs, &before));

            // Tensor parallelism: a column- then a row-parallel layer, the root run with
            // `forward` (it returned partial sums before).
            HOOKED.store(false, Ordering::Relaxed);
            let vs = nn::VarStore::new(Device::Cpu);
            let mut model = Mlp {
                fc1: nn::linear(vs.root() / "fc1", 6, 8, Default::default()),
                fc2: nn::linear(vs.root() / "fc2", 8, 5, Default::default()),
            };
            let plan = MegatronPlanner::default().build_plan(&model).unwrap();
            shard_module(&mut model, &plan, 0, &pg).unwrap();
            let before = values(&vs);
            let x = Tensor::ones([4, 6], (tch::Kind::Float, Device::Cpu));
            let fc1_refused = format!(
                "rank {rank}: shard_module: parameter `fc1.weight` of `fc1` was used outside a \
                 call of the module through its forward hooks, where this rank's shard alone \
                 gives a wrong result; call the module as `self.fc1.call(&x)`, not \
                 `x.apply(&self.fc1)` or `self.fc1.forward(&x)` (a deliberate direct use goes \
                 in ShardState::allow_direct_use)"
            );
            assert_eq!(panics(|| without_grad(|| model.forward(&x))), fc1_refused);
            assert_eq!(panics(|| model.forward(&x)), fc1_refused);
            assert!(unchanged(&vs, &before));
            // Through the hooks it trains: backward uses the shards, by design.
            HOOKED.store(true, Ordering::Relaxed);
            let loss = model.f_call(&x).unwrap().sum(tch::Kind::Float);
            loss.backward();
            assert!(vs.trainable_variables().iter().all(|p| p.grad().defined()));
        },
    );
}

/// A refused op inside `f_call` is the call's error and nothing more (issue 41, section 5:
/// tch's panic text, "thread ... panicked at ...", reached stderr as if the rank had
/// crashed, although `f_call` returned the error and the program went on).
#[test]
fn a_refusal_inside_f_call_prints_no_panic_text() {
    const TEST: &str = "a_refusal_inside_f_call_prints_no_panic_text";
    let launch = Launch::new(TEST, 2);
    if worker().is_some() {
        run_ranks_with(&launch, Backend::Gloo, |pg| {
            HOOKED.store(false, Ordering::Relaxed);
            let vs = nn::VarStore::new(Device::Cpu);
            let m = Embedder {
                emb: nn::embedding(vs.root() / "emb", 8, 4, Default::default()),
                head: nn::linear(vs.root() / "head", 4, 4, Default::default()),
            };
            fully_shard(&m.emb, FsdpOptions::default()).unwrap();
            fully_shard(&m, FsdpOptions::default()).unwrap();
            let ids = Tensor::from_slice(&[0i64, 1, 2, 3]);
            // The root through its hooks, the embedding inside it bypassed.
            let e = m.f_call(&ids).unwrap_err();
            assert!(
                e.message().starts_with(&format!(
                    "rank {}: fully_shard: parameter `emb.weight` of `emb` was used outside",
                    pg.rank()
                )),
                "{e}"
            );
            eprintln!("f_call returned its error");
        });
        return;
    }
    let outputs = launch.run();
    assert!(
        outputs.iter().all(RankOutput::success),
        "{}",
        describe(&outputs)
    );
    for o in &outputs {
        assert!(
            o.stderr.contains("f_call returned its error"),
            "{}",
            o.stderr
        );
        assert!(
            !o.stderr.contains("panicked"),
            "rank {}: {}",
            o.rank,
            o.stderr
        );
    }
}
