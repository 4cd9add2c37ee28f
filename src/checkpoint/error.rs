//! [`CheckpointError`]: what can go wrong saving or loading a checkpoint, naming the rank,
//! the file and the FQN.

use std::path::PathBuf;

use tch_dist_runtime::DistError;

/// Why [`save`](super::save) or [`load`](super::load) failed. A failed `load` changed no
/// tensor; a failed `save` left no checkpoint in place (its temporary folder aside).
///
/// ```
/// use tch_dist::checkpoint::CheckpointError;
/// let e = CheckpointError::MissingKey { rank: 1, fqn: "fc.weight".into() };
/// assert_eq!(e.to_string(), "rank 1: checkpoint: `fc.weight` is not in the checkpoint");
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CheckpointError {
    /// Reading or writing a file or folder failed: names the operation and the path; what
    /// the system said is the [`source`](std::error::Error::source).
    #[error("rank {rank}: checkpoint: {op} {path} failed")]
    Io {
        /// This rank.
        rank: usize,
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
    #[error("rank {rank}: checkpoint: {path}: {cause}")]
    Format {
        /// This rank.
        rank: usize,
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        cause: String,
    },
    /// The folder has no manifest: no checkpoint, or one whose save did not finish.
    #[error(
        "rank {rank}: checkpoint: {dir} holds no complete checkpoint (no manifest.json: never \
         saved there, or the save was interrupted)"
    )]
    NotACheckpoint {
        /// This rank.
        rank: usize,
        /// The folder.
        dir: PathBuf,
    },
    /// A parameter that no API shards (saved whole, by the lowest rank that holds it)
    /// differs across the ranks that hold it: the other ranks' values would be lost.
    #[error(
        "rank {rank}: checkpoint: parameter `{fqn}` is whole on the ranks that hold it but \
         holds other values on ranks {ranks:?} than on rank {first}: a checkpoint keeps one \
         copy of such a tensor (the lowest rank's), so theirs would be lost (independent \
         models, parameters left out of data parallelism); save each rank's model over a \
         group of its own, or make the ranks agree first"
    )]
    ReplicasDiffer {
        /// This rank.
        rank: usize,
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
        "rank {rank}: checkpoint: `{fqn}` is {first} on rank {first_rank} but {other} on rank \
         {other_rank}: the ranks of a save must name each global tensor once (build each \
         pipeline stage's part under the whole model's paths)"
    )]
    TensorsDiffer {
        /// This rank.
        rank: usize,
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
        "rank {rank}: checkpoint: rank {holder} holds `{fqn}` as {blocks} separate blocks of \
         the whole tensor (a fused column-parallel layer sharded per part), and a checkpoint \
         holds one block per tensor and rank; shard the parts as layers of their own"
    )]
    SplitTensor {
        /// This rank.
        rank: usize,
        /// The tensor.
        fqn: String,
        /// The lowest rank holding it so.
        holder: usize,
        /// How many blocks it joins there.
        blocks: usize,
    },
    /// A file listed in the manifest is missing, truncated or changed.
    #[error("rank {rank}: checkpoint: {file} is corrupted: {cause}")]
    Corrupted {
        /// This rank.
        rank: usize,
        /// The file.
        file: PathBuf,
        /// How it differs from the manifest.
        cause: String,
    },
    /// The model has a tensor the checkpoint lacks.
    #[error("rank {rank}: checkpoint: `{fqn}` is not in the checkpoint")]
    MissingKey {
        /// This rank.
        rank: usize,
        /// The tensor's FQN.
        fqn: String,
    },
    /// The checkpoint has a tensor the model lacks (a checkpoint of another model).
    #[error("rank {rank}: checkpoint: `{fqn}` is in the checkpoint but not in the model")]
    UnexpectedKey {
        /// This rank.
        rank: usize,
        /// The tensor's FQN.
        fqn: String,
    },
    /// A tensor's global shape differs.
    #[error(
        "rank {rank}: checkpoint: `{fqn}` is {found:?} in the checkpoint but {expected:?} in \
         the model"
    )]
    Shape {
        /// This rank.
        rank: usize,
        /// The tensor's FQN.
        fqn: String,
        /// The model's (global) shape.
        expected: Vec<i64>,
        /// The checkpoint's.
        found: Vec<i64>,
    },
    /// A tensor's dtype differs.
    #[error(
        "rank {rank}: checkpoint: `{fqn}` is {found} in the checkpoint but {expected} in the \
         model"
    )]
    Dtype {
        /// This rank.
        rank: usize,
        /// The tensor's FQN.
        fqn: String,
        /// The model's dtype (safetensors' name).
        expected: String,
        /// The checkpoint's.
        found: String,
    },
    /// The saved pieces of a tensor do not cover the part this rank needs.
    #[error(
        "rank {rank}: checkpoint: the saved pieces of `{fqn}` cover {covered} of the {needed} \
         values this rank needs"
    )]
    Incomplete {
        /// This rank.
        rank: usize,
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
        "rank {rank}: checkpoint: {dir} has no optimizer state (its save's State held no \
         optimizer)"
    )]
    NoOptimizerState {
        /// This rank.
        rank: usize,
        /// The folder.
        dir: PathBuf,
    },
    /// The checkpoint's optimizer is of another class than the one loading it.
    #[error(
        "rank {rank}: checkpoint: the optimizer state is {found}'s, the optimizer is {expected}"
    )]
    OptimizerKind {
        /// This rank.
        rank: usize,
        /// The optimizer's class (`SGD`, `AdamW`).
        expected: String,
        /// The checkpoint's.
        found: String,
    },
    /// The optimizer state of a parameter does not fit (a state name the optimizer does not
    /// have, state for a parameter the model lacks, a state tensor of another shape).
    #[error("rank {rank}: checkpoint: optimizer state of `{fqn}`: {problem}")]
    OptimizerState {
        /// This rank.
        rank: usize,
        /// The parameter's FQN.
        fqn: String,
        /// What does not fit.
        problem: String,
    },
    /// A collective of [`save`](super::save) failed (a peer died, or other ranks failed
    /// their part: `PeersFailed`): names the checkpoint being written and the step of the
    /// save; the collective's error is the [`source`](std::error::Error::source).
    #[error("rank {rank}: checkpoint.save of {dir}: {step} failed")]
    Save {
        /// This rank.
        rank: usize,
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
    /// [`Dist`](Self::Dist)`(PeersFailed)`.
    #[error("rank {rank}: checkpoint.load of {dir} failed")]
    Load {
        /// This rank.
        rank: usize,
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
    #[error("rank {rank}: checkpoint.save of {dir}: the checkpoint was committed, but what followed failed")]
    Committed {
        /// This rank (0).
        rank: usize,
        /// The checkpoint folder, complete.
        dir: PathBuf,
        /// What failed after the commit (boxed, as [`Save`](Self::Save)'s).
        #[source]
        source: Box<CheckpointError>,
    },
    /// The background thread of [`async_save`](super::async_save()) panicked (a bug: its
    /// errors are values); the other ranks' saves then fail on a collective.
    #[error("rank {rank}: checkpoint.async_save of {dir}: the background write failed: {cause}")]
    Background {
        /// This rank.
        rank: usize,
        /// The checkpoint folder being written.
        dir: PathBuf,
        /// What the panic said.
        cause: String,
    },
    /// A collective between the ranks failed, or another rank failed (`PeersFailed`).
    #[error(transparent)]
    Dist(#[from] DistError),
}
