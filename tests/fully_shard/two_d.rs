//! FSDP x TP on a 2x2 mesh (`dp` x `tp`), PyTorch's order: `parallelize_module` over the
//! mesh's `tp` dim, then `fully_shard` over its `dp` dim, on tests/common/two_d_lm.rs's
//! model.

use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};
use tch_dist::checkpoint::{LoadOptions, SaveOptions, State};
use tch_dist::device_mesh::{init_device_mesh, DeviceMesh};
use tch_dist::sharding::parallelize_module;
use tch_dist::state_dict::{placements, Placement};
use tch_dist::testing::run_ranks;
use tch_dist::{fully_shard, Call, FsdpOptions, ProcessGroup};

use crate::max_diff_full;
use crate::two_d_lm::*;

/// The one-process reference and the FSDP x TP model on a `dp` x `tp` mesh, both from the
/// reference's values.
struct TwoD {
    mesh: DeviceMesh,
    ref_vs: nn::VarStore,
    reference: Lm,
    vs: nn::VarStore,
    m: Lm,
}

fn two_d(pg: &ProcessGroup, shape: [usize; 2]) -> TwoD {
    let mesh = init_device_mesh("cpu", &shape, &["dp", "tp"]).unwrap();
    tch::manual_seed(3);
    let ref_vs = nn::VarStore::new(Device::Cpu);
    let reference = lm(&ref_vs);
    // Per-rank values: every rank must start from the one process's.
    tch::manual_seed(3 + pg.rank() as i64 * 1000);
    let vs = nn::VarStore::new(Device::Cpu);
    let mut m = lm(&vs);
    // The values TP scatters come from tp rank 0, fully_shard's from dp rank 0: global
    // rank 0's in every piece, as the reference's.
    copy_values(&vs, &ref_vs);
    fsdp_x_tp(&mut m, &mesh).unwrap();
    TwoD {
        mesh,
        ref_vs,
        reference,
        vs,
        m,
    }
}

/// `from`'s values into `to`'s variables of the same names.
fn copy_values(to: &nn::VarStore, from: &nn::VarStore) {
    let from = from.variables();
    tch::no_grad(|| {
        for (fqn, t) in to.variables() {
            t.shallow_clone().copy_(&from[&fqn]);
        }
    });
}

/// 3 SGD-with-momentum steps of the reference on the whole batch and of the 2-D model on
/// its dp rank's half, `clip_grad_norm` compared at every step.
fn train(s: &TwoD) {
    let sgd = nn::Sgd {
        momentum: 0.9,
        ..Default::default()
    };
    let mut opt = sgd.build(&s.vs, 0.1).unwrap();
    let mut ref_opt = sgd.build(&s.ref_vs, 0.1).unwrap();
    for step in 0..3 {
        let (ids, targets) = batch(step, Device::Cpu);
        ref_opt.zero_grad();
        loss(&s.reference.forward(&ids), &targets).backward();
        let ref_norm = tch_dist::utils::clip_grad_norm(&s.reference, 1e9, 2.0).unwrap();
        ref_opt.step();
        opt.zero_grad();
        loss(
            &s.m.call(&dp_rows(&ids, &s.mesh)),
            &dp_rows(&targets, &s.mesh),
        )
        .backward();
        let norm = tch_dist::utils::clip_grad_norm(&s.m, 1e9, 2.0).unwrap();
        assert!(
            (norm - ref_norm).abs() < 1e-5 * ref_norm.max(1.0),
            "step {step}: clip_grad_norm {norm} vs one process {ref_norm}"
        );
        opt.step();
    }
    let diff = max_diff_full(&s.m, &s.ref_vs);
    assert!(
        diff < 1e-5,
        "FSDP x TP {:?} vs one process: {diff}",
        s.mesh.shape()
    );
}

/// FSDP x TP 2x2: 3 SGD-with-momentum steps on each dp rank's half of the batch equal one
/// process on the whole batch (1e-5), `clip_grad_norm` is the unsharded model's at every
/// step, and the placement record says where each piece is: `[Shard(0), Shard(d)]` over
/// `dp` then `tp`, the offsets adding up.
#[test]
fn fsdp_x_tp_on_a_2x2_mesh_equals_one_process() {
    run_ranks(
        "two_d::fsdp_x_tp_on_a_2x2_mesh_equals_one_process",
        4,
        |pg: ProcessGroup| {
            let s = two_d(&pg, [2, 2]);
            let (m, mesh) = (&s.m, &s.mesh);
            let dp = mesh.get_local_rank("dp").unwrap() as i64;
            let tp = mesh.get_local_rank("tp").unwrap() as i64;
            let record = placements(m);
            assert_eq!(record.len(), s.vs.trainable_variables().len());
            // blocks.0.fc1.weight [14, 8]: tp rows 7 each, then dp rows 4 and 3.
            let w = record
                .get(&m.blocks[0].fc1.ws)
                .expect("fc1.weight is sharded");
            assert_eq!(w.placements(), [Placement::Shard(0), Placement::Shard(0)]);
            assert_eq!(w.global_shape, [HIDDEN, WIDTH]);
            assert_eq!(w.offsets, [tp * 7 + dp * 4, 0]);
            assert_eq!(w.local_shape, [4 - dp, WIDTH]);
            assert_eq!(m.blocks[0].fc1.ws.size(), w.local_shape);
            // blocks.0.fc2.weight [8, 14]: tp columns 7 each, dp rows 4 each.
            let w = record
                .get(&m.blocks[0].fc2.ws)
                .expect("fc2.weight is sharded");
            assert_eq!(w.placements(), [Placement::Shard(0), Placement::Shard(1)]);
            assert_eq!(w.offsets, [dp * 4, tp * 7]);
            assert_eq!(w.local_shape, [4, 7]);
            // tok.weight [11, 8], vocab-parallel: tp rows 6 and 5, then dp rows.
            let w = record.get(&m.tok.ws).expect("tok.weight is sharded");
            let tp_rows = 6 - tp;
            let dp_chunk = (tp_rows + 1) / 2;
            assert_eq!(w.offsets, [tp * 6 + dp * dp_chunk, 0]);
            assert_eq!(
                w.local_shape,
                [(tp_rows - dp * dp_chunk).min(dp_chunk), WIDTH]
            );
            // The norm is whole over tp: fully_shard's rows only.
            let w = record
                .get(m.norm.ws.as_ref().unwrap())
                .expect("norm.weight");
            assert_eq!(w.placements(), [Placement::Shard(0)]);
            assert_eq!(w.offsets, [dp * 4]);
            train(&s);
            // Evaluation under no_grad computes the one process's logits.
            let (ids, _) = batch(7, Device::Cpu);
            let ours = tch::no_grad(|| m.call(&ids));
            let theirs = tch::no_grad(|| s.reference.forward(&ids));
            let d = (ours - theirs).abs().max().double_value(&[]);
            assert!(d < 1e-5, "no_grad logits: {d}");
        },
    );
}

/// Every rank seeded its own values and nothing copied them: the 2-D model starts from
/// global rank 0's values in every piece, the norm included, and trains as one process
/// from them (issue 41, item 4: the norm, which no tensor-parallel style names, was
/// broadcast only within each `dp` group, so the ranks at `tp` 1 kept their own, trained
/// apart and were saved so).
#[test]
fn fsdp_x_tp_starts_every_rank_from_rank_0s_values() {
    run_ranks(
        "two_d::fsdp_x_tp_starts_every_rank_from_rank_0s_values",
        4,
        |pg: ProcessGroup| {
            let mesh = init_device_mesh("cpu", &[2, 2], &["dp", "tp"]).unwrap();
            // Rank 0's seed: the one process's values are rank 0's. The norm is drawn too
            // (a LayerNorm starts as ones and zeros on every rank).
            let seeded = |seed: i64| {
                tch::manual_seed(seed);
                let vs = nn::VarStore::new(Device::Cpu);
                let m = lm(&vs);
                tch::no_grad(|| {
                    for t in [m.norm.ws.as_ref().unwrap(), m.norm.bs.as_ref().unwrap()] {
                        t.shallow_clone()
                            .copy_(&(Tensor::randn(t.size(), (Kind::Float, Device::Cpu)) + 1));
                    }
                });
                (vs, m)
            };
            let (ref_vs, reference) = seeded(3);
            let (vs, mut m) = seeded(3 + pg.rank() as i64 * 1000);
            fsdp_x_tp(&mut m, &mesh).unwrap();
            let s = TwoD {
                mesh,
                ref_vs,
                reference,
                vs,
                m,
            };
            let diff = max_diff_full(&s.m, &s.ref_vs);
            assert!(
                diff == 0.0,
                "rank {}: not rank 0's values: {diff}",
                pg.rank()
            );
            train(&s);
        },
    );
}

/// AdamW (tch-dist's, on libtorch's fused kernel) on both sides: every parameter's gradient
/// is a real one here (no attention key bias), so the 2-D steps equal one process's too.
#[test]
fn fsdp_x_tp_with_adamw_equals_one_process() {
    run_ranks(
        "two_d::fsdp_x_tp_with_adamw_equals_one_process",
        4,
        |pg: ProcessGroup| {
            let s = two_d(&pg, [2, 2]);
            let adamw = || tch_dist::optim::AdamW::default();
            let mut opt = adamw().build(&s.vs, 1e-2).unwrap();
            let mut ref_opt = adamw().build(&s.ref_vs, 1e-2).unwrap();
            for step in 0..3 {
                let (ids, targets) = batch(step, Device::Cpu);
                ref_opt
                    .backward_step(&loss(&s.reference.forward(&ids), &targets))
                    .unwrap();
                let logits = s.m.call(&dp_rows(&ids, &s.mesh));
                opt.backward_step(&loss(&logits, &dp_rows(&targets, &s.mesh)))
                    .unwrap();
            }
            let diff = max_diff_full(&s.m, &s.ref_vs);
            assert!(
                diff < 1e-5,
                "FSDP x TP 2x2 with AdamW vs one process: {diff}"
            );
        },
    );
}

/// The degenerate meshes: 4 x 1 (fully_shard over all four ranks, tensor parallelism over
/// one: plain FSDP) and 1 x 4 (tensor parallelism over four, fully_shard over one: plain
/// TP, every table and layer split 4 ways unevenly) train like one process too.
#[test]
fn fsdp_x_tp_on_4x1_and_1x4_meshes_equals_one_process() {
    run_ranks(
        "two_d::fsdp_x_tp_on_4x1_and_1x4_meshes_equals_one_process",
        4,
        |pg: ProcessGroup| {
            for shape in [[4, 1], [1, 4]] {
                let s = two_d(&pg, shape);
                train(&s);
                let record = placements(&s.m);
                let w = record.get(&s.m.blocks[0].fc1.ws).expect("fc1.weight");
                assert_eq!(w.placements(), [Placement::Shard(0), Placement::Shard(0)]);
                assert_eq!(w.global_shape, [HIDDEN, WIDTH]);
            }
        },
    );
}

/// The trained 2x2 model's checkpoint: every rank writes its own 2-D pieces; tch-dist
/// reloads it at 4 x 1 (fully_shard over 4 ranks of a 1-rank tp dim) and into a plain
/// model on every rank; PyTorch's `dcp.load` reads it into a plain model in one process and
/// into its own 2x2 FSDP x TP model (torchrun, 4 ranks); all equal the one process.
#[test]
fn fsdp_x_tp_checkpoint_loads_at_other_layouts_and_into_pytorch() {
    run_ranks(
        "two_d::fsdp_x_tp_checkpoint_loads_at_other_layouts_and_into_pytorch",
        4,
        |pg: ProcessGroup| {
            use tch_dist::checkpoint;
            let s = two_d(&pg, [2, 2]);
            train(&s);
            let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("fsdp_x_tp_2x2");
            if pg.rank() == 0 {
                let _ = std::fs::remove_dir_all(&dir);
                std::fs::create_dir_all(&dir).unwrap();
            }
            pg.barrier().unwrap();
            let ckpt = dir.join("step-00000003");
            checkpoint::save(&ckpt, &State::new(&s.m), &pg, &SaveOptions::default()).unwrap();
            // Each rank holds pieces no other rank holds: all four write.
            for r in 0..4 {
                assert!(
                    ckpt.join(checkpoint::file_name(r)).exists(),
                    "rank {r}'s file"
                );
            }
            // 4 x 1: fully_shard over all four ranks, tensor parallelism over one.
            let mesh41 = init_device_mesh("cpu", &[4, 1], &["dp", "tp"]).unwrap();
            let vs41 = nn::VarStore::new(Device::Cpu);
            let mut m41 = lm(&vs41);
            fsdp_x_tp(&mut m41, &mesh41).unwrap();
            checkpoint::load(&ckpt, &mut State::new(&m41), &pg, &LoadOptions::default()).unwrap();
            let diff = max_diff_full(&m41, &s.ref_vs);
            assert!(diff < 1e-5, "loaded at 4 x 1: {diff}");
            // A plain model on every rank (what one process loads).
            let plain_vs = nn::VarStore::new(Device::Cpu);
            let plain = lm(&plain_vs);
            checkpoint::load(&ckpt, &mut State::new(&plain), &pg, &LoadOptions::default()).unwrap();
            let vars = s.ref_vs.variables();
            for (fqn, t) in plain_vs.variables() {
                let d = (&t - &vars[&fqn]).abs().max().double_value(&[]);
                assert!(d < 1e-5, "{fqn} loaded into a plain model: {d}");
            }
            if pg.rank() == 0 {
                let full = dir.join("full.safetensors");
                s.ref_vs.save(&full).unwrap();
                pytorch_loads(&ckpt, &full);
            }
        },
    );
}

/// PyTorch's `dcp.load` of `ckpt` (tests/fully_shard/pytorch_load_2d.py) at 2x2 and, on
/// its rank 0 first, in one process, each compared with `full`.
fn pytorch_loads(ckpt: &std::path::Path, full: &std::path::Path) {
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fully_shard/pytorch_load_2d.py");
    let out = crate::python::python_ranks(&script, &[ckpt, full], 4);
    let verdicts =
        std::iter::once("ok 1".to_string()).chain((0..4).map(|r| format!("ok rank {r} of 4")));
    crate::python::assert_verdicts(&out, verdicts, "PyTorch's load");
}

/// The 2-D refusals, on every rank, changing nothing: `fully_shard` given the mesh's `tp`
/// dim (the ranks that see the same data; `dp`'s would never average), and
/// `parallelize_module` after `fully_shard` on the same layers (their parameters are
/// fully_shard's shards).
#[test]
fn fsdp_x_tp_refusals_on_every_rank_change_nothing() {
    run_ranks(
        "two_d::fsdp_x_tp_refusals_on_every_rank_change_nothing",
        4,
        |_pg: ProcessGroup| {
            use crate::unchanged::{unchanged, values};
            use tch_dist::sharding::{PlanProblem, ShardProblem};
            use tch_dist::Composition;
            let mesh = init_device_mesh("cpu", &[2, 2], &["dp", "tp"]).unwrap();
            let tp = mesh.dim("tp").unwrap();
            let on = |dim: &str| FsdpOptions {
                mesh: Some(mesh.dim(dim).unwrap()),
                ..Default::default()
            };

            // fully_shard over tp after parallelize_module over tp.
            let vs = nn::VarStore::new(Device::Cpu);
            let mut m = lm(&vs);
            parallelize_module(&mut m, &tp, &tp_plan()).unwrap();
            let before = values(&vs);
            let err = fully_shard(&m.blocks[0], on("tp")).unwrap_err();
            let ranks = tp.get_group("tp").unwrap().global_ranks().to_vec();
            assert!(
                matches!(err.composition(), Some(Composition::TensorParallelDim { fqn, ranks: r, .. })
                    if fqn == "fc1.weight" && *r == ranks),
                "{err}"
            );
            assert!(
                err.to_string()
                    .contains("give fully_shard the data-parallel dim"),
                "{err}"
            );
            assert!(unchanged(&vs, &before));
            assert!(fully_shard::state(&m.blocks[0]).is_none());
            // The same model then takes dp, as it should.
            fully_shard(&m.blocks[0], on("dp")).unwrap();

            // parallelize_module after fully_shard on the same layers.
            let vs = nn::VarStore::new(Device::Cpu);
            let mut m = lm(&vs);
            for b in &m.blocks {
                fully_shard(b, on("dp")).unwrap();
            }
            let before = values(&vs);
            let err = parallelize_module(&mut m, &tp, &tp_plan()).unwrap_err();
            assert!(
                matches!(err.problem(), Some(ShardProblem::Plan { fqn, problem: PlanProblem::AlreadyManaged { param, api } })
                    if fqn == "blocks.0.fc1" && param == "blocks.0.fc1.weight" && *api == "fully_shard"),
                "{err}"
            );
            assert!(unchanged(&vs, &before));
            assert!(tch_dist::sharding::shard_module_state(&m).is_none());
        },
    );
}

/// A row-parallel layer inside a fully-sharded block run with `forward` (its hooks
/// bypassed: this rank's partial sum, never all-reduced) is an error on every rank, with
/// grad and under `no_grad`, naming the layer; the parameters stay as they were.
#[test]
fn fsdp_x_tp_bypassed_tensor_parallel_layer_is_an_error() {
    run_ranks(
        "two_d::fsdp_x_tp_bypassed_tensor_parallel_layer_is_an_error",
        4,
        |pg: ProcessGroup| {
            use crate::unchanged::{unchanged, values};
            let mut s = two_d(&pg, [2, 2]);
            s.m.blocks[1].bypass_fc2 = true;
            let before = values(&s.vs);
            let (ids, _) = batch(0, Device::Cpu);
            for grad in [true, false] {
                let out = if grad {
                    s.m.f_call(&ids)
                } else {
                    tch::no_grad(|| s.m.f_call(&ids))
                };
                let err = out.expect_err("a bypassed row-parallel layer").to_string();
                assert!(
                    err.contains("blocks.1.fc2") && err.contains(".call"),
                    "grad {grad}: {err}"
                );
            }
            assert!(unchanged(&s.vs, &before));
        },
    );
}
