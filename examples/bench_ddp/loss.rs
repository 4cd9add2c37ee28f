//! `--mode loss_parallel`: what the loss keeps for backward with `loss_parallel` against the
//! gathered head (the moe part runs it at 2 ranks). A column-parallel output layer
//! (`Linear(256, 8192)` over the ranks) on 2048 tokens: once with its logits left local and
//! `sharding::loss_parallel`, once gathered whole (`output_layouts: Replicate`) and
//! `cross_entropy`. `BENCH`'s `kept_local_bytes` and `kept_gathered_bytes` are what malloc
//! holds after each forward beyond before it (the input is made before), and
//! `kept_head_bytes` what the head alone keeps (its output summed, which keeps nothing of
//! it): the difference is what the loss keeps.

use super::*;
use tch_dist::device_mesh::init_device_mesh;
use tch_dist::sharding::{
    loss_parallel, parallelize_module, ColwiseParallel, Layout, LossParallelOptions,
    ParallelizePlan,
};

const LP_DIM: i64 = 256;
const LP_VOCAB: i64 = 8192;
const LP_TOKENS: i64 = 2048;

/// The output layer, `output`.
#[derive(Debug, Shardable)]
struct Head {
    output: nn::Linear,
}

impl Module for Head {
    fn forward(&self, x: &Tensor) -> Tensor {
        self.output.call(x)
    }
}

fn head(vs: &nn::VarStore, output_layouts: Layout) -> Result<Head, Box<dyn std::error::Error>> {
    let config = nn::LinearConfig {
        bias: false,
        ..Default::default()
    };
    let mut head = Head {
        output: nn::linear(vs.root() / "output", LP_DIM, LP_VOCAB, config),
    };
    let mesh = init_device_mesh("cpu", &[tch_dist::default_group()?.world_size()], &["tp"])?;
    let style = ColwiseParallel {
        output_layouts,
        ..Default::default()
    };
    parallelize_module(
        &mut head,
        &mesh,
        &ParallelizePlan::new().style("output", style),
    )?;
    Ok(head)
}

pub(crate) fn loss_parallel_memory(
    _args: &Args,
    pg: &ProcessGroup,
) -> Result<(), Box<dyn std::error::Error>> {
    tch::manual_seed(0);
    let (vs_local, vs_whole) = (
        nn::VarStore::new(Device::Cpu),
        nn::VarStore::new(Device::Cpu),
    );
    let local = head(&vs_local, Layout::Shard(-1))?;
    let whole = head(&vs_whole, Layout::Replicate)?;
    let x = Tensor::randn([LP_TOKENS, LP_DIM], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let targets = Tensor::randint(LP_VOCAB, [LP_TOKENS], (Kind::Int64, Device::Cpu));
    pg.broadcast(&targets, 0)?;
    let opts = LossParallelOptions::default();
    let mut kept = [0.0; 3];
    let mut losses = [0.0; 2];
    // Twice each, the second measured (the first warms the allocator).
    for _ in 0..2 {
        let before = malloc_in_use();
        let loss = loss_parallel(&local.f_call(&x)?, &targets, pg, &opts)?;
        kept[0] = malloc_in_use() - before;
        loss.f_backward()?;
        losses[0] = loss.double_value(&[]);
        let before = malloc_in_use();
        let loss = whole.f_call(&x)?.cross_entropy_for_logits(&targets);
        kept[1] = malloc_in_use() - before;
        loss.f_backward()?;
        losses[1] = loss.double_value(&[]);
        let before = malloc_in_use();
        let sum = local.f_call(&x)?.sum(Kind::Float);
        kept[2] = malloc_in_use() - before;
        sum.f_backward()?;
    }
    let out = serde_json::json!({
        "impl": "tch-dist",
        "mode": "loss_parallel",
        "rank": pg.rank(),
        "world": pg.world_size(),
        "kept_local_bytes": kept[0],
        "kept_gathered_bytes": kept[1],
        "kept_head_bytes": kept[2],
        "losses": losses,
        "median_ms": 0.0,
        "peak_rss_mib": rss_mib().0,
        "window": Window { wall_ms: 1.0, cpu_ms: 0.0, machine_busy_ms: 0.0 }.json(),
    });
    println!("BENCH {out}");
    pg.barrier()?;
    Ok(())
}
