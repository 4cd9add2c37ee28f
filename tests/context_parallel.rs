//! Context parallelism against the attention of the whole sequence in one process: each
//! rank's output and the gradients of its q, k and v are the whole attention's at its
//! positions (float64, 1e-10; float32, 1e-5), ring and all-to-all, contiguous and head-tail,
//! causal or not, at 2, 3 and 4 ranks; `context_parallel` splits buffers in place and routes
//! `nn::scaled_dot_product_attention`; misuse is refused on every rank, nothing changed.

use tch::{Device, Kind, Tensor};
use tch_dist::context_parallel::{
    context_parallel, context_parallel_unshard, ring_attention, ulysses_attention,
    AttentionOptions, CpError, CpOptions, CpProblem, CpStrategy, SeqLayout,
};
use tch_dist::testing::run_ranks;
use tch_dist::{DistError, OnRank, ProcessGroup};

const HEADS: i64 = 12; // divides by 2, 3 and 4
const LOCAL: i64 = 6; // positions per rank: two head-tail chunks of 3

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.size(), b.size());
    (a - b).abs().max().double_value(&[])
}

#[derive(Debug, Clone, Copy)]
enum Strategy {
    Ring,
    Ulysses,
}

fn attention(
    strategy: Strategy,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    pg: &ProcessGroup,
    opts: &AttentionOptions,
) -> Result<Tensor, CpError> {
    match strategy {
        Strategy::Ring => ring_attention(q, k, v, pg, opts),
        Strategy::Ulysses => ulysses_attention(q, k, v, pg, opts),
    }
}

/// This rank's positions of the sequence, as an index.
fn positions(pg: &ProcessGroup, layout: SeqLayout) -> Tensor {
    let ranks = pg.world_size();
    Tensor::from_slice(&layout.positions(ranks as i64 * LOCAL, ranks, pg.rank()))
}

fn equals_whole_attention(pg: &ProcessGroup, strategy: Strategy, layout: SeqLayout, kind: Kind) {
    let ranks = pg.world_size() as i64;
    let tolerance = if kind == Kind::Double { 1e-10 } else { 1e-5 };
    let index = positions(pg, layout);
    for causal in [false, true] {
        tch::manual_seed(3);
        let shape = [2, HEADS, ranks * LOCAL, 8];
        let whole: Vec<Tensor> = (0..3)
            .map(|_| Tensor::randn(shape, (kind, Device::Cpu)).set_requires_grad(true))
            .collect();
        let g = Tensor::randn(shape, (kind, Device::Cpu));
        let expected = Tensor::scaled_dot_product_attention::<Tensor>(
            &whole[0], &whole[1], &whole[2], None, 0.0, causal, None, false,
        );
        (&expected * &g).sum(kind).backward();
        let at_mine = |t: &Tensor| t.index_select(2, &index);
        let mine = |t: &Tensor| at_mine(&t.detach()).set_requires_grad(true);
        let (q, k, v) = (mine(&whole[0]), mine(&whole[1]), mine(&whole[2]));
        let opts = AttentionOptions {
            causal,
            layout,
            ..Default::default()
        };
        let case = format!("{strategy:?} {layout:?} causal {causal} {kind:?}");
        let out = attention(strategy, &q, &k, &v, pg, &opts).unwrap();
        let d = max_diff(&out, &at_mine(&expected));
        assert!(d < tolerance, "{case}: the output: {d}");
        (&out * at_mine(&g)).sum(kind).backward();
        for (name, local, w) in [
            ("q", &q, &whole[0]),
            ("k", &k, &whole[1]),
            ("v", &v, &whole[2]),
        ] {
            let d = max_diff(&local.grad(), &at_mine(&w.grad()));
            assert!(d < tolerance, "{case}: the gradient of {name}: {d}");
        }
    }
}

fn every_case(pg: &ProcessGroup) {
    for strategy in [Strategy::Ring, Strategy::Ulysses] {
        for layout in [SeqLayout::Contiguous, SeqLayout::HeadTail] {
            equals_whole_attention(pg, strategy, layout, Kind::Double);
        }
    }
    equals_whole_attention(pg, Strategy::Ring, SeqLayout::HeadTail, Kind::Float);
}

fn problem(result: Result<Tensor, CpError>) -> CpProblem {
    match result {
        Err(CpError::OnRank(OnRank { problem, .. })) => problem,
        other => panic!("expected a refusal, got {other:?}"),
    }
}

#[test]
fn attention_equals_the_whole_attention_at_2_ranks_and_refuses_misuse() {
    run_ranks(
        "attention_equals_the_whole_attention_at_2_ranks_and_refuses_misuse",
        2,
        |pg| {
            every_case(&pg);
            let opts = AttentionOptions::default();
            let zeros = |shape: &[i64]| Tensor::zeros(shape, (Kind::Double, Device::Cpu));
            // 3 heads over 2 ranks: the all-to-all refuses on both, before any exchange.
            let odd = zeros(&[1, 3, LOCAL, 8]);
            assert_eq!(
                problem(ulysses_attention(&odd, &odd, &odd, &pg, &opts)),
                CpProblem::Heads { heads: 3, ranks: 2 }
            );
            // Rank 1's chunk is longer: the all-to-all refuses on both ranks.
            let len = if pg.rank() == 1 { LOCAL + 1 } else { LOCAL };
            let t = zeros(&[1, HEADS, len, 8]);
            match ulysses_attention(&t, &t, &t, &pg, &opts) {
                Err(CpError::Collective(DistError::Collective { cause, .. })) => {
                    assert!(cause.starts_with("rows of "), "{cause}")
                }
                other => panic!("expected a refusal, got {other:?}"),
            }
            // ... and the ring names the difference on both.
            let expected = if pg.rank() == 0 {
                CpProblem::Disagree {
                    setting: "local positions",
                    this: LOCAL,
                    other_rank: 1,
                    other: LOCAL + 1,
                }
            } else {
                CpProblem::Disagree {
                    setting: "local positions",
                    this: LOCAL + 1,
                    other_rank: 0,
                    other: LOCAL,
                }
            };
            assert_eq!(problem(ring_attention(&t, &t, &t, &pg, &opts)), expected);
            // Head-tail with an odd number of positions on every rank: refused on both.
            let head_tail = AttentionOptions {
                causal: true,
                layout: SeqLayout::HeadTail,
                ..Default::default()
            };
            let t = zeros(&[1, 2, 5, 8]);
            assert_eq!(
                problem(ring_attention(&t, &t, &t, &pg, &head_tail)),
                CpProblem::OddHeadTail { positions: 5 }
            );
            // Integers on rank 1 only: its own refusal there, the peer's on rank 0.
            let t = if pg.rank() == 1 {
                Tensor::zeros([1, 2, 4, 8], (Kind::Int64, Device::Cpu))
            } else {
                zeros(&[1, 2, 4, 8])
            };
            let got = problem(ring_attention(&t, &t, &t, &pg, &opts));
            if pg.rank() == 0 {
                assert_eq!(got, CpProblem::PeerRefused { peer: 1 });
            } else {
                assert!(matches!(got, CpProblem::Kind { .. }), "{got:?}");
            }
            // Causal on one rank only: named on both.
            let mixed = AttentionOptions {
                causal: pg.rank() == 0,
                ..Default::default()
            };
            let t = zeros(&[1, 2, 4, 8]);
            assert!(matches!(
                problem(ring_attention(&t, &t, &t, &pg, &mixed)),
                CpProblem::Disagree {
                    setting: "causal",
                    ..
                }
            ));
            // Still in step.
            equals_whole_attention(&pg, Strategy::Ring, SeqLayout::HeadTail, Kind::Double);
        },
    );
}

#[test]
fn attention_equals_the_whole_attention_at_3_ranks() {
    run_ranks("attention_equals_the_whole_attention_at_3_ranks", 3, |pg| {
        every_case(&pg)
    });
}

#[test]
fn attention_equals_the_whole_attention_at_4_ranks() {
    run_ranks("attention_equals_the_whole_attention_at_4_ranks", 4, |pg| {
        every_case(&pg)
    });
}

/// A toy block: features from token ids (the same table on every rank), then causal
/// self-attention through `nn::scaled_dot_product_attention`.
fn toy_attention(ids: &Tensor, table: &Tensor) -> Tensor {
    let x = table
        .index_select(0, &ids.flatten(0, -1))
        .view([1, -1, 2, 4])
        .transpose(1, 2);
    tch_dist::nn::scaled_dot_product_attention(&x, &(&x * 0.5), &x.cos(), None, 0.0, true, None)
}

#[test]
fn context_parallel_splits_buffers_routes_attention_and_puts_them_back() {
    run_ranks(
        "context_parallel_splits_buffers_routes_attention_and_puts_them_back",
        2,
        |pg| {
            let (ranks, rank) = (pg.world_size(), pg.rank());
            tch::manual_seed(5);
            let table = Tensor::randn([16, 8], (Kind::Double, Device::Cpu)).set_requires_grad(true);
            let ids = Tensor::from_slice(&[3i64, 1, 4, 1, 5, 9, 2, 6]).view([1, 8]);
            let labels = &ids + 1;
            let whole = toy_attention(&ids, &table);
            let g = whole.randn_like();
            (&whole * &g).sum(Kind::Double).backward();
            let table_grad = table.grad().copy();
            let _ = table.grad().zero_();
            for strategy in [CpStrategy::Ring, CpStrategy::AllToAll] {
                let options = CpOptions {
                    strategy,
                    ..Default::default()
                };
                let layout = options.layout;
                let index = Tensor::from_slice(&layout.positions(8, ranks, rank));
                let out;
                {
                    let _cp = context_parallel(&pg, &[&ids, &labels], &[1, 1], &[&labels], options)
                        .unwrap();
                    assert_eq!(ids.size(), [1, 4]);
                    assert_eq!(
                        Vec::<i64>::try_from(&ids.view([-1])).unwrap(),
                        Vec::<i64>::try_from(
                            &Tensor::from_slice(&[3i64, 1, 4, 1, 5, 9, 2, 6])
                                .index_select(0, &index)
                        )
                        .unwrap()
                    );
                    out = toy_attention(&ids, &table);
                    let d = max_diff(&out, &whole.index_select(2, &index));
                    assert!(d < 1e-10, "{strategy:?}: the output: {d}");
                    (&out * g.index_select(2, &index))
                        .sum(Kind::Double)
                        .backward();
                }
                // ids is back whole; labels, not to be restored, stays split.
                assert_eq!(ids.size(), [1, 8]);
                assert_eq!(labels.size(), [1, 4]);
                // The table's gradient, summed over the ranks, is the whole model's.
                let grad = table.grad().copy();
                pg.all_reduce(&grad, tch_dist::ReduceOp::Sum).unwrap();
                let d = max_diff(&grad, &table_grad);
                assert!(d < 1e-10, "{strategy:?}: the table's gradient: {d}");
                let _ = table.grad().zero_();
                // labels is still split and held: attention outside the region is refused
                // (the model would attend within this rank's part).
                let x = Tensor::zeros([1, 2, 4, 4], (Kind::Double, Device::Cpu));
                match tch_dist::nn::f_scaled_dot_product_attention(
                    &x, &x, &x, None, 0.0, true, None,
                ) {
                    Err(CpError::OnRank(OnRank { problem, .. })) => {
                        assert_eq!(problem, CpProblem::SplitOutsideRegion { shape: vec![1, 4] })
                    }
                    other => panic!("expected a refusal, got {other:?}"),
                }
                let back = context_parallel_unshard(&pg, &[&out.detach()], &[2], layout).unwrap();
                assert!(max_diff(&back[0], &whole.detach()) < 1e-10);
                let labels_back = context_parallel_unshard(&pg, &[&labels], &[1], layout).unwrap();
                let mut handle = labels.shallow_clone();
                let _ = handle.set_source_tensor_(&labels_back[0]);
            }
            // A buffer left split and then dropped is forgotten.
            {
                let tmp = Tensor::zeros([1, 8], (Kind::Int64, Device::Cpu));
                let _cp =
                    context_parallel(&pg, &[&tmp], &[1], &[&tmp], CpOptions::default()).unwrap();
            }
            // Outside the region attention is plain again (and local).
            let plain = toy_attention(&ids, &table);
            assert!(max_diff(&plain, &whole) < 1e-12);

            // Misuse, refused on every rank, nothing split.
            let odd = Tensor::arange(6, (Kind::Int64, Device::Cpu)).view([1, 6]);
            let refusal = |r: Result<tch_dist::context_parallel::ContextParallel, CpError>| match r
            {
                Err(CpError::OnRank(OnRank { problem, .. })) => problem,
                Err(other) => panic!("expected a refusal, got {other:?}"),
                Ok(_) => panic!("expected a refusal"),
            };
            // 6 positions do not split into 4 head-tail chunks.
            assert_eq!(
                refusal(context_parallel(
                    &pg,
                    &[&ids, &odd],
                    &[1, 1],
                    &[],
                    CpOptions::default()
                )),
                CpProblem::SeqLen {
                    index: 1,
                    length: 6,
                    divisor: 4
                }
            );
            assert_eq!(ids.size(), [1, 8]);
            // A parameter is no buffer; on rank 1 only: the peer's refusal on rank 0.
            let param =
                Tensor::zeros([1, 8], (Kind::Float, Device::Cpu)).set_requires_grad(rank == 1);
            let got = refusal(context_parallel(
                &pg,
                &[&ids, &param],
                &[1, 1],
                &[],
                CpOptions::default(),
            ));
            if rank == 0 {
                assert_eq!(got, CpProblem::PeerRefused { peer: 1 });
            } else {
                assert_eq!(got, CpProblem::BufferRequiresGrad { index: 1 });
            }
            assert_eq!(ids.size(), [1, 8]);
            // A no-restore buffer that is not a buffer; a dim out of range.
            assert_eq!(
                refusal(context_parallel(
                    &pg,
                    &[&ids],
                    &[1],
                    &[&odd],
                    CpOptions::default()
                )),
                CpProblem::NoRestoreNotABuffer { index: 0 }
            );
            assert_eq!(
                refusal(context_parallel(
                    &pg,
                    &[&ids],
                    &[2],
                    &[],
                    CpOptions::default()
                )),
                CpProblem::BufferDim {
                    index: 0,
                    dim: 2,
                    ndim: 2
                }
            );
            // A mask inside the region; a region inside it, refused with nothing split.
            {
                let _cp = context_parallel(&pg, &[&ids], &[1], &[], CpOptions::default()).unwrap();
                assert_eq!(
                    refusal(context_parallel(
                        &pg,
                        &[&ids],
                        &[1],
                        &[],
                        CpOptions::default()
                    )),
                    CpProblem::Nested
                );
                assert_eq!(ids.size(), [1, 4]);
                let x = Tensor::zeros([1, 2, 4, 4], (Kind::Double, Device::Cpu));
                let mask = Tensor::ones([4, 4], (Kind::Bool, Device::Cpu));
                match tch_dist::nn::f_scaled_dot_product_attention(
                    &x,
                    &x,
                    &x,
                    Some(&mask),
                    0.0,
                    false,
                    None,
                ) {
                    Err(CpError::OnRank(OnRank { problem, .. })) => {
                        assert_eq!(problem, CpProblem::MaskOrDropout)
                    }
                    other => panic!("expected a refusal, got {other:?}"),
                }
            }
            assert_eq!(ids.size(), [1, 8]);
        },
    );
}
