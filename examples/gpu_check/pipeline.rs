//! Check 9, pipeline parallelism on the device: two ranks on `cuda:0` through Gloo (as check
//! 4), each one stage of a 3-layer chain (`Schedule1F1B`, 4 microbatches), the activations
//! and their gradients sent between the stages (staged through host memory for Gloo), equal
//! to one process training the whole chain on the device; stage 1's backwards split (the
//! input's gradient first, the weights' in a second engine run on the device).

use super::*;
use tch::nn::Module;
use tch_dist::pipelining::{PipelineStage, Schedule1F1B};

// The pipeline tests' model (tests/pipelining/composition.rs).
#[path = "../../tests/common/chain.rs"]
mod chain;
use chain::Chain;

/// The widths of [`Chain`]'s layers.
const DIMS: [i64; 4] = [32, 64, 48, 16];

fn mse(out: &Tensor, y: &Tensor) -> Tensor {
    out.mse_loss(y, tch::Reduction::Mean)
}

pub(crate) fn check_pipeline_pair() -> Outcome {
    check_pair_on_one_device(
        "--pipeline-rank",
        "a 2-stage pipeline through Gloo",
        "pipeline rank",
    )
}

/// One stage of the pair: stage 0 holds layer 0, stage 1 layers 1 and 2.
pub(crate) fn pipeline_rank() -> Result<(), String> {
    let pg = init_process_group(backend()).map_err(|e| e.to_string())?;
    let stage = pg.rank();
    let sgd = || nn::Sgd {
        momentum: 0.9,
        ..Default::default()
    };
    tch::manual_seed(3);
    let ref_vs = nn::VarStore::new(dev());
    let reference = Chain::new(&ref_vs, &DIMS, |_| true);
    let mut vs = nn::VarStore::new(dev());
    let part = Chain::new(&vs, &DIMS, |i| (i == 0) == (stage == 0));
    vs.copy(&ref_vs).map_err(|e| e.to_string())?;
    let mut ref_opt = sgd().build(&ref_vs, 0.05).map_err(|e| e.to_string())?;
    let mut opt = sgd().build(&vs, 0.05).map_err(|e| e.to_string())?;
    let stage_part = PipelineStage::with_forward(
        part,
        |m: &Chain, x: &Tensor, _train| m.f_call(x),
        stage,
        2,
        dev(),
        &pg,
    );
    let mut schedule = Schedule1F1B::new(stage_part, 4, mse).map_err(|e| e.to_string())?;
    let mut worst = 0f64;
    let start = Instant::now();
    for step in 0..3 {
        tch::manual_seed(100 + step);
        let x = Tensor::randn([16, DIMS[0]], (Kind::Float, dev()));
        let y = Tensor::randn([16, DIMS[3]], (Kind::Float, dev()));
        ref_opt.backward_step(&mse(&reference.forward(&x), &y));
        let mut losses = Vec::new();
        let (first, last) = (stage == 0, stage == 1);
        schedule
            .step(first.then_some(&x), last.then_some(&y), &mut losses)
            .map_err(|e| tch_dist::report(&e))?;
        opt.step();
        opt.zero_grad();
        let ref_vars = ref_vs.variables();
        for (fqn, t) in vs.variables() {
            let d = (&t - &ref_vars[&fqn]).abs().max().double_value(&[]);
            worst = worst.max(d);
        }
    }
    if worst >= 1e-4 {
        return Err(format!(
            "stage {stage}: differs from one process by {worst}"
        ));
    }
    // Stage 0 has no input gradient to send; stage 1 splits each of its 3 x 4 backwards.
    let splits = schedule.stage().split_backwards();
    let expected = if stage == 1 { 12 } else { 0 };
    if splits != expected {
        return Err(format!(
            "stage {stage}: {splits} split backwards, expected {expected}"
        ));
    }
    println!(
        "pipeline rank {}: stage {stage} of 2 on {:?}, 3 Schedule1F1B steps in {:.1} ms, {splits} split backwards, max |pipeline - one process| = {worst:.2e}",
        pg.rank(),
        dev(),
        ms(start.elapsed())
    );
    Ok(())
}
