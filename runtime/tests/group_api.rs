//! The rest of a process group's public surface, as real processes over 127.0.0.1: the
//! rendezvous store, subgroup ranks, work handles and their timeouts, checking that ranks
//! pass the same tensors and agree on settings, coalesced broadcasts, and the multi-process
//! harness's own guard.

use std::time::{Duration, Instant};

use tch::{Kind, Tensor};
use tch_dist_runtime::testing::{run_ranks, worker};
use tch_dist_runtime::{Backend, DistError, Mismatch, Refusal, BROADCAST_BUCKET_BYTES};

#[test]
fn store_set_get_add() {
    run_ranks("store_set_get_add", 3, |pg| {
        let store = pg.store();
        store
            .set(
                &format!("from{}", pg.rank()),
                format!("hello {}", pg.rank()).as_bytes(),
            )
            .unwrap();
        // Every rank reads every rank's key, waiting for it.
        for r in 0..3 {
            assert_eq!(
                store.get(&format!("from{r}")).unwrap(),
                format!("hello {r}").as_bytes()
            );
        }
        // add is atomic: the three increments of 1, 2, 3 sum to 6 whatever the order.
        let mine = store.add("counter", pg.rank() as i64 + 1).unwrap();
        assert!((1..=6).contains(&mine), "{mine}");
        pg.barrier().unwrap();
        assert_eq!(store.add("counter", 0).unwrap(), 6);
        // A prefixed view has keys of its own.
        let other = store.prefixed(&format!("rank{}/", pg.rank())).unwrap();
        assert_eq!(other.add("counter", 5).unwrap(), 5);
    });
}

#[test]
fn subgroup_global_ranks_and_work_handles() {
    run_ranks("subgroup_global_ranks_and_work_handles", 3, |pg| {
        assert_eq!(pg.global_ranks(), &[0, 1, 2]);
        let sub = pg.new_group(&[0, 2], Backend::Gloo).unwrap();
        match pg.rank() {
            1 => assert!(sub.is_none()),
            r => {
                let sub = sub.unwrap();
                // Global rank 2 is the subgroup's rank 1.
                assert_eq!(sub.global_ranks(), &[0, 2]);
                assert_eq!(sub.rank(), if r == 2 { 1 } else { 0 });
                let x = Tensor::from_slice(&[r as f32]);
                let work = sub
                    .all_reduce_async(&x, tch_dist_runtime::ReduceOp::Sum)
                    .unwrap();
                assert_eq!(work.op(), "all_reduce");
                work.wait().unwrap();
                assert_eq!(x.double_value(&[0]), 2.0);
            }
        }
        // A barrier only rank 0 has entered is pending; the wait gives up with a Timeout and
        // the same work completes once everyone has arrived.
        if pg.rank() == 0 {
            let mut work = pg.barrier_async().unwrap();
            assert_eq!(work.op(), "barrier");
            assert!(!work.is_completed());
            let err = work.wait_timeout(Duration::from_millis(200)).unwrap_err();
            assert_eq!(
                err,
                DistError::Timeout {
                    rank: 0,
                    op: "barrier",
                    timeout: Duration::from_millis(200)
                }
            );
            pg.send(&Tensor::from_slice(&[1i64]), 1, 7).unwrap();
            work.wait_timeout(Duration::from_secs(30)).unwrap();
            assert!(work.is_completed());
        } else {
            if pg.rank() == 1 {
                let go = Tensor::zeros([1], (Kind::Int64, tch::Device::Cpu));
                pg.recv(&go, 0, 7).unwrap();
            }
            pg.barrier().unwrap();
        }
    });
}

#[test]
fn verify_same_tensors_names_the_first_difference_on_every_rank() {
    run_ranks(
        "verify_same_tensors_names_the_first_difference_on_every_rank",
        3,
        |pg| {
            let w = Tensor::zeros([4, 2], (Kind::Float, tch::Device::Cpu));
            let b = Tensor::zeros([4], (Kind::Float, tch::Device::Cpu));
            pg.verify_same_tensors("test", "parameters", 0, &[("w", &w), ("b", &b)])
                .unwrap();
            // Rank 2's bias is a double: every rank reports it, against rank 0's.
            let b2 = if pg.rank() == 2 {
                b.to_kind(Kind::Double)
            } else {
                b.shallow_clone()
            };
            let err = pg
                .verify_same_tensors("test", "parameters", 0, &[("w", &w), ("b", &b2)])
                .unwrap_err();
            assert_eq!(
                err.to_string(),
                format!(
                "rank {}: test: parameters differ across ranks: `b` has shape [4] (Float) on rank \
                 0 but shape [4] (Double) on rank 2",
                pg.rank()
            )
            );
            // Rank 1 has one tensor fewer.
            let list: Vec<(&str, &Tensor)> = if pg.rank() == 1 {
                vec![("w", &w)]
            } else {
                vec![("w", &w), ("b", &b)]
            };
            let err = pg
                .verify_same_tensors("test", "buffers", 0, &list)
                .unwrap_err();
            let DistError::Mismatch { rank, op, mismatch } = &err else {
                panic!("{err}")
            };
            assert_eq!((*rank, *op), (pg.rank(), "test"));
            assert!(
                matches!(
                    mismatch.as_ref(),
                    Mismatch::List {
                        other_rank: 1,
                        reference_len: 2,
                        other_len: 1,
                        index: 1,
                        other_entry: None,
                        ..
                    }
                ),
                "{err}"
            );
        },
    );
}

#[test]
fn agree_on_values_names_who_refused_and_what_differs_on_every_rank() {
    run_ranks(
        "agree_on_values_names_who_refused_and_what_differs_on_every_rank",
        3,
        |pg| {
            let rank = pg.rank();
            let same = [("stages", 4), ("microbatches", 8)];
            assert_eq!(pg.agree_on_values("test", None::<&str>, &same), Ok(()));
            // Ranks 1 and 2 refuse: each reports its own problem, rank 0 the lowest refusal.
            let own = (rank > 0).then_some("too few microbatches");
            let verdict = pg.agree_on_values("test", own, &same);
            match rank {
                0 => assert_eq!(verdict, Err(Refusal::Peer { rank: 1 })),
                _ => assert_eq!(verdict, Err(Refusal::Own("too few microbatches"))),
            }
            // Rank 2 was given 16 microbatches: the first setting that differs, against the
            // lowest rank with another value.
            let microbatches = if rank == 2 { 16 } else { 8 };
            let verdict = pg.agree_on_values(
                "test",
                None::<&str>,
                &[("stages", 4), ("microbatches", microbatches)],
            );
            let (other_rank, other) = if rank == 2 { (0, 8) } else { (2, 16) };
            assert_eq!(
                verdict,
                Err(Refusal::Differs {
                    setting: "microbatches",
                    this: microbatches,
                    other_rank,
                    other,
                })
            );
            // Values that need not agree: every rank learns every rank's.
            let rows = pg
                .exchange_values("test", None::<&str>, &[rank as i64 * 10, 1])
                .unwrap();
            assert_eq!(rows, [[0, 1], [10, 1], [20, 1]]);
            let refused = pg.exchange_values("test", (rank == 0).then_some(()), &[1]);
            match rank {
                0 => assert_eq!(refused, Err(Refusal::Own(()))),
                _ => assert_eq!(refused, Err(Refusal::Peer { rank: 0 })),
            }
        },
    );
}

#[test]
fn broadcast_coalesced_copies_every_tensor_from_the_source() {
    run_ranks(
        "broadcast_coalesced_copies_every_tensor_from_the_source",
        3,
        |pg| {
            let r = pg.rank() as f64;
            let cpu = tch::Device::Cpu;
            // Mixed dtypes, a scalar, an empty tensor and a non-contiguous one.
            let tensors = [
                Tensor::full([3], r, (Kind::Float, cpu)),
                Tensor::full([2, 2], r * 10.0, (Kind::Double, cpu)),
                Tensor::full([] as [i64; 0], r + 100.0, (Kind::Float, cpu)),
                Tensor::zeros([0], (Kind::Float, cpu)),
                Tensor::arange(6, (Kind::Int64, cpu)).view([2, 3]) * (pg.rank() as i64 + 1),
                Tensor::full([4, 2], r, (Kind::Float, cpu)).tr(),
            ];
            let refs: Vec<&Tensor> = tensors.iter().collect();
            // Small buckets, so that the floats take several buffers.
            pg.broadcast_coalesced(&refs, 1, 16).unwrap();
            assert_eq!(Vec::<f32>::try_from(&tensors[0]).unwrap(), [1.0; 3]);
            assert_eq!(tensors[1].sum(Kind::Double).double_value(&[]), 40.0);
            assert_eq!(tensors[2].double_value(&[]), 101.0);
            assert_eq!(tensors[3].numel(), 0);
            assert_eq!(
                Vec::<i64>::try_from(&tensors[4].reshape([-1])).unwrap(),
                [0, 2, 4, 6, 8, 10]
            );
            assert_eq!(tensors[5].size(), [2, 4]);
            assert_eq!(tensors[5].sum(Kind::Double).double_value(&[]), 8.0);
            // One buffer per dtype by default; rank 0 as the source now.
            if pg.rank() == 0 {
                let _ = tensors[2].shallow_clone().fill_(-5.0);
            }
            pg.broadcast_coalesced(&refs, 0, BROADCAST_BUCKET_BYTES)
                .unwrap();
            assert_eq!(tensors[2].double_value(&[]), -5.0);
            assert_eq!(Vec::<f32>::try_from(&tensors[0]).unwrap(), [1.0; 3]);
            let err = pg
                .broadcast_coalesced(&refs, 3, BROADCAST_BUCKET_BYTES)
                .unwrap_err();
            assert!(
                err.to_string()
                    .ends_with("source rank 3 is not in a group of size 3"),
                "{err}"
            );
        },
    );
}

/// A multi-process test whose name does not match its own path runs zero tests in each
/// child; the harness must fail it instead of passing.
#[test]
fn a_misnamed_multi_process_test_fails() {
    if worker().is_some() {
        return;
    }
    let start = Instant::now();
    let result = std::panic::catch_unwind(|| run_ranks("no_such_test", 2, |_| {}));
    let msg = result
        .expect_err("the parent must fail")
        .downcast_ref::<String>()
        .cloned()
        .unwrap_or_default();
    assert!(
        msg.contains("rank 0 of no_such_test ran no test body"),
        "{msg}"
    );
    assert!(start.elapsed() < Duration::from_secs(60));
}

/// `destroy_process_group` (and `ProcessGroup::shutdown`) shut the backends down while clones
/// of the group are alive — a subgroup's, a reducer's — and every later operation through any
/// of them is a `ShutDown` error value; work launched before may still be waited on.
#[test]
fn shutdown_with_clones_alive_fails_later_operations_cleanly() {
    run_ranks(
        "shutdown_with_clones_alive_fails_later_operations_cleanly",
        2,
        |pg| {
            let rank = pg.rank();
            let clone = pg.clone();
            let sub = pg.new_group(&[0, 1], Backend::Gloo).unwrap().unwrap();
            let w = (Tensor::ones([3], (Kind::Float, tch::Device::Cpu))).set_requires_grad(true);
            let reducer = tch_dist_runtime::Reducer::new(
                vec![("w".into(), w.shallow_clone())],
                pg.clone(),
                Default::default(),
            )
            .unwrap();
            let x = Tensor::from_slice(&[rank as f32 + 1.0]);
            let before = clone
                .all_reduce_async(&x, tch_dist_runtime::ReduceOp::Sum)
                .unwrap();
            // Both ranks have launched before either shuts down.
            pg.barrier().unwrap();
            before.wait().unwrap();
            assert_eq!(x.double_value(&[0]), 3.0);
            let launched = pg.launched_collectives();
            drop(pg);

            tch_dist_runtime::destroy_process_group();
            assert!(!tch_dist_runtime::is_initialized());
            assert!(clone.is_shut_down() && sub.is_shut_down());
            let shut = |op| DistError::ShutDown { rank, op };
            assert_eq!(
                clone.all_reduce(&x, tch_dist_runtime::ReduceOp::Sum),
                Err(shut("all_reduce"))
            );
            assert_eq!(clone.broadcast(&x, 0), Err(shut("broadcast")));
            assert_eq!(clone.barrier(), Err(shut("barrier")));
            assert_eq!(
                clone.monitored_barrier(Duration::from_secs(1), false),
                Err(shut("monitored_barrier"))
            );
            assert_eq!(
                clone.new_group(&[0, 1], Backend::Gloo).unwrap_err(),
                shut("new_group")
            );
            assert_eq!(
                sub.all_reduce(&x, tch_dist_runtime::ReduceOp::Sum),
                Err(shut("all_reduce"))
            );
            assert_eq!(
                clone.verify_same_tensors("replicate", "parameters", 0, &[("x", &x)]),
                Err(shut("all_gather"))
            );
            // A refused launch is not counted.
            assert_eq!(clone.launched_collectives(), launched);
            // The reducer's next backward pass fails with the same error instead of crashing.
            reducer.prepare_for_forward().unwrap();
            let err = (&w * 2.0).sum(Kind::Float).f_backward().unwrap_err();
            assert!(
                err.to_string().contains("the process group was shut down"),
                "{err}"
            );
            // The pass's first collective is its step check's header exchange, an
            // all-to-all (step_check/mod.rs).
            assert!(matches!(
                reducer.prepare_for_forward(),
                Err(DistError::ShutDown {
                    op: "all_to_all",
                    ..
                })
            ));
            // Idempotent, and the store is still there.
            clone.shutdown();
            clone.store().set("after", b"1").unwrap();
        },
    );
}

/// What an NCCL group checks while it is created, with claims made up: ranks 0 and 2 claim
/// one GPU, and every rank fails naming both (the pure pair search is unit-tested in
/// `devices.rs`); distinct claims pass.
#[test]
fn ranks_claiming_one_gpu_fail_on_every_rank_naming_both() {
    run_ranks(
        "ranks_claiming_one_gpu_fail_on_every_rank_naming_both",
        3,
        |pg| {
            let claim = |device| tch_dist_runtime::DeviceClaim {
                host: "node-a".into(),
                device,
                uuid: None,
            };
            pg.verify_distinct_devices(&claim(pg.rank())).unwrap();
            let mine = if pg.rank() == 1 { 1 } else { 0 };
            let err = pg.verify_distinct_devices(&claim(mine)).unwrap_err();
            assert_eq!(
                err,
                DistError::DuplicateDevice {
                    rank: pg.rank(),
                    first: 0,
                    first_device: 0,
                    second: 2,
                    second_device: 0,
                    host: "node-a".into(),
                    gpu: None,
                }
            );
            assert!(
                err.to_string()
                    .contains("rank 0 (cuda:0) and rank 2 (cuda:0) on node-a"),
                "{err}"
            );
            // With UUIDs, they decide: all called cuda:0, three GPUs; then ranks 0 and 1 on one.
            let renamed = tch_dist_runtime::DeviceClaim {
                host: "node-a".into(),
                device: 0,
                uuid: Some(format!("GPU-{}", pg.rank())),
            };
            pg.verify_distinct_devices(&renamed).unwrap();
            let same = tch_dist_runtime::DeviceClaim {
                uuid: Some(if pg.rank() < 2 { "GPU-x" } else { "GPU-z" }.into()),
                ..renamed
            };
            assert!(matches!(
                pg.verify_distinct_devices(&same),
                Err(DistError::DuplicateDevice {
                    first: 0,
                    second: 1,
                    ..
                })
            ));
        },
    );
}

/// LOCAL_RANK as the launcher sets it is the CUDA device an NCCL group of this process would
/// bind; here the ranks' local ranks are swapped, so each would take the other's GPU.
#[test]
fn local_rank_from_the_environment_picks_the_device() {
    let launch = tch_dist_runtime::testing::Launch::new(
        "local_rank_from_the_environment_picks_the_device",
        2,
    )
    .rank_env(0, "LOCAL_RANK", "1")
    .rank_env(1, "LOCAL_RANK", "0");
    tch_dist_runtime::testing::run_ranks_with(&launch, Backend::Gloo, |pg| {
        let opts = tch_dist_runtime::InitOptions::from_env(Backend::Nccl).unwrap();
        assert_eq!(opts.local_rank, 1 - pg.rank());
        assert_eq!(opts.cuda_device(2).unwrap(), Some(1 - pg.rank()));
        assert_eq!(opts.with_device_id(0).cuda_device(2).unwrap(), Some(0));
        // A Gloo group binds no device.
        assert_eq!(pg.bound_device(), None);
        assert!(!pg.cuda_via_gloo());
    });
}
