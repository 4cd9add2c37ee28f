//! Refusals, damage and fallback: every refusal of a load names the FQN on every rank and
//! changes nothing; every byte a load uses (the sidecars too) is checked against the
//! manifest; `latest_valid` skips damaged checkpoints.

use super::*;
use tch_dist::checkpoint::{LoadOptions, SaveOptions, State};

/// Each refusal on every rank, with the model unchanged.
#[test]
fn refusals_name_the_fqn_on_every_rank() {
    run_ranks("refusals::refusals_name_the_fqn_on_every_rank", 2, |pg| {
        let r = pg.rank();
        let dir = scratch("refusals", &pg);
        let ckpt = dir.join("ckpt");
        let saved = mlp(&nn::VarStore::new(Device::Cpu), 8, 1);
        checkpoint::save(&ckpt, &State::new(&saved), &pg, &SaveOptions::default()).unwrap();

        let vs = nn::VarStore::new(Device::Cpu);
        let model = mlp(&vs, 8, 5);
        let before = model.fc1.ws.copy();
        let unchanged = |err: CheckpointError, expected: &str| {
            assert_eq!(err.to_string(), expected);
            assert!(model.fc1.ws.equal(&before), "the model changed");
        };
        // Another model: a key the checkpoint lacks, one it has and the model lacks.
        #[derive(Debug, Shardable)]
        struct Bigger {
            fc1: nn::Linear,
            fc2: nn::Linear,
            head: nn::Linear,
        }
        let bvs = nn::VarStore::new(Device::Cpu);
        let bigger = Bigger {
            fc1: nn::linear(bvs.root() / "fc1", 6, 8, Default::default()),
            fc2: nn::linear(bvs.root() / "fc2", 8, 5, Default::default()),
            head: nn::linear(bvs.root() / "head", 5, 2, Default::default()),
        };
        let err = checkpoint::load(
            &ckpt,
            &mut State::new(&bigger),
            &pg,
            &LoadOptions::default(),
        )
        .unwrap_err();
        assert_eq!(
            err.to_string(),
            format!("rank {r}: checkpoint: `head.weight` is not in the checkpoint")
        );
        #[derive(Debug, Shardable)]
        struct Smaller {
            fc1: nn::Linear,
        }
        let smaller = Smaller {
            fc1: nn::linear(
                nn::VarStore::new(Device::Cpu).root() / "fc1",
                6,
                8,
                Default::default(),
            ),
        };
        let err = checkpoint::load(
            &ckpt,
            &mut State::new(&smaller),
            &pg,
            &LoadOptions::default(),
        )
        .unwrap_err();
        assert_eq!(
            err.to_string(),
            format!("rank {r}: checkpoint: `fc2.bias` is in the checkpoint but not in the model")
        );
        // A shape and a dtype.
        let wide = mlp(&nn::VarStore::new(Device::Cpu), 9, 1);
        let err = checkpoint::load(&ckpt, &mut State::new(&wide), &pg, &LoadOptions::default())
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            format!("rank {r}: checkpoint: `fc1.weight` is [8, 6] in the checkpoint but [9, 6] in the model")
        );
        let mut dvs = nn::VarStore::new(Device::Cpu);
        let double = mlp(&dvs, 8, 1);
        dvs.double();
        let err = checkpoint::load(
            &ckpt,
            &mut State::new(&double),
            &pg,
            &LoadOptions::default(),
        )
        .unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "rank {r}: checkpoint: `fc1.weight` is F32 in the checkpoint but F64 in the model"
            )
        );
        // One rank's bad input is an error on the other too.
        let mine = if r == 0 { &wide } else { &model };
        let err = checkpoint::load(&ckpt, &mut State::new(mine), &pg, &LoadOptions::default())
            .unwrap_err();
        if r == 1 {
            assert!(
                matches!(err, CheckpointError::Dist(DistError::PeersFailed { .. })),
                "{err:?}"
            );
            assert!(model.fc1.ws.equal(&before));
        }
        pg.barrier().unwrap();
        // A corrupted file (one byte changed), a truncated one.
        let file = ckpt.join(checkpoint::file_name(0));
        let bytes = std::fs::read(&file).unwrap();
        pg.barrier().unwrap();
        if r == 0 {
            let mut changed = bytes.clone();
            let last = changed.len() - 1;
            changed[last] ^= 0xff;
            std::fs::write(&file, &changed).unwrap();
        }
        pg.barrier().unwrap();
        // The last bytes are fc2.weight's ([5, 8]: one digest block), which both ranks read.
        unchanged(
            checkpoint::load(&ckpt, &mut State::new(&model), &pg, &LoadOptions::default())
                .unwrap_err(),
            &format!(
                "rank {r}: checkpoint: {} is corrupted: `fc2.weight`'s rows 0..5 differ from the \
                 manifest's SHA-256",
                file.display()
            ),
        );
        pg.barrier().unwrap();
        if r == 0 {
            std::fs::write(&file, &bytes[..bytes.len() - 4]).unwrap();
        }
        pg.barrier().unwrap();
        let err = checkpoint::load(&ckpt, &mut State::new(&model), &pg, &LoadOptions::default())
            .unwrap_err();
        assert!(err.to_string().contains("is corrupted"), "{err}");
        // An interrupted save (no manifest) is never loaded.
        pg.barrier().unwrap();
        if r == 0 {
            std::fs::write(&file, &bytes).unwrap();
            std::fs::remove_file(ckpt.join(checkpoint::MANIFEST)).unwrap();
        }
        pg.barrier().unwrap();
        unchanged(
            checkpoint::load(&ckpt, &mut State::new(&model), &pg, &LoadOptions::default())
                .unwrap_err(),
            &format!(
                "rank {r}: checkpoint: {} holds no complete checkpoint (no manifest.json: never \
                 saved there, or the save was interrupted)",
                ckpt.display()
            ),
        );
        // Saving over it replaces it whole; then it loads.
        pg.barrier().unwrap();
        checkpoint::save(&ckpt, &State::new(&saved), &pg, &SaveOptions::default()).unwrap();
        checkpoint::load(&ckpt, &mut State::new(&model), &pg, &LoadOptions::default()).unwrap();
        assert!(model.fc1.ws.equal(&saved.fc1.ws));
    });
}

/// `path` with `from` replaced by `to` (exactly once), written by rank 0 between barriers.
fn edit_on_rank_0(pg: &ProcessGroup, path: &Path, from: &str, to: &str) {
    pg.barrier().unwrap();
    if pg.rank() == 0 {
        let text = std::fs::read_to_string(path).unwrap();
        assert_eq!(text.matches(from).count(), 1, "{from:?} in {text}");
        std::fs::write(path, text.replace(from, to)).unwrap();
    }
    pg.barrier().unwrap();
}

/// Every byte a load uses is checked against the manifest: one digit changed in
/// `optimizer.json` (lr 0.1 -> 0.5) or in `train_state.json` (step 5 -> 7) is an error on
/// every rank, and neither the model nor the optimizer changed.
#[test]
fn sidecars_are_checksummed() {
    use tch_dist::checkpoint::SaveOptions;
    use tch_dist::optim::Sgd;
    run_ranks("refusals::sidecars_are_checksummed", 2, |pg| {
        let r = pg.rank();
        let dir = scratch("sidecars_checksummed", &pg);
        let ckpt = dir.join("step-00000005");
        let svs = nn::VarStore::new(Device::Cpu);
        let saved = mlp(&svs, 8, 1);
        let sgd = Sgd {
            momentum: 0.9,
            ..Default::default()
        };
        let mut sopt = sgd.build(&svs, 0.1).unwrap();
        let saving = State::new(&saved)
            .with_optimizer(&mut sopt)
            .with_train_state(serde_json::json!({ "step": 5 }));
        checkpoint::save(&ckpt, &saving, &pg, &SaveOptions::default()).unwrap();

        let vs = nn::VarStore::new(Device::Cpu);
        let model = mlp(&vs, 8, 2);
        let before = model.fc1.ws.copy();
        let mut opt = sgd.build(&vs, 0.3).unwrap();
        let corrupted = |name: &str| {
            format!(
                "rank {r}: checkpoint: {} is corrupted: its SHA-256 differs from the manifest's",
                ckpt.join(name).display()
            )
        };
        let sidecar = ckpt.join("optimizer.json");
        edit_on_rank_0(&pg, &sidecar, "\"lr\": 0.1", "\"lr\": 0.5");
        let err = checkpoint::load(
            &ckpt,
            &mut State::new(&model).with_optimizer(&mut opt),
            &pg,
            &LoadOptions::default(),
        )
        .unwrap_err();
        assert_eq!(err.to_string(), corrupted("optimizer.json"));
        assert!(
            model.fc1.ws.equal(&before),
            "a refused load changed the model"
        );
        assert_eq!(opt.lr(), 0.3, "a refused load changed the optimizer");
        edit_on_rank_0(&pg, &sidecar, "\"lr\": 0.5", "\"lr\": 0.1");
        checkpoint::load(
            &ckpt,
            &mut State::new(&model).with_optimizer(&mut opt),
            &pg,
            &LoadOptions::default(),
        )
        .unwrap();
        assert_eq!(opt.lr(), 0.1);
        assert!(model.fc1.ws.equal(&saved.fc1.ws));

        let state = ckpt.join("train_state.json");
        edit_on_rank_0(&pg, &state, "\"step\": 5", "\"step\": 7");
        let load_state = |dir: &std::path::Path| {
            let mut state = State::new(&model);
            checkpoint::load(dir, &mut state, &pg, &LoadOptions::default())
                .map(|_| state.train_state().cloned())
        };
        let err = load_state(&ckpt).unwrap_err();
        assert_eq!(err.to_string(), corrupted("train_state.json"));
        edit_on_rank_0(&pg, &state, "\"step\": 7", "\"step\": 5");
        assert_eq!(
            load_state(&ckpt).unwrap(),
            Some(serde_json::json!({ "step": 5 }))
        );

        // A sidecar the save did not write (the manifest does not list it) is not read.
        let model_only = dir.join("model-only");
        checkpoint::save(
            &model_only,
            &State::new(&saved),
            &pg,
            &SaveOptions::default(),
        )
        .unwrap();
        assert_eq!(load_state(&model_only).unwrap(), None);
        if r == 0 {
            std::fs::write(model_only.join("train_state.json"), "{\"step\": 7}").unwrap();
        }
        pg.barrier().unwrap();
        let err = load_state(&model_only).unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "rank {r}: checkpoint: {} is corrupted: the manifest does not list it",
                model_only.join("train_state.json").display()
            )
        );
    });
}

/// `latest_valid` falls back from damaged checkpoints (a changed byte, a missing file) to
/// the newest that verifies on every rank, naming each one it skipped and why; with every
/// one damaged it finds none and lists them all.
#[test]
fn latest_valid_skips_damaged_checkpoints() {
    run_ranks(
        "refusals::latest_valid_skips_damaged_checkpoints",
        2,
        |pg| {
            let dir = scratch("latest_valid", &pg);
            let none = checkpoint::latest_valid(dir.join("nothing-here"), &pg).unwrap();
            assert_eq!(none, checkpoint::LatestValid::default());
            let vs = nn::VarStore::new(Device::Cpu);
            let mut model = mlp(&vs, 8, 1);
            shard_module(&mut model, &plan(), 0, &pg).unwrap();
            let step = |n: u32| dir.join(format!("step-{n:08}"));
            for n in 1..=3 {
                checkpoint::save(step(n), &State::new(&model), &pg, &SaveOptions::default())
                    .unwrap();
            }
            let found = checkpoint::latest_valid(&dir, &pg).unwrap();
            assert_eq!(found.dir, Some(step(3)));
            assert!(found.skipped.is_empty());
            // step 3: one byte of rank 0's file changed; step 2: rank 1's file gone.
            let flipped = step(3).join(checkpoint::file_name(0));
            let gone = step(2).join(checkpoint::file_name(1));
            pg.barrier().unwrap();
            if pg.rank() == 0 {
                let mut bytes = std::fs::read(&flipped).unwrap();
                let last = bytes.len() - 1;
                bytes[last] ^= 1;
                std::fs::write(&flipped, bytes).unwrap();
                std::fs::remove_file(&gone).unwrap();
            }
            pg.barrier().unwrap();
            let both = |what: &dyn Fn(usize) -> String| format!("{}; {}", what(0), what(1));
            let changed = both(&|r| {
                format!(
                "rank {r}: checkpoint: {} is corrupted: its SHA-256 differs from the manifest's",
                flipped.display()
            )
            });
            let missing = both(&|r| {
                format!(
                    "rank {r}: checkpoint: {} is corrupted: No such file or directory (os error 2)",
                    gone.display()
                )
            });
            let skipped = |dir: PathBuf, reason: &str| checkpoint::Skipped {
                dir,
                reason: reason.to_string(),
            };
            let found = checkpoint::latest_valid(&dir, &pg).unwrap();
            assert_eq!(
                found,
                checkpoint::LatestValid {
                    dir: Some(step(1)),
                    skipped: vec![skipped(step(3), &changed), skipped(step(2), &missing)],
                }
            );
            // `latest` reads no file: it still names the newest complete one.
            assert_eq!(checkpoint::latest(&dir), Some(step(3)));
            checkpoint::load(
                found.dir.unwrap(),
                &mut State::new(&model),
                &pg,
                &LoadOptions::default(),
            )
            .unwrap();
            // Every one damaged: none, all three listed.
            let manifest = step(1).join(checkpoint::MANIFEST);
            edit_on_rank_0(&pg, &manifest, "\"world_size\": 2", "\"world_size\": 2,,");
            let found = checkpoint::latest_valid(&dir, &pg).unwrap();
            let bad_manifest = both(&|r| {
                format!(
                "rank {r}: checkpoint: {}: not a manifest of this format (tch-dist checkpoint 3, \
                 or tch-dist checkpoint 2)",
                manifest.display()
            )
            });
            assert_eq!(found.dir, None);
            assert_eq!(
                found.skipped,
                vec![
                    skipped(step(3), &changed),
                    skipped(step(2), &missing),
                    skipped(step(1), &bad_manifest)
                ]
            );
        },
    );
}

/// A parameter no API shards is saved whole, by the lowest rank that holds it: when ranks
/// hold other values for it (independent models), the save is refused on
/// every rank, naming the first such parameter and the ranks, and nothing is written.
#[test]
fn replicas_that_differ_are_refused_on_every_rank() {
    run_ranks(
        "refusals::replicas_that_differ_are_refused_on_every_rank",
        3,
        |pg| {
            let r = pg.rank();
            let dir = scratch("replicas_differ", &pg);
            let ckpt = dir.join("step-00000001");
            let vs = nn::VarStore::new(Device::Cpu);
            // Ranks 0 and 1 the same model, rank 2 another.
            let model = mlp(&vs, 8, if r == 2 { 9 } else { 1 });
            let e = checkpoint::save(&ckpt, &State::new(&model), &pg, &SaveOptions::default())
                .unwrap_err();
            assert_eq!(
                e.to_string(),
                format!(
                    "rank {r}: checkpoint: parameter `fc1.weight` is whole on the ranks that \
                     hold it but holds other values on ranks [2] than on rank 0: a checkpoint \
                     keeps one copy of such a tensor (the lowest rank's), so theirs would be \
                     lost (independent models, parameters left out of data parallelism); save \
                     each rank's model over a group of its own, or make the ranks agree first"
                )
            );
            pg.barrier().unwrap();
            assert!(!ckpt.exists(), "nothing written");
            assert!(checkpoint::latest(&dir).is_none());
            // The same values everywhere save as before.
            let same_vs = nn::VarStore::new(Device::Cpu);
            let same = mlp(&same_vs, 8, 1);
            checkpoint::save(&ckpt, &State::new(&same), &pg, &SaveOptions::default()).unwrap();
        },
    );
}

/// A fused column-parallel layer sharded per part (`ColwiseLinear { fused: 3 }`: each rank
/// holds its rows of each part, end to end) is several blocks of the whole weight on each
/// rank, which a checkpoint's one block per tensor and rank cannot hold: the save and the
/// load are refused on every rank, naming the weight, and nothing is written or changed.
#[test]
fn a_fused_column_parallel_layer_is_refused_on_every_rank() {
    run_ranks(
        "refusals::a_fused_column_parallel_layer_is_refused_on_every_rank",
        2,
        |pg| {
            let r = pg.rank();
            let dir = scratch("fused_refused", &pg);
            let plain = dir.join("plain");
            checkpoint::save(
                &plain,
                &State::new(&mlp(&nn::VarStore::new(Device::Cpu), 9, 1)),
                &pg,
                &SaveOptions::default(),
            )
            .unwrap();
            let vs = nn::VarStore::new(Device::Cpu);
            let mut model = mlp(&vs, 9, 2);
            let fused = ShardingPlan::builder()
                .shard_module(Mlp::path().fc1(), ColwiseLinear { fused: 3 })
                .build();
            shard_module(&mut model, &fused, 0, &pg).unwrap();
            let before = model.fc1.ws.copy();
            let expected = format!(
                "rank {r}: checkpoint: rank 0 holds `fc1.weight` as 3 separate blocks of the \
                 whole tensor (a fused column-parallel layer sharded per part), and a \
                 checkpoint holds one block per tensor and rank; shard the parts as layers \
                 of their own"
            );
            let err = checkpoint::save(
                dir.join("fused"),
                &State::new(&model),
                &pg,
                &SaveOptions::default(),
            )
            .unwrap_err();
            assert_eq!(err.to_string(), expected);
            assert!(!dir.join("fused").exists(), "nothing written");
            let err = checkpoint::load(
                &plain,
                &mut State::new(&model),
                &pg,
                &LoadOptions::default(),
            )
            .unwrap_err();
            assert_eq!(err.to_string(), expected);
            assert!(model.fc1.ws.equal(&before), "the model changed");
        },
    );
}
