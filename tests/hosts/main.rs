//! The multi-host tier: jobs across hosts that are network namespaces of this machine
//! (tests/common/hosts.rs), each host running its own `tch-dist-run` with the same command
//! line a user types on each machine. Root only; every run bounded in time, the namespaces
//! removed even when a test fails.
//!
//! | file | what it tests | PyTorch's counterpart |
//! | --- | --- | --- |
//! | `main.rs` | the jobs' plumbing; the interface Gloo binds found without `GLOO_SOCKET_IFNAME`; the store listening where `MASTER_ADDR` points, deaf to strays | (none: PyTorch's tests stay on one host) |
//! | `ft.rs` | fault tolerance's replica groups on two hosts: one host's link cut mid-training, the groups meet again and end as without the cut | torchft's tests (one machine, no real hosts) |
//! | `layouts.rs` | `train_lm` across 2 hosts x 2 ranks as HSDP and as dp x tp, equal to one host's run; `init_device_mesh`'s warning when `tp` spans hosts | (none: PyTorch's tests stay on one host) |
//! | `lost.rs` | a cut link and a frozen host noticed on every other host in bounded time; a slow step no alarm | (none: PyTorch's ranks wait out the timeout) |
//! | `restarts.rs` | `--rdzv-backend c10d` across hosts: every host restarted together (train_ddp resumes to an uninterrupted run's parameters), a killed or cut-off host left behind, a host out of restarts ending every host, each round's workers in a store of their own, the same command lines under torchrun | `test/distributed/elastic/rendezvous/dynamic_rendezvous_test.py`, `test/distributed/launcher/api_test.py` (one machine, no real hosts) |

#[path = "../common/build.rs"]
mod build;
mod ft;
#[path = "../common/hosts.rs"]
mod hosts;
mod layouts;
mod lost;
mod restarts;

use std::process::Command;
use std::time::Duration;

use hosts::{describe, launcher, without_launch_vars, Ended, Hosts, Job};
use tch::Tensor;
use tch_dist::testing::{worker, WORKER_ENV};
use tch_dist::{init_process_group, Backend, ReduceOp};

/// The store's port on host 0 (each host has its own port space).
const PORT: &str = "29500";

/// `tch-dist-run` on host `node` of `hosts`, `nproc` ranks of this binary's test `test`,
/// the master on host 0: the command line a user types on each machine.
fn job(hosts: &Hosts, node: usize, nproc: usize, test: &str) -> Command {
    let exe = std::env::current_exe().expect("the test binary's path");
    let mut cmd = hosts.command(node, launcher());
    without_launch_vars(&mut cmd)
        .args(["--nnodes", &hosts.count().to_string()])
        .args(["--node-rank", &node.to_string()])
        .args(["--nproc-per-node", &nproc.to_string()])
        .args(["--master-addr", &hosts.addr(0), "--master-port", PORT, "--"])
        .arg(exe)
        .args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env(WORKER_ENV, test)
        .env("OMP_NUM_THREADS", "1")
        .env("TCH_DIST_TIMEOUT_SECS", "20");
    cmd
}

/// Starts `test` on every host and waits for all of them (at most `timeout`).
fn run_on_hosts(hosts: &Hosts, nproc: usize, test: &str, timeout: Duration) -> Vec<Ended> {
    let jobs = (0..hosts.count())
        .map(|node| Job::start(node, job(hosts, node, nproc, test)))
        .collect();
    Job::wait_all(jobs, timeout)
}

/// The body of the rank tests: a Gloo group of the job's ranks sums rank + 1.
fn sum_ranks() {
    let pg = init_process_group(Backend::Gloo).expect("init_process_group");
    let t = Tensor::from_slice(&[pg.rank() as f32 + 1.0]);
    pg.all_reduce(&t, ReduceOp::Sum).expect("all_reduce");
    println!("rank {} sum={}", pg.rank(), t.double_value(&[0]));
    tch_dist::destroy_process_group();
}

/// Without `GLOO_SOCKET_IFNAME`, on hosts whose hostname resolves to loopback (the Debian
/// `127.0.1.1` line): Gloo binds the address of the interface that routes to
/// `MASTER_ADDR` (eth0's), not the hostname's, so the job connects and sums. (Gloo's own
/// choice, PyTorch's, binds 127.0.1.1, and rank 1's `connectFullMesh` times out.)
#[test]
fn two_hosts_connect_without_gloo_socket_ifname() {
    const NAME: &str = "two_hosts_connect_without_gloo_socket_ifname";
    if worker().is_some() {
        return sum_ranks();
    }
    let hosts = Hosts::new(2);
    let hostname = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    for i in 0..2 {
        hosts.hosts_file(
            i,
            &format!("127.0.0.1 localhost\n127.0.1.1 {}\n", hostname.trim()),
        );
    }
    let ended = run_on_hosts(&hosts, 2, NAME, Duration::from_secs(60));
    assert!(ended.iter().all(Ended::success), "{}", describe(&ended));
    let out: String = ended.iter().map(|e| e.stdout.as_str()).collect();
    for rank in 0..4 {
        assert!(
            out.contains(&format!("rank {rank} sum=10")),
            "rank {rank}: {}",
            describe(&ended)
        );
    }
}

/// Runs `script` with bash on host `host`, returning whether it succeeded.
fn bash_on(hosts: &Hosts, host: usize, script: &str) -> bool {
    hosts
        .command(host, "bash")
        .args(["-c", script])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// The file a test's ranks wait for before their collective (the hosts share this file
/// system): the parent creates it once its probes are done.
fn go_file(test: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("{test}.go"))
}

/// The store rank 0 hosts listens where MASTER_ADDR points (10.77.0.1 on host 0), not on
/// every interface: host 0's own 127.0.0.1:PORT is refused. Stray connections to it — a
/// port scanner's connect-and-close, an HTTP request, 64 KiB of random bytes — change
/// nothing: the job then sums as ever.
#[test]
fn the_store_listens_where_master_addr_points_and_ignores_strays() {
    const NAME: &str = "the_store_listens_where_master_addr_points_and_ignores_strays";
    let go = go_file(NAME);
    if worker().is_some() {
        let pg = init_process_group(Backend::Gloo).expect("init_process_group");
        let start = std::time::Instant::now();
        while !go.exists() && start.elapsed() < Duration::from_secs(40) {
            std::thread::sleep(Duration::from_millis(50));
        }
        let t = Tensor::from_slice(&[pg.rank() as f32 + 1.0]);
        pg.all_reduce(&t, ReduceOp::Sum).expect("all_reduce");
        println!("rank {} sum={}", pg.rank(), t.double_value(&[0]));
        tch_dist::destroy_process_group();
        return;
    }
    let _ = std::fs::remove_file(&go);
    let hosts = Hosts::new(2);
    let jobs: Vec<Job> = (0..2)
        .map(|node| Job::start(node, job(&hosts, node, 1, NAME)))
        .collect();
    let store = format!("/dev/tcp/{}/{PORT}", hosts.addr(0));
    let reachable = |script: &str| bash_on(&hosts, 1, script);
    let start = std::time::Instant::now();
    while !reachable(&format!("exec 3<>{store}")) {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "the store never listened"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let loopback = bash_on(&hosts, 0, &format!("exec 3<>/dev/tcp/127.0.0.1/{PORT}"));
    reachable(&format!("printf 'GET / HTTP/1.0\\r\\n\\r\\n' >{store}"));
    reachable(&format!("head -c 65536 /dev/urandom >{store}"));
    reachable(&format!(
        "exec 3<>{store}; head -c 9 /dev/urandom >&3; sleep 0.2"
    ));
    std::fs::write(&go, "").expect("the go file");
    let ended = Job::wait_all(jobs, Duration::from_secs(60));
    let _ = std::fs::remove_file(&go);
    assert!(!loopback, "host 0's 127.0.0.1:{PORT} reached the store");
    assert!(ended.iter().all(Ended::success), "{}", describe(&ended));
    let out: String = ended.iter().map(|e| e.stdout.as_str()).collect();
    for rank in 0..2 {
        assert!(
            out.contains(&format!("rank {rank} sum=3")),
            "{}",
            describe(&ended)
        );
    }
}
