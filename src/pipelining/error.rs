//! [`PipelineError`]: why a stage or a schedule refused, or a step failed, its context
//! written once — [`OnOp`] (this rank and the operation) of a [`PipelineProblem`] (a stage,
//! a schedule or a step's inputs refused, or the ranks' check could not communicate), or
//! [`OnStage`] (this rank and the stage) of a [`StageProblem`] (a step that failed on a
//! stage). The problems' variants carry no rank; their texts are their `#[error]`s.

use std::fmt;

use tch_dist_core::hooks::ForwardError;
use tch_dist_runtime::{DistError, Refusal};

use super::meta::TensorMeta;
use super::placement::Placement;

/// Why a pipeline stage or schedule could not be made, or a step failed: this rank's
/// [`OnOp`] (a refusal, on every rank of the pipeline's group before any activation moved)
/// or [`OnStage`] (a step that failed on one of this rank's stages). `Display` names the
/// rank once, then the operation or the stage, then the problem; the problem's cause (the
/// engine's [`DistError`], the forward's error) is the
/// [`source`](std::error::Error::source), as [`report`](crate::report) composes it.
///
/// ```
/// use tch_dist::pipelining::{PipelineProblem, StageProblem};
/// let e = PipelineProblem::ZeroMicrobatches.on(1, "ScheduleGPipe::new");
/// assert_eq!(e.to_string(), "rank 1: ScheduleGPipe::new: n_microbatches must be at least 1");
/// assert_eq!((e.rank(), e.op()), (1, Some("ScheduleGPipe::new")));
/// assert_eq!(e.problem(), Some(&PipelineProblem::ZeroMicrobatches));
///
/// let message = "the loss must be one number (a mean), not of shape [2, 3]".to_string();
/// let e = StageProblem::Loss { microbatch: 0, message }.on(1, 1);
/// assert_eq!(
///     e.to_string(),
///     "rank 1: stage 1: the loss of microbatch 0 failed: the loss must be one number (a \
///      mean), not of shape [2, 3]"
/// );
/// assert_eq!((e.stage(), e.microbatch()), (Some(1), Some(0)));
/// assert!(matches!(e.stage_problem(), Some(StageProblem::Loss { .. })));
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PipelineError {
    /// A stage, a schedule or a step's inputs do not fit, refused on every rank of the
    /// pipeline's group before any activation moved; or the ranks' check could not
    /// communicate ([`PipelineProblem::Check`]).
    #[error(transparent)]
    OnOp(#[from] OnOp),
    /// A step failed on one of this rank's stages: a transfer, a forward, a loss, a
    /// backward.
    #[error(transparent)]
    OnStage(#[from] OnStage),
}

impl PipelineError {
    /// This process's rank in the pipeline's group.
    pub fn rank(&self) -> usize {
        match self {
            PipelineError::OnOp(e) => e.rank,
            PipelineError::OnStage(e) => e.rank,
        }
    }

    /// The operation that refused (`None` for a step that failed on a stage).
    pub fn op(&self) -> Option<&'static str> {
        match self {
            PipelineError::OnOp(e) => Some(e.op),
            PipelineError::OnStage(_) => None,
        }
    }

    /// The stage the step failed on (`None` for a refusal).
    pub fn stage(&self) -> Option<usize> {
        match self {
            PipelineError::OnStage(e) => Some(e.stage),
            PipelineError::OnOp(_) => None,
        }
    }

    /// The microbatch the step failed on (`None` for a refusal, or the activation
    /// metadata's [`StageProblem::Metadata`]).
    pub fn microbatch(&self) -> Option<usize> {
        self.stage_problem().and_then(StageProblem::microbatch)
    }

    /// What the operation refused (`None` for a step that failed on a stage).
    pub fn problem(&self) -> Option<&PipelineProblem> {
        match self {
            PipelineError::OnOp(e) => Some(&e.problem),
            PipelineError::OnStage(_) => None,
        }
    }

    /// What failed on the stage (`None` for a refusal).
    pub fn stage_problem(&self) -> Option<&StageProblem> {
        match self {
            PipelineError::OnStage(e) => Some(&e.problem),
            PipelineError::OnOp(_) => None,
        }
    }

    /// The error of a check every rank of the pipeline made together
    /// (`ProcessGroup::agree_on_values`): a refusal or a disagreement is its
    /// [`PipelineProblem`], an exchange that could not communicate is
    /// [`PipelineProblem::Check`].
    pub(crate) fn refused(
        rank: usize,
        op: &'static str,
        refusal: Refusal<PipelineProblem>,
    ) -> Self {
        let problem = match refusal {
            Refusal::Own(problem) => problem,
            Refusal::Peer { rank: peer } => PipelineProblem::PeerRefused { peer },
            Refusal::Differs {
                setting,
                this,
                other_rank,
                other,
            } => PipelineProblem::Disagree {
                setting,
                this,
                other_rank,
                other,
            },
            Refusal::Exchange(source) => PipelineProblem::Check { source },
        };
        problem.on(rank, op)
    }
}

/// An operation's refusal on this rank, its context written once: the rank, the operation,
/// then the [`PipelineProblem`]. `Display` is `rank {rank}: {op}: {problem}`; the
/// problem's cause is the [`source`](std::error::Error::source).
#[derive(Debug, Clone, PartialEq)]
pub struct OnOp {
    /// This process's rank in the pipeline's group.
    pub rank: usize,
    /// `PipelineStage::new`, `Schedule1F1B::new`, `Schedule1F1B::step`, ...
    pub op: &'static str,
    /// What is wrong.
    pub problem: PipelineProblem,
}

impl fmt::Display for OnOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rank {}: {}: {}", self.rank, self.op, self.problem)
    }
}

impl std::error::Error for OnOp {
    // The problem's cause, not the problem: its text is this error's already.
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.problem.source()
    }
}

/// A step that failed on one of this rank's stages, its context written once: the rank,
/// the stage, then the [`StageProblem`] (which names the microbatch where it has one, as
/// its text does). `Display` is `rank {rank}: stage {stage}: {problem}`; the problem's
/// cause is the [`source`](std::error::Error::source).
#[derive(Debug)]
pub struct OnStage {
    /// This process's rank in the pipeline's group.
    pub rank: usize,
    /// The stage (on this rank) the step failed on.
    pub stage: usize,
    /// What failed.
    pub problem: StageProblem,
}

impl fmt::Display for OnStage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "rank {}: stage {}: {}",
            self.rank, self.stage, self.problem
        )
    }
}

impl std::error::Error for OnStage {
    // The problem's cause, not the problem: its text is this error's already.
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.problem.source()
    }
}

impl PipelineProblem {
    /// This problem as rank `rank`'s [`PipelineError`] in `op`.
    pub fn on(self, rank: usize, op: &'static str) -> PipelineError {
        PipelineError::OnOp(OnOp {
            rank,
            op,
            problem: self,
        })
    }
}

impl StageProblem {
    /// This problem as rank `rank`'s [`PipelineError`] on its stage `stage`.
    pub fn on(self, rank: usize, stage: usize) -> PipelineError {
        PipelineError::OnStage(OnStage {
            rank,
            stage,
            problem: self,
        })
    }

    /// The microbatch the problem names (`None` for [`Metadata`](Self::Metadata), which
    /// the first microbatch carries).
    pub fn microbatch(&self) -> Option<usize> {
        match self {
            StageProblem::Transfer { microbatch, .. }
            | StageProblem::ShapeMismatch { microbatch, .. }
            | StageProblem::Loss { microbatch, .. }
            | StageProblem::Forward { microbatch, .. }
            | StageProblem::Backward { microbatch, .. }
            | StageProblem::GradientSync { microbatch, .. } => Some(*microbatch),
            StageProblem::Metadata { .. } => None,
        }
    }
}

/// What failed on a stage during a step ([`OnStage`] adds the rank and the stage).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StageProblem {
    /// Sending or receiving between two stages failed (a stage died, or timed out).
    #[error(
        "{transfer} of microbatch {microbatch} {} stage {peer_stage} (rank {peer_rank}) failed",
        if transfer.is_send() { "to" } else { "from" }
    )]
    Transfer {
        /// What was moving.
        transfer: Transfer,
        /// The microbatch.
        microbatch: usize,
        /// The stage at the other end.
        peer_stage: usize,
        /// Its rank in the pipeline's group.
        peer_rank: usize,
        /// What the engine said (boxed, so that every `Result` stays small).
        #[source]
        source: Box<DistError>,
    },
    /// A microbatch's output differs in shape or dtype from the first microbatch's, whose
    /// metadata the next stage allocated its buffers by.
    #[error(
        "the output of microbatch {microbatch} is {got}, but stage {next_stage} was told \
         {expected} (the first microbatch's): every microbatch must have the same shape and \
         dtype"
    )]
    ShapeMismatch {
        /// The stage that receives it.
        next_stage: usize,
        /// The microbatch.
        microbatch: usize,
        /// What was sent ahead.
        expected: TensorMeta,
        /// What this microbatch produced.
        got: TensorMeta,
    },
    /// The metadata received from the previous stage cannot be read.
    #[error("the activation metadata from stage {from_stage} cannot be read: {text:?}")]
    Metadata {
        /// The sending stage.
        from_stage: usize,
        /// What arrived.
        text: String,
    },
    /// The loss function panicked on the last stage (libtorch refused its inputs), or its
    /// loss is not one number.
    #[error("the loss of microbatch {microbatch} failed: {message}")]
    Loss {
        /// The microbatch.
        microbatch: usize,
        /// The panic's message.
        message: String,
    },
    /// The stage's forward failed.
    #[error("the forward of microbatch {microbatch} failed")]
    Forward {
        /// The microbatch.
        microbatch: usize,
        /// The forward's error.
        #[source]
        source: ForwardError,
    },
    /// The stage's backward (or the last stage's loss) failed.
    #[error("the backward of microbatch {microbatch} failed")]
    Backward {
        /// The microbatch.
        microbatch: usize,
        /// libtorch's error.
        #[source]
        source: tch::TchError,
    },
    /// The stage's gradient-sync callback (`PipelineStage::on_backward`) failed.
    #[error("the gradient-sync callback before microbatch {microbatch}'s backward failed")]
    GradientSync {
        /// The microbatch.
        microbatch: usize,
        /// The callback's error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

/// What moves between two stages ([`StageProblem::Transfer`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Transfer {
    /// The forward activation, sent to the next stage.
    SendActivation,
    /// The forward activation, received from the previous stage.
    RecvActivation,
    /// The gradient of the previous stage's output, sent back to it.
    SendGradient,
    /// The gradient of this stage's output, received from the next stage.
    RecvGradient,
    /// The first microbatch's activation metadata (shape, dtype), sent ahead.
    SendMetadata,
    /// The first microbatch's activation metadata, received.
    RecvMetadata,
}

impl Transfer {
    /// Whether this rank is the sender.
    pub fn is_send(self) -> bool {
        matches!(
            self,
            Transfer::SendActivation | Transfer::SendGradient | Transfer::SendMetadata
        )
    }
}

impl fmt::Display for Transfer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Transfer::SendActivation => "sending the activation",
            Transfer::RecvActivation => "receiving the activation",
            Transfer::SendGradient => "sending the input gradient",
            Transfer::RecvGradient => "receiving the output gradient",
            Transfer::SendMetadata => "sending the activation metadata",
            Transfer::RecvMetadata => "receiving the activation metadata",
        })
    }
}

/// What is wrong with a stage, a schedule or a step's inputs, or why the ranks' check of
/// them failed ([`OnOp`] adds the rank and the operation).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum PipelineProblem {
    /// `stage_index` is not below `num_stages`.
    #[error("stage index {stage_index} is out of range for {num_stages} stages")]
    StageIndex {
        /// The index given.
        stage_index: usize,
        /// The number of stages.
        num_stages: usize,
    },
    /// A pipeline needs a group of at least two ranks.
    #[error("a pipeline needs a group of at least 2 ranks, this one has {group_size}")]
    GroupTooSmall {
        /// The group's size.
        group_size: usize,
    },
    /// The stage count is not the group's size times the stages per rank.
    #[error(
        "{num_stages} stages do not fit {group_size} ranks holding {local_stages} stage(s) \
         each (num_stages must be {})",
        group_size * local_stages
    )]
    NumStages {
        /// The number of stages the stages were given.
        num_stages: usize,
        /// The pipeline group's size.
        group_size: usize,
        /// The stages this rank holds.
        local_stages: usize,
    },
    /// A stage on the wrong rank (loop placement: rank r holds stages r, r+P, ...).
    #[error(
        "stage {stage_index} belongs on rank {} of the {group_size}-rank group, not on rank \
         {rank} (rank r holds stages r, r+{group_size}, ...)",
        Placement::Loop.rank_of(*stage_index, *group_size)
    )]
    Placement {
        /// The stage.
        stage_index: usize,
        /// This rank.
        rank: usize,
        /// The pipeline group's size.
        group_size: usize,
    },
    /// A stage on the wrong rank for the V placement (`ScheduleZBVZeroBubble`: rank r holds
    /// stages r and 2P-1-r).
    #[error(
        "stage {stage_index} belongs on rank {} of the {group_size}-rank group, not on rank \
         {rank} (the V placement: rank r holds stages r and {}-r)",
        Placement::V.rank_of(*stage_index, *group_size),
        2 * group_size - 1
    )]
    VPlacement {
        /// The stage.
        stage_index: usize,
        /// This rank.
        rank: usize,
        /// The pipeline group's size.
        group_size: usize,
    },
    /// The V placement needs exactly two stages on every rank.
    #[error(
        "the V placement needs exactly 2 stages on every rank, this rank holds {local_stages}"
    )]
    TwoStagesPerRank {
        /// The stages this rank holds.
        local_stages: usize,
    },
    /// The stages of one schedule were made over different groups.
    #[error("the stages were made over different process groups")]
    Groups,
    /// A schedule without stages.
    #[error("the schedule was given no stage")]
    NoStages,
    /// Zero microbatches.
    #[error("n_microbatches must be at least 1")]
    ZeroMicrobatches,
    /// 1F1B needs at least as many microbatches as stages.
    #[error(
        "{n_microbatches} microbatches are fewer than the {num_stages} stages (1F1B needs at \
         least one per stage)"
    )]
    FewerMicrobatchesThanStages {
        /// The microbatch count.
        n_microbatches: usize,
        /// The number of stages.
        num_stages: usize,
    },
    /// The interleaved schedules need the microbatches to be a multiple of their rounds.
    #[error("{n_microbatches} microbatches are not a multiple of the schedule's {rounds} rounds")]
    Rounds {
        /// The microbatch count.
        n_microbatches: usize,
        /// `max(1, n_microbatches / group size)`.
        rounds: usize,
    },
    /// Too many stages × microbatches for distinct 32-bit message tags.
    #[error(
        "{num_stages} stages x {n_microbatches} microbatches need more message tags than 32 \
         bits hold"
    )]
    TooManyTags {
        /// The number of stages.
        num_stages: usize,
        /// The microbatch count.
        n_microbatches: usize,
    },
    /// The ranks of the group were given different settings.
    #[error(
        "this rank was given {setting} {this}, rank {other_rank} was given {other} (every rank \
         of the pipeline must agree)"
    )]
    Disagree {
        /// `num_stages`, `n_microbatches`, `schedule`, `stages per rank`.
        setting: &'static str,
        /// This rank's value.
        this: i64,
        /// The first rank whose value differs.
        other_rank: usize,
        /// Its value.
        other: i64,
    },
    /// Another rank refused (its own error says why).
    #[error("rank {peer} refused the pipeline (its error says why)")]
    PeerRefused {
        /// The first rank that refused.
        peer: usize,
    },
    /// The schedule's check that every rank agrees (at construction, and on the batch at
    /// each step) could not communicate.
    #[error("the pipeline group's check failed")]
    Check {
        /// What the engine said (boxed, so that every `Result` stays small).
        #[source]
        source: Box<DistError>,
    },
    /// The batch does not split into equal microbatches.
    #[error("a batch of {batch} does not split into {n_microbatches} equal microbatches")]
    BatchNotDivisible {
        /// The batch's size along dim 0.
        batch: i64,
        /// The microbatch count.
        n_microbatches: usize,
    },
    /// A training step under `no_grad` (`tch::no_grad`, or grad mode off on the calling
    /// thread): its backward would have no graph.
    #[error(
        "a training step needs grad mode, but it is off on this thread (the step is inside \
         `tch::no_grad`); call step outside it"
    )]
    GradDisabled,
    /// The first stage got no input.
    #[error("the first stage needs an input")]
    MissingInput,
    /// The last stage got no target.
    #[error("the last stage needs a target")]
    MissingTarget,
    /// Input and target batches of different sizes.
    #[error("the input's batch is {input} but the target's is {target}")]
    TargetBatch {
        /// The input's batch size.
        input: i64,
        /// The target's batch size.
        target: i64,
    },
    /// An input or target with no dim to split.
    #[error("the input and target need a dim 0 to split into microbatches")]
    Scalar,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn internal() -> Box<DistError> {
        Box::new(DistError::Internal {
            rank: 1,
            op: "recv",
            what: "gone",
        })
    }

    /// Every stage problem's text under its context, and the cause through `source` only
    /// (the texts the variants had when each carried its rank and stage).
    #[test]
    fn stage_problems_read_as_before() {
        let transfer = |transfer| {
            StageProblem::Transfer {
                transfer,
                microbatch: 3,
                peer_stage: 2,
                peer_rank: 0,
                source: internal(),
            }
            .on(1, 1)
        };
        let e = transfer(Transfer::SendActivation);
        assert_eq!(
            e.to_string(),
            "rank 1: stage 1: sending the activation of microbatch 3 to stage 2 (rank 0) failed"
        );
        assert_eq!(crate::report(&e), format!("{}: {}", e, internal()));
        assert_eq!(
            transfer(Transfer::RecvGradient).to_string(),
            "rank 1: stage 1: receiving the output gradient of microbatch 3 from stage 2 (rank \
             0) failed"
        );
        assert_eq!(
            (e.rank(), e.stage(), e.microbatch(), e.op()),
            (1, Some(1), Some(3), None)
        );
        let meta = |shape: &[i64]| TensorMeta {
            shape: shape.to_vec(),
            kind: tch::Kind::Float,
        };
        let shape = StageProblem::ShapeMismatch {
            next_stage: 1,
            microbatch: 0,
            expected: meta(&[2, 12]),
            got: meta(&[2, 11]),
        };
        assert_eq!(
            shape.on(0, 0).to_string(),
            "rank 0: stage 0: the output of microbatch 0 is float32[2, 11], but stage 1 was \
             told float32[2, 12] (the first microbatch's): every microbatch must have the same \
             shape and dtype"
        );
        let unreadable = StageProblem::Metadata {
            from_stage: 0,
            text: "junk".into(),
        }
        .on(1, 1);
        assert_eq!(
            unreadable.to_string(),
            "rank 1: stage 1: the activation metadata from stage 0 cannot be read: \"junk\""
        );
        assert_eq!(unreadable.microbatch(), None);
        let forward = StageProblem::Forward {
            microbatch: 2,
            source: ForwardError::new("the data went away"),
        }
        .on(0, 0);
        assert_eq!(
            crate::report(&forward),
            "rank 0: stage 0: the forward of microbatch 2 failed: the data went away"
        );
        let backward = StageProblem::Backward {
            microbatch: 2,
            source: tch::TchError::Kind("no graph".into()),
        }
        .on(0, 2);
        assert_eq!(
            backward.to_string(),
            "rank 0: stage 2: the backward of microbatch 2 failed"
        );
        let sync = StageProblem::GradientSync {
            microbatch: 1,
            source: "sync failed".into(),
        }
        .on(1, 3);
        assert_eq!(
            crate::report(&sync),
            "rank 1: stage 3: the gradient-sync callback before microbatch 1's backward \
             failed: sync failed"
        );
    }

    /// A check that could not communicate names the operation, its cause through `source`.
    #[test]
    fn a_check_that_could_not_communicate() {
        let e = PipelineError::refused(0, "Schedule1F1B::step", Refusal::Exchange(internal()));
        assert_eq!(
            e.to_string(),
            "rank 0: Schedule1F1B::step: the pipeline group's check failed"
        );
        assert_eq!(crate::report(&e), format!("{e}: {}", internal()));
        assert!(matches!(e.problem(), Some(PipelineProblem::Check { .. })));
        let peer = PipelineError::refused(0, "ScheduleGPipe::new", Refusal::Peer { rank: 1 });
        assert_eq!(
            peer.problem(),
            Some(&PipelineProblem::PeerRefused { peer: 1 })
        );
    }
}
