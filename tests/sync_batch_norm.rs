//! `SyncBatchNorm` equals batch normalisation of the whole batch in one process (ranks as
//! real processes over 127.0.0.1): outputs, input gradients, parameter gradients summed over
//! the ranks, and running statistics; uneven batches at 3 ranks; eval mode and errors.

use tch::nn::{self, ModuleT};
use tch::{Device, Kind, Tensor};
use tch_dist::nn::sync_batch_norm::{sync_batch_norm, SyncBatchNorm, SyncBatchNormError};
use tch_dist::testing::run_ranks;
use tch_dist::{ProcessGroup, ReduceOp, Shardable};

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.size(), b.size());
    (a - b).abs().max().double_value(&[])
}

/// Each rank's rows of the whole batch: `sizes[r]` rows for rank r.
fn rows(x: &Tensor, sizes: &[i64], rank: usize) -> Tensor {
    let start: i64 = sizes[..rank].iter().sum();
    x.narrow(0, start, sizes[rank])
}

/// Trains 3 steps on batches split `sizes` over the ranks, against `nn::batch_norm2d` on
/// the whole batch in one process (loss: the sum over the whole batch of `y * probe`, so
/// that the ranks' losses add up to the reference's).
fn matches_one_process(pg: &ProcessGroup, sizes: &[i64]) {
    let rank = pg.rank();
    let n: i64 = sizes.iter().sum();
    let config = nn::BatchNormConfig {
        momentum: 0.3,
        ..Default::default()
    };
    let ref_vs = nn::VarStore::new(Device::Cpu);
    let reference = nn::batch_norm2d(ref_vs.root() / "bn", 3, config);
    let vs = nn::VarStore::new(Device::Cpu);
    let bn = sync_batch_norm(vs.root() / "bn", 3, config);
    // Non-trivial affine parameters, the same on both sides.
    tch::no_grad(|| {
        for (w, r) in [(&bn.ws, &reference.ws), (&bn.bs, &reference.bs)] {
            let values = Tensor::from_slice(&[0.5f32, 1.5, -2.0]);
            w.as_ref().unwrap().shallow_clone().copy_(&values);
            r.as_ref().unwrap().shallow_clone().copy_(&values);
        }
    });
    for step in 0..3 {
        tch::manual_seed(50 + step);
        let x = (Tensor::randn([n, 3, 4, 5], (Kind::Float, Device::Cpu)) * 2.0 + 1.0)
            .set_requires_grad(true);
        let probe = Tensor::randn([n, 3, 4, 5], (Kind::Float, Device::Cpu));
        let mine = rows(&x, sizes, rank).detach().set_requires_grad(true);
        let y = bn.forward_t(&mine, true);
        let y_ref = reference.forward_t(&x, true);
        let d = max_diff(&y, &rows(&y_ref, sizes, rank));
        assert!(d < 1e-5, "rank {rank} step {step}: output differs by {d}");
        (&y * rows(&probe, sizes, rank)).sum(Kind::Float).backward();
        (&y_ref * &probe).sum(Kind::Float).backward();
        let d = max_diff(&mine.grad(), &rows(&x.grad(), sizes, rank));
        assert!(
            d < 1e-4,
            "rank {rank} step {step}: input gradient differs by {d}"
        );
        for (fqn, p) in bn.named_parameters() {
            let total = p.grad().copy();
            pg.all_reduce(&total, ReduceOp::Sum).unwrap();
            let r = &ref_vs.variables()[&format!("bn.{fqn}")];
            let d = max_diff(&total, &r.grad());
            assert!(
                d < 1e-4,
                "rank {rank} step {step}: {fqn} gradient differs by {d}"
            );
            let _ = p.grad().zero_();
            let _ = r.grad().zero_();
        }
        let d = max_diff(&bn.running_mean, &reference.running_mean);
        assert!(d < 1e-5, "rank {rank}: running_mean differs by {d}");
        let d = max_diff(&bn.running_var, &reference.running_var);
        assert!(d < 1e-5, "rank {rank}: running_var differs by {d}");
    }
    // Eval mode: the running statistics, no communication (one rank alone could run it).
    let x = Tensor::randn([2, 3, 4, 5], (Kind::Float, Device::Cpu));
    let d = max_diff(&bn.forward_t(&x, false), &reference.forward_t(&x, false));
    assert!(d < 1e-6, "eval differs by {d}");
    assert_eq!(
        bn.named_buffers()
            .iter()
            .map(|(n, _)| n.as_str())
            .collect::<Vec<_>>(),
        ["running_mean", "running_var"]
    );
}

#[test]
fn equals_batch_norm_of_the_whole_batch_on_2_ranks() {
    run_ranks("equals_batch_norm_of_the_whole_batch_on_2_ranks", 2, |pg| {
        matches_one_process(&pg, &[4, 4]);
        // f16 input (4050 values per channel over the ranks): the statistics, accumulated in
        // f64, are the whole batch's within f16's precision.
        let vs = nn::VarStore::new(Device::Cpu);
        let bn = sync_batch_norm(vs.root() / "half", 1, Default::default());
        tch::manual_seed(3);
        let full = Tensor::randn([2, 1, 45, 45], (Kind::Float, Device::Cpu)) * 3.0 + 5.0;
        let mine = full.narrow(0, pg.rank() as i64, 1);
        let y = bn
            .forward_t(&mine.to_kind(Kind::Half), true)
            .to_kind(Kind::Float);
        let (w, b) = (bn.ws.as_ref().unwrap(), bn.bs.as_ref().unwrap());
        let expected = (&mine - full.mean(Kind::Float)) / (full.var(false) + 1e-5).sqrt()
            * w.detach().to_kind(Kind::Float)
            + b.detach().to_kind(Kind::Float);
        let d = max_diff(&y, &expected);
        assert!(d < 2e-2, "rank {}: f16 output differs by {d}", pg.rank());
    });
}

#[test]
fn uneven_batches_on_3_ranks_and_errors() {
    run_ranks("uneven_batches_on_3_ranks_and_errors", 3, |pg| {
        matches_one_process(&pg, &[5, 1, 3]);
        // The wrong number of channels: an error before any collective.
        let vs = nn::VarStore::new(Device::Cpu);
        let bn = SyncBatchNorm::from_batch_norm(
            nn::batch_norm1d(vs.root(), 4, Default::default()),
            1e-5,
            0.1,
        );
        let err = bn
            .f_forward_t(&Tensor::zeros([2, 3], (Kind::Float, Device::Cpu)), true)
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "SyncBatchNorm: expected an input [N, 4, ...], got [2, 3]"
        );
        // One value per channel over all ranks: rank 0 has one row, the others none.
        let rows = if pg.rank() == 0 { 1 } else { 0 };
        let err = bn
            .f_forward_t(&Tensor::zeros([rows, 4], (Kind::Float, Device::Cpu)), true)
            .unwrap_err();
        assert!(
            matches!(err, SyncBatchNormError::TooFewValues { rank, count: 1 } if rank == pg.rank()),
            "{err:?}"
        );
    });
}
