//! A peer that left is named at once by every collective fully_shard uses: `PeerGone`, well
//! before the group's timeout. 2 ranks over 127.0.0.1, Gloo, a 20 s group timeout; rank 1
//! returns (its process exits) instead of calling the collective.
//!
//! Found by examples/train_fsdp: `reduce_scatter_tensor` once reported `Timeout { timeout:
//! 20s }` about 70 ms after the peer left (Gloo's work throws the peer's error before it
//! counts as completed, and the shim's `tdr_work_wait` read any throw of an uncompleted work
//! as its own wait ending); the shim now tells c10d's wait timeout from other errors.

use std::time::{Duration, Instant};

use tch::{Kind, Tensor};
use tch_dist_runtime::testing::{run_ranks_with, Launch};
use tch_dist_runtime::{Backend, DistError, ProcessGroup, ReduceOp};

/// Rank 1 leaves; rank 0 runs `op` and must get `PeerGone` naming rank 1, promptly.
fn left(test: &str, op: impl FnOnce(&ProcessGroup) -> Result<(), DistError>) {
    let launch = Launch::new(test, 2)
        .env("TCH_DIST_TIMEOUT_SECS", "20")
        .timeout(Duration::from_secs(60));
    run_ranks_with(&launch, Backend::Gloo, |pg| {
        pg.barrier().unwrap();
        if pg.rank() == 1 {
            return;
        }
        std::thread::sleep(Duration::from_millis(300));
        let start = Instant::now();
        let err = op(&pg).unwrap_err();
        assert!(start.elapsed() < Duration::from_secs(10), "{err}");
        assert!(
            matches!(err, DistError::PeerGone { peer: Some(1), .. }),
            "after {:?}: {err:?}",
            start.elapsed()
        );
    });
}

fn ones(n: i64) -> Tensor {
    Tensor::ones([n], (Kind::Float, tch::Device::Cpu))
}

#[test]
fn all_gather_into_tensor_names_a_peer_that_left() {
    left("all_gather_into_tensor_names_a_peer_that_left", |pg| {
        pg.all_gather_into_tensor(&ones(2048), &ones(1024))
    });
}

#[test]
fn reduce_scatter_tensor_names_a_peer_that_left() {
    left("reduce_scatter_tensor_names_a_peer_that_left", |pg| {
        pg.reduce_scatter_tensor(&ones(1024), &ones(2048), ReduceOp::Avg)
    });
}
