//! Each rank all-reduces a tensor holding rank+1 and prints `rank=R world=W sum=S`.
//!
//! ```text
//! target/release/tch-dist-run --nproc-per-node 2 -- target/release/examples/allreduce
//! ```

use tch_dist::{init_process_group, Backend, ReduceOp};

#[path = "common/cli.rs"]
mod cli;

fn main() {
    cli::main_with(run);
}

fn run() -> Result<(), tch_dist::DistError> {
    let pg = init_process_group(Backend::Gloo)?;
    let t = tch::Tensor::from_slice(&[pg.rank() as f32 + 1.0]);
    pg.all_reduce(&t, ReduceOp::Sum)?;
    println!(
        "rank={} world={} sum={}",
        pg.rank(),
        pg.world_size(),
        t.double_value(&[0])
    );
    Ok(())
}
