//! Which checkpoints of a folder count: [`latest`] (the newest complete one), [`latest_valid`]
//! (the newest that verifies, on every rank, saying which newer ones it skipped and why),
//! and the pruning of older ones to `keep_last`.

use std::path::{Path, PathBuf};

use tch_dist_runtime::ProcessGroup;

use super::{fs, storage, CheckpointError, MANIFEST};

/// The complete checkpoints in `parent` (folders with a manifest, never a save's
/// temporary `.partial` or `.old` folder), oldest first by name. A missing `parent` has
/// none.
pub(super) fn complete_in(rank: usize, parent: &Path) -> Result<Vec<PathBuf>, CheckpointError> {
    let entries = match std::fs::read_dir(parent) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(fs::io(rank, "listing", parent)(e)),
    };
    let mut out: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .is_some_and(|n| !fs::is_temporary(&n.to_string_lossy()))
        })
        .filter(|p| p.join(MANIFEST).is_file())
        .collect();
    out.sort();
    Ok(out)
}

/// Removes all but the last `keep` complete checkpoints beside `dir` (by name).
pub(super) fn prune(rank: usize, dir: &Path, keep: usize) -> Result<(), CheckpointError> {
    let all = complete_in(rank, &fs::parent_of(dir))?;
    let drop = all.len().saturating_sub(keep);
    for old in &all[..drop] {
        fs::remove_checkpoint(rank, old)?;
    }
    Ok(())
}

/// The last complete checkpoint (a folder with a manifest) in `parent`, by name: where a
/// restarted job continues from (`None` when there is none yet, or `parent` does not
/// exist). A save's temporary folder (`step-00000100.partial`, complete or not) is never
/// named. It reads no file: a damaged checkpoint is found by the load (or by
/// [`latest_valid`], which checks every byte).
///
/// ```no_run
/// if let Some(dir) = tch_dist::checkpoint::latest("ckpt") {
///     println!("resuming from {}", dir.display());
/// }
/// ```
pub fn latest(parent: impl AsRef<Path>) -> Option<PathBuf> {
    complete_in(0, parent.as_ref()).ok()?.pop()
}

/// A checkpoint [`latest_valid`] passed over, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Skipped {
    /// The checkpoint's folder.
    pub dir: PathBuf,
    /// Each failing rank's error, `; `-separated (each names its rank and the file).
    pub reason: String,
}

/// What [`latest_valid`] found: the checkpoint to resume from, and the newer ones it
/// skipped (newest first).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LatestValid {
    /// The newest complete checkpoint that verified on every rank; `None` when there is
    /// none (no checkpoint yet, or every one is damaged: then `skipped` lists them all).
    pub dir: Option<PathBuf>,
    /// The newer checkpoints that did not verify, newest first.
    pub skipped: Vec<Skipped>,
}

/// The newest checkpoint in `parent` that verifies on every rank of `group`, falling back
/// from a damaged one to the next older: where a restarted job resumes from when its newest
/// checkpoint was damaged after it was written (a flipped byte, a truncated file).
///
/// Every rank calls it. The candidates are rank 0's list of complete checkpoints (as
/// [`latest`] sees them), newest first; each is verified on every rank: its manifest
/// parses, and every file it lists (the safetensors files and the sidecars
/// `optimizer.json`, `train_state.json`) has the recorded length and SHA-256, and no
/// sidecar is there that the manifest does not list. That is one read of the whole
/// checkpoint per rank (more than a load, which reads only its rank's slices), for the one
/// it returns and for each one it skips; the load then reads its slices again. It does not check the checkpoint against a
/// model (keys, shapes, dtypes: the load does), so a checkpoint of another model is not
/// skipped but refused by the load. The ranks agree on each verdict: a checkpoint that
/// fails on one rank is skipped on all of them, with every failing rank's error.
///
/// ```no_run
/// # let pg = tch_dist::default_group()?;
/// let found = tch_dist::checkpoint::latest_valid("ckpt", &pg)?;
/// for s in &found.skipped {
///     eprintln!("skipped {}: {}", s.dir.display(), s.reason);
/// }
/// if let Some(dir) = found.dir {
///     println!("resuming from {}", dir.display());
/// }
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn latest_valid(
    parent: impl AsRef<Path>,
    group: &ProcessGroup,
) -> Result<LatestValid, CheckpointError> {
    const OP: &str = "checkpoint.latest_valid";
    let (parent, rank) = (parent.as_ref(), group.rank());
    let local = complete_in(rank, parent);
    let mine = group.agree(OP, local)?;
    // Rank 0's list, so that every rank verifies the same candidates in the same order.
    let names: Vec<String> = mine
        .iter()
        .filter_map(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .collect();
    let lists = group.all_gather_bytes(OP, names.join("\n").as_bytes())?;
    let rank_0 = String::from_utf8_lossy(&lists[0]).into_owned();
    let mut found = LatestValid::default();
    for name in rank_0.lines().rev().filter(|n| !n.is_empty()) {
        let dir = parent.join(name);
        let verdict = match storage::verify(rank, &dir) {
            Ok(()) => String::new(),
            // The whole story: an I/O error's own text names only the file.
            Err(e) => crate::report(&e),
        };
        let verdicts = group.all_gather_bytes(OP, verdict.as_bytes())?;
        let failures: Vec<String> = verdicts
            .iter()
            .filter(|v| !v.is_empty())
            .map(|v| String::from_utf8_lossy(v).into_owned())
            .collect();
        if failures.is_empty() {
            found.dir = Some(dir);
            return Ok(found);
        }
        found.skipped.push(Skipped {
            dir,
            reason: failures.join("; "),
        });
    }
    Ok(found)
}
