//! What a load reads and checks: saved at 2 ranks and loaded at 4 (fully_shard and
//! tensor-parallel), each rank reads the manifest, each file's header and only the rows it
//! needs (counted by the loader and by the kernel's `rchar` in /proc/self/io, and equal to
//! the hand-computed bytes); a flipped byte in a slice a rank reads fails the load on every
//! rank and changes nothing; one in a slice no rank reads is found by `checkpoint::verify`;
//! a checkpoint of format 2 (no piece digests) still loads, reading every file whole.

use std::path::Path;

use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};
use tch_dist::checkpoint::{self, CheckpointError, CheckpointProblem, LoadStats};
use tch_dist::checkpoint::{LoadOptions, SaveOptions, State};
use tch_dist::sharding::shard_module;
use tch_dist::testing::run_ranks;
use tch_dist::OnRank;
use tch_dist::Shardable;
use tch_dist::{fully_shard, Backend, DistError, FsdpOptions, ProcessGroup};

use super::{equals_reference, fsdp_equals_reference, mlp, plan, scratch, Mlp};

/// The wide model: fc1 Linear(4, 65536) (rows of 16 bytes), fc2 Linear(65536, 4) (rows of
/// 256 KiB): 2.25 MiB, every rank's rows at 4 ranks whole digest blocks (4096 rows of fc1's
/// weight, 16384 of its bias, 1 of fc2's weight) but fc2's 4-value bias.
fn wide(vs: &nn::VarStore, seed: i64) -> Mlp {
    tch::manual_seed(seed);
    Mlp {
        fc1: nn::linear(vs.root() / "fc1", 4, 65536, Default::default()),
        fc2: nn::linear(vs.root() / "fc2", 65536, 4, Default::default()),
    }
}

/// This process's `rchar` (bytes it passed to read syscalls) from /proc/self/io.
fn rchar() -> u64 {
    let io = std::fs::read_to_string("/proc/self/io").unwrap();
    io.lines()
        .find_map(|l| l.strip_prefix("rchar: "))
        .unwrap()
        .parse()
        .unwrap()
}

/// A safetensors file's header length (8 + its JSON's) and the JSON.
fn header(file: &Path) -> (u64, serde_json::Value) {
    let bytes = std::fs::read(file).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) + 8;
    (n, serde_json::from_slice(&bytes[8..n as usize]).unwrap())
}

/// Where `fqn`'s bytes start in `file`.
fn data_start(file: &Path, fqn: &str) -> u64 {
    let (n, json) = header(file);
    n + json[fqn]["data_offsets"][0].as_u64().unwrap()
}

/// One byte of `file` at `at` flipped (xor 1) by rank 0, between barriers.
fn flip(pg: &ProcessGroup, file: &Path, at: u64) {
    pg.barrier().unwrap();
    if pg.rank() == 0 {
        let mut bytes = std::fs::read(file).unwrap();
        bytes[at as usize] ^= 1;
        std::fs::write(file, bytes).unwrap();
    }
    pg.barrier().unwrap();
}

fn len(path: &Path) -> u64 {
    std::fs::metadata(path).unwrap().len()
}

/// The manifest's and both files' headers' bytes: what every rank reads besides its rows.
fn overhead(ckpt: &Path) -> u64 {
    len(&ckpt.join(checkpoint::MANIFEST))
        + (0..2)
            .map(|r| header(&ckpt.join(checkpoint::file_name(r))).0)
            .sum::<u64>()
}

/// Loads `ckpt` into `model`, returning the loader's stats and the `rchar` delta around it.
fn measured_load(ckpt: &Path, model: &Mlp, pg: &ProcessGroup) -> (LoadStats, u64) {
    let before = rchar();
    let stats =
        checkpoint::load(ckpt, &mut State::new(model), pg, &LoadOptions::default()).unwrap();
    (stats, rchar() - before)
}

/// What the kernel may count beyond the loader's reads: the collective's socket reads
/// (one `agree`) and the read of /proc/self/io itself.
const RCHAR_SLACK: u64 = 16 * 1024;

/// `stats` are `slices` bytes of rows (and the overhead) from 2 files, the kernel saw about
/// as much, and that is under `1 / parts` of the checkpoint's files (all of which every rank
/// read before).
fn reads_only(ckpt: &Path, stats: LoadStats, rchar: u64, slices: u64, parts: u64, what: &str) {
    let expected = LoadStats {
        bytes_read: overhead(ckpt) + slices,
        files_opened: 2,
    };
    assert_eq!(stats, expected, "{what}");
    assert!(
        rchar >= stats.bytes_read && rchar <= stats.bytes_read + RCHAR_SLACK,
        "{what}: rchar {rchar}, the loader read {}",
        stats.bytes_read
    );
    let whole =
        len(&ckpt.join(checkpoint::file_name(0))) + len(&ckpt.join(checkpoint::file_name(1)));
    assert!(parts * rchar < whole, "{what}: {rchar} of {whole}");
}

/// Saves the wide model (seed 1) at ranks 0 and 1, fully_shard, into `ckpt`.
fn save_fsdp_at_2(pg: &ProcessGroup, ckpt: &Path) {
    let pair = pg.new_group(&[0, 1], Backend::Gloo).unwrap();
    if let Some(pair) = &pair {
        let model = wide(&nn::VarStore::new(Device::Cpu), 1);
        let opts = FsdpOptions {
            process_group: Some(pair.clone()),
            ..Default::default()
        };
        fully_shard(&model, opts).unwrap();
        checkpoint::save(ckpt, &State::new(&model), pair, &SaveOptions::default()).unwrap();
    }
    pg.barrier().unwrap();
}

/// Rank r of 4 reads rows 16384r.. of fc1 (16384 rows of 16 bytes, 16384 of 4), row r of
/// fc2.weight (256 KiB), and the 2-value piece of fc2.bias that holds its value (one digest
/// block: 4 bytes more than its share); nothing else but the manifest and the headers.
/// From a one-file `model.safetensors`, exactly its share and the header.
#[test]
fn fully_shard_saved_at_2_loads_at_4_reading_only_its_rows() {
    run_ranks(
        "reads::fully_shard_saved_at_2_loads_at_4_reading_only_its_rows",
        4,
        |pg| {
            let ckpt = scratch("reads_fsdp", &pg).join("by2");
            save_fsdp_at_2(&pg, &ckpt);
            let reference = nn::VarStore::new(Device::Cpu);
            let _ = wide(&reference, 1);
            let model = wide(&nn::VarStore::new(Device::Cpu), 2);
            fully_shard(&model, FsdpOptions::default()).unwrap();
            assert_eq!(model.fc1.ws.size(), [16384, 4]);
            let (stats, rchar) = measured_load(&ckpt, &model, &pg);
            let slices = 16384 * 16 + 16384 * 4 + 65536 * 4 + 2 * 4;
            // A quarter and the overhead: under a third.
            reads_only(&ckpt, stats, rchar, slices, 3, "fully_shard 2 -> 4");
            fsdp_equals_reference(&model, &reference, "fully_shard 2 -> 4");
            // A Hugging Face-style `model.safetensors` (one file of whole tensors, no
            // sharding info, no digests): exactly its share, fc2.bias's one value too.
            let hf = ckpt.with_file_name("model.safetensors");
            if pg.rank() == 0 {
                reference.save(&hf).unwrap();
            }
            pg.barrier().unwrap();
            let model = wide(&nn::VarStore::new(Device::Cpu), 3);
            fully_shard(&model, FsdpOptions::default()).unwrap();
            let stats =
                checkpoint::load(&hf, &mut State::new(&model), &pg, &LoadOptions::default())
                    .unwrap();
            let share = 16384 * 16 + 16384 * 4 + 65536 * 4 + 4;
            let expected = LoadStats {
                bytes_read: header(&hf).0 + share,
                files_opened: 1,
            };
            assert_eq!(stats, expected, "model.safetensors -> 4");
            fsdp_equals_reference(&model, &reference, "model.safetensors -> 4");
        },
    );
}

/// Tensor-parallel (fc1 colwise: rows; fc2 rowwise: columns), saved at 2, loaded at 4:
/// rank r reads its rows of fc1 as fully_shard does, the 4 rows of the fc2.weight piece
/// holding its columns whole (a column shard's rows hold the other ranks' columns too: 2x
/// its share of that tensor), and fc2.bias (replicated) whole.
#[test]
fn tensor_parallel_saved_at_2_loads_at_4_reading_only_its_rows() {
    run_ranks(
        "reads::tensor_parallel_saved_at_2_loads_at_4_reading_only_its_rows",
        4,
        |pg| {
            let ckpt = scratch("reads_tp", &pg).join("by2");
            let pair = pg.new_group(&[0, 1], Backend::Gloo).unwrap();
            if let Some(pair) = &pair {
                let mut model = wide(&nn::VarStore::new(Device::Cpu), 1);
                shard_module(&mut model, &plan(), 0, pair).unwrap();
                checkpoint::save(&ckpt, &State::new(&model), pair, &SaveOptions::default())
                    .unwrap();
            }
            pg.barrier().unwrap();
            let reference = nn::VarStore::new(Device::Cpu);
            let _ = wide(&reference, 1);
            let mut model = wide(&nn::VarStore::new(Device::Cpu), 2);
            shard_module(&mut model, &plan(), 0, &pg).unwrap();
            let (stats, rchar) = measured_load(&ckpt, &model, &pg);
            let slices = 16384 * 16 + 16384 * 4 + 4 * 32768 * 4 + 4 * 4;
            // fc2.weight's rows whole: under a half.
            reads_only(&ckpt, stats, rchar, slices, 2, "tensor-parallel 2 -> 4");
            equals_reference(&model, &reference, "tensor-parallel 2 -> 4");
            // ... and it computes what the reference computes.
            tch::manual_seed(33);
            let x = Tensor::randn([2, 4], (Kind::Float, Device::Cpu));
            let whole = wide(&nn::VarStore::new(Device::Cpu), 1);
            use tch_dist::Call;
            assert!(model
                .call(&x)
                .allclose(&whole.forward(&x), 1e-4, 1e-5, false));
        },
    );
}

/// A flipped byte in fc1.weight's row 20000 (rank 0's file), which rank 1 of 4 reads (its
/// rows 16384..32768, the digest block of rows 16384..20480): rank 1's error names the
/// file, the tensor and the rows; the others' names rank 1; no rank's model changed. A
/// flipped byte in a header fails every rank (each reads every header). Restored, the
/// checkpoint verifies and loads.
#[test]
fn a_flipped_byte_in_a_slice_a_rank_reads_fails_the_load_on_every_rank() {
    run_ranks(
        "reads::a_flipped_byte_in_a_slice_a_rank_reads_fails_the_load_on_every_rank",
        4,
        |pg| {
            let r = pg.rank();
            let ckpt = scratch("reads_corrupt", &pg).join("by2");
            save_fsdp_at_2(&pg, &ckpt);
            let model = wide(&nn::VarStore::new(Device::Cpu), 2);
            fully_shard(&model, FsdpOptions::default()).unwrap();
            let before = model.fc1.ws.copy();
            let file = ckpt.join(checkpoint::file_name(0));
            let at = data_start(&file, "fc1.weight") + 20000 * 16 + 3;
            flip(&pg, &file, at);
            let err =
                checkpoint::load(&ckpt, &mut State::new(&model), &pg, &LoadOptions::default())
                    .unwrap_err();
            if r == 1 {
                assert_eq!(
                    err.to_string(),
                    format!(
                        "rank 1: checkpoint: {} is corrupted: `fc1.weight`'s rows 16384..20480 \
                         differ from the manifest's SHA-256",
                        file.display()
                    )
                );
            } else {
                assert!(
                    matches!(&err, CheckpointError::Dist(DistError::PeersFailed { ranks, .. }) if ranks == &[1]),
                    "{err:?}"
                );
            }
            assert!(model.fc1.ws.equal(&before), "rank {r}: the model changed");
            // verify, one process, finds it too.
            if r == 0 {
                let err = checkpoint::verify(&ckpt).unwrap_err();
                assert_eq!(
                    err.to_string(),
                    format!(
                        "rank 0: checkpoint: {} is corrupted: its SHA-256 differs from the manifest's",
                        file.display()
                    )
                );
            }
            flip(&pg, &file, at);
            // A byte of the header's JSON.
            flip(&pg, &file, 20);
            let err =
                checkpoint::load(&ckpt, &mut State::new(&model), &pg, &LoadOptions::default())
                    .unwrap_err();
            assert_eq!(
                err.to_string(),
                format!(
                    "rank {r}: checkpoint: {} is corrupted: its header's SHA-256 differs from the \
                     manifest's",
                    file.display()
                )
            );
            assert!(model.fc1.ws.equal(&before), "rank {r}: the model changed");
            flip(&pg, &file, 20);
            checkpoint::verify(&ckpt).unwrap();
            checkpoint::load(&ckpt, &mut State::new(&model), &pg, &LoadOptions::default()).unwrap();
            let reference = nn::VarStore::new(Device::Cpu);
            let _ = wide(&reference, 1);
            fsdp_equals_reference(&model, &reference, "restored");
        },
    );
}

/// A flipped byte in the optimizer's state, which a model-only `load` never reads: the load
/// succeeds with the saved values, `verify` finds the damage naming the file, and
/// `load_with_optimizer` (which reads it) fails on every rank, changing nothing.
#[test]
fn a_flipped_byte_no_rank_reads_loads_and_verify_finds_it() {
    use tch_dist::optim::Sgd;
    run_ranks(
        "reads::a_flipped_byte_no_rank_reads_loads_and_verify_finds_it",
        2,
        |pg| {
            let r = pg.rank();
            let ckpt = scratch("reads_unread", &pg).join("step-00000001");
            let svs = nn::VarStore::new(Device::Cpu);
            let saved = mlp(&svs, 8, 1);
            let sgd = Sgd {
                momentum: 0.9,
                ..Default::default()
            };
            let mut sopt = sgd.build(&svs, 0.1).unwrap();
            tch::manual_seed(5);
            let x = Tensor::randn([4, 6], (Kind::Float, Device::Cpu));
            sopt.backward_step(&saved.forward(&x).square().mean(Kind::Float))
                .unwrap();
            checkpoint::save(
                &ckpt,
                &State::new(&saved).with_optimizer(&mut sopt),
                &pg,
                &Default::default(),
            )
            .unwrap();
            let file = ckpt.join(checkpoint::file_name(0));
            let key = "optim.state.fc1.weight.momentum_buffer";
            flip(&pg, &file, data_start(&file, key) + 5);

            let model = mlp(&nn::VarStore::new(Device::Cpu), 8, 2);
            checkpoint::load(&ckpt, &mut State::new(&model), &pg, &LoadOptions::default()).unwrap();
            for (fqn, t) in model.named_parameters() {
                assert!(
                    t.equal(&svs.variables()[&fqn]),
                    "{fqn} differs from the saved one"
                );
            }
            let err = checkpoint::verify(&ckpt).unwrap_err();
            assert_eq!(
                err.to_string(),
                format!(
                    "rank 0: checkpoint: {} is corrupted: its SHA-256 differs from the manifest's",
                    file.display()
                )
            );
            let ovs = nn::VarStore::new(Device::Cpu);
            let omodel = mlp(&ovs, 8, 2);
            let before = omodel.fc1.ws.copy();
            let mut opt = sgd.build(&ovs, 0.3).unwrap();
            let err = checkpoint::load(
                &ckpt,
                &mut State::new(&omodel).with_optimizer(&mut opt),
                &pg,
                &LoadOptions::default(),
            )
            .unwrap_err();
            assert_eq!(
                err.to_string(),
                format!(
                    "rank {r}: checkpoint: {} is corrupted: `{key}`'s rows 0..8 differ from the \
                     manifest's SHA-256",
                    file.display()
                )
            );
            assert!(omodel.fc1.ws.equal(&before), "the model changed");
            assert_eq!(opt.lr(), 0.3, "the optimizer changed");
            assert!(opt.state("fc1.weight").is_none(), "the optimizer changed");
        },
    );
}

/// A checkpoint of format 2 (the manifest without header or piece digests, as saves before
/// format 3 wrote it) loads, each rank reading and checking every file whole; a flipped
/// byte anywhere is found by every rank.
#[test]
fn a_format_2_checkpoint_loads_reading_every_file_whole() {
    run_ranks(
        "reads::a_format_2_checkpoint_loads_reading_every_file_whole",
        2,
        |pg| {
            let r = pg.rank();
            let ckpt = scratch("reads_format_2", &pg).join("old");
            let reference = nn::VarStore::new(Device::Cpu);
            let _ = mlp(&reference, 8, 1);
            let mut saved = mlp(&nn::VarStore::new(Device::Cpu), 8, 1);
            shard_module(&mut saved, &plan(), 0, &pg).unwrap();
            checkpoint::save(&ckpt, &State::new(&saved), &pg, &SaveOptions::default()).unwrap();
            let manifest = ckpt.join(checkpoint::MANIFEST);
            pg.barrier().unwrap();
            if r == 0 {
                let mut m: serde_json::Value =
                    serde_json::from_slice(&std::fs::read(&manifest).unwrap()).unwrap();
                assert_eq!(m["format"], "tch-dist checkpoint 3");
                m["format"] = "tch-dist checkpoint 2".into();
                for (_, entry) in m["files"].as_object_mut().unwrap() {
                    let entry = entry.as_object_mut().unwrap();
                    assert!(entry.remove("header_sha256").is_some());
                    assert!(entry.remove("pieces").is_some());
                }
                std::fs::write(&manifest, serde_json::to_string_pretty(&m).unwrap()).unwrap();
            }
            pg.barrier().unwrap();
            let mut model = mlp(&nn::VarStore::new(Device::Cpu), 8, 2);
            shard_module(&mut model, &plan(), 0, &pg).unwrap();
            let stats =
                checkpoint::load(&ckpt, &mut State::new(&model), &pg, &LoadOptions::default())
                    .unwrap();
            equals_reference(&model, &reference, "format 2");
            let files = [0, 1].map(|r| ckpt.join(checkpoint::file_name(r)));
            assert_eq!(
                stats,
                LoadStats {
                    bytes_read: len(&manifest) + len(&files[0]) + len(&files[1]),
                    files_opened: 2
                }
            );
            // Damage anywhere (the first data byte of rank 1's file) fails every rank.
            flip(&pg, &files[1], header(&files[1]).0);
            let mut fresh = mlp(&nn::VarStore::new(Device::Cpu), 8, 2);
            shard_module(&mut fresh, &plan(), 0, &pg).unwrap();
            let untouched = fresh.fc1.ws.copy();
            let err =
                checkpoint::load(&ckpt, &mut State::new(&fresh), &pg, &LoadOptions::default())
                    .unwrap_err();
            assert_eq!(
                err.to_string(),
                format!(
                    "rank {r}: checkpoint: {} is corrupted: its SHA-256 differs from the manifest's",
                    files[1].display()
                )
            );
            assert!(fresh.fc1.ws.equal(&untouched), "the model changed");
        },
    );
}

/// A manifest whose digests do not fit its files (a piece without digests, a piece with
/// fewer blocks than rows) is refused on every rank, naming the file and the tensor, and
/// the model does not change.
#[test]
fn a_manifest_whose_digests_do_not_fit_is_refused() {
    run_ranks(
        "reads::a_manifest_whose_digests_do_not_fit_is_refused",
        2,
        |pg| {
            let r = pg.rank();
            let ckpt = scratch("reads_bad_digests", &pg).join("ckpt");
            checkpoint::save(
                &ckpt,
                &State::new(&mlp(&nn::VarStore::new(Device::Cpu), 8, 1)),
                &pg,
                &SaveOptions::default(),
            )
            .unwrap();
            let manifest = ckpt.join(checkpoint::MANIFEST);
            let original = std::fs::read(&manifest).unwrap();
            let file = ckpt.join(checkpoint::file_name(0));
            let model = mlp(&nn::VarStore::new(Device::Cpu), 8, 2);
            let before = model.fc1.ws.copy();
            let edited = |edit: &dyn Fn(&mut serde_json::Value)| {
                pg.barrier().unwrap();
                if r == 0 {
                    let mut m: serde_json::Value = serde_json::from_slice(&original).unwrap();
                    edit(&mut m["files"][checkpoint::file_name(0)]["pieces"]);
                    std::fs::write(&manifest, serde_json::to_vec(&m).unwrap()).unwrap();
                }
                pg.barrier().unwrap();
                let err =
                    checkpoint::load(&ckpt, &mut State::new(&model), &pg, &LoadOptions::default())
                        .unwrap_err();
                assert!(model.fc1.ws.equal(&before), "the model changed");
                err.to_string()
            };
            let err = edited(&|p| {
                p.as_object_mut().unwrap().remove("fc2.bias");
            });
            assert_eq!(
                err,
                format!(
                    "rank {r}: checkpoint: {} is corrupted: the manifest has no digests of \
                     `fc2.bias`",
                    file.display()
                )
            );
            let err = edited(&|p| p["fc1.weight"]["sha256"] = serde_json::json!([]));
            assert_eq!(
                err,
                format!(
                    "rank {r}: checkpoint: {} is corrupted: the manifest's digests of \
                     `fc1.weight` do not fit its 8 rows",
                    file.display()
                )
            );
        },
    );
}

/// A replicated model's checkpoint (rank 0's file of whole tensors) loaded at 3 ranks with
/// `Reads::Striped`: each whole tensor is read by one rank, largest first to the rank with
/// the fewest bytes (fc1.weight to 0, fc2.weight to 1, fc1.bias and fc2.bias to 2), and
/// broadcast, so the ranks together read the checkpoint's data once, not three times; the
/// values equal the saved ones on every rank. A flipped byte in fc2.weight, which only
/// rank 1 reads, fails the load on every rank with nothing changed.
#[test]
fn striped_reads_share_a_replicated_models_tensors_out() {
    use tch_dist::checkpoint::{LoadOptions, Reads};
    run_ranks(
        "reads::striped_reads_share_a_replicated_models_tensors_out",
        3,
        |pg| {
            let ckpt = scratch("reads_striped", &pg).join("whole");
            let reference = nn::VarStore::new(Device::Cpu);
            let saved = wide(&reference, 1);
            checkpoint::save(&ckpt, &State::new(&saved), &pg, &SaveOptions::default()).unwrap();
            let file = ckpt.join(checkpoint::file_name(0));
            let overhead = len(&ckpt.join(checkpoint::MANIFEST)) + header(&file).0;
            let striped = LoadOptions {
                reads: Reads::Striped,
            };

            let model = wide(&nn::VarStore::new(Device::Cpu), 2);
            let stats = checkpoint::load(&ckpt, &mut State::new(&model), &pg, &striped).unwrap();
            let share = [65536 * 4 * 4, 4 * 65536 * 4, 65536 * 4 + 4 * 4][pg.rank()];
            let expected = LoadStats {
                bytes_read: overhead + share,
                files_opened: 1,
            };
            assert_eq!(stats, expected, "rank {}'s striped reads", pg.rank());
            equals_reference(&model, &reference, "striped");
            // Each rank on its own reads all of it.
            let model = wide(&nn::VarStore::new(Device::Cpu), 2);
            let stats =
                checkpoint::load(&ckpt, &mut State::new(&model), &pg, &LoadOptions::default())
                    .unwrap();
            assert_eq!(
                stats.bytes_read,
                overhead + 2 * 65536 * 4 * 4 + 65536 * 4 + 16
            );
            equals_reference(&model, &reference, "each rank");

            flip(&pg, &file, data_start(&file, "fc2.weight") + 100);
            let model = wide(&nn::VarStore::new(Device::Cpu), 2);
            let err = checkpoint::load(&ckpt, &mut State::new(&model), &pg, &striped).unwrap_err();
            match (pg.rank(), &err) {
                (
                    1,
                    CheckpointError::OnRank(OnRank {
                        problem: CheckpointProblem::Corrupted { file: f, .. },
                        ..
                    }),
                ) => assert_eq!(f, &file),
                (0 | 2, CheckpointError::Dist(DistError::PeersFailed { ranks, .. })) => {
                    assert_eq!(ranks, &[1])
                }
                _ => panic!("rank {}: {err:?}", pg.rank()),
            }
            let untouched = wide(&nn::VarStore::new(Device::Cpu), 2);
            assert!(model.fc2.ws.equal(&untouched.fc2.ws), "nothing changed");
            assert!(model.fc1.ws.equal(&untouched.fc1.ws), "nothing changed");

            // Ranks that share the reads differently: an error on every rank naming the
            // option, nothing changed (rank 0 striped, the others each their own).
            let opts = LoadOptions {
                reads: [Reads::Striped, Reads::EachRank, Reads::EachRank][pg.rank()],
            };
            let err = checkpoint::load(&ckpt, &mut State::new(&model), &pg, &opts).unwrap_err();
            let Some(CheckpointProblem::Load { source, .. }) = err.problem() else {
                panic!("rank {}: {err:?}", pg.rank());
            };
            assert!(
                matches!(**source, DistError::Mismatch { .. })
                    && source.to_string().contains("reads"),
                "rank {}: {source}",
                pg.rank()
            );
            assert!(model.fc1.ws.equal(&untouched.fc1.ws), "nothing changed");
        },
    );
}

/// `Reads::Striped` with an optimizer in the [`State`]: the momentum buffers and the
/// learning rate come back on every rank, equal to the saved ones (the previous release's
/// `load_with_optimizer` took no `LoadOptions`, so striped reads could not restore one).
#[test]
fn striped_reads_restore_an_optimizer() {
    use tch_dist::checkpoint::Reads;
    use tch_dist::optim::Sgd;
    run_ranks("reads::striped_reads_restore_an_optimizer", 2, |pg| {
        let ckpt = scratch("reads_striped_optimizer", &pg).join("whole");
        let sgd = Sgd {
            momentum: 0.9,
            ..Default::default()
        };
        let svs = nn::VarStore::new(Device::Cpu);
        let saved = mlp(&svs, 8, 1);
        let mut sopt = sgd.build(&svs, 0.1).unwrap();
        let x = Tensor::ones([2, 6], (Kind::Float, Device::Cpu));
        sopt.backward_step(&saved.forward(&x).sum(Kind::Float))
            .unwrap();
        let state = State::new(&saved).with_optimizer(&mut sopt);
        checkpoint::save(&ckpt, &state, &pg, &SaveOptions::default()).unwrap();

        let vs = nn::VarStore::new(Device::Cpu);
        let model = mlp(&vs, 8, 2);
        let mut opt = sgd.build(&vs, 0.3).unwrap();
        let striped = LoadOptions {
            reads: Reads::Striped,
        };
        let mut state = State::new(&model).with_optimizer(&mut opt);
        checkpoint::load(&ckpt, &mut state, &pg, &striped).unwrap();
        assert_eq!(opt.lr(), 0.1);
        assert!(model.fc1.ws.equal(&saved.fc1.ws));
        for (fqn, saved_state) in sopt.states() {
            let buf = |s: &tch_dist::optim::ParamState| s.get("momentum_buffer").unwrap().copy();
            let loaded = opt
                .state(fqn)
                .unwrap_or_else(|| panic!("no state for {fqn}"));
            assert!(
                buf(loaded).equal(&buf(saved_state)),
                "rank {}: {fqn}'s momentum buffer",
                pg.rank()
            );
        }
        assert_eq!(opt.states().count(), 4);
    });
}
