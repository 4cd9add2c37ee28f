//! Rendezvous failures end within the timeout plus a second, with their cause: a rank that
//! never joined (named), nobody listening at MASTER_ADDR:MASTER_PORT, an unresolvable
//! MASTER_ADDR, a rank of another run (TORCHELASTIC_RUN_ID); and no C++ backtrace on
//! stderr. 2 ranks over 127.0.0.1 (the test binary re-executed with `TCH_DIST_TEST_WORKER`),
//! each printing `error: ...` or `ok`, a 3 s group timeout.

use std::os::unix::process::ExitStatusExt;
use std::time::{Duration, Instant};

use tch::Tensor;
use tch_dist_runtime::testing::{describe, worker, Launch, RankOutput};
use tch_dist_runtime::{
    Backend, DistError, InitOptions, ProcessGroup, ReduceOp, RendezvousError, RUN_ID_ENV,
};

/// The group timeout of these tests, and the bound every rendezvous must keep.
const TIMEOUT: Duration = Duration::from_secs(3);
const BOUND: Duration = Duration::from_secs(4);

/// A rank's body: unless `skip`, create the group from the environment and print
/// `error: <e>` and how long it took, or `ok` after an all_reduce.
fn rank_body(skip: bool) {
    if skip {
        return;
    }
    let start = Instant::now();
    match ProcessGroup::from_env(Backend::Gloo) {
        Ok(pg) => {
            let t = Tensor::from_slice(&[1.0f32]);
            pg.all_reduce(&t, ReduceOp::Sum).unwrap();
            println!("ok sum={}", t.double_value(&[0]));
        }
        Err(e) => {
            println!("error: {e}");
            println!("took_ms={}", start.elapsed().as_millis());
        }
    }
}

fn rank_of_env() -> usize {
    std::env::var("RANK").unwrap().parse().unwrap()
}

/// Runs 2 ranks of `test` and checks that each exited by itself with status 0 (no abort, no
/// signal, nothing left at the deadline) and printed no C++ backtrace.
fn run(launch: Launch) -> Vec<RankOutput> {
    let out = launch
        .env("TCH_DIST_TIMEOUT_SECS", TIMEOUT.as_secs().to_string())
        .timeout(Duration::from_secs(60))
        .run();
    let desc = describe(&out);
    for o in &out {
        let status = o
            .status
            .unwrap_or_else(|| panic!("rank {} was killed at the deadline:\n{desc}", o.rank));
        assert_eq!(status.signal(), None, "{desc}");
        assert!(status.success(), "{desc}");
        assert!(
            !o.stderr.contains("frame #") && !o.stderr.contains("Exception raised from"),
            "a C++ backtrace on stderr:\n{desc}"
        );
    }
    out
}

/// The error a rank printed (libtest may have put `test NAME ... ` before it on its line),
/// and how long its rendezvous took.
fn error_of(o: &RankOutput) -> (String, Duration) {
    let line = o
        .stdout
        .lines()
        .find_map(|l| l.split_once("error: ").map(|(_, e)| e))
        .unwrap_or_else(|| panic!("rank {} printed no error:\n{}", o.rank, o.stdout));
    let ms: u64 = o
        .stdout
        .lines()
        .find_map(|l| l.split_once("took_ms=").map(|(_, t)| t))
        .unwrap()
        .parse()
        .unwrap();
    (line.to_string(), Duration::from_millis(ms))
}

#[test]
fn a_missing_rank_is_named() {
    if worker().as_deref() == Some("a_missing_rank_is_named") {
        return rank_body(rank_of_env() == 1);
    }
    let out = run(Launch::new("a_missing_rank_is_named", 2));
    let port = port_of(&out[0]);
    let (err, took) = error_of(&out[0]);
    assert_eq!(
        err,
        format!("rank 0: rendezvous with 127.0.0.1:{port} failed: rank 1 never joined within 3s")
    );
    assert!(took >= TIMEOUT && took < BOUND, "{took:?}");
}

#[test]
fn nobody_listening_ends_in_time() {
    if worker().as_deref() == Some("nobody_listening_ends_in_time") {
        return rank_body(rank_of_env() == 0);
    }
    let out = run(Launch::new("nobody_listening_ends_in_time", 2));
    let port = port_of(&out[1]);
    let (err, took) = error_of(&out[1]);
    assert_eq!(
        err,
        format!(
            "rank 1: rendezvous with 127.0.0.1:{port} failed: no rendezvous store accepted a \
             connection within 3s (last attempt: Connection refused (os error 111)); rank 0 \
             hosts it: is rank 0 running, with the same MASTER_ADDR and MASTER_PORT?"
        )
    );
    assert!(took >= TIMEOUT && took < BOUND, "{took:?}");
}

#[test]
fn a_rank_of_another_run_is_refused() {
    if worker().as_deref() == Some("a_rank_of_another_run_is_refused") {
        if rank_of_env() == 1 {
            // Rank 0 hosts the store (and claims it for its run) first.
            std::thread::sleep(Duration::from_millis(500));
        }
        return rank_body(false);
    }
    let out = run(Launch::new("a_rank_of_another_run_is_refused", 2)
        .rank_env(0, RUN_ID_ENV, "job-a")
        .rank_env(1, RUN_ID_ENV, "job-b"));
    let port = port_of(&out[0]);
    let (refused, took) = error_of(&out[1]);
    assert_eq!(
        refused,
        format!(
            "rank 1: rendezvous with 127.0.0.1:{port} failed: this rank belongs to run `job-b` \
             but the rendezvous store there belongs to run `job-a` (TORCHELASTIC_RUN_ID): is \
             MASTER_PORT another job's?"
        )
    );
    assert!(took < Duration::from_secs(1), "{took:?}");
    let (waited, took) = error_of(&out[0]);
    assert_eq!(
        waited,
        format!(
            "rank 0: rendezvous with 127.0.0.1:{port} failed: rank 1 never joined within 3s (a \
             process of run `job-b` came as rank 1 and was refused)"
        )
    );
    assert!(took >= TIMEOUT && took < BOUND, "{took:?}");
}

/// Only ranks that carry a run id are checked: a rank without one (a PyTorch rank, a rank
/// started by hand) joins a run's rendezvous.
#[test]
fn a_rank_without_a_run_id_joins() {
    if worker().as_deref() == Some("a_rank_without_a_run_id_joins") {
        return rank_body(false);
    }
    let out = run(Launch::new("a_rank_without_a_run_id_joins", 2).rank_env(0, RUN_ID_ENV, "job-a"));
    for o in &out {
        assert!(o.stdout.contains("ok sum=2"), "{}", describe(&out));
    }
}

/// An unresolvable MASTER_ADDR fails at once, naming the host, even for a group of one
/// (rank 0 hosts the store, and connects to it through MASTER_ADDR).
#[test]
fn an_unresolvable_master_addr_fails_fast() {
    let opts = InitOptions::new(Backend::Gloo, 0, 1, "no-such-host.invalid", 29500)
        .with_timeout(Duration::from_secs(30));
    let start = Instant::now();
    let err = ProcessGroup::new(&opts).unwrap_err();
    assert!(
        start.elapsed() < Duration::from_secs(2),
        "{:?}",
        start.elapsed()
    );
    let DistError::Rendezvous { problem, .. } = &err else {
        panic!("{err}");
    };
    assert!(
        matches!(&**problem, RendezvousError::UnresolvableHost { host, .. } if host == "no-such-host.invalid"),
        "{err}"
    );
    assert!(
        err.to_string().starts_with(
            "rank 0: rendezvous with no-such-host.invalid:29500 failed: MASTER_ADDR \
             `no-such-host.invalid` does not resolve: "
        ),
        "{err}"
    );
}

/// The MASTER_PORT the harness gave a rank (it prints it in its error).
fn port_of(o: &RankOutput) -> u16 {
    let (line, _) = error_of(o);
    let after = line.split("127.0.0.1:").nth(1).unwrap();
    after[..after.find(' ').unwrap()].parse().unwrap()
}
