//! The rest of `FSDPModule`'s methods on [`FsdpState`](tch_dist::fully_shard::FsdpState):
//! `set_is_last_backward`, `set_requires_all_reduce` (HSDP on a 2x1 mesh),
//! `set_gradient_divide_factor`, `set_all_reduce_hook`, `set_unshard_in_backward`,
//! `unshard_async`; each against one process with SGD with momentum, at 2 ranks.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use super::*;
use tch_dist::device_mesh::init_device_mesh;
use tch_dist::MisuseProblem;

fn sgd(vs: &nn::VarStore, lr: f64) -> nn::Optimizer {
    nn::Sgd {
        momentum: 0.9,
        ..Default::default()
    }
    .build(vs, lr)
    .unwrap()
}

/// The mean loss of `m` on `x`, `y`.
fn loss<M: Module>(m: &M, x: &Tensor, y: &Tensor) -> Tensor {
    m.forward(x).mse_loss(y, tch::Reduction::Mean)
}

/// The sharded model's loss on this rank's rows of batch `step` (through `call`).
fn rank_loss(m: &Model, step: usize, pg: &ProcessGroup) -> Tensor {
    let (x, y) = batch(step);
    m.call(&slice(&x, pg))
        .mse_loss(&slice(&y, pg), tch::Reduction::Mean)
}

/// Two forwards (micro-batches 2s and 2s + 1) before their two backwards, the first with
/// `set_is_last_backward(false)` (set on a block: the flag is the root's), then one SGD
/// step; against one process on the sum of the two whole batches' losses.
#[test]
fn is_last_backward_two_forwards_then_two_backwards_at_2_ranks() {
    run_ranks(
        "api::is_last_backward_two_forwards_then_two_backwards_at_2_ranks",
        2,
        |pg| {
            let (ref_vs, reference, vs, m) = twin(&pg);
            apply(
                &m,
                Groups::PerBlock {
                    reshard_after_forward: true,
                },
                FsdpOptions::default(),
            );
            let block = fully_shard::state(&m.blocks[1]).unwrap();
            let (mut opt, mut ref_opt) = (sgd(&vs, 0.05), sgd(&ref_vs, 0.05));
            for step in 0..2 {
                ref_opt.zero_grad();
                let (x0, y0) = batch(2 * step);
                let (x1, y1) = batch(2 * step + 1);
                (loss(&reference, &x0, &y0) + loss(&reference, &x1, &y1)).backward();
                ref_opt.step();
                opt.zero_grad();
                let l0 = rank_loss(&m, 2 * step, &pg);
                let l1 = rank_loss(&m, 2 * step + 1, &pg);
                block.set_is_last_backward(false);
                l0.backward();
                block.set_is_last_backward(true);
                l1.backward();
                opt.step();
                assert_sharded(&m, &vs, &pg);
            }
            let diff = max_diff_full(&m, &ref_vs);
            assert!(diff < 1e-5, "is_last_backward vs one process: {diff}");
        },
    );
}

/// HSDP on a 2x1 mesh (each rank a replica of the whole model): two micro-batches per
/// step, the first with `set_requires_all_reduce(false)`: it leaves `.grad` undefined (the
/// reduce-scattered gradients wait in the group), the second all-reduces both; 2 SGD steps
/// equal one process on the sum of the whole batches' losses. Then the misuse: one rank
/// skipping the all-reduce the other runs fails the step check on both, with no number
/// silently wrong.
#[test]
fn requires_all_reduce_accumulates_under_hsdp_at_2_ranks() {
    run_ranks(
        "api::requires_all_reduce_accumulates_under_hsdp_at_2_ranks",
        2,
        |pg| {
            let mesh = init_device_mesh("cpu", &[2, 1], &["dp_replicate", "dp_shard"]).unwrap();
            let (ref_vs, reference, vs, m) = twin(&pg);
            let opts = || FsdpOptions {
                mesh: Some(mesh.clone()),
                ..Default::default()
            };
            for b in &m.blocks {
                fully_shard(b, opts()).unwrap();
            }
            let root = fully_shard(&m, opts()).unwrap();
            let (mut opt, mut ref_opt) = (sgd(&vs, 0.05), sgd(&ref_vs, 0.05));
            for step in 0..2 {
                ref_opt.zero_grad();
                let (x0, y0) = batch(2 * step);
                let (x1, y1) = batch(2 * step + 1);
                (loss(&reference, &x0, &y0) + loss(&reference, &x1, &y1)).backward();
                ref_opt.step();
                opt.zero_grad();
                root.set_requires_all_reduce(false);
                rank_loss(&m, 2 * step, &pg).backward();
                for (fqn, t) in vs.variables() {
                    assert!(
                        !t.grad().defined(),
                        "{fqn}: no `.grad` before the all-reduce"
                    );
                }
                root.set_requires_all_reduce(true);
                rank_loss(&m, 2 * step + 1, &pg).backward();
                opt.step();
            }
            let diff = max_diff_full(&m, &ref_vs);
            assert!(diff < 1e-5, "HSDP accumulation without all-reduce: {diff}");

            // Misuse: rank 0 skips the all-reduce of its first backward, rank 1 does not.
            root.set_requires_all_reduce(pg.rank() != 0);
            let first = rank_loss(&m, 0, &pg).f_backward();
            root.set_requires_all_reduce(true);
            let second = match first {
                Ok(()) => rank_loss(&m, 1, &pg).f_backward(),
                Err(e) => Err(e),
            };
            let err = second
                .expect_err("one rank skipping the all-reduce is an error")
                .to_string();
            assert!(
                err.contains("(a rank skipped or repeated a step, a forward or a backward)"),
                "rank {}: {err}",
                pg.rank()
            );
        },
    );
}

/// `set_gradient_divide_factor(0.5)` at 2 ranks: `.grad` is the sum of the ranks'
/// gradients over 0.5, four times the mean (checked against one process's gradient), and
/// SGD with momentum follows one process trained at 4 times the learning rate. Factors
/// that are not finite and positive are refused, naming the rank and the module.
#[test]
fn gradient_divide_factor_at_2_ranks() {
    run_ranks("api::gradient_divide_factor_at_2_ranks", 2, |pg| {
        let (ref_vs, reference, vs, m) = twin(&pg);
        let root = fully_shard(&m, FsdpOptions::default()).unwrap();
        root.set_gradient_divide_factor(0.5).unwrap();
        let (mut opt, mut ref_opt) = (sgd(&vs, 0.01), sgd(&ref_vs, 0.04));
        for step in 0..2 {
            let (x, y) = batch(step);
            ref_opt.zero_grad();
            loss(&reference, &x, &y).backward();
            opt.zero_grad();
            rank_loss(&m, step, &pg).backward();
            if step == 0 {
                let vars = ref_vs.variables();
                for info in root.shards() {
                    let g = vs.variables()[&info.fqn].grad();
                    let r = vars[&info.fqn]
                        .grad()
                        .narrow(0, info.offsets[0], info.local_shape[0])
                        * 4.0;
                    let d = (&g - &r).abs().max().double_value(&[]);
                    assert!(d < 1e-5, "{}: `.grad` is 4 x the mean: {d}", info.fqn);
                }
            }
            ref_opt.step();
            opt.step();
        }
        let diff = max_diff_full(&m, &ref_vs);
        assert!(
            diff < 1e-5,
            "divide factor 0.5 vs one process at lr x 4: {diff}"
        );

        let block = fully_shard::state(&m).unwrap();
        for bad in [0.0, -2.0, f64::NAN, f64::INFINITY] {
            let e = block.set_gradient_divide_factor(bad).unwrap_err();
            assert!(
                matches!(
                    e.problem(),
                    Some(FsdpProblem::GradientDivideFactor { module, .. }) if module.is_empty()
                ),
                "{e:?}"
            );
            assert_eq!(e.rank(), Some(pg.rank()));
        }
        assert_eq!(
            block
                .set_gradient_divide_factor(f64::NAN)
                .unwrap_err()
                .to_string(),
            format!(
                "rank {}: fully_shard: set_gradient_divide_factor(NaN) on the root module: the \
                 factor must be a finite number greater than 0",
                pg.rank()
            )
        );
    });
}

/// A nested call's refusal names its FQN from the root.
#[test]
fn gradient_divide_factor_refusal_names_the_module_at_2_ranks() {
    run_ranks(
        "api::gradient_divide_factor_refusal_names_the_module_at_2_ranks",
        2,
        |pg| {
            let vs = nn::VarStore::new(Device::Cpu);
            let m = model(&vs);
            let block = fully_shard(&m.blocks[1], FsdpOptions::default()).unwrap();
            fully_shard(&m, FsdpOptions::default()).unwrap();
            let e = block.set_gradient_divide_factor(-1.0).unwrap_err();
            assert_eq!(
                e.to_string(),
                format!(
                    "rank {}: fully_shard: set_gradient_divide_factor(-1.0) on `blocks.1`: the \
                     factor must be a finite number greater than 0",
                    pg.rank()
                )
            );
        },
    );
}

/// `set_all_reduce_hook`: a hook tripling the reduced gradients in place makes `.grad` 3 x
/// the mean (SGD with momentum then follows one process at 3 x the learning rate), and is
/// called once per backward with the group's flat reduce-scatter output; its `Err`, a panic
/// and a replaced tensor each fail the backward pass with an error naming the rank and the
/// module.
#[test]
fn all_reduce_hook_at_2_ranks() {
    run_ranks("api::all_reduce_hook_at_2_ranks", 2, |pg| {
        let (ref_vs, reference, vs, m) = twin(&pg);
        apply(
            &m,
            Groups::PerBlock {
                reshard_after_forward: true,
            },
            FsdpOptions::default(),
        );
        let calls = Arc::new(AtomicUsize::new(0));
        let sizes = Arc::new(Mutex::new(Vec::new()));
        let states: Vec<_> = m
            .named_modules()
            .into_iter()
            .filter_map(|(_, sub)| fully_shard::state(sub))
            .collect();
        for s in &states {
            let (calls, sizes) = (Arc::clone(&calls), Arc::clone(&sizes));
            s.set_all_reduce_hook(move |t: &mut Tensor| {
                calls.fetch_add(1, Ordering::SeqCst);
                sizes.lock().unwrap().push(t.size());
                let _ = t.f_mul_scalar_(3.0).map_err(|e| e.to_string())?;
                Ok(())
            });
        }
        let (mut opt, mut ref_opt) = (sgd(&vs, 0.01), sgd(&ref_vs, 0.03));
        for step in 0..2 {
            let (x, y) = batch(step);
            ref_opt.backward_step(&loss(&reference, &x, &y));
            opt.zero_grad();
            rank_loss(&m, step, &pg).backward();
            opt.step();
        }
        let diff = max_diff_full(&m, &ref_vs);
        assert!(diff < 1e-5, "hook x 3 vs one process at lr x 3: {diff}");
        assert_eq!(calls.load(Ordering::SeqCst), 2 * states.len());
        // Finished in forward order, block 0 first: its weight (7, 15) and bias (7), 4 rows
        // of 15 and 4 values per rank (padded).
        assert_eq!(sizes.lock().unwrap()[0], [64]);

        // A hook's error, a panic, a replaced tensor: errors naming rank and module.
        let block = fully_shard::state(&m.blocks[1]).unwrap();
        for (i, expected) in [
            "boom",
            "it panicked: hook panic",
            "it replaced the reduced gradients ([",
        ]
        .into_iter()
        .enumerate()
        {
            block.set_all_reduce_hook(move |t: &mut Tensor| match i {
                0 => Err("boom".to_string()),
                1 => panic!("hook panic"),
                _ => {
                    *t = Tensor::zeros([1], (Kind::Double, Device::Cpu));
                    Ok(())
                }
            });
            let text = rank_loss(&m, 0, &pg).f_backward().unwrap_err().to_string();
            assert!(text.contains(expected), "{text}");
            let root = fully_shard::state(&m).unwrap();
            let e = root.take_backward_error().expect("the typed error");
            assert_eq!(e.rank(), Some(pg.rank()));
            let FsdpError::Hooked { module, source, .. } = &e else {
                panic!("{e:?}")
            };
            assert_eq!(module, "blocks.1");
            let tch_dist::DistError::Misuse { problem, .. } = source else {
                panic!("{source:?}")
            };
            assert!(
                matches!(&**problem, MisuseProblem::AllReduceHook { module, cause }
                    if module == "blocks.1" && cause.starts_with(expected)),
                "{problem:?}"
            );
            assert!(
                source.to_string().starts_with(&format!(
                    "rank {}: fully_shard failed: the all-reduce hook of module `blocks.1` \
                     failed: {expected}",
                    pg.rank()
                )),
                "{source}"
            );
        }
    });
}

/// HSDP on a 2x1 mesh: the hook gets the all-reduce's output, averaged over the replicas
/// (f32: divided before the hook), which is what `.grad` then holds: one process's
/// gradient.
#[test]
fn all_reduce_hook_sees_the_all_reduce_output_under_hsdp_at_2_ranks() {
    run_ranks(
        "api::all_reduce_hook_sees_the_all_reduce_output_under_hsdp_at_2_ranks",
        2,
        |pg| {
            let mesh = init_device_mesh("cpu", &[2, 1], &["dp_replicate", "dp_shard"]).unwrap();
            let (ref_vs, reference, vs, m) = twin(&pg);
            let root = fully_shard(
                &m,
                FsdpOptions {
                    mesh: Some(mesh),
                    ..Default::default()
                },
            )
            .unwrap();
            let seen = Arc::new(Mutex::new(None));
            let s = Arc::clone(&seen);
            root.set_all_reduce_hook(move |t: &mut Tensor| {
                *s.lock().unwrap() = Some(t.copy());
                Ok(())
            });
            let (x, y) = batch(0);
            loss(&reference, &x, &y).backward();
            rank_loss(&m, 0, &pg).backward();
            let seen = seen.lock().unwrap().take().expect("the hook ran");
            // Every parameter whole on each rank (a shard dim of 1), end to end in the
            // group's order.
            let (vars, ref_vars) = (vs.variables(), ref_vs.variables());
            let order: Vec<String> = root.shards().into_iter().map(|i| i.fqn).collect();
            let flat = |vars: &std::collections::HashMap<String, Tensor>| {
                let parts: Vec<Tensor> =
                    order.iter().map(|f| vars[f].grad().reshape([-1])).collect();
                Tensor::cat(&parts, 0)
            };
            assert_eq!(seen.size(), flat(&vars).size());
            assert_eq!((&seen - flat(&vars)).abs().max().double_value(&[]), 0.0);
            let d = (&seen - flat(&ref_vars)).abs().max().double_value(&[]);
            assert!(d < 1e-5, "the hook saw the mean over the replicas: {d}");
        },
    );
}

/// An embedding and a linear head.
#[derive(Debug, Shardable)]
struct Embedded {
    emb: nn::Embedding,
    head: nn::Linear,
}

impl Module for Embedded {
    fn forward(&self, ids: &Tensor) -> Tensor {
        self.head.call(&self.emb.call(ids).tanh())
    }
}

fn embedded(vs: &nn::VarStore) -> Embedded {
    let p = vs.root();
    Embedded {
        emb: nn::embedding(&p / "emb", 10, 6, Default::default()),
        head: nn::linear(&p / "head", 6, 3, Default::default()),
    }
}

/// `set_unshard_in_backward(false)` on an embedding (its weight's gradient needs only the
/// indices): 2 SGD steps equal one process. On a linear block whose backward needs its
/// weight, the gather is skipped too, and the backward pass fails rather than computing
/// with a shard.
#[test]
fn unshard_in_backward_at_2_ranks() {
    run_ranks("api::unshard_in_backward_at_2_ranks", 2, |pg| {
        tch::manual_seed(5);
        let ref_vs = nn::VarStore::new(Device::Cpu);
        let reference = embedded(&ref_vs);
        tch::manual_seed(5);
        let vs = nn::VarStore::new(Device::Cpu);
        let m = embedded(&vs);
        fully_shard(&m.emb, FsdpOptions::default())
            .unwrap()
            .set_unshard_in_backward(false);
        fully_shard(&m, FsdpOptions::default()).unwrap();
        let (mut opt, mut ref_opt) = (sgd(&vs, 0.1), sgd(&ref_vs, 0.1));
        for step in 0..2 {
            tch::manual_seed(40 + step);
            let ids = Tensor::randint(10, [8, 4], (Kind::Int64, Device::Cpu));
            let y = Tensor::randn([8, 4, 3], (Kind::Float, Device::Cpu));
            ref_opt.backward_step(&loss(&reference, &ids, &y));
            let n = 8 / pg.world_size() as i64;
            let rows = |t: &Tensor| t.narrow(0, pg.rank() as i64 * n, n);
            opt.backward_step(
                &m.call(&rows(&ids))
                    .mse_loss(&rows(&y), tch::Reduction::Mean),
            );
        }
        let vars = ref_vs.variables();
        let full = full_state_dict(&m).unwrap();
        for (fqn, t) in &full {
            let d = (t - &vars[fqn]).abs().max().double_value(&[]);
            assert!(d < 1e-5, "{fqn}: {d}");
        }

        // A linear block's backward uses its weight: without the gather it fails.
        let vs = nn::VarStore::new(Device::Cpu);
        let m = model(&vs);
        apply(
            &m,
            Groups::PerBlock {
                reshard_after_forward: true,
            },
            FsdpOptions::default(),
        );
        fully_shard::state(&m.blocks[1])
            .unwrap()
            .set_unshard_in_backward(false);
        let err = rank_loss(&m, 0, &pg).f_backward();
        assert!(err.is_err(), "backward with block 1's weight sharded");
    });
}

/// `unshard_async`: the parameters stay sharded until `wait`, then hold the full values;
/// a handle dropped unwaited is waited for by the next forward (training still equals one
/// process); a gather started before an optimizer step installs the values at the call,
/// whole (PyTorch's copy-in), and resharding then holds the stepped shards.
#[test]
fn unshard_async_at_2_ranks() {
    run_ranks("api::unshard_async_at_2_ranks", 2, |pg| {
        let (ref_vs, reference, vs, m) = twin(&pg);
        apply(
            &m,
            Groups::PerBlock {
                reshard_after_forward: true,
            },
            FsdpOptions::default(),
        );
        let block = fully_shard::state(&m.blocks[0]).unwrap();
        // The largest difference between the gathered weight of block 0 and `expected`.
        let gathered_diff = |expected: &Tensor| {
            assert_eq!(m.blocks[0].ws.size(), [7, 15], "gathered");
            (&m.blocks[0].ws - expected).abs().max().double_value(&[])
        };
        let handle = block.unshard_async().unwrap();
        assert!(block.is_sharded(), "sharded until wait");
        handle.wait().unwrap();
        assert!(!block.is_sharded());
        let initial = ref_vs.variables()["blocks.0.weight"].copy();
        assert_eq!(gathered_diff(&initial), 0.0, "rank 0's initial weight");
        block.reshard().unwrap();

        let (mut opt, mut ref_opt) = (sgd(&vs, 0.05), sgd(&ref_vs, 0.05));
        for step in 0..2 {
            // Started, never waited: the block's forward takes it.
            let _ = block.unshard_async().unwrap();
            step_both(&reference, &mut ref_opt, &m, &mut opt, step, &pg);
        }
        // Started before a step changed the shards (the same gradients again; tch's
        // optimizer writes through `.data`): `wait` installs the values at the call, as
        // PyTorch's copy-in does, whole and not torn by the step.
        let before = ref_vs.variables()["blocks.0.weight"].copy();
        let handle = block.unshard_async().unwrap();
        opt.step();
        ref_opt.step();
        handle.wait().unwrap();
        let after = ref_vs.variables()["blocks.0.weight"].copy();
        let d = gathered_diff(&before);
        assert!(d < 1e-6, "the weight at the call: {d}");
        let d = gathered_diff(&after);
        assert!(d > 1e-3, "not the weight after the step: {d}");
        block.reshard().unwrap();
        let diff = max_diff_full(&m, &ref_vs);
        assert!(diff < 1e-5, "unshard_async vs one process: {diff}");
    });
}

/// A setter that changes what a pass computes or sends, called on rank 1 only (or with
/// another value), fails the next pass on both ranks, before it sends anything: the step
/// check compares the groups' settings. Without it the divide factor gave other numbers
/// silently, a skipped backward gather aborted the peer, and `is_last_backward` waited out
/// the timeout. Called alike on every rank, the same setters train on.
#[test]
fn a_setter_on_one_rank_only_fails_every_rank_at_2_ranks() {
    run_ranks(
        "api::a_setter_on_one_rank_only_fails_every_rank_at_2_ranks",
        2,
        |pg| {
            type Setter = fn(&tch_dist::fully_shard::FsdpState, bool);
            let setters: [(&str, Setter); 4] = [
                ("set_gradient_divide_factor", |s, on| {
                    s.set_gradient_divide_factor(if on { 0.5 } else { 2.0 })
                        .unwrap()
                }),
                ("set_unshard_in_backward", |s, on| {
                    s.set_unshard_in_backward(!on)
                }),
                ("set_is_last_backward", |s, on| s.set_is_last_backward(!on)),
                ("set_all_reduce_hook", |s, on| {
                    if on {
                        s.set_all_reduce_hook(|_: &mut Tensor| Ok(()));
                    }
                }),
            ];
            for (name, set) in setters {
                // A group of its own per setter: a failed step check fails every later
                // pass over its group (so that no rank goes on alone).
                let group = pg
                    .new_group(&[0, 1], tch_dist::Backend::Gloo)
                    .unwrap()
                    .unwrap();
                let over = || FsdpOptions {
                    process_group: Some(group.clone()),
                    ..Default::default()
                };
                let vs = nn::VarStore::new(Device::Cpu);
                let m = model(&vs);
                for b in &m.blocks {
                    fully_shard(b, over()).unwrap();
                }
                fully_shard(&m, over()).unwrap();
                let block = fully_shard::state(&m.blocks[1]).unwrap();
                // Alike on both ranks: a step runs.
                set(&block, false);
                rank_loss(&m, 0, &pg).backward();
                // On rank 1 only: the next forward fails on both ranks.
                set(&block, pg.rank() == 1);
                let (x, _) = batch(1);
                let err = match m.f_call(&slice(&x, &pg)) {
                    Ok(y) => y.sum(Kind::Float).f_backward().map_err(|e| e.to_string()),
                    Err(e) => Err(e.to_string()),
                }
                .expect_err(name);
                assert!(
                    err.contains("runs this pass with other settings than this rank"),
                    "{name} on rank 1 only, rank {}: {err}",
                    pg.rank()
                );
            }
        },
    );
}
