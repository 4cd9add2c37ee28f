//! The multi-host tier: jobs across hosts that are network namespaces of this machine
//! (tests/common/hosts.rs), each host running its own `tch-dist-run` with the same command
//! line a user types on each machine. Root only; every run bounded in time, the namespaces
//! removed even when a test fails.
//!
//! | file | what it tests | PyTorch's counterpart |
//! | --- | --- | --- |
//! | `main.rs` | the jobs' plumbing; the interface Gloo binds found without `GLOO_SOCKET_IFNAME` | `test_c10d_gloo.py`'s `test_default_device` ... (none across real hosts) |
//! | `restarts.rs` | `--rdzv-backend c10d` across hosts: every host restarted together (train_ddp resumes to an uninterrupted run's parameters), a killed or cut-off host left behind, a host out of restarts ending every host, each round's workers in a store of their own, the same command lines under torchrun | `test/distributed/elastic/rendezvous/dynamic_rendezvous_test.py`, `test/distributed/launcher/api_test.py` (one machine, no real hosts) |

#[path = "../common/hosts.rs"]
mod hosts;
mod restarts;

use std::process::Command;
use std::time::Duration;

use hosts::{describe, launcher, Ended, Hosts, Job};
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
    cmd.args(["--nnodes", &hosts.count().to_string()])
        .args(["--node-rank", &node.to_string()])
        .args(["--nproc-per-node", &nproc.to_string()])
        .args(["--master-addr", &hosts.addr(0), "--master-port", PORT, "--"])
        .arg(exe)
        .args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env(WORKER_ENV, test)
        .env("OMP_NUM_THREADS", "1")
        .env("TCH_DIST_TIMEOUT_SECS", "20");
    for var in [
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "GLOO_SOCKET_IFNAME",
        "TORCHELASTIC_RUN_ID",
        "TCH_DIST_DEBUG",
    ] {
        cmd.env_remove(var);
    }
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
