//! Check 11, the layers of issues 44 and 46 on the device over the default group (NCCL on
//! `cuda:0`, world size 1): the differentiable `all_to_all_single` (NCCL's all-to-all),
//! `loss_parallel` against `cross_entropy`, a MoE layer with expert parallelism against
//! the same layer without, and Ulysses and ring attention against the whole attention (the
//! ring's blocks by plain ops on the device, its backward a custom autograd function).

use super::*;
use tch::nn::Module;
use tch_dist::context_parallel::{ring_attention, ulysses_attention, AttentionOptions, SeqLayout};
use tch_dist::nn::moe::{MoE, MoeConfig};
use tch_dist::sharding::{functional, loss_parallel, LossParallelOptions};

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).abs().max().double_value(&[])
}

/// 11: each against its one-device reference, on the device, within float32's precision.
pub(crate) fn check_new_layers(pg: &ProcessGroup) -> Outcome {
    let start = Instant::now();
    let f32_dev = (Kind::Float, dev());
    tch::manual_seed(5);
    // The exchange: at world size 1 every row comes back, its gradient too.
    let x = Tensor::randn([6, 4], f32_dev).set_requires_grad(true);
    let (y, from) = functional::all_to_all_single(&x, &[6], pg).expect("all_to_all_single");
    assert_eq!(from, [6]);
    assert_eq!(y.device(), dev());
    (&y * 2.0).sum(Kind::Float).backward();
    assert!(
        max_diff(&y, &x) == 0.0 && max_diff(&x.grad(), &x.ones_like().g_mul_scalar(2.0)) == 0.0
    );
    // loss_parallel on the whole vocabulary (one rank holds it all).
    let logits = Tensor::randn([8, 11], f32_dev).set_requires_grad(true);
    let targets = Tensor::randint(11, [8], (Kind::Int64, dev()));
    let got = loss_parallel(&logits, &targets, pg, &LossParallelOptions::default())
        .expect("loss_parallel");
    let want = logits.cross_entropy_for_logits(&targets);
    let loss_diff = max_diff(&got, &want);
    assert!(loss_diff < 1e-5, "loss_parallel differs by {loss_diff}");
    // A MoE layer with its experts "split" over the group of one, against the plain layer.
    let vs = nn::VarStore::new(dev());
    let config = MoeConfig {
        shared_hidden: Some(32),
        ..MoeConfig::new(16, 32, 4, 2)
    };
    let plain = MoE::new(&vs.root() / "plain", config.clone()).expect("a MoE layer");
    let mut ep_vs = nn::VarStore::new(dev());
    let mut ep = MoE::new(&ep_vs.root() / "plain", config).expect("a MoE layer");
    ep_vs.copy(&vs).expect("the same weights");
    ep.parallelize_experts(pg).expect("expert parallelism");
    let tokens = Tensor::randn([3, 5, 16], f32_dev);
    let moe_diff = max_diff(
        &ep.f_forward(&tokens).expect("the EP forward"),
        &plain.forward(&tokens),
    );
    assert!(moe_diff < 1e-5, "EP differs by {moe_diff}");
    // Ulysses attention at world size 1 is the whole attention.
    let q = Tensor::randn([2, 4, 16, 8], f32_dev);
    let (k, v) = (q.randn_like(), q.randn_like());
    let opts = AttentionOptions {
        causal: true,
        ..Default::default()
    };
    let att = ulysses_attention(&q, &k, &v, pg, &opts).expect("ulysses_attention");
    let whole =
        Tensor::scaled_dot_product_attention::<Tensor>(&q, &k, &v, None, 0.0, true, None, false);
    let att_diff = max_diff(&att, &whole);
    assert!(att_diff < 1e-5, "Ulysses differs by {att_diff}");
    // Ring attention at world size 1 (head-tail, causal): its output and the gradients of
    // q, k and v against the whole attention's.
    let leaf = |t: &Tensor| t.detach().copy().set_requires_grad(true);
    let (rq, rk, rv) = (leaf(&q), leaf(&k), leaf(&v));
    let opts = AttentionOptions {
        causal: true,
        layout: SeqLayout::HeadTail,
        ..Default::default()
    };
    let ring = ring_attention(&rq, &rk, &rv, pg, &opts).expect("ring_attention");
    let (wq, wk, wv) = (leaf(&q), leaf(&k), leaf(&v));
    let whole =
        Tensor::scaled_dot_product_attention::<Tensor>(&wq, &wk, &wv, None, 0.0, true, None, false);
    let g = whole.randn_like();
    (&ring * &g).sum(Kind::Float).backward();
    (&whole * &g).sum(Kind::Float).backward();
    let ring_diff = [
        max_diff(&ring, &whole),
        max_diff(&rq.grad(), &wq.grad()),
        max_diff(&rk.grad(), &wk.grad()),
        max_diff(&rv.grad(), &wv.grad()),
    ]
    .into_iter()
    .fold(0.0, f64::max);
    assert!(ring_diff < 1e-4, "ring attention differs by {ring_diff}");
    println!(
        "        on {:?} ({:?}): loss_parallel {loss_diff:.1e}, MoE EP {moe_diff:.1e}, Ulysses {att_diff:.1e}, ring {ring_diff:.1e} from their references ({:.1} ms)",
        dev(),
        pg.backend(),
        ms(start.elapsed())
    );
    Outcome::Pass
}
