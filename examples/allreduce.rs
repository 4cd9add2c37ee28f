//! Each rank all-reduces a tensor holding rank+1 and prints `rank=R world=W sum=S`.
//!
//! ```text
//! target/release/tch-dist-run --nproc-per-node 2 -- target/release/examples/allreduce
//! ```

use tch_dist::{init_process_group, Backend, ReduceOp};

fn main() {
    let result = run();
    // Before the process exits, whatever happened: the default group's backends are shut
    // down (NCCL's threads must not outlive CUDA's teardown).
    tch_dist::destroy_process_group();
    if let Err(e) = result {
        eprintln!("error: {}", tch_dist::report(&e));
        std::process::exit(1);
    }
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
