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
//!    f32 reduction within bf16's precision.
//!
//! It ends with `gpu_check: N passed, M failed, K skipped (T s)`, exits 1 on any failure (or
//! after 300 s) and 2 when CUDA is not available. The ranks of 4. and 5. are this binary
//! again (`--pair-rank`, `--duplicate-rank`), started with torchrun's variables.

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

#[path = "../tests/common/replicate_net.rs"]
mod replicate_net;
use replicate_net::{
    batch, each_case_against_plain, local_loss, net, option_cases, Case, BUCKETS_ONE_PER_PARAM,
    PARAM_FQNS,
};

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

// ---------------------------------------------------------------------------------------
// 1. The default group: NCCL init, collectives, the reducer with the shortcuts
// ---------------------------------------------------------------------------------------

fn check_collectives(pg: &ProcessGroup) -> Outcome {
    if !cpu() {
        assert_eq!(pg.bound_device(), Some(Device::Cuda(0)));
    }
    let t = Tensor::arange(10, (Kind::Float, dev()));
    let work = pg.all_reduce_async(&t, ReduceOp::Sum).unwrap();
    assert_eq!(
        work.is_on_stream(),
        !cpu(),
        "an NCCL work waits on the stream"
    );
    work.wait().unwrap();
    pg.all_reduce(&t, ReduceOp::Avg).unwrap();
    let strided = Tensor::arange(20, (Kind::Float, dev())).view([10, 2]).tr();
    pg.broadcast(&strided, 0).unwrap();
    assert!(strided.equal(&Tensor::arange(20, (Kind::Float, dev())).view([10, 2]).tr()));
    assert!(
        t.equal(&Tensor::arange(10, (Kind::Float, dev()))),
        "all_reduce at world size 1 changed the tensor"
    );
    let c = Tensor::arange(10, (Kind::Float, Device::Cpu));
    let work = pg.all_reduce_async(&c, ReduceOp::Sum).unwrap();
    assert!(!work.is_on_stream(), "Gloo waits on the CPU");
    work.wait().unwrap();
    assert!(c.equal(&Tensor::arange(10, (Kind::Float, Device::Cpu))));
    Outcome::Pass
}

/// Collectives launched in each step after the first of `train`'s steps.
fn per_step(pg: &ProcessGroup, steps: usize, mut step: impl FnMut(usize)) -> Vec<u64> {
    let mut out = Vec::new();
    for i in 0..steps {
        let before = pg.launched_collectives();
        step(i);
        if i > 0 {
            out.push(pg.launched_collectives() - before);
        }
    }
    out
}

/// Replicated training on `pg` (world size 1) with `opts`: the collectives of each step
/// after the first.
fn replicate_per_step(pg: &ProcessGroup, opts: replicate::Options) -> Vec<u64> {
    let vs = nn::VarStore::new(dev());
    let model = net(&vs, 8, false);
    replicate::apply(
        &model,
        replicate::Options {
            process_group: Some(pg.clone()),
            ..opts
        },
    )
    .unwrap();
    let mut opt = nn::Sgd::default().build(&vs, 0.1).unwrap();
    per_step(pg, 3, |i| {
        opt.backward_step(&local_loss(&model, &batch(i, dev()), pg));
    })
}

fn check_shortcuts(pg: &ProcessGroup) -> Outcome {
    assert!(pg.skips_communication());
    let opts = replicate::Options {
        process_group: Some(pg.clone()),
        ..Default::default()
    };
    let d = replicate_net::train_both(pg, dev(), opts, false, 3);
    assert!(d < 1e-5, "max |replicate - plain| = {d}");
    let launched = replicate_per_step(pg, replicate::Options::default());
    assert_eq!(launched, vec![0, 0], "a group of one communicates nothing");
    Outcome::Pass
}

/// The reducer directly: an f32 and an f64 parameter, plain SGD by hand, with `opts`;
/// returns the largest difference with the same steps without a reducer, and the
/// collectives of each step after the first.
fn reducer_vs_plain(pg: &ProcessGroup, opts: ReducerOptions) -> (f64, Vec<u64>) {
    let make = || {
        tch::manual_seed(7);
        vec![
            (
                "w32".to_string(),
                (Tensor::randn([16, 8], (Kind::Float, dev())) * 0.5).set_requires_grad(true),
            ),
            (
                "w64".to_string(),
                (Tensor::randn([8, 3], (Kind::Double, dev())) * 0.5).set_requires_grad(true),
            ),
        ]
    };
    let (a, b) = (make(), make());
    let handles = a
        .iter()
        .map(|(n, t)| (n.clone(), t.shallow_clone()))
        .collect();
    let reducer = Reducer::new(handles, pg.clone(), opts).unwrap();
    let forward = |p: &[(String, Tensor)], x: &Tensor| {
        x.matmul(&p[0].1)
            .tanh()
            .to_kind(Kind::Double)
            .matmul(&p[1].1)
            .square()
            .mean(Kind::Double)
    };
    let sgd = |p: &[(String, Tensor)]| {
        tch::no_grad(|| {
            for (_, t) in p {
                let mut g = t.grad();
                let _ = t.shallow_clone().f_sub_(&(&g * 0.1)).unwrap();
                let _ = g.zero_();
            }
        })
    };
    let launched = per_step(pg, 4, |step| {
        tch::manual_seed(100 + step as i64);
        let x = Tensor::randn([5, 16], (Kind::Float, dev()));
        reducer.prepare_for_forward().unwrap();
        forward(&a, &x).backward();
        sgd(&a);
        forward(&b, &x).backward();
        sgd(&b);
    });
    assert_eq!(reducer.stats().steps, 4);
    let d = a
        .iter()
        .zip(&b)
        .map(|((_, x), (_, y))| (x - y).abs().max().double_value(&[]))
        .fold(0.0, f64::max);
    (d, launched)
}

fn check_reducer_with_shortcuts(pg: &ProcessGroup) -> Outcome {
    let (d, launched) = reducer_vs_plain(pg, ReducerOptions::default());
    assert!(d < 1e-6, "mixed dtypes: {d}");
    assert_eq!(launched, vec![0; 3]);
    let views = ReducerOptions {
        gradient_as_bucket_view: true,
        bucket_cap_mb: 1e6,
        first_bucket_bytes: usize::MAX,
        ..Default::default()
    };
    let (d, _) = reducer_vs_plain(pg, views);
    assert!(
        d < 1e-6,
        "gradient_as_bucket_view, one bucket per dtype: {d}"
    );
    // The compression hooks communicate even in a group of one: one bucket per dtype.
    for (hook, tol) in [
        (CommHook::Fp16Compress, 2e-3),
        (CommHook::Bf16Compress, 2e-2),
    ] {
        let opts = ReducerOptions {
            comm_hook: hook,
            ..Default::default()
        };
        let (d, launched) = reducer_vs_plain(pg, opts);
        assert!(d < tol, "{hook:?}: {d}");
        assert_eq!(launched, vec![2; 3], "{hook:?}: a bucket per dtype");
    }
    Outcome::Pass
}

// ---------------------------------------------------------------------------------------
// 2. A group of one without shortcuts: every replicate case communicates
// ---------------------------------------------------------------------------------------

/// The shared option cases (tests/common/replicate_net.rs) and this run's own (one bucket,
/// PowerSGD, `device_id`), all on `pg`.
fn replicate_cases(pg: &ProcessGroup) -> Vec<Case> {
    let full_rank = PowerSgdOptions {
        matrix_approximation_rank: 8,
        start_powersgd_iter: 2,
        min_compression_rate: 0.0,
        ..Default::default()
    };
    let mut cases = option_cases();
    // After "defaults", as the run has always listed it.
    cases.insert(
        1,
        Case {
            name: "one bucket",
            options: replicate::Options {
                bucket_cap_mb: 1e6,
                ..Default::default()
            },
            head: false,
        },
    );
    cases.extend([
        Case {
            name: "PowerSGD (full rank: exact)",
            options: replicate::Options {
                comm_hook: CommHook::PowerSgd(full_rank),
                ..Default::default()
            },
            head: false,
        },
        Case {
            name: "device_id moves the input",
            options: replicate::Options {
                device_id: Some(dev().into()),
                ..Default::default()
            },
            head: false,
        },
    ]);
    for case in &mut cases {
        case.options.process_group = Some(pg.clone());
    }
    cases
}

fn check_replicate_case(pg: &ProcessGroup, opts: replicate::Options, head: bool) -> Outcome {
    assert!(!pg.skips_communication());
    let before = pg.launched_collectives();
    let d = replicate_net::train_both(pg, dev(), opts, head, 4);
    assert!(d < 1e-5, "max |replicate - plain| = {d}");
    // apply's checks and broadcast, the rebuild, and every step's buckets.
    assert!(
        pg.launched_collectives() - before >= 4 + 4,
        "it communicated"
    );
    Outcome::Pass
}

fn check_bucket_counts(pg: &ProcessGroup) -> Outcome {
    let one = replicate_per_step(pg, replicate::Options::default());
    assert_eq!(one, vec![1, 1], "defaults: one bucket per step");
    let per_param = replicate::Options {
        bucket_cap_mb: 1e-9,
        ..Default::default()
    };
    assert_eq!(
        replicate_per_step(pg, per_param),
        vec![4, 4],
        "one collective per bucket"
    );
    Outcome::Pass
}

fn check_in_place_thresholds(pg: &ProcessGroup) -> Outcome {
    // Threshold 0: every gradient all-reduced in place, one collective each.
    let all = ReducerOptions {
        in_place_min_bytes: 0,
        ..Default::default()
    };
    let (d, launched) = reducer_vs_plain(pg, all);
    assert!(d < 1e-6, "in-place threshold 0: {d}");
    assert_eq!(launched, vec![2; 3], "in-place threshold 0");
    // Unlimited: nothing in place, every gradient through its flat bucket.
    let none = ReducerOptions {
        in_place_min_bytes: usize::MAX,
        bucket_cap_mb: 1e-9,
        first_bucket_bytes: 1,
        ..Default::default()
    };
    let (d, launched) = reducer_vs_plain(pg, none);
    assert!(d < 1e-6, "in-place threshold unlimited: {d}");
    assert_eq!(launched, vec![2; 3], "in-place threshold unlimited");
    for (hook, tol) in [
        (CommHook::Fp16Compress, 2e-3),
        (CommHook::Bf16Compress, 2e-2),
    ] {
        let opts = ReducerOptions {
            comm_hook: hook,
            ..Default::default()
        };
        let (d, _) = reducer_vs_plain(pg, opts);
        assert!(d < tol, "{hook:?}: {d}");
    }
    Outcome::Pass
}

fn check_no_sync(pg: &ProcessGroup) -> Outcome {
    // no_sync_vs_one_step applies replicate with the default group; this group is passed
    // explicitly through a one-case copy of it.
    let ((ref_vs, reference), (vs, model)) = {
        tch::manual_seed(3);
        let ref_vs = nn::VarStore::new(dev());
        let reference = net(&ref_vs, 8, false);
        tch::manual_seed(3);
        let vs = nn::VarStore::new(dev());
        let model = net(&vs, 8, false);
        let opts = replicate::Options {
            process_group: Some(pg.clone()),
            ..Default::default()
        };
        replicate::apply(&model, opts).unwrap();
        ((ref_vs, reference), (vs, model))
    };
    let k = 3;
    let mut opt = nn::Sgd::default().build(&vs, 0.1).unwrap();
    let mut ref_opt = nn::Sgd::default().build(&ref_vs, 0.1).unwrap();
    let mut total = Tensor::zeros([], (Kind::Float, dev()));
    for step in 0..k {
        let (x, y) = batch(step, dev());
        total +=
            tch::nn::Module::forward(&reference, &x).mse_loss(&y, tch::Reduction::Mean) / k as f64;
    }
    ref_opt.backward_step(&total);
    opt.zero_grad();
    let before = pg.launched_collectives();
    replicate::no_sync(&model, || {
        for step in 0..k - 1 {
            (local_loss(&model, &batch(step, dev()), pg) / k as f64).backward();
        }
    })
    .unwrap();
    assert_eq!(
        pg.launched_collectives(),
        before,
        "no_sync communicates nothing"
    );
    (local_loss(&model, &batch(k - 1, dev()), pg) / k as f64).backward();
    opt.step();
    let d = replicate_net::max_diff(&vs, &ref_vs);
    assert!(d < 1e-5, "no_sync: {d}");
    Outcome::Pass
}

/// `fully_shard` over `pg` (one rank): per-layer groups and the root against plain training
/// (AdamW, 1e-5), and with mixed precision (SGD, within bf16's precision).
fn check_fully_shard(pg: &ProcessGroup) -> Outcome {
    use tch_dist::fully_shard::{full_state_dict, MixedPrecisionPolicy};
    use tch_dist::{fully_shard, FsdpOptions};
    for mixed in [false, true] {
        tch::manual_seed(3);
        let ref_vs = nn::VarStore::new(dev());
        let reference = net(&ref_vs, 8, false);
        tch::manual_seed(3);
        let vs = nn::VarStore::new(dev());
        let model = net(&vs, 8, false);
        let mp = MixedPrecisionPolicy {
            param_dtype: mixed.then_some(Kind::BFloat16),
            reduce_dtype: mixed.then_some(Kind::Float),
            ..Default::default()
        };
        let opts = |output: Option<Kind>| FsdpOptions {
            process_group: Some(pg.clone()),
            mp_policy: MixedPrecisionPolicy {
                output_dtype: output,
                ..mp
            },
            ..Default::default()
        };
        fully_shard(&model.fc1, opts(None)).unwrap();
        fully_shard(&model, opts(mixed.then_some(Kind::Float))).unwrap();
        let (mut opt, mut ref_opt) = if mixed {
            (
                nn::Sgd::default().build(&vs, 0.2).unwrap(),
                nn::Sgd::default().build(&ref_vs, 0.2).unwrap(),
            )
        } else {
            (
                nn::AdamW::default().build(&vs, 1e-2).unwrap(),
                nn::AdamW::default().build(&ref_vs, 1e-2).unwrap(),
            )
        };
        let before = pg.launched_collectives();
        for step in 0..3 {
            let (x, y) = batch(step, dev());
            ref_opt.backward_step(
                &tch::nn::Module::forward(&reference, &x).mse_loss(&y, tch::Reduction::Mean),
            );
            opt.backward_step(&model.call(&x).mse_loss(&y, tch::Reduction::Mean));
        }
        assert!(
            pg.launched_collectives() > before,
            "fully_shard communicates"
        );
        let vars = ref_vs.variables();
        let d = full_state_dict(&model)
            .unwrap()
            .iter()
            .map(|(k, t)| (t - &vars[k]).abs().max().double_value(&[]))
            .fold(0.0, f64::max);
        let tol = if mixed { 5e-3 } else { 1e-5 };
        assert!(d < tol, "fully_shard (mixed precision: {mixed}): {d}");
        if mixed {
            assert!(d > 0.0, "computed in bf16");
        }
    }
    Outcome::Pass
}

fn check_state_and_unused_error(pg: &ProcessGroup) -> Outcome {
    let vs = nn::VarStore::new(dev());
    let model = net(&vs, 8, false);
    let opts = replicate::Options {
        bucket_cap_mb: 1e-9,
        process_group: Some(pg.clone()),
        ..Default::default()
    };
    replicate::apply(&model, opts).unwrap();
    let s = replicate::state(&model).unwrap();
    assert_eq!(s.param_fqns(), PARAM_FQNS);
    assert_eq!(s.buckets(), BUCKETS_ONE_PER_PARAM.map(|b| vec![b]));
    let mut opt = nn::Sgd::default().build(&vs, 0.1).unwrap();
    for step in 0..2 {
        let (x, y) = batch(step, dev());
        opt.backward_step(&model.call(&x).mse_loss(&y, tch::Reduction::Mean));
    }
    let st = s.stats();
    assert_eq!(st.steps, 2, "{st:?}");
    assert!(st.rebuilt, "{st:?}");
    assert_eq!(st.bytes, (8 * 4 + 8 + 3 * 8 + 3) * 4, "{st:?}");

    let vs = nn::VarStore::new(dev());
    let model = net(&vs, 8, true);
    let opts = replicate::Options {
        process_group: Some(pg.clone()),
        ..Default::default()
    };
    replicate::apply(&model, opts).unwrap();
    let (x, y) = batch(0, dev());
    model.call(&x).mse_loss(&y, tch::Reduction::Mean).backward();
    let err = replicate::prepare_forward(&model).unwrap_err().to_string();
    assert!(
        err.contains("Expected to have finished reduction in the prior iteration")
            && err.ends_with("did not receive grad for rank 0: head.weight, head.bias"),
        "{err}"
    );
    Outcome::Pass
}

// ---------------------------------------------------------------------------------------
// 3. The wait probe
// ---------------------------------------------------------------------------------------

/// This thread's CPU time.
fn thread_cpu() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime fills the timespec we own.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn check_wait_probe(pg: &ProcessGroup) -> Outcome {
    if cpu() {
        return Outcome::Skip("needs NCCL");
    }
    let big = Tensor::ones([64 << 20], (Kind::Float, dev())); // 256 MiB
    let a = Tensor::randn([8192, 8192], (Kind::Float, dev())) * 0.01;
    // Warm-up: NCCL's buffers for this size, and the matmul's kernels.
    pg.all_reduce(&big, ReduceOp::Sum).unwrap();
    let _ = a.matmul(&a);
    tch::Cuda::synchronize(0);
    let busy = || {
        let mut m = a.shallow_clone();
        for _ in 0..8 {
            m = m.matmul(&a);
        }
        m
    };
    // Stream-ordered: wait() returns while the GPU still runs the matmuls and the all_reduce.
    let launched = Instant::now();
    let _m = busy();
    let work = pg.all_reduce_async(&big, ReduceOp::Sum).unwrap();
    let pending = !work.is_completed();
    let (t0, c0) = (Instant::now(), thread_cpu());
    work.wait().unwrap();
    let (wait_wall, wait_cpu) = (t0.elapsed(), thread_cpu() - c0);
    tch::Cuda::synchronize(0);
    let gpu = launched.elapsed();
    // CPU-bounded: wait_timeout blocks until the GPU is done.
    let _m = busy();
    let mut work = pg.all_reduce_async(&big, ReduceOp::Sum).unwrap();
    let (t1, c1) = (Instant::now(), thread_cpu());
    work.wait_timeout(Duration::from_secs(60)).unwrap();
    let (bounded_wall, bounded_cpu) = (t1.elapsed(), thread_cpu() - c1);
    tch::Cuda::synchronize(0);
    println!(
        "figure  wait_probe: 256 MiB NCCL all_reduce behind 8 matmuls 8192^2 (GPU busy {:.1} ms \
         from launch to done): wait() returned after {:.3} ms wall, {:.3} ms CPU; \
         wait_timeout() after {:.1} ms wall, {:.1} ms CPU",
        ms(gpu),
        ms(wait_wall),
        ms(wait_cpu),
        ms(bounded_wall),
        ms(bounded_cpu)
    );
    println!("figure  wait_probe_wait_ms={:.3}", ms(wait_wall));
    println!("figure  wait_probe_wait_cpu_ms={:.3}", ms(wait_cpu));
    println!("figure  wait_probe_gpu_ms={:.1}", ms(gpu));
    assert!(
        pending,
        "the all_reduce was already done at launch: the probe is too short"
    );
    assert!(
        wait_wall < gpu / 5 && wait_wall < Duration::from_millis(20),
        "wait() blocked the CPU for {:.1} ms of {:.1} ms",
        ms(wait_wall),
        ms(gpu)
    );
    assert!(
        bounded_wall > gpu / 4,
        "wait_timeout() returned after {:.1} ms, before the GPU could be done",
        ms(bounded_wall)
    );
    Outcome::Pass
}

// ---------------------------------------------------------------------------------------
// 4, 5. Child ranks
// ---------------------------------------------------------------------------------------

/// Starts this binary as `n` ranks with `mode` and torchrun's variables plus `env`
/// (`tch_dist::testing::Launch`), waits for them (killing them at CHILD_LIMIT) and returns
/// each rank's (success, output).
fn spawn_ranks(mode: &str, n: usize, env: &[(&str, &str)]) -> Vec<(bool, String)> {
    let exe = std::env::current_exe().expect("this binary's path");
    let mut argv = vec![exe.to_string_lossy().into_owned(), mode.to_string()];
    if cpu() {
        argv.push("--cpu".into());
    }
    let mut launch = Launch::new(mode, n)
        .timeout(CHILD_LIMIT)
        .env("TCH_DIST_TIMEOUT_SECS", "60");
    for &(key, value) in env {
        launch = launch.env(key, value);
    }
    for rank in 0..n {
        launch = launch.rank_program(rank, argv.clone());
    }
    launch
        .run()
        .into_iter()
        .map(|o| (o.success(), format!("{}{}", o.stdout, o.stderr)))
        .collect()
}

fn check_children(what: &str, ranks: &[(bool, String)]) {
    for (rank, (ok, out)) in ranks.iter().enumerate() {
        assert!(*ok, "{what}: rank {rank} failed:\n{out}");
    }
}

fn check_gloo_pair() -> Outcome {
    // Both ranks on cuda:0 whatever the machine has: LOCAL_RANK=0 for both.
    let ranks = spawn_ranks(
        "--pair-rank",
        2,
        &[(CUDA_VIA_GLOO_ENV, "1"), ("LOCAL_RANK", "0")],
    );
    check_children("2 ranks through Gloo", &ranks);
    for (_, out) in &ranks {
        if let Some(line) = out.lines().find(|l| l.starts_with("pair rank 0")) {
            println!("        {line}");
        }
    }
    Outcome::Pass
}

/// One rank of the pair: two ranks, one device, CUDA through Gloo; replicated training on
/// halves of each batch equals single-process training on the whole batch.
fn pair_rank() -> Result<(), String> {
    let pg = init_process_group(backend()).map_err(|e| e.to_string())?;
    if !cpu() {
        assert!(pg.cuda_via_gloo(), "TCH_DIST_CUDA_VIA_GLOO=1 was not seen");
        assert_eq!(
            pg.bound_device(),
            Some(Device::Cuda(0)),
            "both ranks on cuda:0"
        );
    }
    assert_eq!(pg.world_size(), 2);
    let cases = option_cases();
    let count = cases.len();
    let worst = each_case_against_plain(&pg, dev(), cases, 4, 1e-5)?;
    let d = replicate_net::no_sync_vs_one_step(&pg, dev(), 3);
    if d >= 1e-5 {
        return Err(format!("no_sync: {d}"));
    }
    println!(
        "pair rank {}: {count} replicate cases and no_sync on {:?} with {} collectives, max |replicate - plain| = {worst:.2e}",
        pg.rank(),
        dev(),
        pg.launched_collectives()
    );
    Ok(())
}

fn check_duplicate_gpu() -> Outcome {
    let ranks = spawn_ranks("--duplicate-rank", 2, &[]);
    check_children("two ranks on one GPU", &ranks);
    if let Some(line) = ranks[0]
        .1
        .lines()
        .find(|l| l.starts_with("duplicate rank 0"))
    {
        println!("        {line}");
    }
    Outcome::Pass
}

/// One rank of the duplicate case: both ranks bind cuda:0 for NCCL; creating the group must
/// fail on both with `DuplicateDevice` naming ranks 0 and 1. On CPU, the same check with
/// made-up claims over Gloo.
fn duplicate_rank() -> Result<(), String> {
    let rank: usize = std::env::var("RANK")
        .ok()
        .and_then(|r| r.parse().ok())
        .ok_or("RANK is not set")?;
    let result = if cpu() {
        let pg = init_process_group(Backend::Gloo).map_err(|e| e.to_string())?;
        let claim = DeviceClaim {
            host: "made-up-host".into(),
            device: 0,
            uuid: None,
        };
        pg.verify_distinct_devices(&claim)
    } else {
        let opts = InitOptions::from_env(Backend::Nccl)
            .map_err(|e| e.to_string())?
            .with_device_id(0);
        init_process_group_with(&opts).map(|_| ())
    };
    match result {
        Err(
            e @ DistError::DuplicateDevice {
                first: 0,
                second: 1,
                first_device: 0,
                second_device: 0,
                ..
            },
        ) => {
            println!("duplicate rank {rank}: {e}");
            Ok(())
        }
        Err(e) => Err(format!(
            "expected DuplicateDevice for ranks 0 and 1, got: {e}"
        )),
        Ok(()) => Err("two ranks on one GPU were accepted".into()),
    }
}

/// Runs a child mode and exits: 0 on success, 1 with the message otherwise.
fn child(run: fn() -> Result<(), String>) -> ! {
    let result = catch_unwind(run)
        .unwrap_or_else(|e| Err(panic_text(&*e)))
        .map_err(|e| eprintln!("{e}"));
    destroy_process_group();
    std::process::exit(if result.is_ok() { 0 } else { 1 });
}

// ---------------------------------------------------------------------------------------
// 6. Shutdown
// ---------------------------------------------------------------------------------------

/// PyTorch's "nccl" (`Backend::NcclOnly`) at world size 1, under PyTorch 2.11's naming
/// (`default_pg/0//cuda//`): CUDA collectives and a barrier through NCCL; CPU tensors refused.
fn check_nccl_only() -> Outcome {
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

fn check_shutdown(default: &ProcessGroup, alone: &ProcessGroup) -> Outcome {
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

// ---------------------------------------------------------------------------------------

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
    // 6.
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
