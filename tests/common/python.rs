//! Running the `.venv`'s Python (PyTorch's side of the interop tests) from a test rank:
//! the interpreter's folder, a command without the rank's launch variables, and a run
//! bounded in time, and a job of Python ranks. Included with `#[path]` by several tests.

#![allow(dead_code)] // each includer uses part of it

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The `.venv`'s `bin` folder.
pub fn python() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(".venv/bin")
}

/// A command without this rank's launch variables (PyTorch's processes get their own).
pub fn clean(program: PathBuf) -> Command {
    let mut cmd = Command::new(program);
    for v in [
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_RUN_ID",
    ] {
        cmd.env_remove(v);
    }
    cmd
}

/// Runs `cmd` to its end with its output, killing it (its whole process group: torchrun
/// and its ranks) after 180 s. The output is read while it runs, so a chatty process
/// never blocks on a full pipe.
pub fn bounded(mut cmd: Command) -> std::process::Output {
    use std::process::Stdio;
    let child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .spawn()
        .unwrap();
    let group = child.id() as i32;
    let (done, finished) = std::sync::mpsc::channel::<()>();
    let watchdog = std::thread::spawn(move || {
        if finished
            .recv_timeout(std::time::Duration::from_secs(180))
            .is_err()
        {
            // SAFETY: kill(2) on the child's own process group (not yet reaped: the
            // wait below has not returned).
            unsafe { libc::kill(-group, libc::SIGKILL) };
        }
    });
    let out = child.wait_with_output().unwrap();
    let _ = done.send(());
    watchdog.join().unwrap();
    out
}

/// The `.venv`'s Python running `script ARGS` as `ranks` processes of one job, each started
/// with torchrun's variables but without torchrun, whose own interpreter would be one more
/// start of torch (seconds of CPU each). Each rank is bounded as [`bounded`] bounds one
/// command; the outputs are concatenated in rank order and the status is the first failed
/// rank's (or rank 0's).
pub fn python_ranks<S: AsRef<std::ffi::OsStr>>(
    script: &Path,
    args: &[S],
    ranks: usize,
) -> std::process::Output {
    let port = tch_dist::testing::free_port().to_string();
    let children: Vec<_> = (0..ranks)
        .map(|rank| {
            let mut cmd = clean(python().join("python"));
            cmd.arg(script)
                .args(args)
                .env("RANK", rank.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .env("WORLD_SIZE", ranks.to_string())
                .env("LOCAL_WORLD_SIZE", ranks.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", &port)
                .env("OMP_NUM_THREADS", "1");
            std::thread::spawn(move || bounded(cmd))
        })
        .collect();
    let outputs: Vec<std::process::Output> =
        children.into_iter().map(|c| c.join().unwrap()).collect();
    let status = outputs
        .iter()
        .map(|o| o.status)
        .find(|s| !s.success())
        .unwrap_or(outputs[0].status);
    std::process::Output {
        status,
        stdout: outputs.iter().flat_map(|o| o.stdout.clone()).collect(),
        stderr: outputs.iter().flat_map(|o| o.stderr.clone()).collect(),
    }
}

/// Asserts that the Python ranks' standard output holds each of `verdicts`: each rank's own
/// verdict decides, not its interpreter's exit status (a rank that checked everything and
/// printed its verdict passed, whatever its interpreter did after). `what` names the job in
/// the failure, which shows both outputs.
pub fn assert_verdicts<V: AsRef<str>>(
    out: &std::process::Output,
    verdicts: impl IntoIterator<Item = V>,
    what: &str,
) {
    let stdout = String::from_utf8_lossy(&out.stdout);
    for verdict in verdicts {
        let verdict = verdict.as_ref();
        assert!(
            stdout.contains(verdict),
            "{what}: no `{verdict}` ({}):\n{stdout}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
