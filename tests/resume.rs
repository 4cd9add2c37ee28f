//! Resume that loses no step: `examples/train_ddp` on 2 ranks (its test build,
//! tests/resume/train_ddp_crash.rs), one of which SIGKILLs itself after a step the test
//! picks (its first start only), restarted by `tch-dist-run --max-restarts 1` and by the `.venv`'s `torchrun --no-python --max-restarts 1`, ends with
//! parameters within 1e-6 of an uninterrupted run of the same length: it continued from its
//! last checkpoint at the same step, in the same data order, with the same momentum. And
//! PyTorch loads one of its checkpoints, optimizer state included.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

#[path = "common/build.rs"]
mod build;

use tch::Tensor;

/// 30 steps cross an epoch's end (23 steps per epoch at 2 ranks, global batch 64).
const STEPS: u64 = 30;
const EVERY: u64 = 5;

/// (train_ddp_crash, tch-dist-run), built once in this test binary's profile.
fn binaries() -> (PathBuf, &'static Path) {
    (build::example("train_ddp_crash"), build::launcher())
}

fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Runs a launcher command to its end (bounded), returning its combined output.
fn run(mut cmd: Command, what: &str) -> String {
    use std::os::unix::process::CommandExt;
    for v in [
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
    ] {
        cmd.env_remove(v);
    }
    for v in [
        "TORCHELASTIC_RUN_ID",
        "TORCHELASTIC_RESTART_COUNT",
        "TCH_DIST_DEBUG",
    ] {
        cmd.env_remove(v);
    }
    cmd.env("OMP_NUM_THREADS", "1")
        .env("TCH_DIST_TIMEOUT_SECS", "30")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0);
    let mut child = cmd.spawn().unwrap();
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > Duration::from_secs(240) {
            // SAFETY: kill(2) on the child's own process group (the launcher and its ranks).
            unsafe { libc::kill(-(child.id() as i32), libc::SIGKILL) };
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    let text = format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "{what} failed ({:?}):\n{text}",
        out.status
    );
    text
}

/// train_ddp's arguments for a run in `dir`.
fn train_args(dir: &Path) -> Vec<String> {
    let s = |p: PathBuf| p.to_string_lossy().into_owned();
    vec![
        "--epochs".into(),
        "2".into(),
        "--max-steps".into(),
        STEPS.to_string(),
        "--checkpoint-dir".into(),
        s(dir.join("ckpt")),
        "--checkpoint-every".into(),
        EVERY.to_string(),
        "--checkpoint".into(),
        s(dir.join("final.safetensors")),
    ]
}

fn tch_dist_run(dir: &Path, kill_at: Option<u64>) -> String {
    let (train, launcher) = binaries();
    let mut cmd = Command::new(launcher);
    cmd.args(["--nproc-per-node", "2", "--max-restarts", "1", "--"])
        .arg(train)
        .args(train_args(dir));
    if let Some(k) = kill_at {
        cmd.env("TCH_DIST_TEST_KILL_AT_STEP", k.to_string());
    }
    run(cmd, "tch-dist-run")
}

/// The uninterrupted run's final parameters (run once per test binary).
fn reference() -> Vec<(String, Tensor)> {
    static REFERENCE: OnceLock<PathBuf> = OnceLock::new();
    let path = REFERENCE.get_or_init(|| {
        let dir = scratch("resume_reference");
        let out = tch_dist_run(&dir, None);
        assert!(!out.contains("resumed from"), "{out}");
        assert!(out.contains(&format!("trained to step {STEPS}")), "{out}");
        dir.join("final.safetensors")
    });
    Tensor::read_safetensors(path).unwrap()
}

/// One job at a time: both launchers pick free ports at start, and two jobs starting at
/// once on this machine have been seen to meet the other's ranks (a Gloo connect timeout).
fn one_job_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// A step in 6..=29 that changes from run to run (any step should do).
fn kill_step() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos() as u64;
    6 + nanos % (STEPS - 6)
}

/// The killed run resumed from the checkpoint before the kill and ended at the reference.
fn check_resumed(dir: &Path, out: &str, kill_at: u64) {
    // The kill comes after step `kill_at` and before its checkpoint: the last complete one
    // is of an earlier step.
    let last = (kill_at - 1) / EVERY * EVERY;
    let expected = format!(
        "resumed from {} at step {last}",
        dir.join("ckpt").join(format!("step-{last:08}")).display()
    );
    assert!(
        out.contains(&expected),
        "killed at {kill_at}: no `{expected}` in\n{out}"
    );
    assert!(out.contains(&format!("trained to step {STEPS}")), "{out}");
    let ours: std::collections::BTreeMap<String, Tensor> =
        Tensor::read_safetensors(dir.join("final.safetensors"))
            .unwrap()
            .into_iter()
            .collect();
    let reference = reference();
    assert_eq!(ours.len(), reference.len());
    for (fqn, t) in &reference {
        let diff = (&ours[fqn] - t).abs().max().double_value(&[]);
        assert!(
            diff <= 1e-6,
            "killed at step {kill_at}: `{fqn}` is {diff} from the uninterrupted run"
        );
    }
    // Only the last 3 checkpoints are kept.
    let mut left: Vec<String> = std::fs::read_dir(dir.join("ckpt"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    left.sort();
    assert_eq!(left, ["step-00000020", "step-00000025", "step-00000030"]);
}

#[test]
fn killed_under_tch_dist_run_resumes_to_the_same_parameters() {
    let _serial = one_job_at_a_time();
    let kill_at = kill_step();
    let _ = reference();
    let dir = scratch("resume_tch_dist_run");
    let out = tch_dist_run(&dir, Some(kill_at));
    check_resumed(&dir, &out, kill_at);
    // PyTorch loads the last checkpoint with its optimizer state.
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut cmd = Command::new(root.join(".venv/bin/python"));
    cmd.arg(root.join("tests/resume/pytorch_load.py"))
        .arg(dir.join("ckpt/step-00000030"));
    let out = run(cmd, "PyTorch's load");
    assert!(out.contains("ok"), "{out}");
}

#[test]
fn killed_under_torchrun_resumes_to_the_same_parameters() {
    let _serial = one_job_at_a_time();
    let kill_at = kill_step();
    let _ = reference();
    let dir = scratch("resume_torchrun");
    let (train, _) = binaries();
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut cmd = Command::new(root.join(".venv/bin/torchrun"));
    cmd.args([
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "--no-python",
    ])
    .arg(train)
    .args(train_args(&dir))
    .env("TCH_DIST_TEST_KILL_AT_STEP", kill_at.to_string());
    let out = run(cmd, "torchrun");
    check_resumed(&dir, &out, kill_at);
}

/// Copies the folder `from` to `to` (files and folders only).
fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_tree(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}

/// A byte changed in the newest checkpoint (step 30 of the uninterrupted run): `--resume`
/// skips it, says why, resumes from step 25, and ends at the uninterrupted run's
/// parameters, saving step 30 again over the damaged one.
#[test]
fn a_damaged_newest_checkpoint_falls_back_to_the_one_before() {
    let _serial = one_job_at_a_time();
    let _ = reference();
    let dir = scratch("resume_damaged");
    copy_tree(
        &Path::new(env!("CARGO_TARGET_TMPDIR")).join("resume_reference/ckpt"),
        &dir.join("ckpt"),
    );
    let newest = dir.join("ckpt/step-00000030");
    let file = newest.join("shard-00001-model-00001-of-00001.safetensors");
    let mut bytes = std::fs::read(&file).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 1;
    std::fs::write(&file, bytes).unwrap();
    let (train, launcher) = binaries();
    let mut cmd = Command::new(launcher);
    cmd.args(["--nproc-per-node", "2", "--"])
        .arg(train)
        .args(train_args(&dir))
        .arg("--resume");
    let out = run(cmd, "tch-dist-run --resume");
    let skipped = format!(
        "skipped {}: rank 0: checkpoint: {} is corrupted: its SHA-256 differs from the \
         manifest's; rank 1: checkpoint: {} is corrupted: its SHA-256 differs from the \
         manifest's",
        newest.display(),
        file.display(),
        file.display()
    );
    assert!(out.contains(&skipped), "no `{skipped}` in\n{out}");
    let resumed = format!(
        "resumed from {} at step 25",
        dir.join("ckpt/step-00000025").display()
    );
    assert!(out.contains(&resumed), "no `{resumed}` in\n{out}");
    // From step 25 it ends where the uninterrupted run does (as after a kill after step 29).
    check_resumed(&dir, &out, 29);
}
