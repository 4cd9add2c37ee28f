//! Checkpoints PyTorch wrote load into tch-dist: `dcp.save` with `HuggingFaceStorageWriter`
//! from a plain PyTorch model (one file, no manifest) and from a `fully_shard`ed one at 2
//! ranks (`save_distributed=True`: one file per rank), each loaded at 1, 2 and 3 ranks into a
//! plain, a fully_shard and a tensor-parallel tch-dist model, values equal to what PyTorch
//! saved; saved again by tch-dist, PyTorch reads the same values back. Such a folder has
//! no checksums, so nothing is verified; one named as a save's temporary folder
//! (`.partial`) is refused as an interrupted save.

use std::path::{Path, PathBuf};

use tch::nn;
use tch::Device;
use tch_dist::checkpoint::{self, CheckpointProblem};
use tch_dist::checkpoint::{LoadOptions, SaveOptions, State};
use tch_dist::sharding::shard_module;
use tch_dist::testing::{run_ranks, worker};
use tch_dist::{fully_shard, Backend, FsdpOptions};

use super::{assert_verdicts, equals_reference, fsdp_equals_reference, mlp, plan, python_ranks};

fn folder() -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR")).join("from_pytorch")
}

/// Runs tests/checkpoint/pytorch_save.py at 2 ranks, writing into [`folder`] `fsdp2` (and
/// `fsdp2.safetensors`, the reference) and, on rank 0 in one process first, `plain` (and
/// `plain.safetensors`).
fn pytorch_saves() {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/checkpoint/pytorch_save.py");
    let args: Vec<PathBuf> = ["fsdp2", "fsdp2.safetensors", "plain", "plain.safetensors"]
        .iter()
        .map(|name| folder().join(name))
        .collect();
    let out = python_ranks(&script, &args, 2);
    let verdicts = ["saved 1", "saved rank 0 of 2", "saved rank 1 of 2"];
    assert_verdicts(&out, verdicts, "PyTorch's saves");
}

#[test]
fn pytorch_written_checkpoints_load_at_1_2_and_3_ranks() {
    if worker().is_none() {
        let _ = std::fs::remove_dir_all(folder());
        std::fs::create_dir_all(folder()).unwrap();
        pytorch_saves();
    }
    run_ranks(
        "from_pytorch::pytorch_written_checkpoints_load_at_1_2_and_3_ranks",
        3,
        |pg| {
            // Rank 0 alone, ranks 0 and 1, all three (fc1's 8 rows as 3 + 3 + 2 there).
            let groups = [
                pg.new_group(&[0], Backend::Gloo).unwrap(),
                pg.new_group(&[0, 1], Backend::Gloo).unwrap(),
                Some(pg.clone()),
            ];
            for name in ["plain", "fsdp2"] {
                let ckpt = folder().join(name);
                // What PyTorch saved, from its one-file copy.
                let reference = nn::VarStore::new(Device::Cpu);
                let whole = mlp(&reference, 8, 9);
                checkpoint::load(
                    folder().join(format!("{name}.safetensors")),
                    &mut State::new(&whole),
                    &pg,
                    &LoadOptions::default(),
                )
                .unwrap();
                for g in groups.iter().flatten() {
                    let at = format!("{name} at {} ranks", g.world_size());
                    let model = mlp(&nn::VarStore::new(Device::Cpu), 8, 3);
                    checkpoint::load(&ckpt, &mut State::new(&model), g, &LoadOptions::default())
                        .unwrap();
                    equals_reference(&model, &reference, &format!("{at}, plain"));
                    let model = mlp(&nn::VarStore::new(Device::Cpu), 8, 4);
                    let opts = FsdpOptions {
                        process_group: Some(g.clone()),
                        ..Default::default()
                    };
                    fully_shard(&model, opts).unwrap();
                    checkpoint::load(&ckpt, &mut State::new(&model), g, &LoadOptions::default())
                        .unwrap();
                    fsdp_equals_reference(&model, &reference, &format!("{at}, fully_shard"));
                    let mut model = mlp(&nn::VarStore::new(Device::Cpu), 8, 5);
                    shard_module(&mut model, &plan(), 0, g).unwrap();
                    checkpoint::load(&ckpt, &mut State::new(&model), g, &LoadOptions::default())
                        .unwrap();
                    equals_reference(&model, &reference, &format!("{at}, tensor-parallel"));
                    if g.world_size() == 3 {
                        // Saved again by tch-dist, for PyTorch to read back below.
                        checkpoint::save(
                            folder().join(format!("{name}-by-tch-dist")),
                            &State::new(&model),
                            g,
                            &SaveOptions::default(),
                        )
                        .unwrap();
                    }
                }
                pg.barrier().unwrap();
            }
            // The same files in a folder named as a save's temporary one: an interrupted
            // save, refused.
            let partial = folder().join("plain-copy.partial");
            if pg.rank() == 0 {
                std::fs::create_dir_all(&partial).unwrap();
                let file = "model-00001-of-00001.safetensors";
                std::fs::copy(folder().join("plain").join(file), partial.join(file)).unwrap();
            }
            pg.barrier().unwrap();
            let model = mlp(&nn::VarStore::new(Device::Cpu), 8, 6);
            let err = checkpoint::load(
                &partial,
                &mut State::new(&model),
                &pg,
                &LoadOptions::default(),
            )
            .unwrap_err();
            assert!(
                matches!(
                    err.problem(),
                    Some(CheckpointProblem::NotACheckpoint { .. })
                ) && err.rank() == Some(pg.rank()),
                "{err:?}"
            );
        },
    );
    // The round trip PyTorch -> tch-dist -> PyTorch keeps every value.
    if worker().is_none() {
        let [plain, fsdp2] = ["plain", "fsdp2"].map(|name| {
            (
                folder().join(format!("{name}-by-tch-dist")),
                folder().join(format!("{name}.safetensors")),
            )
        });
        super::pytorch_loads(&[(&plain.0, &plain.1), (&fsdp2.0, &fsdp2.1)]);
    }
}
