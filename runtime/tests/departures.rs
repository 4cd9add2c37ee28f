//! No rank waits out the group's timeout for a rank that has already failed (issue 41,
//! section 4): a rank that stops taking part in a group after a failure says so through the
//! store, and a peer blocked on it fails within seconds naming it and its error; both
//! groups refuse every later operation at once. 2 ranks over 127.0.0.1, Gloo, a 60 s group
//! timeout that must not be what ends the wait.

use std::time::{Duration, Instant};

use tch::{Kind, Tensor};
use tch_dist_runtime::testing::{run_ranks_with, Launch};
use tch_dist_runtime::{Backend, Departure, DistError, ReduceOp};

const CAUSE: &str = "rank 0: my_api: the batch could not be loaded";

#[test]
fn a_peer_blocked_on_a_rank_that_stopped_fails_within_seconds() {
    let launch = Launch::new(
        "a_peer_blocked_on_a_rank_that_stopped_fails_within_seconds",
        2,
    )
    .env("TCH_DIST_TIMEOUT_SECS", "60")
    .timeout(Duration::from_secs(90));
    run_ranks_with(&launch, Backend::Gloo, |pg| {
        let t = Tensor::ones([4], (Kind::Float, tch::Device::Cpu));
        pg.barrier().unwrap();
        if pg.rank() == 0 {
            // Rank 0 fails, says so, and carries on without sending or exiting.
            pg.stop_after_failure(CAUSE);
            std::thread::sleep(Duration::from_secs(4));
        } else {
            let started = Instant::now();
            let err = pg.recv(&t, 0, 0).unwrap_err();
            let took = started.elapsed();
            assert!(took < Duration::from_secs(4), "after {took:?}: {err}");
            assert_eq!(
                err,
                DistError::PeerDeparted {
                    rank: 1,
                    op: "recv",
                    peer: 0,
                    departure: Departure::Failed {
                        error: CAUSE.into()
                    },
                }
            );
            assert_eq!(
                err.to_string(),
                format!("rank 1: recv: rank 0 failed and stopped taking part: {CAUSE}")
            );
        }
        // Both ranks' groups stopped: every later operation is refused at once, naming the
        // failure that stopped it (rank 1's own: its wait for rank 0).
        let started = Instant::now();
        let err = pg.all_reduce(&t, ReduceOp::Sum).unwrap_err();
        assert!(started.elapsed() < Duration::from_secs(1), "{err}");
        let cause = if pg.rank() == 0 {
            CAUSE.to_string()
        } else {
            format!("rank 1: recv: rank 0 failed and stopped taking part: {CAUSE}")
        };
        assert_eq!(
            err.to_string(),
            format!(
                "rank {}: all_reduce: the group stopped after this rank's failure ({cause}); \
                 create a new group to go on",
                pg.rank()
            )
        );
    });
}
