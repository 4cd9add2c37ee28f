//! Part 1, the default group: NCCL's eager init, collectives beside Gloo, and the reducer with
//! the shortcuts of a group of one.

use super::*;

pub(crate) fn check_collectives(pg: &ProcessGroup) -> Outcome {
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
pub(crate) fn per_step(pg: &ProcessGroup, steps: usize, mut step: impl FnMut(usize)) -> Vec<u64> {
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
pub(crate) fn replicate_per_step(pg: &ProcessGroup, opts: replicate::Options) -> Vec<u64> {
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

pub(crate) fn check_shortcuts(pg: &ProcessGroup) -> Outcome {
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
pub(crate) fn reducer_vs_plain(pg: &ProcessGroup, opts: ReducerOptions) -> (f64, Vec<u64>) {
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

pub(crate) fn check_reducer_with_shortcuts(pg: &ProcessGroup) -> Outcome {
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
