//! Running a command with a hard wall-clock limit: the launcher's tests here and the
//! runtime's (`runtime/tests/launcher.rs` includes this file).

use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// Runs `cmd` with a hard wall-clock limit (killing it at the deadline).
pub fn run_bounded(mut cmd: Command, limit: Duration) -> (Output, Duration) {
    let start = Instant::now();
    let child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    wait_bounded(child, start, limit)
}

/// Waits for `child` until `limit` after `start` (killing it then); returns its output and
/// the time from `start`.
pub fn wait_bounded(mut child: Child, start: Instant, limit: Duration) -> (Output, Duration) {
    loop {
        if child.try_wait().expect("try_wait").is_some() {
            break;
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().expect("output");
    (out, start.elapsed())
}
