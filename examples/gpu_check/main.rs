//! The GPU check: one run of at most 5 minutes on one GPU (`make gpu-check` stages it; see
//! docs/PERFORMANCE.md for what it prints).
//!
//! ```text
//! target/release/examples/gpu_check          # CUDA and NCCL on cuda:0 (exit 2 without CUDA)
//! target/release/examples/gpu_check --cpu    # the same flow on CPU with Gloo: everything
//!                                            # but the NCCL-only checks, which it skips
//! ```
//!
//! What it checks, each a line `ok`/`FAILED`/`skip`:
//!
//! 1. NCCL's eager init on `cuda:0` (`device_id`) in a one-rank group, NCCL and Gloo beside
//!    it, and the reducer's paths with the shortcuts of a group of one (mixed dtypes, bucket
//!    views, the fp16/bf16 buckets, which communicate anyway);
//! 2. in a second one-rank group created without shortcuts (the test switch
//!    `TCH_DIST_NO_SHORTCUTS`), every replicate case against plain training — defaults, one
//!    bucket, a bucket per parameter, `gradient_as_bucket_view`, `find_unused_parameters`,
//!    `static_graph`, PowerSGD, `no_sync`, in-place threshold 0 and unlimited — each
//!    communicating (collectives per step counted), the state and the unused-parameter
//!    error;
//! 3. a probe: the CPU time of `Work::wait` on a 256 MiB NCCL all_reduce queued behind
//!    ~100 ms of GPU work (stream-ordered: it must not wait for the GPU), against
//!    `wait_timeout`, which does;
//! 4. two ranks on `cuda:0` through Gloo (the test switch `TCH_DIST_CUDA_VIA_GLOO`), each on
//!    its half of every batch, against single-process training;
//! 5. two NCCL ranks both on `cuda:0`: a clean `DuplicateDevice` error naming both ranks, on
//!    both, before NCCL's "Duplicate GPU detected" (on CPU: the same check with made-up
//!    claims);
//! 6. shutdown with clones alive: later collectives fail with `ShutDown`, and the program
//!    exits with status 0 after `destroy_process_group`;
//! 7. (before 6.) `fully_shard` at world size 1 in the group without shortcuts (NCCL's
//!    all-gathers and reduce-scatters, storage released and restored on the device): per
//!    layer and root groups against plain training (AdamW), and with bf16 parameters and
//!    f32 reduction within bf16's precision;
//! 8. (before 6.) activation checkpointing: a block with dropout under a one-rank
//!    `fully_shard`, checkpointed, trains as without (the device's RNG state restored for
//!    the recomputation);
//! 9. (before 6.) pipeline parallelism: two ranks on `cuda:0` through Gloo, each one stage
//!    of a chain (`Schedule1F1B`, 4 microbatches), against one process training the whole
//!    chain;
//! 10. (before 6.) device meshes: FSDP x TP (`parallelize_module` over `tp`, `fully_shard`
//!     over `dp`) on a 1x1 mesh over NCCL, and on a 2x1 mesh of two ranks on `cuda:0`
//!     through Gloo, each against one process;
//! 11. (before 6.) the differentiable `all_to_all_single` over NCCL, `loss_parallel`, a MoE
//!     layer with expert parallelism and Ulysses attention, at world size 1 on the device,
//!     each against its one-device reference.
//! 12. (before 6.) fault tolerance: two replica groups of one rank on the device at a
//!     lighthouse this process serves, group 1 healing from group 0 at step 0, each step's
//!     gradients averaged across them, against one process.
//!
//! It ends with `gpu_check: N passed, M failed, K skipped (T s)`, exits 1 on any failure (or
//! after 300 s) and 2 when CUDA is not available. The ranks of 4., 5., 9. and 10. are this
//! binary again (`--pair-rank`, `--duplicate-rank`, `--pipeline-rank`, `--mesh-rank`),
//! started with torchrun's variables; the groups of 12. too (`--ft-group`, each a job of
//! one rank).
//!
//! | file | what it checks | PyTorch's counterpart |
//! | --- | --- | --- |
//! | `main.rs` | the device, the tally of checks, the order they run in | — |
//! | `default_group.rs` | 1. NCCL's eager init, collectives, the reducer with the shortcuts | `test_c10d_nccl.py` |
//! | `without_shortcuts.rs` | 2. and 7. every replicate case and `fully_shard` in a group of one that communicates | `test_c10d_nccl.py`'s DDP cases, `test_fully_shard_training.py` |
//! | `wait_probe.rs` | 3. `Work::wait` is stream-ordered, `wait_timeout` waits | `Work.wait` / `Work.synchronize` |
//! | `child_ranks.rs` | 4. two ranks on one GPU through Gloo, 5. the duplicate-GPU error | `test_c10d_nccl.py`'s duplicate-GPU test |
//! | `shutdown.rs` | 6. the NCCL-only backend, shutdown with clones alive | `destroy_process_group` |
//! | `activation_checkpoint.rs` | 8. activation checkpointing with dropout on the device | `test_checkpoint.py` (composable) |
//! | `pipeline.rs` | 9. a 2-stage pipeline of two ranks on one GPU through Gloo | `test_schedule_multiproc.py` |
//! | `new_layers.rs` | 11. `all_to_all_single`, `loss_parallel`, MoE expert parallelism, Ulysses attention on the device | `test_c10d_nccl.py`'s all-to-all, torchtitan's MoE and loss tests |
//! | `ft.rs` | 12. fault tolerance's heal and average with the parameters on the device | torchft's `manager_integ_test.py` |
//! | `mesh.rs` | 10. FSDP x TP on a 1x1 mesh (NCCL) and a 2x1 mesh (two ranks through Gloo) | `test_fully_shard_training.py`'s `TestFullyShard2DTraining` |

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use tch::nn::{self, OptimizerConfig};
use tch::{Device, Kind, Tensor};
use tch_dist::testing::{free_port, Launch};
use tch_dist::{
    destroy_process_group, init_process_group, init_process_group_with, replicate, Backend, Call,
    CommHook, DeviceClaim, DistError, InitOptions, PowerSgdOptions, ProcessGroup, ReduceOp,
    Reducer, ReducerOptions, CUDA_VIA_GLOO_ENV,
};

#[path = "../../tests/common/replicate_net.rs"]
mod replicate_net;
use replicate_net::{
    batch, each_case_against_plain, local_loss, net, option_cases, Case, BUCKETS_ONE_PER_PARAM,
    PARAM_FQNS,
};

mod activation_checkpoint;
mod child_ranks;
mod default_group;
mod ft;
mod mesh;
mod new_layers;
mod pipeline;
mod shutdown;
mod wait_probe;
mod without_shortcuts;
use activation_checkpoint::*;
use child_ranks::*;
use default_group::*;
use ft::*;
use mesh::*;
use new_layers::*;
use pipeline::*;
use shutdown::*;
use wait_probe::*;
use without_shortcuts::*;

/// The whole run's limit.
const LIMIT: Duration = Duration::from_secs(300);
/// The limit for a pair of child ranks.
const CHILD_LIMIT: Duration = Duration::from_secs(120);

/// The device every check runs on: `Cuda(0)`, or `Cpu` with `--cpu`.
static DEV: OnceLock<Device> = OnceLock::new();

fn dev() -> Device {
    DEV.get().copied().unwrap_or(Device::Cuda(0))
}

fn cpu() -> bool {
    dev() == Device::Cpu
}

fn backend() -> Backend {
    if cpu() {
        Backend::Gloo
    } else {
        Backend::Nccl
    }
}

/// What a check did when it did not panic.
enum Outcome {
    Pass,
    Skip(&'static str),
}

/// A one-rank group on cuda:0 (eagerly connected) or on CPU.
fn one_rank_group(shortcuts: bool) -> Result<ProcessGroup, DistError> {
    let mut opts = InitOptions::new(backend(), 0, 1, "127.0.0.1", free_port());
    if !cpu() {
        opts = opts.with_device_id(0);
    }
    if !shortcuts {
        opts = opts.without_shortcuts();
    }
    ProcessGroup::new(&opts)
}

fn panic_text(e: &(dyn std::any::Any + Send)) -> String {
    e.downcast_ref::<String>()
        .cloned()
        .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default()
}

struct Tally {
    passed: usize,
    failed: usize,
    skipped: usize,
}

impl Tally {
    fn run(&mut self, name: &str, check: impl FnOnce() -> Outcome) {
        let start = Instant::now();
        match catch_unwind(AssertUnwindSafe(check)) {
            Ok(Outcome::Pass) => {
                self.passed += 1;
                println!("ok      {name} ({:.1} s)", start.elapsed().as_secs_f64());
            }
            Ok(Outcome::Skip(why)) => {
                self.skipped += 1;
                println!("skip    {name} ({why})");
            }
            Err(e) => {
                self.failed += 1;
                println!("FAILED  {name}: {}", panic_text(&*e));
            }
        }
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let has = |flag: &str| args.iter().any(|a| a == flag);
    let _ = DEV.set(if has("--cpu") {
        Device::Cpu
    } else {
        Device::Cuda(0)
    });
    if !cpu() && !tch::Cuda::is_available() {
        eprintln!("gpu_check: CUDA is not available on this machine; nothing to check");
        std::process::exit(2);
    }
    if has("--pair-rank") {
        child(pair_rank);
    }
    if has("--duplicate-rank") {
        child(duplicate_rank);
    }
    if has("--pipeline-rank") {
        child(pipeline_rank);
    }
    if has("--mesh-rank") {
        child(mesh_rank);
    }
    if has("--ft-group") {
        child(ft_group);
    }
    let start = Instant::now();
    std::thread::spawn(move || {
        std::thread::sleep(LIMIT);
        println!(
            "FAILED  gpu_check: still running after {} s; stopping",
            LIMIT.as_secs()
        );
        std::process::exit(1);
    });
    println!(
        "gpu_check: on {:?}, {} CUDA device(s), NCCL compiled: {}",
        dev(),
        tch::Cuda::device_count(),
        Backend::nccl_compiled()
    );
    let mut tally = Tally {
        passed: 0,
        failed: 0,
        skipped: 0,
    };
    // 1. The default group: world size 1, NCCL on cuda:0, connected eagerly.
    let t0 = Instant::now();
    let mut opts = InitOptions::new(backend(), 0, 1, "127.0.0.1", free_port());
    if !cpu() {
        opts = opts.with_device_id(0);
    }
    let pg = match init_process_group_with(&opts) {
        Ok(pg) => pg,
        Err(e) => {
            println!(
                "FAILED  {backend:?} init on {:?}: {e}",
                dev(),
                backend = backend()
            );
            println!("gpu_check: 0 passed, 1 failed, 0 skipped");
            std::process::exit(1);
        }
    };
    let how = match pg.bound_device() {
        Some(d) => format!("device_id {d:?}, connected eagerly"),
        None => "no device".to_string(),
    };
    println!(
        "ok      {:?} init: world size 1, {how} ({:.1} s)",
        backend(),
        t0.elapsed().as_secs_f64()
    );
    println!("figure  init_ms={:.0}", ms(t0.elapsed()));
    tally.passed += 1;
    tally.run("collectives: NCCL on the stream, Gloo beside it", || {
        check_collectives(&pg)
    });
    tally.run(
        "world size 1 with shortcuts: nothing communicated, equals plain",
        || check_shortcuts(&pg),
    );
    tally.run(
        "reducer with shortcuts: mixed dtypes, bucket views, fp16/bf16 buckets",
        || check_reducer_with_shortcuts(&pg),
    );

    // 2. A second group of one, without shortcuts.
    let alone = match one_rank_group(false) {
        Ok(g) => g,
        Err(e) => {
            println!("FAILED  a group of one without shortcuts: {e}");
            println!(
                "gpu_check: {} passed, {} failed",
                tally.passed,
                tally.failed + 1
            );
            std::process::exit(1);
        }
    };
    for Case {
        name,
        options: opts,
        head,
    } in replicate_cases(&alone)
    {
        tally.run(&format!("without shortcuts, replicate: {name}"), || {
            check_replicate_case(&alone, opts, head)
        });
    }
    tally.run(
        "without shortcuts: one collective per bucket and step",
        || check_bucket_counts(&alone),
    );
    tally.run(
        "without shortcuts: in-place threshold 0 and unlimited, fp16/bf16",
        || check_in_place_thresholds(&alone),
    );
    tally.run(
        "without shortcuts: no_sync accumulates, then averages",
        || check_no_sync(&alone),
    );
    tally.run(
        "without shortcuts: state, and the unused-parameter error",
        || check_state_and_unused_error(&alone),
    );

    // 3-5.
    tally.run(
        "wait probe: Work::wait on a 256 MiB NCCL all_reduce",
        || check_wait_probe(&pg),
    );
    tally.run(
        "2 ranks on one device through Gloo (TCH_DIST_CUDA_VIA_GLOO) equal one process",
        check_gloo_pair,
    );
    tally.run(
        "2 NCCL ranks on one GPU: DuplicateDevice naming both, on both",
        check_duplicate_gpu,
    );
    tally.run(
        "NCCL only (PyTorch's \"nccl\"), world size 1: NCCL barrier, CPU tensors refused",
        check_nccl_only,
    );
    // 7.
    tally.run(
        "without shortcuts: fully_shard equals plain training; bf16 within its precision",
        || check_fully_shard(&alone),
    );
    // 8.
    tally.run(
        "activation checkpointing with dropout under fully_shard equals no checkpointing",
        || check_activation_checkpointing(&alone),
    );
    // 9.
    tally.run(
        "a 2-stage pipeline of 2 ranks on one device through Gloo equals one process",
        check_pipeline_pair,
    );
    // 10.
    tally.run(
        "FSDP x TP on a 1x1 mesh of the device equals one process",
        || check_mesh_one_device(&pg),
    );
    tally.run(
        "FSDP x TP on a 2x1 mesh of 2 ranks on one device through Gloo equals one process",
        check_mesh_pair,
    );
    // 6.
    tally.run(
        "all_to_all_single, loss_parallel, MoE expert parallelism, Ulysses and ring attention over the device's group equal their references",
        || check_new_layers(&pg),
    );
    // 12.
    tally.run(
        "fault tolerance: 2 replica groups on one device heal and average, equal to one process",
        check_ft_groups,
    );
    tally.run("shutdown with clones alive; destroy_process_group", || {
        check_shutdown(&pg, &alone)
    });
    drop(alone);
    drop(pg);
    println!(
        "gpu_check: {} passed, {} failed, {} skipped ({:.0} s)",
        tally.passed,
        tally.failed,
        tally.skipped,
        start.elapsed().as_secs_f64()
    );
    std::process::exit(if tally.failed == 0 { 0 } else { 1 });
}
