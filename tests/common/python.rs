//! Running the `.venv`'s Python (PyTorch's side of the interop tests) from a test rank:
//! the interpreter's folder, a command without the rank's launch variables, and a run
//! bounded in time. Included with `#[path]` by `checkpoint.rs` and `pipelining/main.rs`.

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

/// Runs `cmd` to its end, killing it after 180 s.
pub fn bounded(mut cmd: Command) -> std::process::Output {
    use std::process::Stdio;
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .spawn()
        .unwrap();
    let start = std::time::Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > std::time::Duration::from_secs(180) {
            // The whole group: torchrun and its ranks.
            // SAFETY: kill(2) on the child's own process group.
            unsafe { libc::kill(-(child.id() as i32), libc::SIGKILL) };
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    child.wait_with_output().unwrap()
}
