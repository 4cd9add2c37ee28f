//! Start-up through `tch-dist-run` and through torchrun, and failures: a rank killed with
//! SIGKILL mid-collective, nobody listening at MASTER_ADDR:MASTER_PORT, a port already taken.
//! The launcher's hold on its ranks' whole process trees: SIGTERM to it, ranks that leave
//! background processes behind, a rank failing while another's grandchild runs.
//!
//! The ranks are this test binary itself, re-executed with `TCH_DIST_TEST_WORKER` set, or
//! `sh -c` scripts whose processes carry a marker variable that /proc shows.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use tch::Tensor;
use tch_dist_runtime::testing::{free_port, worker, Launch, WORKER_ENV};
use tch_dist_runtime::{Backend, DistError, InitOptions, ProcessGroup, ReduceOp};

fn launcher() -> &'static str {
    env!("CARGO_BIN_EXE_tch-dist-run")
}

/// Runs `cmd` with a hard wall-clock limit (killing it at the deadline).
fn run_bounded(mut cmd: Command, limit: Duration) -> (Output, Duration) {
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
fn wait_bounded(mut child: Child, start: Instant, limit: Duration) -> (Output, Duration) {
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

/// The body every started rank runs: all-reduce rank+1 and print the sum and its pid.
fn allreduce_rank() {
    let pg = ProcessGroup::from_env(Backend::Gloo).unwrap();
    let t = Tensor::from_slice(&[pg.rank() as f32 + 1.0]);
    pg.all_reduce(&t, ReduceOp::Sum).unwrap();
    println!(
        "rank={} world={} sum={}",
        pg.rank(),
        pg.world_size(),
        t.double_value(&[0])
    );
}

#[test]
fn launcher_starts_ranks_with_prefixed_output() {
    if worker().as_deref() == Some("launcher_starts_ranks_with_prefixed_output") {
        return allreduce_rank();
    }
    let mut cmd = Command::new(launcher());
    cmd.env(WORKER_ENV, "launcher_starts_ranks_with_prefixed_output")
        .args([
            "--nproc-per-node",
            "3",
            "--master-port",
            &free_port().to_string(),
            "--",
        ])
        .arg(std::env::current_exe().unwrap())
        .args([
            "launcher_starts_ranks_with_prefixed_output",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ]);
    let (out, _) = run_bounded(cmd, Duration::from_secs(90));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for r in 0..3 {
        let line = stdout
            .lines()
            .find(|l| l.contains(&format!("rank={r} world=3 sum=6")));
        assert!(
            line.is_some_and(|l| l.starts_with(&format!("[rank{r}]: "))),
            "{stdout}"
        );
    }
}

/// Each launch has a run id of its own, the same for all its ranks; the launcher's own
/// TORCHELASTIC_RUN_ID (torchrun's, a job script's) is passed on.
#[test]
fn launcher_gives_its_ranks_a_run_id() {
    let ids = |outer: Option<&str>| -> Vec<String> {
        let mut cmd = Command::new(launcher());
        cmd.env_remove("TORCHELASTIC_RUN_ID")
            .args(["--nproc-per-node", "2", "--"])
            .args(["sh", "-c", "echo id=$TORCHELASTIC_RUN_ID"]);
        if let Some(id) = outer {
            cmd.env("TORCHELASTIC_RUN_ID", id);
        }
        let (out, _) = run_bounded(cmd, Duration::from_secs(30));
        assert!(out.status.success());
        let stdout = String::from_utf8_lossy(&out.stdout);
        let mut ids: Vec<String> = stdout
            .lines()
            .filter_map(|l| l.split_once("id=").map(|(_, id)| id.to_string()))
            .collect();
        ids.dedup();
        assert_eq!(ids.len(), 1, "one run id for every rank: {stdout}");
        ids
    };
    let first = ids(None);
    let second = ids(None);
    assert!(first[0].starts_with("tch-dist-run-"), "{first:?}");
    assert_ne!(first, second);
    assert_eq!(ids(Some("job-42")), ["job-42"]);
}

#[test]
fn launcher_rejects_bad_arguments() {
    let out = Command::new(launcher())
        .args(["--nproc-per-node", "zero", "--", "true"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr)
        .contains("--nproc-per-node \"zero\" is not a positive integer"));
    let out = Command::new(launcher())
        .args(["--nproc-per-node", "2"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no command given"));
}

fn torchrun() -> Option<PathBuf> {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../.venv/bin/torchrun");
    p.exists().then_some(p)
}

#[test]
fn torchrun_starts_the_same_ranks() {
    if worker().as_deref() == Some("torchrun_starts_the_same_ranks") {
        return allreduce_rank();
    }
    let torchrun = torchrun().expect("torchrun in .venv (run `make setup`)");
    let mut cmd = Command::new(torchrun);
    cmd.env(WORKER_ENV, "torchrun_starts_the_same_ranks")
        .env("OMP_NUM_THREADS", "1")
        .args(["--standalone", "--nproc-per-node", "2", "--no-python"])
        .arg(std::env::current_exe().unwrap())
        .args([
            "torchrun_starts_the_same_ranks",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ]);
    let (out, _) = run_bounded(cmd, Duration::from_secs(120));
    let all = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{all}");
    assert!(
        all.contains("rank=0 world=2 sum=3") && all.contains("rank=1 world=2 sum=3"),
        "{all}"
    );
    // Under torchrun's agent store every rank is a client: none tries to host the store.
    assert!(!all.contains("has failed to bind"), "{all}");
}

/// Rank 1 kills itself with SIGKILL while rank 0 waits in an all_reduce.
fn killed_rank_body(report_pid_to: Option<&str>) {
    let pg = ProcessGroup::from_env(Backend::Gloo).unwrap();
    if let Some(dir) = report_pid_to {
        std::fs::write(
            Path::new(dir).join(format!("pid{}", pg.rank())),
            std::process::id().to_string(),
        )
        .unwrap();
    }
    let t = Tensor::from_slice(&[1.0f32]);
    pg.all_reduce(&t, ReduceOp::Sum).unwrap();
    if pg.rank() == 1 {
        // SAFETY: killing this very process; nothing runs after.
        unsafe { libc::kill(std::process::id() as i32, libc::SIGKILL) };
    }
    let start = Instant::now();
    let err = pg.all_reduce(&t, ReduceOp::Sum).unwrap_err();
    let msg = err.to_string();
    assert!(
        matches!(&err, DistError::PeerGone { rank, op: "all_reduce", peer: Some(1), .. } if *rank == pg.rank()),
        "{msg}"
    );
    assert!(start.elapsed() < Duration::from_secs(25), "{msg}");
    println!("rank {} saw: {msg}", pg.rank());
}

#[test]
fn killed_rank_makes_the_others_fail() {
    if worker().as_deref() == Some("killed_rank_makes_the_others_fail") {
        return killed_rank_body(None);
    }
    let out = Launch::new("killed_rank_makes_the_others_fail", 2)
        .env("TCH_DIST_TIMEOUT_SECS", "20")
        .run();
    let desc = tch_dist_runtime::testing::describe(&out);
    assert!(
        out[0].success(),
        "rank 0 must see an error value, not hang or crash:\n{desc}"
    );
    assert!(
        out[0]
            .stdout
            .contains("rank 0 saw: rank 0: all_reduce failed:"),
        "{desc}"
    );
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(
        out[1].status.and_then(|s| s.signal()),
        Some(libc::SIGKILL),
        "{desc}"
    );
}

#[test]
fn launcher_stops_everyone_when_a_rank_is_killed() {
    if worker().as_deref() == Some("launcher_stops_everyone_when_a_rank_is_killed") {
        // Rank 0 must not finish on its own: it waits in a collective until the launcher
        // stops it (its error path also ends it, with status 0 here, which is fine).
        return killed_rank_body(std::env::var("PID_DIR").ok().as_deref());
    }
    let dir = std::env::temp_dir().join(format!("tch-dist-pids-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut cmd = Command::new(launcher());
    cmd.env(WORKER_ENV, "launcher_stops_everyone_when_a_rank_is_killed")
        .env("PID_DIR", &dir)
        .env("TCH_DIST_TIMEOUT_SECS", "600")
        .args(["--nproc-per-node", "3", "--"])
        .arg(std::env::current_exe().unwrap())
        .args([
            "launcher_stops_everyone_when_a_rank_is_killed",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ]);
    let (out, elapsed) = run_bounded(cmd, Duration::from_secs(90));
    let stderr = String::from_utf8_lossy(&out.stderr);
    // Rank 1's SIGKILL (137) or another rank's failure, whichever the launcher saw first.
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("failed") && stderr.contains("stopping the other ranks"),
        "{stderr}"
    );
    assert!(elapsed < Duration::from_secs(60), "{elapsed:?}");
    // No rank is left behind.
    std::thread::sleep(Duration::from_millis(200));
    for r in 0..3 {
        let pid = std::fs::read_to_string(dir.join(format!("pid{r}"))).unwrap();
        assert!(
            !Path::new(&format!("/proc/{pid}")).exists() || is_zombie(&pid),
            "rank {r} (pid {pid}) still runs"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

fn is_zombie(pid: &str) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| s.contains(") Z "))
        .unwrap_or(true)
}

#[test]
fn nobody_listening_is_a_timely_error() {
    let port = free_port();
    let opts = InitOptions::new(Backend::Gloo, 1, 2, "127.0.0.1", port)
        .with_timeout(Duration::from_secs(3));
    let start = Instant::now();
    let err = ProcessGroup::new(&opts).unwrap_err();
    let elapsed = start.elapsed();
    // Within the timeout plus a second (c10d's own connect loop took two timeouts and more).
    assert!(elapsed < Duration::from_secs(4), "{elapsed:?}");
    let msg = err.to_string();
    assert!(
        msg.starts_with(&format!("rank 1: rendezvous with 127.0.0.1:{port} failed:")),
        "{msg}"
    );
    assert!(
        !msg.contains("frame #"),
        "no C++ backtrace in the message: {msg}"
    );
    println!("{msg}");
}

#[test]
fn port_already_taken_is_an_error() {
    let listener = std::net::TcpListener::bind("0.0.0.0:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let opts = InitOptions::new(Backend::Gloo, 0, 2, "127.0.0.1", port)
        .with_timeout(Duration::from_secs(3));
    let start = Instant::now();
    let err = ProcessGroup::new(&opts).unwrap_err();
    assert!(start.elapsed() < Duration::from_secs(15));
    let msg = err.to_string();
    assert!(
        msg.starts_with(&format!("rank 0: rendezvous with 127.0.0.1:{port} failed:")),
        "{msg}"
    );
    assert!(
        msg.contains("EADDRINUSE") || msg.to_lowercase().contains("address already in use"),
        "{msg}"
    );
    drop(listener);
}

#[test]
fn bad_launch_variables_are_errors() {
    if let Some(w) = worker() {
        if w == "bad_launch_variables_are_errors" {
            let err = ProcessGroup::from_env(Backend::Gloo).unwrap_err();
            println!("error: {err}");
        }
        return;
    }
    let out = Launch::new("bad_launch_variables_are_errors", 2)
        .rank_env(0, "RANK", "2")
        .rank_env(1, "WORLD_SIZE", "two")
        .timeout(Duration::from_secs(60))
        .run();
    let desc = tch_dist_runtime::testing::describe(&out);
    assert!(
        out[0]
            .stdout
            .contains("error: invalid launch environment: RANK=2 is out of range for WORLD_SIZE=2"),
        "{desc}"
    );
    assert!(
        out[1].stdout.contains(
            "error: invalid launch environment: WORLD_SIZE=\"two\" is not a non-negative integer"
        ),
        "{desc}"
    );
    let opts = InitOptions::new(Backend::Gloo, 2, 2, "127.0.0.1", free_port());
    assert!(matches!(ProcessGroup::new(&opts), Err(DistError::Env(_))));
}

/// A CUDA tensor handed to a Gloo-only group is an error value. This needs a GPU: on a
/// CPU-only machine only the world-size-1 part runs (the GPU check runs it on CUDA).
#[test]
fn cuda_tensor_on_gloo_only_group_is_an_error() {
    let opts = InitOptions::new(Backend::Gloo, 0, 1, "127.0.0.1", free_port())
        .with_timeout(Duration::from_secs(20));
    let pg = ProcessGroup::new(&opts).unwrap();
    if tch::Cuda::is_available() {
        let t = Tensor::ones([2], (tch::Kind::Float, tch::Device::Cuda(0)));
        let err = pg.all_reduce(&t, ReduceOp::Sum).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.starts_with("rank 0: all_reduce failed: tensor is on cuda:0"),
            "{msg}"
        );
        assert!(msg.contains("no NCCL backend (it is Gloo-only)"), "{msg}");
    } else {
        eprintln!("no CUDA here: the CUDA half of this test runs in `make gpu-check`");
    }
    // World size 1: collectives are identities.
    let x = Tensor::from_slice(&[4.0f32]);
    pg.all_reduce(&x, ReduceOp::Avg).unwrap();
    assert_eq!(x.double_value(&[0]), 4.0);
}

/// The variable that marks the processes of one test's ranks (the launcher passes its
/// environment on, and every process started below inherits it).
const MARKER_ENV: &str = "TCH_DIST_TEST_MARKER";

/// One test's marker; dropping it SIGKILLs whatever still carries it, so that a failing
/// test leaves nothing behind either.
struct Marker(String);

impl Marker {
    fn new(test: &str) -> Marker {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .subsec_nanos();
        Marker(format!("{test}-{}-{nanos}", std::process::id()))
    }

    /// Live processes carrying the marker, as (pid, command line), except `but`.
    fn processes(&self, but: Option<u32>) -> Vec<(u32, String)> {
        let needle = format!("{MARKER_ENV}={}", self.0);
        let mut found = Vec::new();
        for entry in std::fs::read_dir("/proc").unwrap().flatten() {
            let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
                continue;
            };
            // A zombie's environment reads as empty: only live processes match.
            let Ok(env) = std::fs::read(format!("/proc/{pid}/environ")) else {
                continue;
            };
            if Some(pid) != but && env.split(|&b| b == 0).any(|v| v == needle.as_bytes()) {
                let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
                let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
                found.push((pid, cmdline.trim_end().to_string()));
            }
        }
        found
    }

    /// Waits (bounded) until no process carries the marker; returns those left.
    fn wait_gone(&self) -> Vec<(u32, String)> {
        let deadline = Instant::now() + Duration::from_secs(2);
        loop {
            let left = self.processes(None);
            if left.is_empty() || Instant::now() > deadline {
                return left;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// `tch-dist-run --nproc-per-node N -- sh -c SCRIPT`, marked, with `$SYNC` a fresh
    /// directory the scripts may use.
    fn sh_ranks(&self, nproc: usize, script: &str) -> Command {
        let sync = self.sync_dir();
        std::fs::create_dir_all(&sync).unwrap();
        let mut cmd = Command::new(launcher());
        cmd.env(MARKER_ENV, &self.0)
            .env("SYNC", &sync)
            .args(["--nproc-per-node", &nproc.to_string()])
            .args(["--master-port", &free_port().to_string(), "--"])
            .args(["sh", "-c", script]);
        cmd
    }

    fn sync_dir(&self) -> PathBuf {
        std::env::temp_dir().join(format!("tch-dist-sync-{}", self.0))
    }
}

impl Drop for Marker {
    fn drop(&mut self) {
        for (pid, _) in self.processes(None) {
            // SAFETY: kill(2) on a process of this test's own.
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        }
        let _ = std::fs::remove_dir_all(self.sync_dir());
    }
}

fn spawn_piped(mut cmd: Command) -> Child {
    cmd.stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn")
}

#[test]
fn sigterm_to_the_launcher_stops_the_ranks_process_trees() {
    let marker = Marker::new("sigterm");
    // Each rank is a shell waiting for its "trainer": two processes in the rank's group.
    let child = spawn_piped(marker.sh_ranks(2, "sleep 300; echo done"));
    let launcher_pid = child.id();
    let deadline = Instant::now() + Duration::from_secs(30);
    while marker
        .processes(Some(launcher_pid))
        .iter()
        .filter(|(_, cmd)| cmd == "sleep 300")
        .count()
        < 2
    {
        assert!(Instant::now() < deadline, "{:?}", marker.processes(None));
        std::thread::sleep(Duration::from_millis(20));
    }
    let signalled = Instant::now();
    // SAFETY: kill(2) on the launcher this test started.
    unsafe { libc::kill(launcher_pid as i32, libc::SIGTERM) };
    let (out, elapsed) = wait_bounded(child, signalled, Duration::from_secs(30));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(128 + libc::SIGTERM),
        "{stdout}\n{stderr}"
    );
    assert!(
        stderr.contains("received signal 15 (SIGTERM), stopping all ranks"),
        "{stderr}"
    );
    // The shells got SIGTERM with their trainers (no SIGKILL after the grace period).
    assert!(elapsed < Duration::from_secs(4), "{elapsed:?}\n{stderr}");
    assert!(!stdout.contains("done"), "{stdout}");
    let left = marker.wait_gone();
    assert!(left.is_empty(), "left running: {left:?}");
}

#[test]
fn ranks_that_leave_background_processes_do_not_hold_the_launcher() {
    let marker = Marker::new("background");
    // Rank 0 leaves a `sleep 30 &` in its group; rank 1 one that left the group (setsid),
    // which it waits to see in its own session before exiting.
    let script = r#"if [ "$RANK" = 0 ]; then sleep 30 &
else setsid sh -c 'touch "$SYNC/bg"; exec sleep 30' &
  while [ ! -e "$SYNC/bg" ]; do sleep 0.01; done
fi
echo hi"#;
    let (out, elapsed) = run_bounded(marker.sh_ranks(2, script), Duration::from_secs(60));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(
        stdout.contains("[rank0]: hi") && stdout.contains("[rank1]: hi"),
        "{stdout}"
    );
    assert!(elapsed < Duration::from_secs(10), "{elapsed:?}\n{stderr}");
    assert!(
        stderr.contains(
            "rank 0 exited; terminating the processes it left running in its process group"
        ),
        "{stderr}"
    );
    assert!(
        stderr.contains("terminating 1 process(es) that left their rank's process group"),
        "{stderr}"
    );
    let left = marker.wait_gone();
    assert!(left.is_empty(), "left running: {left:?}");
}

#[test]
fn failing_rank_stops_the_others_process_trees() {
    let marker = Marker::new("failing");
    // Rank 0 runs a trainer and a grandchild that left its group and ignores SIGTERM;
    // rank 1 fails once that grandchild is in place.
    let script = r#"if [ "$RANK" = 0 ]; then
  (trap '' TERM; exec setsid sh -c 'touch "$SYNC/bg"; exec sleep 300') &
  sleep 300; echo done
else
  while [ ! -e "$SYNC/bg" ]; do sleep 0.01; done
  exit 3
fi"#;
    let (out, elapsed) = run_bounded(marker.sh_ranks(2, script), Duration::from_secs(60));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{stdout}\n{stderr}");
    assert!(
        stderr.contains("rank 1 failed (exit status: 3); stopping the other ranks"),
        "{stderr}"
    );
    assert!(
        stderr.contains("terminating 1 process(es) that left their rank's process group"),
        "{stderr}"
    );
    // The grandchild ignores SIGTERM: SIGKILL 5 s later.
    assert!(stderr.contains("sending SIGKILL"), "{stderr}");
    assert!(elapsed < Duration::from_secs(15), "{elapsed:?}\n{stderr}");
    assert!(!stdout.contains("done"), "{stdout}");
    let left = marker.wait_gone();
    assert!(left.is_empty(), "left running: {left:?}");
}

/// `--max-restarts`: rank 1 fails on the first start; the launcher stops rank 0, starts both
/// again with TORCHELASTIC_RESTART_COUNT=1, and exits 0 when they succeed. Without restarts
/// left, the failing rank's status is the launcher's.
#[test]
fn max_restarts_starts_every_rank_again() {
    let script = r#"if [ "$TORCHELASTIC_RESTART_COUNT" -lt 1 ] && [ "$RANK" = 1 ]; then exit 3; fi
if [ "$TORCHELASTIC_RESTART_COUNT" -lt 1 ]; then sleep 30; fi
echo "rank $RANK start $TORCHELASTIC_RESTART_COUNT of $TORCHELASTIC_MAX_RESTARTS""#;
    let mut cmd = Command::new(launcher());
    cmd.args([
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "2",
        "--",
        "sh",
        "-c",
        script,
    ]);
    let (out, took) = run_bounded(cmd, Duration::from_secs(60));
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{stderr}");
    assert!(stderr.contains("tch-dist-run: rank 1 failed"), "{stderr}");
    assert!(
        stderr.contains("tch-dist-run: starting the ranks again (restart 1 of 2)"),
        "{stderr}"
    );
    assert!(!stderr.contains("restart 2 of 2"), "{stderr}");
    for r in 0..2 {
        assert!(
            stdout.contains(&format!("[rank{r}]: rank {r} start 1 of 2")),
            "{stdout}"
        );
    }
    // Rank 0's `sleep 30` of the first start was stopped, not waited for.
    assert!(took < Duration::from_secs(20), "took {took:?}");

    // Always failing: one restart, then the rank's status.
    let mut cmd = Command::new(launcher());
    cmd.args([
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "--",
        "sh",
        "-c",
    ])
    .arg(r#"[ "$RANK" = 1 ] && exit 3; sleep 30"#);
    let (out, _) = run_bounded(cmd, Duration::from_secs(60));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{stderr}");
    assert_eq!(
        stderr.matches("starting the ranks again").count(),
        1,
        "{stderr}"
    );
}

/// `--nnodes 2 --node-rank R`: two launchers, one rank each, make one world of 2 (global
/// ranks from the node rank, one run id derived alike on both), and all-reduce across them.
#[test]
fn two_nodes_make_one_world() {
    if worker().as_deref() == Some("two_nodes_make_one_world") {
        println!(
            "group_rank={} local_rank={}",
            std::env::var("GROUP_RANK").unwrap(),
            std::env::var("LOCAL_RANK").unwrap()
        );
        return allreduce_rank();
    }
    let port = free_port().to_string();
    let node = |r: &str| {
        let mut cmd = Command::new(launcher());
        cmd.env(WORKER_ENV, "two_nodes_make_one_world")
            .env_remove("TORCHELASTIC_RUN_ID")
            .args(["--nnodes", "2", "--node-rank", r, "--nproc-per-node", "1"])
            .args(["--master-port", &port, "--"])
            .arg(std::env::current_exe().unwrap())
            .args([
                "two_nodes_make_one_world",
                "--exact",
                "--nocapture",
                "--test-threads=1",
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        cmd.spawn().expect("spawn")
    };
    let start = Instant::now();
    let (a, b) = (node("0"), node("1"));
    let (a, _) = wait_bounded(a, start, Duration::from_secs(60));
    let (b, _) = wait_bounded(b, start, Duration::from_secs(60));
    for (out, rank) in [(a, 0), (b, 1)] {
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            stdout.contains(&format!("group_rank={rank} local_rank=0")),
            "{stdout}"
        );
        assert!(
            stdout.contains(&format!("[rank{rank}]: rank={rank} world=2 sum=3")),
            "{stdout}"
        );
    }
    // Several nodes need the port every node shares, and a node rank below the node count.
    for args in [
        &["--nnodes", "2", "--node-rank", "0", "--nproc-per-node", "1"][..],
        &[
            "--nnodes",
            "2",
            "--node-rank",
            "2",
            "--nproc-per-node",
            "1",
            "--master-port",
            "1234",
        ],
        &["--nnodes", "1:2", "--nproc-per-node", "1"],
    ] {
        let out = Command::new(launcher())
            .args(args)
            .args(["--", "true"])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}");
    }
}
