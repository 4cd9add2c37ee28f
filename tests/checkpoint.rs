//! `tch_dist::checkpoint` end to end, ranks as real processes over 127.0.0.1: a
//! tensor-parallel model saved by 2 ranks loads at 3 ranks (tensor-parallel and plain) and
//! into PyTorch (`dcp.load` with `HuggingFaceStorageReader`, in one process and into a
//! `fully_shard` model at 3 ranks); saved at 3, it loads again; the optimizer's state
//! resharded; a save killed at each commit point; a peer dying during a load.
//!
//! | file | what it tests |
//! | --- | --- |
//! | `checkpoint.rs` | the fixtures; round trips through PyTorch, resharding, optimizer state, crashes |
//! | `checkpoint/refusals.rs` | refusals naming the FQN, checksummed sidecars, `latest_valid` |
//! | `checkpoint/reads.rs` | each rank reading only its slices; per-block digests; format 2 |
//! | `checkpoint/from_pytorch.rs` | folders PyTorch's `HuggingFaceStorageWriter` wrote |
//! | `checkpoint/async_save.rs` | `async_save`, the plan cache |

use std::path::{Path, PathBuf};

use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};
use tch_dist::checkpoint::{
    self, CheckpointError, CheckpointProblem, LoadOptions, SaveOptions, State,
};
use tch_dist::sharding::{
    shard_module, shard_module_state, ColwiseLinear, RowwiseLinear, ShardingPlan,
};
use tch_dist::testing::{run_ranks, worker};
use tch_dist::{Backend, Call, DistError, ProcessGroup, Shardable};

/// `async_save`: training goes on while it writes; crash safety; memory; the plan cache.
#[path = "checkpoint/async_save.rs"]
mod async_save;
/// Checkpoints PyTorch's `HuggingFaceStorageWriter` wrote load.
#[path = "checkpoint/from_pytorch.rs"]
mod from_pytorch;
/// Each rank reads only its slices; what a load checks; format 2 still loads.
#[path = "checkpoint/reads.rs"]
mod reads;

#[path = "checkpoint/refusals.rs"]
mod refusals;

#[path = "common/python.rs"]
mod python;
use python::{assert_verdicts, python_ranks};

#[derive(Debug, Shardable)]
struct Mlp {
    fc1: nn::Linear,
    fc2: nn::Linear,
}

impl Module for Mlp {
    fn forward(&self, xs: &Tensor) -> Tensor {
        self.fc2.call(&self.fc1.call(xs).relu())
    }
}

fn mlp(vs: &nn::VarStore, hidden: i64, seed: i64) -> Mlp {
    tch::manual_seed(seed);
    Mlp {
        fc1: nn::linear(vs.root() / "fc1", 6, hidden, Default::default()),
        fc2: nn::linear(vs.root() / "fc2", hidden, 5, Default::default()),
    }
}

fn plan() -> ShardingPlan {
    ShardingPlan::builder()
        .shard_module(Mlp::path().fc1(), ColwiseLinear::default())
        .shard_module(Mlp::path().fc2(), RowwiseLinear)
        .return_local_tensor(Mlp::path().fc1())
        .build()
}

/// A folder for this test's files, the same for every rank (emptied by rank 0).
fn scratch(name: &str, pg: &ProcessGroup) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    if pg.rank() == 0 {
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
    }
    pg.barrier().unwrap();
    dir
}

/// Every tensor of `model` (sharded ones gathered) against the reference store's.
fn equals_reference(model: &Mlp, reference: &nn::VarStore, what: &str) {
    let state = shard_module_state(model);
    let mut names: Vec<(String, Tensor)> = model
        .named_parameters()
        .into_iter()
        .map(|(n, t)| (n, t.shallow_clone()))
        .collect();
    names.sort_by(|a, b| a.0.cmp(&b.0));
    for (fqn, t) in names {
        let whole = match &state {
            Some(s) if s.metadata(&fqn).is_some() => {
                s.sharded_tensor(model, &fqn).unwrap().all_gather().unwrap()
            }
            _ => t,
        };
        assert!(
            whole.equal(&reference.variables()[&fqn]),
            "{what}: {fqn} differs from the reference"
        );
    }
}

/// PyTorch loads each `(ckpt, full)` in one process and into a 3-rank fully_shard model,
/// equal to the reference `full` (one job: rank 0 does the one-process loads first).
fn pytorch_loads(pairs: &[(&Path, &Path)]) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/checkpoint/pytorch_load.py");
    let args: Vec<&Path> = pairs.iter().flat_map(|(c, f)| [*c, *f]).collect();
    let out = python_ranks(&script, &args, 3);
    let verdicts = pairs
        .iter()
        .map(|(ckpt, _)| format!("ok 1 {}", ckpt.display()))
        .chain((0..3).map(|rank| format!("ok rank {rank} of 3")));
    assert_verdicts(&out, verdicts, "PyTorch's loads");
}

#[test]
fn tensor_parallel_checkpoints_reshard_and_load_in_pytorch() {
    run_ranks(
        "tensor_parallel_checkpoints_reshard_and_load_in_pytorch",
        3,
        |pg| {
            let dir = scratch("tp_reshard", &pg);
            let (ckpt2, ckpt3, full) = (
                dir.join("by2"),
                dir.join("by3"),
                dir.join("full.safetensors"),
            );
            // The reference values: seed 1, unsharded.
            let reference = nn::VarStore::new(Device::Cpu);
            let _ = mlp(&reference, 8, 1);
            if pg.rank() == 0 {
                reference.save(&full).unwrap();
            }
            // Saved by ranks 0 and 1 (a subgroup), tensor-parallel: uneven shards of 4 rows.
            let pair = pg.new_group(&[0, 1], Backend::Gloo).unwrap();
            if let Some(pair) = &pair {
                let vs = nn::VarStore::new(Device::Cpu);
                let mut model = mlp(&vs, 8, 1);
                shard_module(&mut model, &plan(), 0, pair).unwrap();
                checkpoint::save(&ckpt2, &State::new(&model), pair, &SaveOptions::default())
                    .unwrap();
                assert!(!ckpt2.with_file_name("by2.partial").exists());
            }
            pg.barrier().unwrap();
            let files: Vec<String> = {
                let mut f: Vec<String> = std::fs::read_dir(&ckpt2)
                    .unwrap()
                    .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                    .collect();
                f.sort();
                f
            };
            assert_eq!(
                files,
                [
                    "manifest.json",
                    "shard-00001-model-00001-of-00001.safetensors",
                    "shard-00002-model-00001-of-00001.safetensors"
                ]
            );
            // Loaded at 3 ranks, tensor-parallel (3 + 3 + 2 rows), from other initial values.
            let vs = nn::VarStore::new(Device::Cpu);
            let mut model = mlp(&vs, 8, 2 + pg.rank() as i64);
            shard_module(&mut model, &plan(), 0, &pg).unwrap();
            checkpoint::load(
                &ckpt2,
                &mut State::new(&model),
                &pg,
                &LoadOptions::default(),
            )
            .unwrap();
            equals_reference(&model, &reference, "2 -> 3 ranks, tensor-parallel");
            // ... and it computes what the reference computes.
            tch::manual_seed(33); // the same input on every rank
            let x = Tensor::randn([4, 6], (Kind::Float, Device::Cpu));
            let ref_model = mlp(&nn::VarStore::new(Device::Cpu), 8, 9);
            checkpoint::load(
                &full,
                &mut State::new(&ref_model),
                &pg,
                &LoadOptions::default(),
            )
            .unwrap();
            assert!(model
                .call(&x)
                .allclose(&ref_model.forward(&x), 1e-5, 1e-6, false));
            // Saved again at 3; loaded into a plain model.
            checkpoint::save(&ckpt3, &State::new(&model), &pg, &SaveOptions::default()).unwrap();
            let plain = mlp(&nn::VarStore::new(Device::Cpu), 8, 7);
            checkpoint::load(
                &ckpt3,
                &mut State::new(&plain),
                &pg,
                &LoadOptions::default(),
            )
            .unwrap();
            equals_reference(&plain, &reference, "3 ranks -> plain");
        },
    );
    // PyTorch reads both, once the ranks are done (in the test's own process, so that no
    // rank waits on PyTorch's start-up).
    if worker().is_none() {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("tp_reshard");
        let full = dir.join("full.safetensors");
        pytorch_loads(&[(&dir.join("by2"), &full), (&dir.join("by3"), &full)]);
    }
}

/// Every tensor of a fully_shard `model`, gathered, against the reference store's.
fn fsdp_equals_reference(model: &Mlp, reference: &nn::VarStore, what: &str) {
    for (fqn, t) in tch_dist::fully_shard::full_state_dict(model).unwrap() {
        assert!(
            t.equal(&reference.variables()[&fqn]),
            "{what}: {fqn} differs from the reference"
        );
    }
}

#[test]
fn fully_shard_checkpoints_reshard_and_load_in_pytorch() {
    run_ranks(
        "fully_shard_checkpoints_reshard_and_load_in_pytorch",
        3,
        |pg| {
            use tch_dist::{fully_shard, FsdpOptions};
            let dir = scratch("fsdp_reshard", &pg);
            let (ckpt2, ckpt3, full) = (
                dir.join("by2"),
                dir.join("by3"),
                dir.join("full.safetensors"),
            );
            let reference = nn::VarStore::new(Device::Cpu);
            let _ = mlp(&reference, 8, 1);
            if pg.rank() == 0 {
                reference.save(&full).unwrap();
            }
            // Saved by ranks 0 and 1, per-layer groups and the root: fc1 4 + 4 rows, fc2 3 + 2.
            let pair = pg.new_group(&[0, 1], Backend::Gloo).unwrap();
            if let Some(pair) = &pair {
                let model = mlp(&nn::VarStore::new(Device::Cpu), 8, 1);
                let opts = || FsdpOptions {
                    process_group: Some(pair.clone()),
                    ..Default::default()
                };
                fully_shard(&model.fc1, opts()).unwrap();
                fully_shard(&model, opts()).unwrap();
                assert_eq!(
                    model.fc2.ws.size(),
                    [if pair.rank() == 0 { 3 } else { 2 }, 8]
                );
                checkpoint::save(&ckpt2, &State::new(&model), pair, &SaveOptions::default())
                    .unwrap();
            }
            pg.barrier().unwrap();
            // Loaded at 3 ranks (3 + 3 + 2 rows and 2 + 2 + 1), from other initial values.
            let model = mlp(&nn::VarStore::new(Device::Cpu), 8, 2);
            fully_shard(&model, FsdpOptions::default()).unwrap();
            checkpoint::load(
                &ckpt2,
                &mut State::new(&model),
                &pg,
                &LoadOptions::default(),
            )
            .unwrap();
            fsdp_equals_reference(&model, &reference, "2 -> 3 ranks, fully_shard");
            checkpoint::save(&ckpt3, &State::new(&model), &pg, &SaveOptions::default()).unwrap();
            let plain = mlp(&nn::VarStore::new(Device::Cpu), 8, 7);
            checkpoint::load(
                &ckpt3,
                &mut State::new(&plain),
                &pg,
                &LoadOptions::default(),
            )
            .unwrap();
            equals_reference(&plain, &reference, "3 ranks fully_shard -> plain");
        },
    );
    if worker().is_none() {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("fsdp_reshard");
        let full = dir.join("full.safetensors");
        pytorch_loads(&[(&dir.join("by2"), &full), (&dir.join("by3"), &full)]);
    }
}

/// Checkpoints one per step with a train state and `keep_last`: only the last two complete
/// ones stay, `latest` finds the newest (never an interrupted `.partial` one), and the train
/// state comes back as saved.
#[test]
fn train_state_keep_last_and_latest() {
    run_ranks("train_state_keep_last_and_latest", 2, |pg| {
        let dir = scratch("keep_last", &pg);
        let vs = nn::VarStore::new(Device::Cpu);
        let mut model = mlp(&vs, 8, 1);
        shard_module(&mut model, &plan(), 0, &pg).unwrap();
        assert_eq!(checkpoint::latest(&dir), None);
        for step in 1..=3u64 {
            let state = State::new(&model)
                .with_train_state(serde_json::json!({ "step": step, "epoch": step / 2 }));
            let opts = SaveOptions { keep_last: Some(2) };
            checkpoint::save(dir.join(format!("step-{step:08}")), &state, &pg, &opts).unwrap();
        }
        // An interrupted later save: a folder without a manifest.
        if pg.rank() == 0 {
            std::fs::create_dir_all(dir.join("step-00000004.partial")).unwrap();
        }
        pg.barrier().unwrap();
        let mut left: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        assert_eq!(
            left,
            ["step-00000002", "step-00000003", "step-00000004.partial"]
        );
        let last = checkpoint::latest(&dir).unwrap();
        assert_eq!(last, dir.join("step-00000003"));
        let mut state = State::new(&model);
        checkpoint::load(&last, &mut state, &pg, &LoadOptions::default()).unwrap();
        assert_eq!(
            state.train_state(),
            Some(&serde_json::json!({ "step": 3, "epoch": 1 }))
        );
        let partial = dir.join("step-00000004.partial");
        let err = checkpoint::load(&partial, &mut state, &pg, &LoadOptions::default()).unwrap_err();
        assert!(
            matches!(
                err.problem(),
                Some(CheckpointProblem::NotACheckpoint { .. })
            ) && err.rank() == Some(pg.rank())
        );
        // The previous release's function, kept for one release.
        #[allow(deprecated)]
        let old = checkpoint::load_train_state(&last, &pg).unwrap();
        assert_eq!(old, Some(serde_json::json!({ "step": 3, "epoch": 1 })));
    });
}

/// The largest difference between `model`'s tensors (sharded ones gathered) and the
/// reference store's.
fn max_difference(model: &Mlp, reference: &nn::VarStore) -> f64 {
    let state = shard_module_state(model);
    let mut worst = 0f64;
    for (fqn, t) in model.named_parameters() {
        let whole = match &state {
            Some(s) if s.metadata(&fqn).is_some() => {
                s.sharded_tensor(model, &fqn).unwrap().all_gather().unwrap()
            }
            _ => t.shallow_clone(),
        };
        let d = (whole - &reference.variables()[&fqn])
            .abs()
            .max()
            .double_value(&[]);
        worst = worst.max(d);
    }
    worst
}

/// AdamW's state saved with the model by 2 tensor-parallel ranks and loaded at 3: training
/// continues as one uninterrupted single-process run (parameters within 1e-6), the state is
/// sharded like its parameters under PyTorch's names, and the settings come back. Loading
/// optimizer state from a model-only checkpoint, or into another optimizer class, is an error
/// on every rank that changes nothing.
#[test]
fn optimizer_state_saved_at_2_continues_at_3() {
    use tch_dist::checkpoint::SaveOptions;
    use tch_dist::optim::{AdamW, Optimizer, Sgd};
    run_ranks("optimizer_state_saved_at_2_continues_at_3", 3, |pg| {
        let dir = scratch("optim_reshard", &pg);
        let ckpt = dir.join("step-00000003");
        let adamw = AdamW {
            weight_decay: 0.1,
            amsgrad: true,
            ..Default::default()
        };
        // The same batch on every rank (tensor parallelism replicates the input).
        let train = |model: &Mlp, opt: &mut Optimizer, steps: std::ops::Range<i64>| {
            for step in steps {
                tch::manual_seed(100 + step);
                let x = Tensor::randn([4, 6], (Kind::Float, Device::Cpu));
                let y = Tensor::randn([4, 5], (Kind::Float, Device::Cpu));
                let loss = (model.call(&x) - y).square().mean(Kind::Float);
                opt.backward_step(&loss).unwrap();
            }
        };
        // Uninterrupted: 6 steps in this process, unsharded.
        let rvs = nn::VarStore::new(Device::Cpu);
        let reference = mlp(&rvs, 8, 1);
        let mut ropt = adamw.build(&rvs, 0.01).unwrap();
        train(&reference, &mut ropt, 0..6);
        // 3 steps on ranks 0 and 1, tensor-parallel, saved with the optimizer.
        let pair = pg.new_group(&[0, 1], Backend::Gloo).unwrap();
        if let Some(pair) = &pair {
            let vs = nn::VarStore::new(Device::Cpu);
            let mut model = mlp(&vs, 8, 1);
            shard_module(&mut model, &plan(), 0, pair).unwrap();
            let mut opt = adamw.build(&vs, 0.01).unwrap();
            train(&model, &mut opt, 0..3);
            // Sharded state: this rank's half of fc1's 8 rows.
            assert_eq!(
                opt.state("fc1.weight")
                    .unwrap()
                    .get("exp_avg")
                    .unwrap()
                    .size(),
                [4, 6]
            );
            checkpoint::save(
                &ckpt,
                &State::new(&model).with_optimizer(&mut opt),
                pair,
                &SaveOptions::default(),
            )
            .unwrap();
            checkpoint::save(
                dir.join("model-only"),
                &State::new(&model),
                pair,
                &SaveOptions::default(),
            )
            .unwrap();
        }
        pg.barrier().unwrap();
        // PyTorch's names: each rank's shards of the state in its own file, the scalar
        // steps once, in rank 0's; the settings in the sidecar.
        let keys = |rank: usize| -> Vec<String> {
            let file = ckpt.join(checkpoint::file_name(rank));
            let mut k: Vec<String> = Tensor::read_safetensors(file)
                .unwrap()
                .into_iter()
                .map(|(k, _)| k)
                .filter(|k| k.starts_with("optim.state.fc1.weight."))
                .collect();
            k.sort();
            k
        };
        let state = |names: &[&str]| -> Vec<String> {
            names
                .iter()
                .map(|n| format!("optim.state.fc1.weight.{n}"))
                .collect()
        };
        assert_eq!(
            keys(0),
            state(&["exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step"])
        );
        assert_eq!(keys(1), state(&["exp_avg", "exp_avg_sq", "max_exp_avg_sq"]));
        let sidecar: serde_json::Value =
            serde_json::from_slice(&std::fs::read(ckpt.join("optimizer.json")).unwrap()).unwrap();
        assert_eq!(sidecar["optimizer"], "AdamW");
        assert_eq!(sidecar["param_groups"][0]["lr"], 0.01);
        assert_eq!(sidecar["param_groups"][0]["amsgrad"], true);

        // Loaded at 3 ranks (3 + 3 + 2 rows) from other values and another learning rate,
        // which the checkpoint's replaces; 3 more steps.
        let vs = nn::VarStore::new(Device::Cpu);
        let mut model = mlp(&vs, 8, 2 + pg.rank() as i64);
        shard_module(&mut model, &plan(), 0, &pg).unwrap();
        let before = model.fc1.ws.copy();
        // Refusals first: a model-only checkpoint, another optimizer class.
        let r = pg.rank();
        let mut sgd = Sgd::default().build(&vs, 0.1).unwrap();
        let err = checkpoint::load(
            dir.join("model-only"),
            &mut State::new(&model).with_optimizer(&mut sgd),
            &pg,
            &LoadOptions::default(),
        )
        .unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "rank {r}: checkpoint: {} has no optimizer state (its save's State held no \
                 optimizer)",
                dir.join("model-only").display()
            )
        );
        let err = checkpoint::load(
            &ckpt,
            &mut State::new(&model).with_optimizer(&mut sgd),
            &pg,
            &LoadOptions::default(),
        )
        .unwrap_err();
        assert_eq!(
            err.to_string(),
            format!("rank {r}: checkpoint: the optimizer state is AdamW's, the optimizer is SGD")
        );
        assert!(
            model.fc1.ws.equal(&before),
            "a refused load changed the model"
        );
        let mut opt = AdamW::default().build(&vs, 0.5).unwrap();
        checkpoint::load(
            &ckpt,
            &mut State::new(&model).with_optimizer(&mut opt),
            &pg,
            &LoadOptions::default(),
        )
        .unwrap();
        assert_eq!(opt.lr(), 0.01);
        assert_eq!(opt.algorithm(), &tch_dist::optim::Algorithm::AdamW(adamw));
        let rows = [3, 3, 2][r];
        assert_eq!(
            opt.state("fc1.weight")
                .unwrap()
                .get("exp_avg")
                .unwrap()
                .size(),
            [rows, 6]
        );
        train(&model, &mut opt, 3..6);
        let step = opt.state("fc2.bias").unwrap().get("step").unwrap();
        assert_eq!(step.double_value(&[]), 6.0);
        let diff = max_difference(&model, &rvs);
        assert!(
            diff <= 1e-6,
            "resumed at 3 ranks: {diff} from the uninterrupted run"
        );
    });
}

const COMMIT_CRASH: &str = "a_save_killed_at_each_commit_point_leaves_a_complete_checkpoint";

/// The commit points the test kills rank 0 at (`TCH_DIST_TEST_CHECKPOINT_CRASH`), each
/// for a save under a new name (`step-00000003`) and over an existing one
/// (`step-00000002`): (point, name, the checkpoint `latest` then finds, the seed of the
/// values it holds).
const COMMIT_CASES: [(&str, &str, &str, i64); 6] = [
    ("files-written", "step-00000003", "step-00000002", 2),
    ("manifest-written", "step-00000003", "step-00000002", 2),
    ("replaced", "step-00000003", "step-00000003", 3),
    ("files-written", "step-00000002", "step-00000002", 2),
    ("manifest-written", "step-00000002", "step-00000002", 2),
    ("replaced", "step-00000002", "step-00000002", 3),
];

fn commit_case_dir(case: usize) -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("commit_crash")
        .join(format!("case-{case}"))
}

/// What a worker of [`a_save_killed_at_each_commit_point_leaves_a_complete_checkpoint`]
/// does, by `COMMIT_CRASH_MODE`: `setup` saves `step-00000001` and `step-00000002` (seeds 1
/// and 2) into every case's folder; `crash` saves case `COMMIT_CRASH_CASE`'s name (seed 3)
/// with rank 0 killed at its point, and rank 1 checks its error; `verify` (one rank) checks
/// what `latest` and `load` make of each case's folder, then that a new save over the same
/// name cleans up.
fn commit_crash_worker(pg: ProcessGroup) {
    let mode = std::env::var("COMMIT_CRASH_MODE").unwrap();
    let model = |seed| mlp(&nn::VarStore::new(Device::Cpu), 8, seed);
    match mode.as_str() {
        "setup" => {
            for case in 0..COMMIT_CASES.len() {
                let dir = commit_case_dir(case);
                for (name, seed) in [("step-00000001", 1), ("step-00000002", 2)] {
                    checkpoint::save(
                        dir.join(name),
                        &State::new(&model(seed)),
                        &pg,
                        &SaveOptions::default(),
                    )
                    .unwrap();
                }
            }
        }
        "crash" => {
            let case: usize = std::env::var("COMMIT_CRASH_CASE").unwrap().parse().unwrap();
            let ckpt = commit_case_dir(case).join(COMMIT_CASES[case].1);
            let result =
                checkpoint::save(&ckpt, &State::new(&model(3)), &pg, &SaveOptions::default());
            assert_eq!(pg.rank(), 1, "rank 0 was not killed: {result:?}");
            // Rank 1 waited for rank 0 to commit: its error names the checkpoint.
            let err = result.unwrap_err();
            assert_eq!(
                err.to_string(),
                format!(
                    "rank 1: checkpoint.save of {}: committing failed",
                    ckpt.display()
                )
            );
            let Some(CheckpointProblem::Save { source, .. }) = err.problem() else {
                panic!("{err:?}");
            };
            assert!(source.to_string().contains("rank 0"), "{source}");
            let cause = std::error::Error::source(&err).expect("the collective's error");
            assert_eq!(cause.to_string(), source.to_string());
            // The group is unusable with rank 0 gone: end here.
            println!(
                "tch-dist-test: rank body finished: {COMMIT_CRASH} {}",
                pg.rank()
            );
            std::process::exit(0);
        }
        "verify" => {
            for (case, &(point, name, latest, seed)) in COMMIT_CASES.iter().enumerate() {
                let dir = commit_case_dir(case);
                let what = format!("killed at {point} saving {name}");
                let found = checkpoint::latest(&dir).unwrap_or_else(|| panic!("{what}: none"));
                assert_eq!(found, dir.join(latest), "{what}");
                let loaded = model(9);
                checkpoint::load(
                    &found,
                    &mut State::new(&loaded),
                    &pg,
                    &LoadOptions::default(),
                )
                .unwrap();
                let expected = model(seed);
                assert!(
                    loaded.fc1.ws.equal(&expected.fc1.ws),
                    "{what}: other values"
                );
                // A name that held a checkpoint always holds a complete one.
                if name == latest {
                    checkpoint::load(
                        dir.join(name),
                        &mut State::new(&loaded),
                        &pg,
                        &LoadOptions::default(),
                    )
                    .unwrap();
                }
                // Saving the same name again works and leaves no temporary folder.
                checkpoint::save(
                    dir.join(name),
                    &State::new(&model(4)),
                    &pg,
                    &SaveOptions::default(),
                )
                .unwrap();
                checkpoint::load(
                    dir.join(name),
                    &mut State::new(&loaded),
                    &pg,
                    &LoadOptions::default(),
                )
                .unwrap();
                assert!(loaded.fc1.ws.equal(&model(4).fc1.ws), "{what}: re-saved");
                let mut left: Vec<String> = std::fs::read_dir(&dir)
                    .unwrap()
                    .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                    .filter(|n| n.ends_with(".partial") || n.ends_with(".old"))
                    .collect();
                left.sort();
                assert!(left.is_empty(), "{what}: {left:?} left");
            }
        }
        other => panic!("COMMIT_CRASH_MODE={other}"),
    }
}

/// Rank 0 killed at each point of a save's commit (after the files, after the manifest,
/// after the rename), saving under a new name and over an existing one: the name never
/// lacks a complete checkpoint, `latest` never names a `.partial` folder, and each loads
/// the values of the last save that committed. Rank 1's error names the checkpoint and
/// the step of the save.
#[test]
fn a_save_killed_at_each_commit_point_leaves_a_complete_checkpoint() {
    use tch_dist::testing::{describe, Launch};
    if worker().is_some() {
        return tch_dist::testing::run_ranks(COMMIT_CRASH, 2, commit_crash_worker);
    }
    let _ = std::fs::remove_dir_all(commit_case_dir(0).parent().unwrap());
    let check = |launch: Launch, rank_0_killed: bool| {
        let out = launch.run();
        let killed = out[0].status.is_some_and(|s| !s.success());
        assert!(
            killed == rank_0_killed && out[1..].iter().all(|o| o.success()),
            "{}",
            describe(&out)
        );
    };
    let mode =
        |mode: &str, world: usize| Launch::new(COMMIT_CRASH, world).env("COMMIT_CRASH_MODE", mode);
    check(mode("setup", 2), false);
    for (case, (point, ..)) in COMMIT_CASES.iter().enumerate() {
        check(
            mode("crash", 2)
                .env("COMMIT_CRASH_CASE", case.to_string())
                .rank_env(0, "TCH_DIST_TEST_CHECKPOINT_CRASH", *point)
                .env("TCH_DIST_TIMEOUT_SECS", "20"),
            true,
        );
    }
    check(mode("verify", 1), false);
}

const LOAD_PEER_DIES: &str = "a_peer_dying_during_a_load_names_the_checkpoint";

/// Rank 0 of two dies after the save, while rank 1 loads: rank 1's error names the
/// checkpoint it was loading, with the collective's error (the dead peer) as its source, as
/// a save's error does ([`a_save_killed_at_each_commit_point_leaves_a_complete_checkpoint`]).
#[test]
fn a_peer_dying_during_a_load_names_the_checkpoint() {
    use tch_dist::testing::{describe, Launch};
    if worker().is_some() {
        return tch_dist::testing::run_ranks(LOAD_PEER_DIES, 2, |pg| {
            let ckpt = scratch("load_peer_dies", &pg).join("step-00000001");
            let model = mlp(&nn::VarStore::new(Device::Cpu), 8, 1);
            checkpoint::save(&ckpt, &State::new(&model), &pg, &SaveOptions::default()).unwrap();
            pg.barrier().unwrap();
            if pg.rank() == 0 {
                // No destructor, no goodbye: a rank that dies.
                std::process::abort();
            }
            let err =
                checkpoint::load(&ckpt, &mut State::new(&model), &pg, &LoadOptions::default())
                    .unwrap_err();
            assert_eq!(
                err.to_string(),
                format!("rank 1: checkpoint.load of {} failed", ckpt.display())
            );
            let Some(CheckpointProblem::Load { source, .. }) = err.problem() else {
                panic!("{err:?}");
            };
            assert!(source.to_string().contains("rank 0"), "{source}");
            let cause = std::error::Error::source(&err).expect("the collective's error");
            assert_eq!(cause.to_string(), source.to_string());
            // The group is unusable with rank 0 gone: end here.
            println!(
                "tch-dist-test: rank body finished: {LOAD_PEER_DIES} {}",
                pg.rank()
            );
            std::process::exit(0);
        });
    }
    let out = Launch::new(LOAD_PEER_DIES, 2)
        .env("TCH_DIST_TIMEOUT_SECS", "20")
        .run();
    let killed = out[0].status.is_some_and(|s| !s.success());
    assert!(killed && out[1].success(), "{}", describe(&out));
}

const FULL_DISK: &str = "a_save_that_fails_on_a_full_disk_removes_what_it_wrote";

/// Rank 0's disk fills while it writes its file (the only one: the model is whole on every
/// rank; the test-only switch `TCH_DIST_TEST_CHECKPOINT_FULL`: half its file written, then
/// `ENOSPC`), in a save and in an async save: rank 0's error is the full disk, rank 1's that
/// rank 0 failed, and
/// `DIR.partial` with the files written into it is gone (issue 41, section 5: it stayed, so
/// the disk stayed full, while rank 0's message said that nothing was changed); the previous
/// checkpoint is still `latest`, and the next save trains on.
#[test]
fn a_save_that_fails_on_a_full_disk_removes_what_it_wrote() {
    use tch_dist::testing::{describe, Launch};
    if worker().is_some() {
        return run_ranks(FULL_DISK, 2, |pg| {
            let rank = pg.rank();
            let dir = scratch("full_disk", &pg);
            let model = mlp(&nn::VarStore::new(Device::Cpu), 8, 1);
            checkpoint::save(
                dir.join("step-00000001"),
                &State::new(&model),
                &pg,
                &SaveOptions::default(),
            )
            .unwrap();
            let full = dir.join("step-00000002");
            let partial = dir.join("step-00000002.partial");
            let check = |result: Result<(), CheckpointError>| {
                let err = result.unwrap_err();
                if rank == 0 {
                    let Some(CheckpointProblem::Io { op, source, .. }) = err.problem() else {
                        panic!("{err:?}");
                    };
                    assert_eq!(
                        (*op, source.raw_os_error()),
                        ("writing", Some(libc::ENOSPC))
                    );
                } else {
                    assert_eq!(
                        tch_dist::report(&err),
                        format!(
                            "rank 1: checkpoint.save of {}: writing the files failed: rank 1: \
                             checkpoint.save: rank 0 failed its own check (see its error); \
                             nothing was changed",
                            full.display()
                        )
                    );
                }
                pg.barrier().unwrap();
                assert!(!partial.exists(), "rank {rank}: {} left", partial.display());
                assert!(!full.exists());
                assert_eq!(checkpoint::latest(&dir), Some(dir.join("step-00000001")));
            };
            check(checkpoint::save(
                &full,
                &State::new(&model),
                &pg,
                &SaveOptions::default(),
            ));
            check(
                checkpoint::async_save(&full, &State::new(&model), &pg, &SaveOptions::default())
                    .and_then(|s| s.wait()),
            );
            // Another name saves as ever.
            checkpoint::save(
                dir.join("step-00000003"),
                &State::new(&model),
                &pg,
                &SaveOptions::default(),
            )
            .unwrap();
        });
    }
    let out = Launch::new(FULL_DISK, 2)
        .rank_env(0, "TCH_DIST_TEST_CHECKPOINT_FULL", "step-00000002")
        .run();
    assert!(out.iter().all(|o| o.success()), "{}", describe(&out));
}

const COMMITTED: &str = "a_peer_dying_after_the_commit_is_reported_as_committed";

/// Rank 1 dies once its file is written, while rank 0 commits (the test-only crash point
/// `awaiting-commit`): rank 0's error says that the checkpoint was committed, with the dead
/// peer as its cause, and the checkpoint verifies and is `latest` (issue 41, section 5: an
/// async save reported a plain failure for a committed checkpoint). Both for a save and an
/// async save (`COMMITTED_MODE`).
#[test]
fn a_peer_dying_after_the_commit_is_reported_as_committed() {
    use tch_dist::testing::{describe, Launch};
    if worker().is_some() {
        return run_ranks(COMMITTED, 2, |pg| {
            let mode = std::env::var("COMMITTED_MODE").unwrap();
            let dir = scratch(&format!("committed_{mode}"), &pg);
            let ckpt = dir.join("step-00000001");
            let model = mlp(&nn::VarStore::new(Device::Cpu), 8, 1);
            let result = match mode.as_str() {
                "save" => {
                    checkpoint::save(&ckpt, &State::new(&model), &pg, &SaveOptions::default())
                }
                _ => {
                    checkpoint::async_save(&ckpt, &State::new(&model), &pg, &SaveOptions::default())
                        .and_then(|s| s.wait())
                }
            };
            assert_eq!(pg.rank(), 0, "rank 1 was not killed: {result:?}");
            let err = result.unwrap_err();
            assert_eq!(
                err.to_string(),
                format!(
                    "rank 0: checkpoint.save of {}: the checkpoint was committed, but what \
                     followed failed",
                    ckpt.display()
                )
            );
            let Some(CheckpointProblem::Committed { source, .. }) = err.problem() else {
                panic!("{err:?}");
            };
            assert!(
                matches!(
                    source.problem(),
                    Some(CheckpointProblem::Save {
                        step: "committing",
                        ..
                    })
                ),
                "{source:?}"
            );
            checkpoint::verify(&ckpt).unwrap();
            assert_eq!(checkpoint::latest(&dir), Some(ckpt.clone()));
            // The group is unusable with rank 1 gone: end here.
            println!("tch-dist-test: rank body finished: {COMMITTED} 0");
            std::process::exit(0);
        });
    }
    for mode in ["save", "async"] {
        let out = Launch::new(COMMITTED, 2)
            .env("COMMITTED_MODE", mode)
            .env("TCH_DIST_TIMEOUT_SECS", "20")
            .rank_env(1, "TCH_DIST_TEST_CHECKPOINT_CRASH", "awaiting-commit")
            .run();
        let killed = out[1].status.is_some_and(|s| !s.success());
        assert!(out[0].success() && killed, "{mode}: {}", describe(&out));
    }
}
