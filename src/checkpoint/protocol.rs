//! The commit protocol of a save: the ranks' steps ([`Save`], in the order they run) and
//! the file-system moves under them, so that a crash at any point leaves a checkpoint's
//! name with the previous complete checkpoint or the new one, never with nothing, and never
//! a half-written folder where [`latest`](super::latest) looks (docs/design/checkpoints.md,
//! "Checkpoint commit protocol", says what each crash point leaves). DCP's
//! `state_dict_saver.py` (`_save_state_dict`: local plan, global plan, write, finish) and
//! `filesystem.py` (its writes and the rename of `.metadata` into place).
//!
//! Everything is fsynced before it is relied on: each file before its rank reports it
//! written, the temporary folder before it is renamed, the parent folder after the rename
//! (so that the rename itself survives a power cut).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use tch::Tensor;
use tch_dist_runtime::ProcessGroup;

use super::fs::{finish, io, remove_checkpoint, replace, start, PARTIAL};
use super::storage::{self, file_name, FileEntry, Manifest, RankReport, TensorEntry, MANIFEST};
use super::CheckpointProblem;
use super::{retention, CheckpointError, OPTIMIZER_SIDECAR, TRAIN_STATE};
use crate::optim;

/// The collectives' name in errors.
const OP: &str = "checkpoint.save";

/// One save of the checkpoint folder `dir` on this rank, step by step. Every step ends in
/// a collective that every rank makes, so a failure on one rank is an error on all, and a
/// collective's own failure (a dead peer) is [`CheckpointProblem::Save`] naming the folder
/// and the step.
pub(super) struct Save<'a> {
    rank: usize,
    group: &'a ProcessGroup,
    dir: &'a Path,
    /// `DIR.partial`, where the files are written before the folder is put in place.
    tmp: PathBuf,
    /// Rank 0 put the new folder in place (`replace` returned): from then on the save's
    /// errors say that the checkpoint was committed.
    committed: std::cell::Cell<bool>,
}

/// What rank 0 writes beside the safetensors files, each into its JSON sidecar.
pub(super) struct Sidecars<'a> {
    /// `train_state.json`.
    pub train_state: Option<&'a serde_json::Value>,
    /// `optimizer.json`'s content (taken at the call: an async save's background must not
    /// read the optimizer, which the next step changes).
    pub optimizer: Option<optim::sidecar::OptimizerSidecar>,
}

impl<'a> Save<'a> {
    pub(super) fn new(dir: &'a Path, group: &'a ProcessGroup) -> Self {
        Save {
            rank: group.rank(),
            group,
            dir,
            tmp: storage::sibling(dir, PARTIAL),
            committed: std::cell::Cell::new(false),
        }
    }

    /// A collective's failure in `step`, naming the checkpoint and the step; any other
    /// error as it is.
    pub(super) fn failed(
        &self,
        step: &'static str,
    ) -> impl Fn(CheckpointError) -> CheckpointError + use<> {
        let (rank, dir) = (self.rank, self.dir.to_path_buf());
        move |e| match e {
            CheckpointError::Dist(source) => CheckpointProblem::Save {
                dir: dir.clone(),
                step,
                source: Box::new(source),
            }
            .on(rank),
            e => e,
        }
    }

    /// Step 1: Rank 0 makes the empty temporary folder, removing what an interrupted save of
    /// the same name left there.
    pub(super) fn make_temporary_folder(&self) -> Result<(), CheckpointError> {
        let local = if self.rank == 0 {
            start(self.rank, &self.tmp)
        } else {
            Ok(())
        };
        self.group
            .agree(OP, local)
            .map_err(self.failed("making the temporary folder"))
    }

    /// Step 2: Every rank with something of its own (`pieces`: FQN, values, offsets) writes and
    /// fsyncs its safetensors file; the ranks agree, and get the file's entry (its length
    /// and SHA-256, its header's and its pieces' block digests; none for a rank without a
    /// file).
    pub(super) fn write_file(
        &self,
        pieces: Result<Vec<(String, Tensor, Vec<i64>)>, CheckpointError>,
    ) -> Result<Option<FileEntry>, CheckpointError> {
        let (rank, path) = (self.rank, self.tmp.join(file_name(self.rank)));
        let local = pieces.and_then(|mine| {
            if mine.is_empty() {
                // Nothing of its own to write (every tensor it holds written by another).
                return Ok(None);
            }
            let file = storage::SafetensorsFile::new(rank, &path, &mine)?;
            full_disk_point(rank, self.dir, &path, file.len())?;
            Ok(Some(file.write(rank, &path)?))
        });
        self.group
            .agree(OP, local)
            .map_err(self.failed("writing the files"))
    }

    /// Every step after the plan, in order: the temporary folder, this rank's file
    /// (`pieces`), the checksums and every rank's `tensors` (merged into the manifest's),
    /// the commit, the sidecars and the pruning to `keep_last`. What
    /// [`save`](super::save) runs on the caller's thread and
    /// [`async_save`](super::async_save()) in its background thread.
    pub(super) fn run(
        &self,
        pieces: Result<Vec<(String, Tensor, Vec<i64>)>, CheckpointError>,
        tensors: BTreeMap<String, TensorEntry>,
        sidecars: Sidecars<'_>,
        keep_last: Option<usize>,
    ) -> Result<(), CheckpointError> {
        self.make_temporary_folder()?;
        let outcome = self
            .write_file(pieces)
            .and_then(|file| self.gather_reports(&RankReport { file, tensors }))
            .and_then(|reports| {
                let tensors = merge_tensors(self.rank, &reports)?;
                self.commit(&reports, tensors, sidecars, keep_last)
            });
        if matches!(outcome, Err(ref e) if !matches!(e.problem(), Some(CheckpointProblem::Committed { .. })))
        {
            self.discard_temporary_folder();
        }
        outcome
    }

    /// After a failed save, rank 0 removes `DIR.partial` and what the ranks wrote into it
    /// (a save that failed on a full disk would otherwise keep the disk full). Every step
    /// ends in a collective, so no rank writes there any more. Its own failure is not the
    /// save's error: the cause is; the next save of the name removes the folder again.
    fn discard_temporary_folder(&self) {
        if self.rank == 0 && self.tmp.exists() {
            let _ = remove_checkpoint(self.rank, &self.tmp);
        }
    }

    /// 2 (end). Every rank's report, gathered: its file's entry (rank 0 lists them in the
    /// manifest) and the tensors it holds (each rank merges them, [`merge_tensors`]).
    pub(super) fn gather_reports(
        &self,
        report: &RankReport,
    ) -> Result<Vec<RankReport>, CheckpointError> {
        let path = self.tmp.join(MANIFEST);
        let mine = storage::to_json(self.rank, &path, report)?;
        self.group
            .all_gather_bytes(OP, mine.as_bytes())
            .map_err(|e| self.failed("gathering the files' checksums")(e.into()))?
            .iter()
            .map(|b| storage::from_json(self.rank, &path, b))
            .collect()
    }

    /// 3 to 5. Rank 0 writes and fsyncs the sidecars, then the manifest (every file with
    /// its checksum, every tensor's global shape and dtype), puts the folder in place,
    /// removes what it replaced and prunes to `keep_last`; the ranks agree.
    pub(super) fn commit(
        &self,
        entries: &[RankReport],
        tensors: BTreeMap<String, TensorEntry>,
        sidecars: Sidecars<'_>,
        keep_last: Option<usize>,
    ) -> Result<(), CheckpointError> {
        let (local, after) = if self.rank == 0 {
            match self.commit_on_rank_0(entries, tensors, sidecars, keep_last) {
                Ok(after) => (Ok(true), after),
                Err(e) => (Err(e), Ok(())),
            }
        } else {
            crash_point("awaiting-commit");
            (Ok(false), Ok(()))
        };
        let agreed = self
            .group
            .agree(OP, local)
            .map_err(self.failed("committing"));
        match (agreed, after) {
            // Rank 0 committed: whatever failed afterwards says so.
            (Ok(true), Err(e)) | (Err(e), _) if self.committed.get() => {
                Err(CheckpointProblem::Committed {
                    dir: self.dir.to_path_buf(),
                    source: Box::new(e),
                }
                .on(self.rank))
            }
            (agreed, _) => agreed.map(|_| ()),
        }
    }

    /// Rank 0's part of the commit: `Err` when the checkpoint could not be put in place;
    /// `Ok` once it is, with what failed after that (removing the replaced checkpoint,
    /// pruning).
    fn commit_on_rank_0(
        &self,
        entries: &[RankReport],
        tensors: BTreeMap<String, TensorEntry>,
        sidecars: Sidecars<'_>,
        keep_last: Option<usize>,
    ) -> Result<Result<(), CheckpointError>, CheckpointError> {
        let (rank, tmp) = (self.rank, &self.tmp);
        crash_point("files-written");
        hold_point();
        let mut files = BTreeMap::new();
        for (r, e) in entries.iter().enumerate() {
            if let Some(entry) = &e.file {
                files.insert(file_name(r), entry.clone());
            }
        }
        let mut written = BTreeMap::new();
        if let Some(state) = sidecars.train_state {
            let entry = storage::write_json(rank, &tmp.join(TRAIN_STATE), state)?;
            written.insert(TRAIN_STATE.to_string(), entry);
        }
        if let Some(sidecar) = &sidecars.optimizer {
            let entry = storage::write_json(rank, &tmp.join(OPTIMIZER_SIDECAR), sidecar)?;
            written.insert(OPTIMIZER_SIDECAR.to_string(), entry);
        }
        let manifest = Manifest {
            format: storage::FORMAT.to_string(),
            world_size: self.group.world_size(),
            files,
            sidecars: written,
            tensors,
        };
        // The manifest last: a folder without one is never loaded.
        storage::write_json(rank, &tmp.join(MANIFEST), &manifest)?;
        crash_point("manifest-written");
        replace(rank, tmp, self.dir)?;
        self.committed.set(true);
        crash_point("replaced");
        Ok(finish(rank, tmp).and_then(|()| match keep_last {
            Some(k) => retention::prune(rank, self.dir, k),
            None => Ok(()),
        }))
    }
}

/// The manifest's `tensors`: every rank's, merged; a name two ranks save with different
/// global shapes or dtypes (two tensors under one name) fails on every rank alike (each
/// merges the same reports).
pub(super) fn merge_tensors(
    rank: usize,
    reports: &[RankReport],
) -> Result<BTreeMap<String, TensorEntry>, CheckpointError> {
    let mut merged: BTreeMap<String, (usize, TensorEntry)> = BTreeMap::new();
    for (r, report) in reports.iter().enumerate() {
        for (fqn, entry) in &report.tensors {
            match merged.get(fqn) {
                None => {
                    merged.insert(fqn.clone(), (r, entry.clone()));
                }
                Some((first, seen)) if seen != entry => {
                    return Err(CheckpointProblem::TensorsDiffer {
                        fqn: fqn.clone(),
                        first_rank: *first,
                        first: seen.to_string(),
                        other_rank: r,
                        other: entry.to_string(),
                    }
                    .on(rank))
                }
                Some(_) => {}
            }
        }
    }
    Ok(merged.into_iter().map(|(k, (_, e))| (k, e)).collect())
}

/// The test-only crash switch: a rank 0 whose environment has
/// `TCH_DIST_TEST_CHECKPOINT_CRASH=<point>` aborts at that point of every save's commit
/// (rank 0's `files-written`, `manifest-written`, `replaced`; the other ranks'
/// `awaiting-commit`, before they wait for rank 0's commit), leaving the disk as a crash
/// there would (tests/checkpoint.rs kills saves at each point this way).
pub(super) const CRASH_SWITCH: &str = "TCH_DIST_TEST_CHECKPOINT_CRASH";

/// Aborts this process when the crash switch names `point` (see [`CRASH_SWITCH`]).
pub(super) fn crash_point(point: &str) {
    if std::env::var(CRASH_SWITCH).as_deref() == Ok(point) {
        // abort: no destructor, no unwinding, no flush; what is on disk stays as it is.
        std::process::abort();
    }
}

/// The test-only full-disk switch: a rank whose environment has
/// `TCH_DIST_TEST_CHECKPOINT_FULL=<name>` writes half of its file of each save into a folder
/// named `<name>`, then fails as a full disk would (`ENOSPC`), so that a test can see what a
/// failed save leaves behind (tests/checkpoint.rs).
pub(super) const FULL_SWITCH: &str = "TCH_DIST_TEST_CHECKPOINT_FULL";

/// Fails like a full disk when the full-disk switch names `dir` (see [`FULL_SWITCH`]).
fn full_disk_point(rank: usize, dir: &Path, path: &Path, len: u64) -> Result<(), CheckpointError> {
    match std::env::var_os(FULL_SWITCH) {
        Some(name) if dir.file_name() == Some(name.as_os_str()) => {
            let _ = std::fs::write(path, vec![0u8; (len / 2) as usize]);
            Err(io(rank, "writing", path)(
                std::io::Error::from_raw_os_error(libc::ENOSPC),
            ))
        }
        _ => Ok(()),
    }
}

/// The test-only hold switch: a rank 0 whose environment has
/// `TCH_DIST_TEST_CHECKPOINT_HOLD=<file>` waits, once every rank's file is written and
/// before the manifest, until `<file>` exists (at most the group's timeout), so that a
/// test can see what runs while a save is unfinished (tests/checkpoint/async_save.rs).
pub(super) const HOLD_SWITCH: &str = "TCH_DIST_TEST_CHECKPOINT_HOLD";

/// Waits while the hold switch's file is missing (see [`HOLD_SWITCH`]).
fn hold_point() {
    if let Some(file) = std::env::var_os(HOLD_SWITCH) {
        let start = std::time::Instant::now();
        while !Path::new(&file).exists() && start.elapsed() < std::time::Duration::from_secs(300) {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(tensors: &[(&str, &[i64], &str)]) -> RankReport {
        RankReport {
            file: None,
            tensors: tensors
                .iter()
                .map(|(k, shape, dtype)| {
                    let entry = TensorEntry {
                        shape: shape.to_vec(),
                        dtype: dtype.to_string(),
                    };
                    (k.to_string(), entry)
                })
                .collect(),
        }
    }

    /// Pipeline stages hold different tensors: the manifest lists the union.
    #[test]
    fn every_ranks_tensors_are_merged() {
        let reports = [
            report(&[("layers.0.weight", &[8, 5], "F32")]),
            report(&[("layers.0.weight", &[8, 5], "F32")]),
            report(&[
                ("layers.1.weight", &[6, 8], "F32"),
                ("optim.state.layers.1.weight.step", &[], "F32"),
            ]),
        ];
        let merged = merge_tensors(1, &reports).unwrap();
        let names: Vec<&str> = merged.keys().map(String::as_str).collect();
        assert_eq!(
            names,
            [
                "layers.0.weight",
                "layers.1.weight",
                "optim.state.layers.1.weight.step"
            ]
        );
        assert_eq!(merged["layers.1.weight"].shape, [6, 8]);
    }

    /// Two tensors under one name: refused, naming both ranks and both layouts.
    #[test]
    fn one_name_with_two_layouts_is_refused() {
        let reports = [
            report(&[("layers.0.weight", &[8, 5], "F32")]),
            report(&[("layers.0.weight", &[6, 8], "F32")]),
        ];
        let e = merge_tensors(0, &reports).unwrap_err();
        assert_eq!(
            e.to_string(),
            "rank 0: checkpoint: `layers.0.weight` is [8, 5] F32 on rank 0 but [6, 8] F32 on \
             rank 1: the ranks of a save must name each global tensor once (build each \
             pipeline stage's part under the whole model's paths)"
        );
    }
}
