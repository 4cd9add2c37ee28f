//! 6. PyTorch's NCCL-only backend, and shutdown with clones alive.

use super::*;

/// PyTorch's "nccl" (`Backend::NcclOnly`) at world size 1, under PyTorch 2.11's naming
/// (`default_pg/0//cuda//`): CUDA collectives and a barrier through NCCL; CPU tensors refused.
pub(crate) fn check_nccl_only() -> Outcome {
    if cpu() {
        return Outcome::Skip("needs CUDA");
    }
    let opts =
        InitOptions::new(Backend::NcclOnly, 0, 1, "127.0.0.1", free_port()).with_device_id(0);
    let pg = ProcessGroup::new(&opts).unwrap();
    assert_eq!(pg.group_name(), "0");
    let t = Tensor::arange(4, (Kind::Float, dev()));
    pg.all_reduce(&t, ReduceOp::Sum).unwrap();
    assert!(t.equal(&Tensor::arange(4, (Kind::Float, dev()))));
    pg.barrier().unwrap();
    let err = pg
        .all_reduce(
            &Tensor::ones([1], (Kind::Float, Device::Cpu)),
            ReduceOp::Sum,
        )
        .unwrap_err();
    assert!(err.to_string().contains("NCCL only"), "{err}");
    let err = pg
        .monitored_barrier(Duration::from_secs(5), true)
        .unwrap_err();
    assert!(err.to_string().contains("needs a Gloo backend"), "{err}");
    pg.shutdown();
    Outcome::Pass
}

pub(crate) fn check_shutdown(default: &ProcessGroup, alone: &ProcessGroup) -> Outcome {
    // A replicated model keeps a clone of `alone`; shutting it down fails the clone's next
    // collective cleanly.
    let vs = nn::VarStore::new(dev());
    let model = net(&vs, 8, false);
    let opts = replicate::Options {
        process_group: Some(alone.clone()),
        ..Default::default()
    };
    replicate::apply(&model, opts).unwrap();
    let clone = replicate::state(&model).unwrap().group().clone();
    alone.shutdown();
    let t = Tensor::ones([4], (Kind::Float, dev()));
    match clone.all_reduce(&t, ReduceOp::Sum) {
        Err(DistError::ShutDown {
            op: "all_reduce", ..
        }) => {}
        other => panic!("after shutdown: {other:?}"),
    }
    // destroy_process_group shuts the default group down with clones alive (`default`).
    destroy_process_group();
    assert!(default.is_shut_down());
    match default.barrier() {
        Err(DistError::ShutDown { op: "barrier", .. }) => {}
        other => panic!("after destroy_process_group: {other:?}"),
    }
    Outcome::Pass
}
