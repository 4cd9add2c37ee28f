//! The exact text of every variant: messages name the rank, the operation and the
//! parameter once, in one shape.

use std::time::Duration;

use tch::{Device, Kind};

use super::*;
use tch_dist_core::sharding::Placement;

fn sig(shape: &[i64]) -> TensorSignature {
    TensorSignature {
        shape: shape.to_vec(),
        kind: Kind::Float,
    }
}

fn invalid(problem: ArgumentError) -> String {
    DistError::InvalidArgument {
        rank: 1,
        op: "op",
        problem: Box::new(problem),
    }
    .to_string()
}

#[test]
fn dist_error_texts() {
    let cases: Vec<(DistError, &str)> = vec![
        (
            EnvError::NoRank.into(),
            "invalid launch environment: neither RANK (torchrun, tch-dist-run) nor \
             SLURM_PROCID is set; start the program with tch-dist-run, torchrun or srun",
        ),
        (
            DistError::Rendezvous {
                rank: 1,
                addr: "10.0.0.1".into(),
                port: 29500,
                problem: Box::new(RendezvousError::Engine {
                    cause: "Connection refused".into(),
                }),
            },
            "rank 1: rendezvous with 10.0.0.1:29500 failed: Connection refused",
        ),
        (
            DistError::Collective {
                rank: 1,
                op: "all_gather",
                cause: "bad sizes".into(),
            },
            "rank 1: all_gather failed: bad sizes",
        ),
        (
            DistError::PeerDeparted {
                rank: 0,
                op: "all_reduce",
                peer: 1,
                departure: Departure::Silent {
                    silent: Duration::from_millis(60_400),
                },
            },
            "rank 0: all_reduce: rank 1 has not been heard from for 60 s (its heartbeat \
             stopped: its host lost its link, or froze)",
        ),
        (
            DistError::StoreUnreachable {
                rank: 1,
                op: "all_reduce",
                store: "10.77.0.1:29500".into(),
                silent: Duration::from_secs(61),
            },
            "rank 1: all_reduce: the store at 10.77.0.1:29500 (rank 0's host) has not answered \
             for 61 s: this host lost its link, or rank 0's host is gone; no peer can be \
             reached",
        ),
        (
            DistError::PeerGone {
                rank: 0,
                op: "all_reduce",
                peer: Some(1),
                cause: "Connection closed by peer".into(),
            },
            "rank 0: all_reduce failed: rank 1 closed the connection",
        ),
        (
            DistError::PeerGone {
                rank: 0,
                op: "all_reduce",
                peer: None,
                cause: "Connection closed by peer".into(),
            },
            "rank 0: all_reduce failed: a peer closed the connection",
        ),
        (
            DistError::Timeout {
                rank: 2,
                op: "barrier",
                timeout: Duration::from_secs(10),
            },
            "rank 2: barrier timed out after 10s",
        ),
        (
            DistError::InvalidArgument {
                rank: 1,
                op: "send",
                problem: Box::new(ArgumentError::SelfPeer),
            },
            "rank 1: invalid argument to send: a rank cannot send to or receive from itself",
        ),
        (
            DistError::Mismatch {
                rank: 1,
                op: "replicate",
                mismatch: Box::new(Mismatch::Tensor {
                    what: "parameters",
                    fqn: "fc1.weight".into(),
                    reference_rank: 0,
                    reference: sig(&[8, 4]),
                    other_rank: 1,
                    other: sig(&[9, 4]),
                }),
            },
            "rank 1: replicate: parameters differ across ranks: `fc1.weight` has shape [8, 4] \
             (Float) on rank 0 but shape [9, 4] (Float) on rank 1",
        ),
        (
            DistError::PeersFailed {
                rank: 0,
                op: "replicate",
                ranks: vec![1],
            },
            "rank 0: replicate: rank 1 failed its own check (see its error); nothing was \
             changed",
        ),
        (
            DistError::PeersFailed {
                rank: 0,
                op: "replicate",
                ranks: vec![1, 2, 3],
            },
            "rank 0: replicate: ranks 1, 2 and 3 failed their own checks (see their error); \
             nothing was changed",
        ),
        (
            ReducerError::GraphChanged {
                rank: 1,
                op: "replicate",
                fqn: "b".into(),
                used_in_first_pass: true,
            }
            .into(),
            "rank 1: replicate: the training graph changed in this iteration: `b` got a \
             gradient in the first iteration but none in this one, which static_graph=true \
             does not allow",
        ),
        (
            ReducerError::GraphChanged {
                rank: 1,
                op: "replicate",
                fqn: "b".into(),
                used_in_first_pass: false,
            }
            .into(),
            "rank 1: replicate: the training graph changed in this iteration: `b` got no \
             gradient in the first iteration but one in this one, which static_graph=true \
             does not allow",
        ),
        (
            ReducerError::UnfinishedReduction {
                rank: 0,
                op: "replicate",
                indices: vec![2, 3],
                fqns: vec!["head.weight".into(), "head.bias".into()],
            }
            .into(),
            "rank 0: replicate failed: Expected to have finished reduction in the prior \
             iteration before starting a new one. This error indicates that your module has \
             parameters that were not used in producing loss. You can enable unused \
             parameter detection by passing `find_unused_parameters: true` in \
             replicate::Options, and by making sure all forward outputs participate in \
             calculating loss. Parameter indices which did not receive grad: 2 3. \
             Parameters which did not receive grad for rank 0: head.weight, head.bias",
        ),
        (
            ReducerError::GradientAfterLaunch {
                rank: 1,
                op: "replicate",
                fqn: "fc.weight".into(),
            }
            .into(),
            "rank 1: replicate: parameter `fc.weight` received a gradient after its \
             all-reduce had started (it was marked ready twice in one backward pass, e.g. \
             used in several reentrant backward passes or outside forward)",
        ),
        (
            DistError::Store {
                op: "get",
                key: "epoch".into(),
                cause: "wait timeout after 1000ms".into(),
            },
            "store get of `epoch` failed: wait timeout after 1000ms",
        ),
        (
            DistError::ShutDown {
                rank: 1,
                op: "all_reduce",
            },
            "rank 1: all_reduce failed: the process group was shut down \
             (ProcessGroup::shutdown or destroy_process_group)",
        ),
        (
            DistError::DuplicateDevice {
                rank: 1,
                first: 0,
                first_device: 0,
                second: 1,
                second_device: 0,
                host: "gpu-node-3".into(),
                gpu: Some("GPU-5e7c2a1b-0d3f-4c1e-9a2b-7f6e5d4c3b2a".into()),
            },
            "rank 1: init_process_group: rank 0 (cuda:0) and rank 1 (cuda:0) on gpu-node-3 \
             use the same GPU (GPU-5e7c2a1b-0d3f-4c1e-9a2b-7f6e5d4c3b2a); NCCL needs a GPU per \
             rank: start at most one rank per GPU, or give each rank its own device_id",
        ),
        (
            DistError::DuplicateDevice {
                rank: 0,
                first: 0,
                first_device: 1,
                second: 2,
                second_device: 1,
                host: "h".into(),
                gpu: None,
            },
            "rank 0: init_process_group: rank 0 (cuda:1) and rank 2 (cuda:1) on h use the \
             same GPU; NCCL needs a GPU per rank: start at most one rank per GPU, or give \
             each rank its own device_id",
        ),
        (
            DistError::Desync {
                rank: 1,
                op: "all_reduce",
                desync: Box::new(Desync::Differ {
                    calls: vec![
                        call(0, 3, "all_reduce", &[(&[4], Kind::Float)]),
                        call(1, 3, "all_reduce", &[(&[4], Kind::Int)]),
                    ],
                }),
            },
            "rank 1: all_reduce: the ranks called different collectives (TCH_DIST_DEBUG=DETAIL \
             checks each one before it runs): rank 0 called all_reduce of [4] (Float) on Cpu \
             as its collective 3, rank 1 called all_reduce of [4] (Int) on Cpu as its \
             collective 3; nothing was sent",
        ),
        (
            DistError::Desync {
                rank: 0,
                op: "broadcast",
                desync: Box::new(Desync::Differ {
                    calls: vec![
                        CollectiveCall {
                            root: Some(0),
                            ..call(0, 1, "broadcast", &[(&[4], Kind::Float)])
                        },
                        CollectiveCall {
                            root: Some(1),
                            ..call(1, 1, "broadcast", &[(&[4], Kind::Float)])
                        },
                    ],
                }),
            },
            "rank 0: broadcast: the ranks called different collectives (TCH_DIST_DEBUG=DETAIL \
             checks each one before it runs): rank 0 called broadcast from rank 0 of [4] \
             (Float) on Cpu as its collective 1, rank 1 called broadcast from rank 1 of [4] \
             (Float) on Cpu as its collective 1; nothing was sent",
        ),
        (
            DistError::Desync {
                rank: 0,
                op: "all_reduce",
                desync: Box::new(Desync::Missing {
                    call: call(0, 12, "all_reduce", &[(&[10], Kind::Float)]),
                    ranks: vec![1],
                    within: Some(Duration::from_secs(5)),
                    cause: "[Rank 0]: Ranks 1 failed to pass monitoredBarrier in 5000 ms".into(),
                }),
            },
            "rank 0: all_reduce: rank 1 did not reach this collective within 5s (rank 0 \
             called all_reduce of [10] (Float) on Cpu as its collective 12; \
             TCH_DIST_DEBUG=DETAIL checks that every rank calls each collective before it \
             runs)",
        ),
        (
            DistError::Desync {
                rank: 0,
                op: "barrier",
                desync: Box::new(Desync::Missing {
                    call: call(0, 2, "barrier", &[]),
                    ranks: vec![1, 2],
                    within: None,
                    cause: String::new(),
                }),
            },
            "rank 0: barrier: ranks 1 and 2 left (closed the connection) without reaching \
             this collective (rank 0 called barrier as its collective 2; \
             TCH_DIST_DEBUG=DETAIL checks that every rank calls each collective before it \
             runs)",
        ),
        (
            DistError::Desync {
                rank: 1,
                op: "broadcast",
                desync: Box::new(Desync::Unconfirmed {
                    call: call(1, 0, "broadcast", &[(&[2, 2], Kind::Double)]),
                    within: Some(Duration::from_secs(3)),
                    cause: String::new(),
                }),
            },
            "rank 1: broadcast: rank 1 called broadcast of [2, 2] (Double) on Cpu as its \
             collective 0, but rank 0 did not confirm within 3s that every rank called it \
             (see rank 0's error; TCH_DIST_DEBUG=DETAIL checks each collective before it \
             runs)",
        ),
        (
            DistError::Desync {
                rank: 2,
                op: "all_gather",
                desync: Box::new(Desync::Unconfirmed {
                    call: call(2, 0, "all_gather", &[(&[1], Kind::Int64)]),
                    within: None,
                    cause: String::new(),
                }),
            },
            "rank 2: all_gather: rank 2 called all_gather of [1] (Int64) on Cpu as its \
             collective 0, but rank 0 closed its connection before confirming that every \
             rank called it (see rank 0's error; TCH_DIST_DEBUG=DETAIL checks each \
             collective before it runs)",
        ),
        (
            DistError::Desync {
                rank: 0,
                op: "fully_shard",
                desync: Box::new(Desync::Elsewhere {
                    peer: 1,
                    call: Some("barrier"),
                    seq: 6,
                    own: 6,
                }),
            },
            "rank 0: fully_shard: rank 1 called barrier as its collective 6 on the group, \
             where this rank waits for its step-check header after 6: the ranks called \
             different collectives (TCH_DIST_DEBUG=DETAIL names each call)",
        ),
        (
            DistError::Desync {
                rank: 0,
                op: "replicate",
                desync: Box::new(Desync::Elsewhere {
                    peer: 2,
                    call: None,
                    seq: 3,
                    own: 2,
                }),
            },
            "rank 0: replicate: rank 2 called a collective as its collective 3 on the group, \
             where this rank waits for its step-check header after 2: the ranks called \
             different collectives (TCH_DIST_DEBUG=DETAIL names each call)",
        ),
        (
            DistError::Misuse {
                rank: 1,
                op: "replicate",
                problem: Box::new(MisuseProblem::Undecodable {
                    what: "a step check",
                    from: Some(0),
                }),
            },
            "rank 1: replicate failed: rank 0 sent a step check that this rank cannot decode \
             (another tch-dist build?)",
        ),
        (
            DistError::Misuse {
                rank: 0,
                op: "fully_shard",
                problem: Box::new(MisuseProblem::GradShape {
                    module: "fc".into(),
                    fqn: "fc.weight".into(),
                    shape: vec![4, 4],
                    expected: vec![2, 4],
                }),
            },
            "rank 0: fully_shard failed: module `fc`: `.grad` of `fc.weight` has shape [4, 4], \
             not its shard's [2, 4]",
        ),
        (
            DistError::Internal {
                rank: 1,
                op: "replicate",
                what: "not every bucket was launched",
            },
            "rank 1: replicate failed: internal error: not every bucket was launched",
        ),
        (
            DistError::NotInitialized,
            "the default process group is not initialized; call init_process_group first",
        ),
        (
            DistError::AlreadyInitialized,
            "the default process group is already initialized; call destroy_process_group \
             first",
        ),
    ];
    for (e, text) in cases {
        assert_eq!(e.to_string(), text);
    }
}

fn call(rank: usize, seq: u64, op: &str, tensors: &[(&[i64], Kind)]) -> CollectiveCall {
    CollectiveCall {
        rank,
        seq,
        op: op.into(),
        tensors: tensors
            .iter()
            .map(|(shape, kind)| CallTensor {
                signature: TensorSignature {
                    shape: shape.to_vec(),
                    kind: *kind,
                },
                device: Device::Cpu,
            })
            .collect(),
        root: None,
    }
}

/// Ranks with the same call are named together; a call's tensors on several devices
/// name each device.
#[test]
fn desync_calls_group_ranks() {
    let mut on_cuda = call(
        2,
        5,
        "reduce_scatter_tensor",
        &[(&[8], Kind::Half), (&[4], Kind::Half)],
    );
    on_cuda.tensors[1].device = Device::Cuda(1);
    let d = Desync::Differ {
        calls: vec![
            call(0, 5, "barrier", &[]),
            call(1, 5, "barrier", &[]),
            on_cuda,
            call(3, 4, "barrier", &[]),
        ],
    };
    assert_eq!(
        d.to_string(),
        "the ranks called different collectives (TCH_DIST_DEBUG=DETAIL checks each one \
         before it runs): ranks 0 and 1 called barrier as their collective 5, rank 2 called \
         reduce_scatter_tensor of [8] (Half) on Cpu and [4] (Half) on Cuda(1) as its \
         collective 5, rank 3 called barrier as its collective 4; nothing was sent"
    );
}

#[test]
fn rendezvous_error_texts() {
    let cases: Vec<(RendezvousError, &str)> = vec![
        (
            RendezvousError::UnresolvableHost {
                host: "no-such-host.invalid".into(),
                cause: "failed to lookup address information: Name or service not known".into(),
            },
            "MASTER_ADDR `no-such-host.invalid` does not resolve: failed to lookup address \
             information: Name or service not known",
        ),
        (
            RendezvousError::NobodyListening {
                timeout: Duration::from_secs(3),
                cause: "Connection refused (os error 111)".into(),
            },
            "no rendezvous store accepted a connection within 3s (last attempt: Connection \
             refused (os error 111)); rank 0 hosts it: is rank 0 running, with the same \
             MASTER_ADDR and MASTER_PORT?",
        ),
        (
            RendezvousError::NeverJoined {
                ranks: vec![1],
                timeout: Duration::from_secs(10),
                refused: vec![],
            },
            "rank 1 never joined within 10s",
        ),
        (
            RendezvousError::NeverJoined {
                ranks: vec![1, 3],
                timeout: Duration::from_millis(2500),
                refused: vec![(3, "job-b".into())],
            },
            "ranks 1 and 3 never joined within 2.5s (a process of run `job-b` came as rank 3 \
             and was refused)",
        ),
        (
            RendezvousError::OtherRun {
                mine: "job-b".into(),
                theirs: "job-a".into(),
            },
            "this rank belongs to run `job-b` but the rendezvous store there belongs to run \
             `job-a` (TORCHELASTIC_RUN_ID): is MASTER_PORT another job's?",
        ),
        (
            RendezvousError::Engine {
                cause: "wait timeout".into(),
            },
            "wait timeout",
        ),
    ];
    for (e, text) in cases {
        assert_eq!(e.to_string(), text);
        let full = DistError::Rendezvous {
            rank: 1,
            addr: "h".into(),
            port: 1,
            problem: Box::new(e),
        };
        assert_eq!(
            full.to_string(),
            format!("rank 1: rendezvous with h:1 failed: {text}")
        );
    }
}

#[test]
fn env_error_texts() {
    let cases: Vec<(EnvError, &str)> = vec![
        (
            EnvError::NoWorldSize,
            "neither WORLD_SIZE nor SLURM_NTASKS is set",
        ),
        (
            EnvError::NotAnInteger {
                var: "RANK",
                value: "x".into(),
            },
            "RANK=\"x\" is not a non-negative integer",
        ),
        (
            EnvError::ZeroWorldSize { var: "WORLD_SIZE" },
            "WORLD_SIZE=0: the world size must be at least 1",
        ),
        (
            EnvError::RankOutOfRange {
                rank_var: "RANK",
                rank: 2,
                world_var: "WORLD_SIZE",
                world_size: 2,
            },
            "RANK=2 is out of range for WORLD_SIZE=2 (ranks are 0..2)",
        ),
        (EnvError::EmptyMasterAddr, "MASTER_ADDR is empty"),
        (
            EnvError::NoMasterAddr,
            "MASTER_ADDR is not set (the rendezvous host, rank 0's address)",
        ),
        (
            EnvError::BadPort {
                value: "99999".into(),
            },
            "MASTER_PORT=\"99999\" is not a port number (1-65535)",
        ),
        (
            EnvError::BadTimeout {
                var: "TCH_DIST_TIMEOUT_SECS",
                value: "-1".into(),
            },
            "TCH_DIST_TIMEOUT_SECS=\"-1\" is not a positive number",
        ),
        (
            EnvError::NcclNotCompiled,
            "tch-dist was built without NCCL support",
        ),
        (
            EnvError::DeviceOutOfRange {
                from: "LOCAL_RANK",
                device: 1,
                count: 1,
            },
            "LOCAL_RANK 1 names CUDA device 1, but this process sees 1 CUDA device(s); start \
             at most one rank per GPU (or set device_id, CUDA_VISIBLE_DEVICES)",
        ),
        (
            EnvError::BadDebugLevel {
                var: "TCH_DIST_DEBUG",
                value: "all".into(),
            },
            "TCH_DIST_DEBUG=\"all\" is not a debug level (OFF, INFO or DETAIL)",
        ),
        (
            EnvError::BadSwitch {
                var: "TCH_DIST_NO_SHORTCUTS",
                value: "maybe".into(),
            },
            "TCH_DIST_NO_SHORTCUTS=\"maybe\" is not a switch (1, true, yes, on; or 0, false, \
             no, off)",
        ),
    ];
    for (e, text) in cases {
        assert_eq!(e.to_string(), text);
    }
}

#[test]
fn argument_error_texts() {
    let on = |rank| Placement::new(rank, Device::Cpu);
    let cases: Vec<(ArgumentError, &str)> = vec![
        (
            ArgumentError::RankNotInGroup {
                what: "src_rank",
                rank: 2,
                world_size: 2,
            },
            "src_rank 2 is not in a group of size 2",
        ),
        (ArgumentError::EmptyRankList, "the rank list is empty"),
        (
            ArgumentError::DuplicateRank { rank: 1 },
            "rank 1 is listed twice",
        ),
        (
            ArgumentError::NotPositive {
                option: "bucket_cap_mb",
                value: -1.0,
            },
            "bucket_cap_mb must be positive, got -1",
        ),
        (
            ArgumentError::PowerSgdRank,
            "PowerSGD: matrix_approximation_rank must be at least 1",
        ),
        (
            ArgumentError::PowerSgdStartIter {
                start_powersgd_iter: 1,
            },
            "PowerSGD: expected start_powersgd_iter > 1 if use_error_feedback or warm_start \
             is enabled (got 1), because PowerSGD can only be applied after the buckets are \
             rebuilt at the end of the first step",
        ),
        (
            ArgumentError::PowerSgdCompressionRate { value: -2.0 },
            "PowerSGD: min_compression_rate must be a non-negative number, got -2",
        ),
        (
            ArgumentError::NoGrad { fqn: "w".into() },
            "parameter `w` does not require grad",
        ),
        (
            ArgumentError::MixedDevices {
                fqn: "b".into(),
                device: Device::Cuda(0),
                first_fqn: "a".into(),
                first_device: Device::Cpu,
            },
            "parameter `b` is on Cuda(0) but `a` is on Cpu; a replicated module lives on one \
             device",
        ),
        (
            ArgumentError::PlacementRank {
                placement: on(3),
                world_size: 2,
            },
            "placement `rank:3/cpu` names rank 3, but the group has 2 ranks",
        ),
        (
            ArgumentError::PlacementNeedsCuda {
                placement: Placement::new(0, Device::Cuda(0)),
            },
            "placement `rank:0/cuda:0` needs CUDA, which is not available",
        ),
        (
            ArgumentError::LocalShards {
                expected: 1,
                got: 2,
            },
            "the global metadata places 1 shard(s) on this rank, got 2 that do not match it",
        ),
        (
            ArgumentError::LocalShardSignature {
                actual: sig(&[2, 2]),
                expected: sig(&[3, 2]),
            },
            "a local shard is [2, 2] (Float), its metadata says [3, 2] (Float)",
        ),
        (
            ArgumentError::LocalTensorCount { held: 0 },
            "local_tensor() needs exactly one local shard, this rank holds 0",
        ),
        (
            ArgumentError::MissingShard {
                offsets: vec![4, 0],
            },
            "this rank should hold the shard at offsets [4, 0] but does not",
        ),
    ];
    for (e, text) in cases {
        assert_eq!(
            invalid(e),
            format!("rank 1: invalid argument to op: {text}")
        );
    }
    let sharding = tch_dist_core::sharding::ShardingError::UnknownDtype { name: "f33".into() };
    assert_eq!(
        invalid(sharding.clone().into()),
        format!("rank 1: invalid argument to op: {sharding}")
    );
}

/// A position at `phase` after `forwards` and `backwards` passes, without `set_step`.
fn position(phase: Phase, forwards: u64, backwards: u64) -> StepPosition {
    StepPosition {
        phase,
        forwards,
        backwards,
        step: None,
    }
}

#[test]
fn mismatch_texts() {
    let named = |fqn: &str, shape: &[i64]| NamedSignature {
        fqn: fqn.into(),
        signature: sig(shape),
    };
    let cases: Vec<(Mismatch, &str)> =
        vec![
        (
            Mismatch::List {
                what: "parameters",
                reference_rank: 0,
                reference_len: 2,
                other_rank: 1,
                other_len: 1,
                index: 1,
                reference_entry: Some(named("fc.bias", &[4])),
                other_entry: None,
            },
            "parameters differ across ranks: rank 0 has 2 parameters and rank 1 has 1; entry 1 \
             is `fc.bias` with shape [4] (Float) on rank 0 but missing on rank 1",
        ),
        (
            Mismatch::OptionValue {
                option: "bucket_cap_mb".into(),
                values: vec!["25".into(), "10".into()],
            },
            "option `bucket_cap_mb` differs across ranks: rank 0 has 25, rank 1 has 10",
        ),
        (
            Mismatch::Shape {
                reference_rank: 0,
                reference: sig(&[10, 2]),
                other_rank: 2,
                other: sig(&[9, 2]),
            },
            "rank 0 passes a tensor of shape [10, 2] (Float), but rank 2 passed [9, 2] (Float)",
        ),
        (
            Mismatch::Step {
                other_rank: 1,
                other: position(Phase::Forward, 3, 1),
                this: position(Phase::Backward, 2, 2),
            },
            "rank 1 is in the forward of step 3 (3 forward and 1 backward passes) while this \
             rank is in the backward of step 2 (2 forward and 2 backward passes) (a rank skipped \
             or repeated a step, a forward or a backward)",
        ),
        (
            Mismatch::Program {
                other_rank: 1,
                position: position(Phase::Backward, 1, 1),
                other: PassProgram {
                    recorded: 0,
                    first: None,
                    settings: 0,
                },
                this: PassProgram {
                    recorded: 1,
                    first: None,
                    settings: 0,
                },
            },
            "rank 1's forward recorded 0 tensor-parallel collectives for its backward while \
             this rank's recorded 1, in the backward of step 1 (1 forward and 1 backward passes) \
             (activation checkpointing, no_grad or another model on some ranks only: the \
             backward passes would run different collectives)",
        ),
        (
            Mismatch::Program {
                other_rank: 0,
                position: position(Phase::Forward, 1, 0),
                other: PassProgram {
                    recorded: 0,
                    first: Some(CollectiveSignature::new(
                        "all_reduce (tensor-parallel forward)",
                        vec![2, 6, 8],
                        Kind::Float,
                    )),
                    settings: 0,
                },
                this: PassProgram::default(),
            },
            "rank 0 starts this pass with all_reduce (tensor-parallel forward) of [2, 6, 8] \
             (Float) while this rank starts it with no tensor-parallel collective, in the \
             forward of step 1 (1 forward and 0 backward passes) (the ranks' inputs differ: \
             every rank of a tensor-parallel group must get inputs of the same shapes, and run \
             the same layers)",
        ),
        (
            Mismatch::Program {
                other_rank: 1,
                position: position(Phase::Forward, 2, 1),
                other: PassProgram { settings: 7, ..Default::default() },
                this: PassProgram::default(),
            },
            "rank 1 runs this pass with other settings than this rank, in the forward of step 2 \
             (2 forward and 1 backward passes) (a fully_shard setter, set_gradient_divide_factor, \
             set_unshard_in_backward, set_is_last_backward or set_all_reduce_hook, was called on \
             some ranks only or with other values: call it on every rank alike)",
        ),
    ];
    for (m, text) in cases {
        assert_eq!(m.to_string(), text);
    }
}

#[test]
fn misuse_texts() {
    let cases = [
        (
            MisuseProblem::Undecodable {
                what: "tensor signatures",
                from: None,
            },
            "a rank sent tensor signatures that this rank cannot decode (another tch-dist \
             build?)",
        ),
        (
            MisuseProblem::NoSuchParameter { index: 7 },
            "no such parameter (index 7)",
        ),
        (
            MisuseProblem::GradientOrder,
            "rank 0's gradient order is not an order of this rank's parameters",
        ),
    ];
    for (problem, text) in cases {
        assert_eq!(problem.to_string(), text);
    }
}

#[test]
fn autograd_error_texts() {
    // The texts the split backward and the recomputation returned as Strings before they had
    // a type: the facade's messages around them do not change.
    assert_eq!(
        AutogradError::GradientCount {
            outputs: 2,
            grads: 3
        }
        .to_string(),
        "2 outputs but 3 gradients for them"
    );
    assert_eq!(
        AutogradError::Engine {
            message: "element 0 of tensors does not require grad".into()
        }
        .to_string(),
        "element 0 of tensors does not require grad"
    );
}
