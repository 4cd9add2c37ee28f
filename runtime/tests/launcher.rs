//! Start-up of process groups through `tch-dist-run` and through torchrun, and failures: a
//! rank killed with SIGKILL mid-collective, nobody listening at MASTER_ADDR:MASTER_PORT, a
//! port already taken. (The launcher's own behaviour, with `sh -c` ranks, is tested in
//! `launcher/tests/launcher.rs`.)
//!
//! The ranks are this test binary itself, re-executed with `TCH_DIST_TEST_WORKER` set.

#[path = "../../launcher/tests/common/bounded.rs"]
mod bounded;
use bounded::{run_bounded, wait_bounded};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use tch::Tensor;
use tch_dist_runtime::testing::{free_port, worker, Launch, WORKER_ENV};
use tch_dist_runtime::{Backend, DistError, InitOptions, ProcessGroup, ReduceOp};

/// The launcher, `tch-dist-launcher`'s binary, built once per run of this test binary, in its
/// profile: cargo builds only this package's own binaries for its tests.
fn launcher() -> &'static Path {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT.get_or_init(|| {
        let exe = std::env::current_exe().unwrap();
        let profile_dir = exe.parent().unwrap().parent().unwrap();
        let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("../launcher/Cargo.toml");
        let mut cmd = Command::new(env!("CARGO"));
        cmd.args([
            "build",
            "--quiet",
            "--bin",
            "tch-dist-run",
            "--manifest-path",
        ])
        .arg(&manifest);
        if profile_dir.ends_with("release") {
            cmd.arg("--release");
        }
        assert!(
            cmd.status().unwrap().success(),
            "cargo build of the launcher failed"
        );
        profile_dir.join("tch-dist-run")
    })
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

/// Runs this test binary's `test` as the ranks of `tch-dist-run --nproc-per-node n`, with a
/// group timeout of 60 s that no rank may wait out; returns the launcher's stdout and
/// stderr together, and how long it took.
fn under_launcher(test: &str, n: usize) -> (String, Duration) {
    let mut cmd = Command::new(launcher());
    cmd.env(WORKER_ENV, test)
        .env("TCH_DIST_TIMEOUT_SECS", "60")
        .args(["--nproc-per-node", &n.to_string(), "--"])
        .arg(std::env::current_exe().unwrap())
        .args([test, "--exact", "--nocapture", "--test-threads=1"]);
    let (out, elapsed) = run_bounded(cmd, Duration::from_secs(90));
    let all = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (all, elapsed)
}

/// Rank 1 exits (status 0) before it creates its process group; rank 0 creating the group
/// fails within seconds naming rank 1 and how it ended, as its launcher reported it, where
/// it waited out the rendezvous timeout (issue 41, section 4).
#[test]
fn a_rank_that_exits_before_joining_is_named_within_seconds() {
    const TEST: &str = "a_rank_that_exits_before_joining_is_named_within_seconds";
    if worker().as_deref() == Some(TEST) {
        if std::env::var("RANK").as_deref() == Ok("1") {
            return;
        }
        let started = Instant::now();
        let err = ProcessGroup::from_env(Backend::Gloo).unwrap_err();
        let took = started.elapsed();
        println!("rank 0 saw after {:.1} s: {err}", took.as_secs_f64());
        assert!(took < Duration::from_secs(15), "{err}");
        assert!(
            err.to_string().ends_with(
                "rank 1 exited with status 0 (its launcher reported it) without joining"
            ),
            "{err}"
        );
        return;
    }
    let (all, elapsed) = under_launcher(TEST, 2);
    assert!(all.contains("rank 0 saw after"), "{all}");
    assert!(elapsed < Duration::from_secs(30), "{elapsed:?}: {all}");
}

/// Rank 0 alone creates a subgroup (as `DeviceMesh::flatten` on one rank only does) while
/// rank 1 finishes and exits: rank 0 fails within seconds naming rank 1, where it waited out
/// the rendezvous timeout (issue 41, section 4).
#[test]
fn a_group_created_on_one_rank_only_fails_within_seconds() {
    const TEST: &str = "a_group_created_on_one_rank_only_fails_within_seconds";
    if worker().as_deref() == Some(TEST) {
        let pg = ProcessGroup::from_env(Backend::Gloo).unwrap();
        pg.barrier().unwrap();
        if pg.rank() == 1 {
            return;
        }
        let started = Instant::now();
        let err = pg.new_group(&[0, 1], Backend::Gloo).unwrap_err();
        let took = started.elapsed();
        println!("rank 0 saw after {:.1} s: {err}", took.as_secs_f64());
        assert!(took < Duration::from_secs(15), "{err}");
        assert!(
            err.to_string().ends_with(
                "rank 1 exited with status 0 (its launcher reported it) without joining"
            ),
            "{err}"
        );
        return;
    }
    let (all, elapsed) = under_launcher(TEST, 2);
    assert!(all.contains("rank 0 saw after"), "{all}");
    assert!(elapsed < Duration::from_secs(30), "{elapsed:?}: {all}");
}
