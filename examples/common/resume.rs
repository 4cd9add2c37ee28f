//! Resuming a training job after a restart, for `train_ddp` and `train_fsdp`: whether this
//! start resumes (every rank alike), from which checkpoint, and where the loop continues.
//!
//! A start resumes when asked (`--resume`) or when it is a restart: torchrun's (and
//! tch-dist-run's) `TORCHELASTIC_RESTART_COUNT` above 0, or tch-dist-run's
//! `TCH_DIST_RDZV_ROUND` above 0 (a later round of its dynamic rendezvous). Across hosts the
//! restart count is each node's own: a node whose ranks were stopped because another node's
//! failed starts them again without counting, and a node that comes in later has counted
//! nothing. So the ranks decide together, in one all-reduce: they resume when any of them
//! would. (Under torchrun, which sets no round, a restart that only admits a new node counts
//! nowhere: give `--resume`, which starts afresh when the folder has no checkpoint yet.)

use std::error::Error;
use std::path::{Path, PathBuf};

use tch::Tensor;
use tch_dist::checkpoint as dcp;
use tch_dist::{ProcessGroup, ReduceOp};

/// torchrun's (and tch-dist-run's) restart count: 0 on the first start, each node's own.
pub fn restart_count() -> Result<u64, String> {
    count_var("TORCHELASTIC_RESTART_COUNT")
}

/// `tch-dist-run --rdzv-backend c10d`'s round, which every node agrees on: 0 in the first,
/// and without the variable (torchrun sets none).
pub fn rdzv_round() -> Result<u64, String> {
    count_var("TCH_DIST_RDZV_ROUND")
}

fn count_var(name: &str) -> Result<u64, String> {
    match std::env::var(name) {
        Ok(v) => v
            .parse()
            .map_err(|_| format!("{name}={v:?} is not a count")),
        Err(_) => Ok(0),
    }
}

/// Whether this start resumes, the same answer on every rank of `pg`: `asked`, or a restart
/// on any rank.
pub fn should_resume(pg: &ProcessGroup, asked: bool) -> Result<bool, Box<dyn Error>> {
    let mine = asked || restart_count()? > 0 || rdzv_round()? > 0;
    let t = Tensor::from_slice(&[i64::from(mine)]);
    pg.all_reduce(&t, ReduceOp::Max)?;
    Ok(t.int64_value(&[0]) > 0)
}

/// The newest checkpoint in `dir` that verifies on every rank (`checkpoint::latest_valid`: a
/// damaged newer one is skipped, and rank 0 says so); `None` when the folder has none yet,
/// an error when it has some and none verifies. Nothing may write there meanwhile.
pub fn newest_valid(dir: &Path, pg: &ProcessGroup) -> Result<Option<PathBuf>, Box<dyn Error>> {
    let found = dcp::latest_valid(dir, pg)?;
    if pg.rank() == 0 {
        for s in &found.skipped {
            println!("skipped {}: {}", s.dir.display(), s.reason);
        }
    }
    if found.dir.is_none() && !found.skipped.is_empty() {
        return Err(format!(
            "no checkpoint in {} verifies ({} skipped)",
            dir.display(),
            found.skipped.len()
        )
        .into());
    }
    Ok(found.dir)
}

/// Loads the newest checkpoint of `dir` that verifies on every rank ([`newest_valid`]) into
/// `state` and returns where training continues, rank 0 saying so; `None` (and `state`
/// untouched) when the folder has no checkpoint yet.
pub fn load_newest<M: tch_dist::Shardable + ?Sized>(
    dir: &Path,
    state: &mut dcp::State<'_, M>,
    pg: &ProcessGroup,
) -> Result<Option<Position>, Box<dyn Error>> {
    let Some(last) = newest_valid(dir, pg)? else {
        return Ok(None);
    };
    dcp::load(&last, state, pg, &dcp::LoadOptions::default())?;
    let train_state = state
        .train_state()
        .ok_or_else(|| format!("{}: no train state", last.display()))?;
    let at = Position::from_json(train_state)?;
    if pg.rank() == 0 {
        println!("resumed from {} at step {}", last.display(), at.step);
    }
    Ok(Some(at))
}

/// Where training continues: the global step, the epoch and the batches done in it (the
/// checkpoint's train state).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Position {
    pub step: u64,
    pub epoch: u64,
    pub batch: u64,
}

impl Position {
    /// The position after batch `batch` (0-based) of epoch `epoch` of `steps_per_epoch`,
    /// at global step `step`: the next epoch's start after its last batch.
    pub fn after(step: u64, epoch: u64, batch: u64, steps_per_epoch: u64) -> Position {
        if batch + 1 == steps_per_epoch {
            Position {
                step,
                epoch: epoch + 1,
                batch: 0,
            }
        } else {
            Position {
                step,
                epoch,
                batch: batch + 1,
            }
        }
    }

    /// The first batch to train in epoch `epoch` of a run that starts here: in the epoch it
    /// resumes, the batch after the checkpoint's (the batches done before are skipped, so the
    /// data order is an uninterrupted run's); in every later epoch, 0.
    pub fn first_batch(self, epoch: u64) -> i64 {
        if epoch == self.epoch {
            self.batch as i64
        } else {
            0
        }
    }

    pub fn to_json(self) -> serde_json::Value {
        serde_json::json!({ "step": self.step, "epoch": self.epoch, "batch": self.batch })
    }

    pub fn from_json(v: &serde_json::Value) -> Result<Self, String> {
        let field = |k: &str| {
            v[k].as_u64()
                .ok_or_else(|| format!("the train state has no `{k}` count: {v}"))
        };
        Ok(Position {
            step: field("step")?,
            epoch: field("epoch")?,
            batch: field("batch")?,
        })
    }
}
