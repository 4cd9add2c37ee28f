//! Bypasses (a parameter used outside its module's hooked call: what is gathered during
//! forward, memory, `unshard`, an error in every grad mode), refusals at `fully_shard` time
//! and errors naming the module's FQN.

use super::unchanged::{unchanged, values};
use super::*;
use tch_dist::{Api, Composition, OnRank};

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
    run_ranks("errors::bypass_memory_and_unshard_at_2_ranks", 2, |pg| {
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
            matches!(e.composition(), Some(Composition::HooksBypassed { module, param, .. })
                if module == "inner.head" && param == "inner.head.weight"),
            "{e}"
        );
        assert!(e.to_string().contains("self.head.call(&x)"), "{e}");
        let after = vs.trainable_variables();
        assert!(before.iter().zip(&after).all(|(a, b)| a.equal(b)));
        assert!(fully_shard::state(&m).unwrap().is_sharded());

        // Called directly (no enclosing call): the shard fences' watch refuses its first op
        // that applies the weight, before anything is computed (before the watch, the
        // forward returned the shard's rows and only backward failed).
        let head = nn::VarStore::new(Device::Cpu);
        let layer = nn::linear(head.root() / "head", 3, 4, Default::default());
        fully_shard(&layer, FsdpOptions::default()).unwrap();
        let x = Tensor::ones([2, 3], tch::kind::FLOAT_CPU);
        let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| x.apply(&layer)));
        let err = panic_text(panicked.unwrap_err());
        assert!(
            err.contains("`weight`") && err.contains(".call(&x)"),
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
    run_ranks("errors::refusals_at_2_ranks", 2, |pg| {
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
            matches!(err.problem(), Some(FsdpProblem::TiedParameter { fqn, other }) if fqn == "b.weight" && other == "weight"),
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
            matches!(err.problem(), Some(FsdpProblem::UnknownIgnoredParam { .. })),
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
                matches!(err.problem(), Some(FsdpProblem::NonContiguous { fqn }) if fqn == "weight"),
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
            Some(FsdpError::Composition(OnRank {
                rank: r,
                problem: Composition::HooksBypassed { api: Api::FullyShard, module: m, param: p },
            })) if *r == rank && m == module && p == param
        ),
        "{err:?}"
    );
}

/// The model's trainable values, copied.
#[test]
fn bypass_is_an_error_in_every_grad_mode_at_2_ranks() {
    run_ranks(
        "errors::bypass_is_an_error_in_every_grad_mode_at_2_ranks",
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
        tch_dist::report(&nested),
        format!("fully_shard: the hook of `blocks.3` failed: {}", source())
    );
    // Display names its own context only; the DistError is the source.
    assert_eq!(
        nested.to_string(),
        "fully_shard: the hook of `blocks.3` failed"
    );
    let root = FsdpError::Hooked {
        rank: 1,
        module: String::new(),
        source: source(),
    };
    assert_eq!(
        tch_dist::report(&root),
        format!(
            "fully_shard: the hook of the root module failed: {}",
            source()
        )
    );
    let bypassed = FsdpError::from(OnRank::new(
        0,
        Composition::HooksBypassed {
            api: Api::FullyShard,
            module: "blocks.3.fc2".into(),
            param: "blocks.3.fc2.weight".into(),
        },
    ));
    assert_eq!(
        bypassed.to_string(),
        bypass_message(0, "blocks.3.fc2", "blocks.3.fc2.weight")
    );
}

/// A mesh fully_shard cannot use is refused on every rank before anything changes: three
/// dims, and a mesh given together with a process group.
#[test]
fn meshes_fully_shard_cannot_use_are_refused_at_2_ranks() {
    run_ranks(
        "errors::meshes_fully_shard_cannot_use_are_refused_at_2_ranks",
        2,
        |pg| {
            use tch_dist::device_mesh::init_device_mesh;
            let rank = pg.rank();
            let vs = nn::VarStore::new(Device::Cpu);
            let m = model(&vs);
            let before = values(&vs);
            let mesh = init_device_mesh("cpu", &[2, 1, 1], &["a", "b", "c"]).unwrap();
            let opts = FsdpOptions {
                mesh: Some(mesh),
                ..Default::default()
            };
            let e = fully_shard(&m, opts).unwrap_err();
            assert_eq!(
                e.to_string(),
                format!(
                    "rank {rank}: fully_shard: the mesh has 3 dims; fully_shard takes a 1-D mesh \
                     (FSDP) or a 2-D one (HSDP: dim 0 replicates, dim 1 shards)"
                )
            );
            let mesh = init_device_mesh("cpu", &[2], &["dp"]).unwrap();
            let opts = FsdpOptions {
                mesh: Some(mesh),
                process_group: Some(pg.clone()),
                ..Default::default()
            };
            let e = fully_shard(&m, opts).unwrap_err();
            assert_eq!(
                e.to_string(),
                format!(
                    "rank {rank}: fully_shard: both `mesh` and `process_group` were given; give \
                     one"
                )
            );
            assert!(unchanged(&vs, &before), "nothing changed on rank {rank}");
            assert!(fully_shard::state(&m).is_none());
        },
    );
}
