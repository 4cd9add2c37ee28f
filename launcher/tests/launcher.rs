//! The launcher, `tch-dist-run`, with `sh -c` ranks: its arguments and limits, run ids, its
//! hold on its ranks' whole process trees (SIGTERM to it, ranks that leave background
//! processes behind, a rank failing while another's grandchild runs, a rank failing while
//! the others are still being started), restarts, the reports of its ranks' exits to a real
//! TCPStore. Process groups started through it are tested in `runtime/tests/launcher.rs`.
//!
//! The ranks' processes carry a marker variable that /proc shows.

#[path = "common/bounded.rs"]
mod bounded;
#[path = "common/tcp_store.rs"]
#[allow(dead_code)] // shared with src/store.rs's tests, which use the rest
mod tcp_store;
use bounded::{run_bounded, wait_bounded};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use tcp_store::TcpStoreServer;

fn launcher() -> &'static str {
    env!("CARGO_BIN_EXE_tch-dist-run")
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
        .args(["--nproc-per-node", "0", "--", "true"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr)
        .contains("--nproc-per-node \"0\" is not a positive integer"));
    let out = Command::new(launcher())
        .args(["--nproc-per-node", "2"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no command given"));
}

#[test]
fn replica_group_options_that_do_not_fit_are_refused() {
    for (args, says) in [
        (
            &["--replica-groups", "2", "--master-port", "29500"][..],
            "--replica-groups 2 does not go with --master-port (each group takes a free port)",
        ),
        (
            &["--replica-groups", "0"][..],
            "--replica-groups \"0\" is not a positive integer",
        ),
        (
            &["--start-lighthouse", "1"][..],
            "--start-lighthouse needs --replica-groups",
        ),
        (
            &[
                "--replica-groups",
                "2",
                "--start-lighthouse",
                "1",
                "--lighthouse",
                "http://h:1",
            ][..],
            "--start-lighthouse and --lighthouse name two lighthouses: give one",
        ),
        (
            &["--lighthouse", "h:1"][..],
            "--lighthouse \"h:1\" is not an http:// or https:// URL",
        ),
        (
            &["--replica-groups", "2", "--nnodes", "2", "--node-rank", "0"][..],
            "--replica-groups 2 does not go with --nnodes above 1",
        ),
    ] {
        let out = Command::new(launcher())
            .args(["--nproc-per-node", "1"])
            .args(args)
            .args(["--", "true"])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(says), "{args:?}: {stderr}");
    }
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
        self.sh_ranks_with(&["--nproc-per-node", &nproc.to_string()], script)
    }

    /// `tch-dist-run LAUNCHER_ARGS -- sh -c SCRIPT`, as [`Marker::sh_ranks`].
    fn sh_ranks_with(&self, launcher_args: &[&str], script: &str) -> Command {
        let sync = self.sync_dir();
        std::fs::create_dir_all(&sync).unwrap();
        let mut cmd = Command::new(launcher());
        cmd.env(MARKER_ENV, &self.0)
            .env("SYNC", &sync)
            .args(launcher_args)
            .arg("--")
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

/// The launcher tells the ranks' store (here a real TCPStore in Python, at MASTER_PORT) of
/// each rank that exits while it is not stopping: rank 1's success, then rank 2's death by
/// SIGKILL, which starts the stop. Rank 0, which the launcher stops itself, is not reported.
#[test]
fn rank_exits_are_reported_to_the_store() {
    let mut store = TcpStoreServer::start();
    let marker = Marker::new("store");
    let script = r#"case "$RANK" in
0) sleep 300; echo done ;;
1) exit 0 ;;
2) while [ ! -e "$SYNC/go" ]; do sleep 0.01; done; kill -9 $$ ;;
esac"#;
    let port = store.port().to_string();
    let args = [
        "--nproc-per-node",
        "3",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        &port,
    ];
    let start = Instant::now();
    let child = spawn_piped(marker.sh_ranks_with(&args, script));
    // Rank 2 dies only once rank 1's exit is in the store, so the order is fixed.
    store.wait("tch_dist/exited/1");
    std::fs::write(marker.sync_dir().join("go"), "").unwrap();
    let (out, elapsed) = wait_bounded(child, start, Duration::from_secs(60));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(128 + libc::SIGKILL),
        "{stdout}\n{stderr}"
    );
    assert_eq!(store.get("tch_dist/exited/1"), "exited with status 0");
    assert_eq!(
        store.get("tch_dist/exited/2"),
        "was killed by signal 9 (SIGKILL)"
    );
    assert_eq!(store.get("tch_dist/exited/0"), "<missing>");
    assert_eq!(store.count("tch_dist/exited_count"), 2);
    // Reports that reach the store print nothing.
    assert!(!stderr.contains("could not tell"), "{stderr}");
    assert!(elapsed < Duration::from_secs(30), "{elapsed:?}\n{stderr}");
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

/// A rank that fails at once, with many ranks still to start: the launcher stops starting
/// them (it looks after the started ranks between two starts, rather than once the last one
/// is started) and stops the ranks already started.
#[test]
fn a_rank_failing_during_the_start_stops_it() {
    const RANKS: usize = 500; // 2 pipes each: within the common 1024 open files
    let marker = Marker::new("early_failure");
    let script = r#"[ "$RANK" = 0 ] && exit 3
touch "$SYNC/started.$RANK"
exec sleep 30"#;
    let (out, _) = run_bounded(marker.sh_ranks(RANKS, script), Duration::from_secs(120));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{stderr}");
    assert!(
        stderr.contains("rank 0 failed (exit status: 3); stopping the other ranks"),
        "{stderr}"
    );
    // The ranks that ran their script: some of those started (rank 0 marks nothing, and a
    // rank may be stopped before its `touch`), never one that was not started.
    let marked = std::fs::read_dir(marker.sync_dir()).unwrap().count();
    let started: usize = stderr
        .lines()
        .find_map(|l| {
            l.strip_prefix("tch-dist-run: started ")?
                .strip_suffix(&format!(" of {RANKS} ranks; not starting the others"))?
                .parse()
                .ok()
        })
        .unwrap_or_else(|| {
            panic!("{marked} ranks ran, and no `started S of {RANKS} ranks` line: {stderr}")
        });
    assert!(started < RANKS, "{stderr}");
    assert!(marked < started, "{marked} ranks ran, {started} started");
    let left = marker.wait_gone();
    assert!(left.is_empty(), "left running: {left:?}");
}

/// More ranks than the open-file limit leaves room for (2 pipes each, 16 descriptors of the
/// launcher's own) are refused before any starts; as many as it allows start.
#[test]
fn nproc_per_node_beyond_the_open_file_limit_is_refused() {
    let limited = |nproc: &str| {
        let mut cmd = Command::new(launcher());
        cmd.args(["--nproc-per-node", nproc, "--", "true"]);
        // SAFETY: setrlimit(2) in the forked child before exec: async-signal-safe.
        unsafe {
            cmd.pre_exec(|| {
                let mut l = libc::rlimit {
                    rlim_cur: 0,
                    rlim_max: 0,
                };
                libc::getrlimit(libc::RLIMIT_NOFILE, &mut l);
                l.rlim_cur = 64;
                if libc::setrlimit(libc::RLIMIT_NOFILE, &l) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        run_bounded(cmd, Duration::from_secs(60)).0
    };
    let out = limited("25");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.starts_with(
            "tch-dist-run: --nproc-per-node 25 is more ranks than the open-file limit allows: \
             each rank needs 2 pipes in the launcher, and RLIMIT_NOFILE (ulimit -n) 64 is \
             enough for 24; raise it or start fewer ranks\n"
        ),
        "{stderr}"
    );
    let out = limited("24");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `--rdzv-backend c10d` on one machine: two launchers of one rank each meet at
/// 127.0.0.1 (the first to bind it hosts). Launcher B's rank fails in round 0: B spends its
/// restart, A's rank is stopped and started again in round 1 without spending one, every
/// rank gets the round's placement (ranks contiguous per node, the nodes in address then
/// pid order), and both exit 0. Static multi-node restarts are still refused.
#[test]
fn c10d_restarts_every_node_together() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let script = r#"echo "node $NODE round $TCH_DIST_RDZV_ROUND rank $RANK/$WORLD_SIZE group $GROUP_RANK/$GROUP_WORLD_SIZE role $ROLE_RANK/$ROLE_WORLD_SIZE count $TORCHELASTIC_RESTART_COUNT/$TORCHELASTIC_MAX_RESTARTS"
if [ "$TCH_DIST_RDZV_ROUND" = 0 ]; then if [ "$NODE" = B ]; then sleep 1; exit 3; fi; sleep 30; fi"#;
    let start = std::time::Instant::now();
    let children: Vec<Child> = ["A", "B"]
        .into_iter()
        .map(|node| {
            Command::new(launcher())
                .args([
                    "--nnodes",
                    "2",
                    "--nproc-per-node",
                    "1",
                    "--max-restarts",
                    "1",
                ])
                .args(["--rdzv-backend", "c10d"])
                .args(["--rdzv-endpoint", &format!("127.0.0.1:{port}")])
                .args(["--rdzv-conf", "join_timeout=30", "--", "sh", "-c", script])
                .env("NODE", node)
                .env_remove("TORCHELASTIC_RUN_ID")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("a launcher")
        })
        .collect();
    let outs: Vec<String> = children
        .into_iter()
        .map(|c| {
            let (out, _) = wait_bounded(c, start, Duration::from_secs(60));
            let text = format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            assert_eq!(out.status.code(), Some(0), "{text}");
            text
        })
        .collect();
    let all = outs.concat();
    assert!(
        outs[1].contains("rank 1 failed") || outs[1].contains("rank 0 failed"),
        "{all}"
    );
    assert!(outs[1].contains("restart 1 of 1"), "{all}");
    assert!(outs[0].contains("no restart spent"), "{all}");
    // Round 1: A's count is 0, B's 1; both see the same world of 2 nodes.
    assert!(outs[0].contains("node A round 1 rank"), "{all}");
    assert!(outs[0].contains("count 0/1"), "{all}");
    assert!(outs[1].contains("node B round 1 rank"), "{all}");
    assert!(outs[1].contains("count 1/1"), "{all}");
    for out in &outs {
        let line = out
            .lines()
            .find(|l| l.contains("round 1 rank"))
            .unwrap_or_else(|| panic!("{all}"));
        assert!(line.contains("/2 group "), "{line}");
        assert!(line.contains("/2 role "), "{line}");
    }

    let out = Command::new(launcher())
        .args(["--nnodes", "2", "--node-rank", "0", "--master-port", "1"])
        .args(["--nproc-per-node", "1", "--max-restarts", "1", "--", "true"])
        .output()
        .expect("a launcher");
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains(
        "--max-restarts with --nnodes above 1 needs the dynamic rendezvous: --rdzv-backend c10d"
    ));
}
