//! `--mode loss_parallel`: what the loss keeps for backward with `loss_parallel` against the
//! gathered head (the moe part runs it at 2 ranks), the loss's own activations alone: a
//! column-parallel output layer's local logits (`Linear(256, 8192)` over the ranks, 2048
//! tokens: `[2048, 8192 / ranks]`, made before and requiring grad) once through
//! `sharding::loss_parallel`, once gathered (`functional::all_gather`, the column-parallel
//! layer's `output_layouts: Replicate`) and through `cross_entropy`. `BENCH`'s
//! `kept_local_bytes` and `kept_gathered_bytes` are the least that malloc holds after the
//! loss's forward beyond before it, over 5 tries (a try's allocator noise only adds).

use super::*;
use tch_dist::sharding::{functional, loss_parallel, LossParallelOptions};

const LP_VOCAB: i64 = 8192;
const LP_TOKENS: i64 = 2048;

pub(crate) fn loss_parallel_memory(
    _args: &Args,
    pg: &ProcessGroup,
) -> Result<(), Box<dyn std::error::Error>> {
    tch::manual_seed(0);
    let ranks = pg.world_size() as i64;
    let width = LP_VOCAB / ranks;
    let local =
        Tensor::randn([LP_TOKENS, width], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let targets = Tensor::randint(LP_VOCAB, [LP_TOKENS], (Kind::Int64, Device::Cpu));
    pg.broadcast(&targets, 0)?;
    let opts = LossParallelOptions::default();
    let sizes = vec![width; ranks as usize];
    let mut kept = [f64::INFINITY; 2];
    let mut losses = [0.0; 2];
    // The first tries warm the allocator; the least of the tries is the loss's own.
    for _ in 0..5 {
        let before = malloc_in_use();
        let loss = loss_parallel(&local, &targets, pg, &opts)?;
        kept[0] = kept[0].min(malloc_in_use() - before);
        loss.f_backward()?;
        losses[0] = loss.double_value(&[]);
        drop(loss);
        let before = malloc_in_use();
        let loss =
            functional::all_gather(&local, 1, &sizes, pg)?.cross_entropy_for_logits(&targets);
        kept[1] = kept[1].min(malloc_in_use() - before);
        loss.f_backward()?;
        losses[1] = loss.double_value(&[]);
    }
    let out = serde_json::json!({
        "impl": "tch-dist",
        "mode": "loss_parallel",
        "rank": pg.rank(),
        "world": pg.world_size(),
        "kept_local_bytes": kept[0],
        "kept_gathered_bytes": kept[1],
        "losses": losses,
        "median_ms": 0.0,
        "peak_rss_mib": rss_mib().0,
        "window": Window { wall_ms: 1.0, cpu_ms: 0.0, machine_busy_ms: 0.0 }.json(),
    });
    println!("BENCH {out}");
    pg.barrier()?;
    Ok(())
}
