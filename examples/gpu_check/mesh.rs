//! Check 10, device meshes on the device: FSDP x TP (tests/common/two_d_lm.rs's model:
//! `parallelize_module` over the mesh's `tp` dim, then `fully_shard` over `dp`) on a 1x1
//! mesh of the one GPU over NCCL (the default group of one), and on a 2x1 mesh of two ranks
//! on `cuda:0` through Gloo (as check 4), each against one process training the model on
//! the device.

use super::*;
use tch::nn::Module;
use tch_dist::device_mesh::{init_device_mesh, DeviceMesh};

#[path = "../../tests/common/two_d_lm.rs"]
mod two_d_lm;
use two_d_lm::{batch, dp_rows, fsdp_x_tp, lm, loss};

/// The mesh's device type, as PyTorch names it.
fn device_type() -> &'static str {
    if cpu() {
        "cpu"
    } else {
        "cuda"
    }
}

/// 3 SGD-with-momentum steps of FSDP x TP on `mesh` (each dp rank on its rows) and of one
/// process on the whole batch; the largest difference of their full parameters.
fn train_on(mesh: &DeviceMesh) -> Result<f64, String> {
    let sgd = || nn::Sgd {
        momentum: 0.9,
        ..Default::default()
    };
    tch::manual_seed(3);
    let ref_vs = nn::VarStore::new(dev());
    let reference = lm(&ref_vs);
    let mut vs = nn::VarStore::new(dev());
    let mut m = lm(&vs);
    vs.copy(&ref_vs).map_err(|e| e.to_string())?;
    fsdp_x_tp(&mut m, mesh)?;
    let mut ref_opt = sgd().build(&ref_vs, 0.1).map_err(|e| e.to_string())?;
    let mut opt = sgd().build(&vs, 0.1).map_err(|e| e.to_string())?;
    for step in 0..3 {
        let (ids, targets) = batch(step, dev());
        ref_opt.backward_step(&loss(&reference.forward(&ids), &targets));
        let logits = m.f_call(&dp_rows(&ids, mesh)).map_err(|e| e.to_string())?;
        opt.backward_step(&loss(&logits, &dp_rows(&targets, mesh)));
    }
    let full = tch_dist::fully_shard::full_state_dict(&m).map_err(|e| tch_dist::report(&e))?;
    let ref_vars = ref_vs.variables();
    let mut worst = 0f64;
    for (fqn, t) in full {
        if t.device() != dev() {
            return Err(format!(
                "{fqn} gathered on {:?}, not {:?}",
                t.device(),
                dev()
            ));
        }
        worst = worst.max((&t - &ref_vars[&fqn]).abs().max().double_value(&[]));
    }
    Ok(worst)
}

/// 10a: a 1x1 mesh over the default group (NCCL on `cuda:0`, world size 1).
pub(crate) fn check_mesh_one_device(pg: &ProcessGroup) -> Outcome {
    let mesh = init_device_mesh(device_type(), &[1, 1], &["dp", "tp"]).expect("a 1x1 mesh");
    let start = Instant::now();
    let worst = train_on(&mesh).expect("FSDP x TP on a 1x1 mesh");
    assert!(worst < 1e-4, "1x1 mesh differs from one process by {worst}");
    println!(
        "        1x1 mesh on {:?} ({:?}, world size {}): 3 FSDP x TP steps in {:.1} ms, max |mesh - one process| = {worst:.2e}",
        dev(),
        pg.backend(),
        pg.world_size(),
        ms(start.elapsed())
    );
    Outcome::Pass
}

/// 10b: a 2x1 mesh of two ranks on `cuda:0` through Gloo.
pub(crate) fn check_mesh_pair() -> Outcome {
    check_pair_on_one_device("--mesh-rank", "a 2x1 mesh through Gloo", "mesh rank")
}

/// One rank of the 2x1 mesh (dp 2, tp 1).
pub(crate) fn mesh_rank() -> Result<(), String> {
    let pg = init_process_group(backend()).map_err(|e| e.to_string())?;
    let mesh =
        init_device_mesh(device_type(), &[2, 1], &["dp", "tp"]).map_err(|e| e.to_string())?;
    let start = Instant::now();
    let worst = train_on(&mesh)?;
    if worst >= 1e-4 {
        return Err(format!(
            "rank {}: differs from one process by {worst}",
            pg.rank()
        ));
    }
    println!(
        "mesh rank {}: {mesh} on {:?}, 3 FSDP x TP steps in {:.1} ms, max |mesh - one process| = {worst:.2e}",
        pg.rank(),
        dev(),
        ms(start.elapsed())
    );
    Ok(())
}
