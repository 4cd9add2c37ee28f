//! The checkpoint benchmark's tch side (bench/checkpoint.py runs it; docs/PERFORMANCE.md,
//! "Checkpoints").
//!
//! ```text
//! tch-dist-run --nproc-per-node 2 -- bench_checkpoint --mode save --dir DIR
//! tch-dist-run --nproc-per-node 4 -- bench_checkpoint --mode load --dir DIR/sync [--reads each|striped]
//! ```
//!
//! The model: 12 `Linear` layers alternating 2048 -> 4096 and 4096 -> 2048 (100.7M
//! parameters, 403 MB of float32), `fully_shard` on each layer, then the root (as
//! bench/pytorch_checkpoint.py builds it in PyTorch).
//!
//! - `save`: `checkpoint::save` into `DIR/sync`, then `checkpoint::async_save` into
//!   `DIR/async`: the time the call blocked the caller (staging) and the time to the end of
//!   its background write (`wait`).
//! - `load`: the model (other values) loaded from `--dir` with `--reads`: the time, the bytes
//!   the loader read, the kernel's `rchar` (bytes passed to read calls) and `read_bytes`
//!   (bytes fetched from storage: the driver drops the page cache first where it may), and
//!   the peak resident memory during the load above the resident memory before it (the
//!   peak is reset first through /proc/self/clear_refs), beside this rank's shard bytes and
//!   its largest tensor.
//!
//! Every rank prints one `BENCH {json}` line.

use std::path::PathBuf;
use std::time::Instant;

use tch::nn::{self, Module};
use tch::{Device, Tensor};
use tch_dist::checkpoint::{self, LoadOptions, Reads};
use tch_dist::checkpoint::{SaveOptions, State};
use tch_dist::{fully_shard, init_process_group, Backend, Call, FsdpOptions, Shardable};

#[path = "common/cli.rs"]
mod cli;
#[path = "common/memory.rs"]
#[allow(dead_code)] // status_kib: the resident set before and after a load is the reading here
mod memory;

/// 12 layers, 2048 -> 4096 -> 2048 -> ...: 100.7M parameters.
#[derive(Debug, Shardable)]
struct Big {
    layers: Vec<nn::Linear>,
}

impl Big {
    fn new(seed: i64) -> Big {
        tch::manual_seed(seed);
        let vs = nn::VarStore::new(Device::Cpu);
        let layers = (0..12)
            .map(|i| {
                let (i_dim, o_dim) = if i % 2 == 0 {
                    (2048, 4096)
                } else {
                    (4096, 2048)
                };
                nn::linear(vs.root() / "layers" / i, i_dim, o_dim, Default::default())
            })
            .collect();
        Big { layers }
    }
}

impl Module for Big {
    fn forward(&self, xs: &Tensor) -> Tensor {
        self.layers
            .iter()
            .fold(xs.shallow_clone(), |h, l| l.call(&h))
    }
}

/// `field` of /proc/self/status in bytes.
fn status_bytes(field: &str) -> u64 {
    let [kib] = memory::status_kib([field]);
    kib * 1024
}

/// `field` of /proc/self/io.
fn io(field: &str) -> u64 {
    let io = std::fs::read_to_string("/proc/self/io").unwrap_or_default();
    io.lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

fn sharded(seed: i64) -> Result<Big, Box<dyn std::error::Error>> {
    let model = Big::new(seed);
    for layer in &model.layers {
        fully_shard(layer, FsdpOptions::default())?;
    }
    fully_shard(&model, FsdpOptions::default())?;
    // The whole model built before sharding is freed memory now: give it back, so that the
    // load's resident memory starts from the shards.
    // SAFETY: malloc_trim(3) only returns free memory to the system.
    unsafe {
        libc::malloc_trim(0);
    }
    Ok(model)
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let (mut mode, mut dir, mut reads) = (String::new(), PathBuf::new(), Reads::EachRank);
    let mut flags = cli::Flags::from_env();
    while let Some(flag) = flags.next_flag() {
        match flag.as_str() {
            "--mode" => mode = flags.value(&flag)?,
            "--dir" => dir = flags.value(&flag)?.into(),
            "--reads" => {
                reads = match flags.value(&flag)?.as_str() {
                    "each" => Reads::EachRank,
                    "striped" => Reads::Striped,
                    other => return Err(format!("--reads: each or striped, not {other}").into()),
                }
            }
            other => return Err(cli::unknown(other).into()),
        }
    }
    tch::set_num_threads(1);
    let pg = init_process_group(Backend::Gloo)?;
    let rank = pg.rank();
    let out = match mode.as_str() {
        "save" => {
            let model = sharded(1)?;
            pg.barrier()?;
            let t = Instant::now();
            checkpoint::save(
                dir.join("sync"),
                &State::new(&model),
                &pg,
                &SaveOptions::default(),
            )?;
            let save_ms = ms(t);
            pg.barrier()?;
            let t = Instant::now();
            let handle = checkpoint::async_save(
                dir.join("async"),
                &State::new(&model),
                &pg,
                &SaveOptions::default(),
            )?;
            let blocked_ms = ms(t);
            handle.wait()?;
            let async_total_ms = ms(t);
            serde_json::json!({
                "mode": "save", "rank": rank, "world": pg.world_size(),
                "save_ms": save_ms, "async_blocked_ms": blocked_ms,
                "async_total_ms": async_total_ms,
            })
        }
        "load" => {
            let model = sharded(2)?;
            let local = model.parameters();
            let shard_bytes: u64 = local
                .iter()
                .map(|t| (t.numel() * t.kind().elt_size_in_bytes()) as u64)
                .sum();
            let largest = local
                .iter()
                .map(|t| (t.numel() * t.kind().elt_size_in_bytes()) as u64)
                .max()
                .unwrap_or(0);
            pg.barrier()?;
            // Resets VmHWM to the current RSS (Linux >= 4.0).
            let _ = std::fs::write("/proc/self/clear_refs", "5");
            let (rss0, rchar0, disk0) = (status_bytes("VmRSS:"), io("rchar:"), io("read_bytes:"));
            let t = Instant::now();
            let stats =
                checkpoint::load(&dir, &mut State::new(&model), &pg, &LoadOptions { reads })?;
            let load_ms = ms(t);
            serde_json::json!({
                "mode": "load", "rank": rank, "world": pg.world_size(),
                "reads": format!("{reads:?}"), "load_ms": load_ms,
                "bytes_read": stats.bytes_read, "files_opened": stats.files_opened,
                "rchar": io("rchar:") - rchar0, "read_bytes": io("read_bytes:") - disk0,
                "peak_rss_over_start": status_bytes("VmHWM:").saturating_sub(rss0),
                "shard_bytes": shard_bytes, "largest_tensor_bytes": largest,
            })
        }
        other => return Err(format!("--mode: save or load, not {other:?}").into()),
    };
    println!("BENCH {out}");
    Ok(())
}

fn main() {
    cli::main_with(run);
}
