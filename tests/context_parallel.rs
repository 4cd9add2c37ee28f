//! Context parallelism's all-to-all strategy (`ulysses_attention`) against the attention of
//! the whole sequence in one process: each rank's output and the gradients of its q, k and v
//! chunks are the whole attention's at its positions (float64, 1e-10), causal or not, at 2,
//! 3 and 4 ranks; misuse is refused on every rank.

use tch::{Device, Kind, Tensor};
use tch_dist::context_parallel::{ulysses_attention, AttentionOptions, CpError, CpProblem};
use tch_dist::testing::run_ranks;
use tch_dist::{DistError, OnRank, ProcessGroup};

const HEADS: i64 = 12; // divides by 2, 3 and 4
const CHUNK: i64 = 5; // positions per rank

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.size(), b.size());
    (a - b).abs().max().double_value(&[])
}

fn equals_whole_attention(pg: &ProcessGroup) {
    let (ranks, rank) = (pg.world_size() as i64, pg.rank() as i64);
    for causal in [false, true] {
        tch::manual_seed(3);
        let shape = [2, HEADS, ranks * CHUNK, 8];
        let whole: Vec<Tensor> = (0..3)
            .map(|_| Tensor::randn(shape, (Kind::Double, Device::Cpu)).set_requires_grad(true))
            .collect();
        let g = Tensor::randn(shape, (Kind::Double, Device::Cpu));
        let expected = Tensor::scaled_dot_product_attention::<Tensor>(
            &whole[0], &whole[1], &whole[2], None, 0.0, causal, None, false,
        );
        (&expected * &g).sum(Kind::Double).backward();
        let mine = |t: &Tensor| {
            t.detach()
                .narrow(2, rank * CHUNK, CHUNK)
                .copy()
                .set_requires_grad(true)
        };
        let (q, k, v) = (mine(&whole[0]), mine(&whole[1]), mine(&whole[2]));
        let opts = AttentionOptions {
            causal,
            ..Default::default()
        };
        let out = ulysses_attention(&q, &k, &v, pg, &opts).unwrap();
        let at_mine = |t: &Tensor| t.narrow(2, rank * CHUNK, CHUNK);
        assert!(
            max_diff(&out, &at_mine(&expected)) < 1e-10,
            "causal {causal}: the output"
        );
        (&out * at_mine(&g)).sum(Kind::Double).backward();
        for (name, local, w) in [
            ("q", &q, &whole[0]),
            ("k", &k, &whole[1]),
            ("v", &v, &whole[2]),
        ] {
            let d = max_diff(&local.grad(), &at_mine(&w.grad()));
            assert!(d < 1e-10, "causal {causal}: the gradient of {name}: {d}");
        }
    }
}

#[test]
fn ulysses_attention_equals_the_whole_attention_at_2_ranks_and_refuses_misuse() {
    run_ranks(
        "ulysses_attention_equals_the_whole_attention_at_2_ranks_and_refuses_misuse",
        2,
        |pg| {
            equals_whole_attention(&pg);
            let opts = AttentionOptions::default();
            // 3 heads over 2 ranks: refused on both, before any exchange.
            let odd = Tensor::zeros([1, 3, CHUNK, 8], (Kind::Double, Device::Cpu));
            match ulysses_attention(&odd, &odd, &odd, &pg, &opts) {
                Err(CpError::OnRank(OnRank { problem, .. })) => {
                    assert_eq!(problem, CpProblem::Heads { heads: 3, ranks: 2 })
                }
                other => panic!("expected a refusal, got {other:?}"),
            }
            // Rank 1's chunk is longer: the exchange refuses on both ranks.
            let len = if pg.rank() == 1 { CHUNK + 1 } else { CHUNK };
            let t = Tensor::zeros([1, HEADS, len, 8], (Kind::Double, Device::Cpu));
            match ulysses_attention(&t, &t, &t, &pg, &opts) {
                Err(CpError::Collective(DistError::Collective { cause, .. })) => {
                    assert!(cause.starts_with("rows of "), "{cause}")
                }
                other => panic!("expected a refusal, got {other:?}"),
            }
            // Still in step.
            equals_whole_attention(&pg);
        },
    );
}

#[test]
fn ulysses_attention_equals_the_whole_attention_at_3_ranks() {
    run_ranks(
        "ulysses_attention_equals_the_whole_attention_at_3_ranks",
        3,
        |pg| equals_whole_attention(&pg),
    );
}

#[test]
fn ulysses_attention_equals_the_whole_attention_at_4_ranks() {
    run_ranks(
        "ulysses_attention_equals_the_whole_attention_at_4_ranks",
        4,
        |pg| equals_whole_attention(&pg),
    );
}
