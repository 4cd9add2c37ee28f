//! [`CheckpointError`]: what can go wrong saving or loading a checkpoint, naming the rank,
//! the file and the FQN.

use std::path::PathBuf;

use tch_dist_runtime::DistError;

use crate::OnRank;

/// Why [`save`](super::save) or [`load`](super::load) failed. A failed `load` changed no
/// tensor; a failed `save` left no checkpoint in place (its temporary folder aside). This
/// rank's problem is [`OnRank`](Self::OnRank), its rank written once; another rank's
/// failure, or a collective's own, is [`Dist`](Self::Dist).
///
/// ```
/// use tch_dist::checkpoint::{CheckpointError, CheckpointProblem};
/// let e = CheckpointProblem::MissingKey { fqn: "fc.weight".into() }.on(1);
/// assert_eq!(e.to_string(), "rank 1: checkpoint: `fc.weight` is not in the checkpoint");
/// assert!(matches!(e.problem(), Some(CheckpointProblem::MissingKey { .. })));
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CheckpointError {
    /// This rank refused or failed: its rank and the problem.
    #[error(transparent)]
    OnRank(#[from] OnRank<CheckpointProblem>),
    /// A collective between the ranks failed, or another rank failed (`PeersFailed`).
    #[error(transparent)]
    Dist(#[from] DistError),
}

impl CheckpointError {
    /// The rank the error names (this rank's, or the collective's).
    pub fn rank(&self) -> Option<usize> {
        match self {
            CheckpointError::OnRank(e) => Some(e.rank),
            CheckpointError::Dist(e) => e.rank(),
        }
    }

    /// This rank's problem (`None` for a [`Dist`](Self::Dist) error).
    pub fn problem(&self) -> Option<&CheckpointProblem> {
        match self {
            CheckpointError::OnRank(e) => Some(&e.problem),
            CheckpointError::Dist(_) => None,
        }
    }
}

impl CheckpointProblem {
    /// This problem as rank `rank`'s [`CheckpointError`].
    pub fn on(self, rank: usize) -> CheckpointError {
        CheckpointError::OnRank(OnRank::new(rank, self))
    }
}

/// What went wrong on a rank saving or loading a checkpoint, naming the file and the FQN
/// ([`CheckpointError::OnRank`] adds the rank).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CheckpointProblem {
    /// Reading or writing a file or folder failed: names the operation and the path; what
    /// the system said is the [`source`](std::error::Error::source).
    #[error("checkpoint: {op} {path} failed")]
    Io {
        /// What was done: `reading`, `writing`, `fsyncing`, `creating`, `renaming`,
        /// `swapping`, `removing`, `listing`.
        op: &'static str,
        /// The file or folder.
        path: PathBuf,
        /// What the system said.
        #[source]
        source: std::io::Error,
    },
    /// A file is not a checkpoint file this version reads (bad safetensors, bad JSON).
    #[error("checkpoint: {path}: {cause}")]
    Format {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        cause: String,
    },
    /// The folder has no manifest: no checkpoint, or one whose save did not finish.
    #[error(
        "checkpoint: {dir} holds no complete checkpoint (no manifest.json: never \
         saved there, or the save was interrupted)"
    )]
    NotACheckpoint {
        /// The folder.
        dir: PathBuf,
    },
    /// A parameter that no API shards (saved whole, by the lowest rank that holds it)
    /// differs across the ranks that hold it: the other ranks' values would be lost.
    #[error(
        "checkpoint: parameter `{fqn}` is whole on the ranks that hold it but \
         holds other values on ranks {ranks:?} than on rank {first}: a checkpoint keeps one \
         copy of such a tensor (the lowest rank's), so theirs would be lost (independent \
         models, parameters left out of data parallelism); save each rank's model over a \
         group of its own, or make the ranks agree first"
    )]
    ReplicasDiffer {
        /// The first such parameter, in walk order.
        fqn: String,
        /// The lowest rank that holds it: the copy a checkpoint keeps.
        first: usize,
        /// The ranks whose value (or shape) differs from rank `first`'s.
        ranks: Vec<usize>,
    },
    /// Two ranks of a save hold parts of tensors of one name with different global shapes
    /// or dtypes: two tensors under one name (pipeline stages whose parts were built under
    /// the same paths), which one checkpoint cannot hold.
    #[error(
        "checkpoint: `{fqn}` is {first} on rank {first_rank} but {other} on rank \
         {other_rank}: the ranks of a save must name each global tensor once (build each \
         pipeline stage's part under the whole model's paths)"
    )]
    TensorsDiffer {
        /// The tensor's name.
        fqn: String,
        /// The lowest rank that holds it.
        first_rank: usize,
        /// Its global shape and dtype there (`[8, 4] F32`).
        first: String,
        /// The first rank that holds another.
        other_rank: usize,
        /// Its global shape and dtype there.
        other: String,
    },
    /// A rank holds a tensor as several separate blocks of the whole (a fused
    /// column-parallel layer sharded per part): a checkpoint holds one block per tensor and
    /// rank, so its values would land in the wrong rows.
    #[error(
        "checkpoint: rank {holder} holds `{fqn}` as {blocks} separate blocks of \
         the whole tensor (a fused column-parallel layer sharded per part), and a checkpoint \
         holds one block per tensor and rank; shard the parts as layers of their own"
    )]
    SplitTensor {
        /// The tensor.
        fqn: String,
        /// The lowest rank holding it so.
        holder: usize,
        /// How many blocks it joins there.
        blocks: usize,
    },
    /// A file listed in the manifest is missing, truncated or changed.
    #[error("checkpoint: {file} is corrupted: {cause}")]
    Corrupted {
        /// The file.
        file: PathBuf,
        /// How it differs from the manifest.
        cause: String,
    },
    /// The model has a tensor the checkpoint lacks.
    #[error("checkpoint: `{fqn}` is not in the checkpoint")]
    MissingKey {
        /// The tensor's FQN.
        fqn: String,
    },
    /// The checkpoint has a tensor the model lacks (a checkpoint of another model).
    #[error("checkpoint: `{fqn}` is in the checkpoint but not in the model")]
    UnexpectedKey {
        /// The tensor's FQN.
        fqn: String,
    },
    /// A tensor's global shape differs.
    #[error(
        "checkpoint: `{fqn}` is {found:?} in the checkpoint but {expected:?} in \
         the model"
    )]
    Shape {
        /// The tensor's FQN.
        fqn: String,
        /// The model's (global) shape.
        expected: Vec<i64>,
        /// The checkpoint's.
        found: Vec<i64>,
    },
    /// A tensor's dtype differs.
    #[error(
        "checkpoint: `{fqn}` is {found} in the checkpoint but {expected} in the \
         model"
    )]
    Dtype {
        /// The tensor's FQN.
        fqn: String,
        /// The model's dtype (safetensors' name).
        expected: String,
        /// The checkpoint's.
        found: String,
    },
    /// The saved pieces of a tensor do not cover the part this rank needs.
    #[error(
        "checkpoint: the saved pieces of `{fqn}` cover {covered} of the {needed} \
         values this rank needs"
    )]
    Incomplete {
        /// The tensor's FQN.
        fqn: String,
        /// Values covered.
        covered: i64,
        /// Values needed.
        needed: i64,
    },
    /// A [`load`](super::load) with an optimizer of a checkpoint saved without optimizer
    /// state (no `optimizer.json`).
    #[error(
        "checkpoint: {dir} has no optimizer state (its save's State held no \
         optimizer)"
    )]
    NoOptimizerState {
        /// The folder.
        dir: PathBuf,
    },
    /// The checkpoint's optimizer is of another class than the one loading it.
    #[error("checkpoint: the optimizer state is {found}'s, the optimizer is {expected}")]
    OptimizerKind {
        /// The optimizer's class (`SGD`, `AdamW`).
        expected: String,
        /// The checkpoint's.
        found: String,
    },
    /// The optimizer state of a parameter does not fit (a state name the optimizer does not
    /// have, state for a parameter the model lacks, a state tensor of another shape).
    #[error("checkpoint: optimizer state of `{fqn}`: {problem}")]
    OptimizerState {
        /// The parameter's FQN.
        fqn: String,
        /// What does not fit.
        problem: String,
    },
    /// A collective of [`save`](super::save) failed (a peer died, or other ranks failed
    /// their part: `PeersFailed`): names the checkpoint being written and the step of the
    /// save; the collective's error is the [`source`](std::error::Error::source).
    #[error("checkpoint.save of {dir}: {step} failed")]
    Save {
        /// The checkpoint folder being written.
        dir: PathBuf,
        /// The step of the save (`making the temporary folder`, `writing the files`,
        /// `gathering the files' checksums`, `committing`).
        step: &'static str,
        /// The collective's error (boxed: it is large, and a save's error is rare).
        #[source]
        source: Box<DistError>,
    },
    /// A collective of [`load`](super::load) failed (a peer died): names the
    /// checkpoint being loaded; the collective's error is the
    /// [`source`](std::error::Error::source). Other ranks' failures stay
    /// [`Dist`](CheckpointError::Dist)`(PeersFailed)`.
    #[error("checkpoint.load of {dir} failed")]
    Load {
        /// The checkpoint being loaded (a folder, or a one-file `VarStore::save`).
        dir: PathBuf,
        /// The collective's error.
        #[source]
        source: Box<DistError>,
    },
    /// Rank 0 put the checkpoint in place (it is complete as `dir`, and loads), but what
    /// followed failed: removing the checkpoint it replaced, pruning to `keep_last`, or the
    /// ranks' last agreement (a peer that died after its files were written). What failed is
    /// the [`source`](std::error::Error::source). Only rank 0 knows that it committed; the
    /// other ranks' errors say that committing failed.
    #[error("checkpoint.save of {dir}: the checkpoint was committed, but what followed failed")]
    Committed {
        /// The checkpoint folder, complete.
        dir: PathBuf,
        /// What failed after the commit (boxed, as [`Save`](Self::Save)'s).
        #[source]
        source: Box<CheckpointError>,
    },
    /// The background thread of [`async_save`](super::async_save()) panicked (a bug: its
    /// errors are values); the other ranks' saves then fail on a collective.
    #[error("checkpoint.async_save of {dir}: the background write failed: {cause}")]
    Background {
        /// The checkpoint folder being written.
        dir: PathBuf,
        /// What the panic said.
        cause: String,
    },
}
