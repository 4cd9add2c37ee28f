//! replicate's correctness checks on CUDA tensors with NCCL at world size 1 (`make gpu-check`
//! stages this binary for the GPU machine; see docs/PERFORMANCE.md).
//!
//! ```text
//! target/release/examples/gpu_check            # creates its own one-rank NCCL group
//! target/release/examples/gpu_check --cpu      # the same checks on CPU with Gloo (a smoke
//!                                              # test of this program where there is no GPU)
//! ```
//!
//! The same assertions as tests/replicate.rs and runtime/tests/reducer.rs, on `Device::Cuda(0)`:
//! replicated training equals plain training (default buckets, one bucket, a bucket per
//! parameter, `gradient_as_bucket_view`, `find_unused_parameters`), `no_sync`, the fp16/bf16
//! hooks, mixed dtypes, the unused-parameter error, the bucket layout and stats. Prints one
//! `ok`/`FAILED` line per check and `gpu_check: N passed, M failed`; exits 1 on any failure
//! and 2 when CUDA is not available.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::OnceLock;

use tch::nn::{self, OptimizerConfig};
use tch::{Device, Kind, Tensor};
use tch_dist::{
    init_process_group_with, replicate, Backend, Call, CommHook, InitOptions, ProcessGroup,
    ReduceOp, Reducer, ReducerOptions,
};

#[path = "../tests/common/replicate_net.rs"]
mod replicate_net;
use replicate_net::{batch, net, BUCKETS_ONE_PER_PARAM, PARAM_FQNS};

/// The device every check runs on: `Cuda(0)`, or `Cpu` with `--cpu`.
static DEV: OnceLock<Device> = OnceLock::new();

fn dev() -> Device {
    DEV.get().copied().unwrap_or(Device::Cuda(0))
}

fn check_training(pg: &ProcessGroup) {
    let cases: Vec<(&str, replicate::Options, bool)> = vec![
        ("defaults", replicate::Options::default(), false),
        (
            "one bucket",
            replicate::Options {
                bucket_cap_mb: 1e6,
                ..Default::default()
            },
            false,
        ),
        (
            "a bucket per parameter",
            replicate::Options {
                bucket_cap_mb: 1e-9,
                ..Default::default()
            },
            false,
        ),
        (
            "gradient_as_bucket_view",
            replicate::Options {
                gradient_as_bucket_view: true,
                ..Default::default()
            },
            false,
        ),
        (
            "find_unused_parameters",
            replicate::Options {
                find_unused_parameters: true,
                ..Default::default()
            },
            true,
        ),
        (
            "device_id moves the input",
            replicate::Options {
                device_id: Some(dev().into()),
                ..Default::default()
            },
            false,
        ),
    ];
    for (name, opts, head) in cases {
        let d = replicate_net::train_both(pg, dev(), opts, head, 4);
        assert!(d < 1e-5, "{name}: max |replicate - plain| = {d}");
    }
}

fn check_state() {
    let vs = nn::VarStore::new(dev());
    let model = net(&vs, 8, false);
    let opts = replicate::Options {
        bucket_cap_mb: 1e-9,
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
}

fn check_no_sync(pg: &ProcessGroup) {
    let d = replicate_net::no_sync_vs_one_step(pg, dev(), 3);
    assert!(d < 1e-5, "no_sync: {d}");
}

fn check_unused_error() {
    let vs = nn::VarStore::new(dev());
    let model = net(&vs, 8, true);
    replicate::apply(&model, replicate::Options::default()).unwrap();
    let (x, y) = batch(0, dev());
    model.call(&x).mse_loss(&y, tch::Reduction::Mean).backward();
    let err = replicate::prepare_forward(&model).unwrap_err().to_string();
    assert!(
        err.contains("Expected to have finished reduction in the prior iteration")
            && err.ends_with("did not receive grad for rank 0: head.weight, head.bias"),
        "{err}"
    );
}

/// The reducer directly: an f32 and an f64 parameter on CUDA, plain SGD by hand, with
/// `opts`; returns the largest difference with the same steps without a reducer.
fn reducer_vs_plain(pg: &ProcessGroup, opts: ReducerOptions) -> f64 {
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
    for step in 0..4 {
        tch::manual_seed(100 + step);
        let x = Tensor::randn([5, 16], (Kind::Float, dev()));
        reducer.prepare_for_forward().unwrap();
        forward(&a, &x).backward();
        sgd(&a);
        forward(&b, &x).backward();
        sgd(&b);
    }
    assert_eq!(reducer.stats().steps, 4);
    a.iter()
        .zip(&b)
        .map(|((_, x), (_, y))| (x - y).abs().max().double_value(&[]))
        .fold(0.0, f64::max)
}

fn check_reducer_paths(pg: &ProcessGroup) {
    let d = reducer_vs_plain(pg, ReducerOptions::default());
    assert!(d < 1e-6, "mixed dtypes: {d}");
    let views = ReducerOptions {
        gradient_as_bucket_view: true,
        bucket_cap_mb: 1e6,
        first_bucket_bytes: usize::MAX,
        ..Default::default()
    };
    let d = reducer_vs_plain(pg, views);
    assert!(
        d < 1e-6,
        "gradient_as_bucket_view, one bucket per dtype: {d}"
    );
    let fp16 = ReducerOptions {
        comm_hook: CommHook::Fp16Compress,
        ..Default::default()
    };
    let d = reducer_vs_plain(pg, fp16);
    assert!(d < 2e-3, "fp16 compression: {d}");
    let bf16 = ReducerOptions {
        comm_hook: CommHook::Bf16Compress,
        ..Default::default()
    };
    let d = reducer_vs_plain(pg, bf16);
    assert!(d < 2e-2, "bf16 compression: {d}");
}

fn check_collectives(pg: &ProcessGroup) {
    let t = Tensor::arange(10, (Kind::Float, dev()));
    pg.all_reduce(&t, ReduceOp::Sum).unwrap();
    pg.all_reduce(&t, ReduceOp::Avg).unwrap();
    let expect = Tensor::arange(10, (Kind::Float, dev()));
    assert!(
        t.equal(&expect),
        "NCCL all_reduce at world size 1 changed the tensor"
    );
    let c = Tensor::arange(10, (Kind::Float, Device::Cpu));
    pg.all_reduce(&c, ReduceOp::Sum).unwrap();
    assert!(
        c.equal(&Tensor::arange(10, (Kind::Float, Device::Cpu))),
        "Gloo beside NCCL"
    );
}

fn main() {
    let cpu = std::env::args().skip(1).any(|a| a == "--cpu");
    let (device, backend) = if cpu {
        (Device::Cpu, Backend::Gloo)
    } else {
        (Device::Cuda(0), Backend::Nccl)
    };
    if !cpu && !tch::Cuda::is_available() {
        eprintln!("gpu_check: CUDA is not available on this machine; nothing to check");
        std::process::exit(2);
    }
    let _ = DEV.set(device);
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or(29511);
    let pg = match init_process_group_with(&InitOptions::new(backend, 0, 1, "127.0.0.1", port)) {
        Ok(pg) => pg,
        Err(e) => {
            eprintln!("gpu_check: cannot create a one-rank {backend:?} group: {e}");
            std::process::exit(1);
        }
    };
    println!(
        "gpu_check: on {device:?}, {} CUDA device(s), NCCL compiled: {}",
        tch::Cuda::device_count(),
        Backend::nccl_compiled()
    );
    type Check<'a> = (&'static str, Box<dyn Fn() + 'a>);
    let checks: Vec<Check> = vec![
        (
            "collectives (NCCL and Gloo)",
            Box::new(|| check_collectives(&pg)),
        ),
        (
            "replicate matches plain training",
            Box::new(|| check_training(&pg)),
        ),
        ("state: FQNs, buckets, stats", Box::new(check_state)),
        (
            "no_sync accumulates then averages",
            Box::new(|| check_no_sync(&pg)),
        ),
        (
            "unused parameter fails the next iteration",
            Box::new(check_unused_error),
        ),
        (
            "reducer: mixed dtypes, bucket views, fp16/bf16 hooks",
            Box::new(|| check_reducer_paths(&pg)),
        ),
    ];
    let (mut passed, mut failed) = (0, 0);
    for (name, check) in &checks {
        match catch_unwind(AssertUnwindSafe(check)) {
            Ok(()) => {
                passed += 1;
                println!("ok      {name}");
            }
            Err(e) => {
                failed += 1;
                let msg = e
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                println!("FAILED  {name}: {msg}");
            }
        }
    }
    println!("gpu_check: {passed} passed, {failed} failed");
    std::process::exit(if failed == 0 { 0 } else { 1 });
}
