//! [`PipelineError`] and [`PipelineProblem`]: why a stage or a schedule refused, or a step
//! failed.

use std::fmt;

use tch_dist_core::hooks::ForwardError;
use tch_dist_runtime::{DistError, Refusal};

use super::meta::TensorMeta;
use super::placement::Placement;

/// Why a pipeline stage or schedule could not be made, or a step failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PipelineError {
    /// The stage, the schedule or the step's inputs do not fit (refused on every rank of the
    /// pipeline's group before any activation moved).
    #[error("rank {rank}: {op}: {problem}")]
    Invalid {
        /// This process's rank in the pipeline's group.
        rank: usize,
        /// `PipelineStage::new`, `Schedule1F1B::new`, `Schedule1F1B::step`, ...
        op: &'static str,
        /// What is wrong.
        problem: PipelineProblem,
    },
    /// Sending or receiving between two stages failed (a stage died, or timed out).
    #[error(
        "rank {rank}: stage {stage}: {transfer} of microbatch {microbatch} {} stage {peer_stage} (rank {peer_rank}) failed",
        if transfer.is_send() { "to" } else { "from" }
    )]
    Transfer {
        /// This process's rank in the pipeline's group.
        rank: usize,
        /// The stage on this rank.
        stage: usize,
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
        "rank {rank}: stage {stage}: the output of microbatch {microbatch} is {got}, but stage \
         {next_stage} was told {expected} (the first microbatch's): every microbatch must have \
         the same shape and dtype"
    )]
    ShapeMismatch {
        /// This process's rank in the pipeline's group.
        rank: usize,
        /// The stage whose output changed.
        stage: usize,
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
    #[error(
        "rank {rank}: stage {stage}: the activation metadata from stage {from_stage} cannot be \
         read: {text:?}"
    )]
    Metadata {
        /// This process's rank in the pipeline's group.
        rank: usize,
        /// The receiving stage.
        stage: usize,
        /// The sending stage.
        from_stage: usize,
        /// What arrived.
        text: String,
    },
    /// The schedule's check that every rank agrees (at construction, and on the batch at
    /// each step) could not communicate.
    #[error("rank {rank}: {op}: the pipeline group's check failed")]
    Check {
        /// This process's rank in the pipeline's group.
        rank: usize,
        /// The schedule's constructor or `step`.
        op: &'static str,
        /// What the engine said.
        #[source]
        source: Box<DistError>,
    },
    /// The loss function panicked on the last stage (libtorch refused its inputs), or its
    /// loss is not one number.
    #[error("rank {rank}: stage {stage}: the loss of microbatch {microbatch} failed: {message}")]
    Loss {
        /// This process's rank in the pipeline's group.
        rank: usize,
        /// The last stage.
        stage: usize,
        /// The microbatch.
        microbatch: usize,
        /// The panic's message.
        message: String,
    },
    /// The stage's forward failed.
    #[error("rank {rank}: stage {stage}: the forward of microbatch {microbatch} failed")]
    Forward {
        /// This process's rank in the pipeline's group.
        rank: usize,
        /// The stage.
        stage: usize,
        /// The microbatch.
        microbatch: usize,
        /// The forward's error.
        #[source]
        source: ForwardError,
    },
    /// The stage's backward (or the last stage's loss) failed.
    #[error("rank {rank}: stage {stage}: the backward of microbatch {microbatch} failed")]
    Backward {
        /// This process's rank in the pipeline's group.
        rank: usize,
        /// The stage.
        stage: usize,
        /// The microbatch.
        microbatch: usize,
        /// libtorch's error.
        #[source]
        source: tch::TchError,
    },
    /// The stage's gradient-sync callback (`PipelineStage::on_backward`) failed.
    #[error("rank {rank}: stage {stage}: the gradient-sync callback before microbatch {microbatch}'s backward failed")]
    GradientSync {
        /// This process's rank in the pipeline's group.
        rank: usize,
        /// The stage.
        stage: usize,
        /// The microbatch.
        microbatch: usize,
        /// The callback's error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

impl PipelineError {
    /// The error of a check every rank of the pipeline made together
    /// (`ProcessGroup::agree_on_values`): a refusal or a disagreement is
    /// [`Invalid`](Self::Invalid), an exchange that could not communicate is
    /// [`Check`](Self::Check).
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
            Refusal::Exchange(source) => return PipelineError::Check { rank, op, source },
        };
        PipelineError::Invalid { rank, op, problem }
    }
}

/// What moves between two stages ([`PipelineError::Transfer`]).
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

/// What is wrong with a stage, a schedule or a step's inputs ([`PipelineError::Invalid`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum PipelineProblem {
    /// `stage_index` is not below `num_stages`.
    StageIndex {
        /// The index given.
        stage_index: usize,
        /// The number of stages.
        num_stages: usize,
    },
    /// A pipeline needs a group of at least two ranks.
    GroupTooSmall {
        /// The group's size.
        group_size: usize,
    },
    /// The stage count is not the group's size times the stages per rank.
    NumStages {
        /// The number of stages the stages were given.
        num_stages: usize,
        /// The pipeline group's size.
        group_size: usize,
        /// The stages this rank holds.
        local_stages: usize,
    },
    /// A stage on the wrong rank (loop placement: rank r holds stages r, r+P, ...).
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
    VPlacement {
        /// The stage.
        stage_index: usize,
        /// This rank.
        rank: usize,
        /// The pipeline group's size.
        group_size: usize,
    },
    /// The V placement needs exactly two stages on every rank.
    TwoStagesPerRank {
        /// The stages this rank holds.
        local_stages: usize,
    },
    /// The stages of one schedule were made over different groups.
    Groups,
    /// A schedule without stages.
    NoStages,
    /// Zero microbatches.
    ZeroMicrobatches,
    /// 1F1B needs at least as many microbatches as stages.
    FewerMicrobatchesThanStages {
        /// The microbatch count.
        n_microbatches: usize,
        /// The number of stages.
        num_stages: usize,
    },
    /// The interleaved schedules need the microbatches to be a multiple of their rounds.
    Rounds {
        /// The microbatch count.
        n_microbatches: usize,
        /// `max(1, n_microbatches / group size)`.
        rounds: usize,
    },
    /// Too many stages × microbatches for distinct 32-bit message tags.
    TooManyTags {
        /// The number of stages.
        num_stages: usize,
        /// The microbatch count.
        n_microbatches: usize,
    },
    /// The ranks of the group were given different settings.
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
    PeerRefused {
        /// The first rank that refused.
        peer: usize,
    },
    /// The batch does not split into equal microbatches.
    BatchNotDivisible {
        /// The batch's size along dim 0.
        batch: i64,
        /// The microbatch count.
        n_microbatches: usize,
    },
    /// A training step under `no_grad` (`tch::no_grad`, or grad mode off on the calling
    /// thread): its backward would have no graph.
    GradDisabled,
    /// The first stage got no input.
    MissingInput,
    /// The last stage got no target.
    MissingTarget,
    /// Input and target batches of different sizes.
    TargetBatch {
        /// The input's batch size.
        input: i64,
        /// The target's batch size.
        target: i64,
    },
    /// An input or target with no dim to split.
    Scalar,
}

impl fmt::Display for PipelineProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PipelineProblem::StageIndex {
                stage_index,
                num_stages,
            } => write!(
                f,
                "stage index {stage_index} is out of range for {num_stages} stages"
            ),
            PipelineProblem::GroupTooSmall { group_size } => write!(
                f,
                "a pipeline needs a group of at least 2 ranks, this one has {group_size}"
            ),
            PipelineProblem::NumStages {
                num_stages,
                group_size,
                local_stages,
            } => write!(
                f,
                "{num_stages} stages do not fit {group_size} ranks holding {local_stages} \
                 stage(s) each (num_stages must be {})",
                group_size * local_stages
            ),
            PipelineProblem::Placement {
                stage_index,
                rank,
                group_size,
            } => write!(
                f,
                "stage {stage_index} belongs on rank {} of the {group_size}-rank group, not on \
                 rank {rank} (rank r holds stages r, r+{group_size}, ...)",
                stage_index % group_size
            ),
            PipelineProblem::VPlacement {
                stage_index,
                rank,
                group_size,
            } => write!(
                f,
                "stage {stage_index} belongs on rank {} of the {group_size}-rank group, not on \
                 rank {rank} (the V placement: rank r holds stages r and {}-r)",
                Placement::V.rank_of(*stage_index, *group_size),
                2 * group_size - 1
            ),
            PipelineProblem::TwoStagesPerRank { local_stages } => write!(
                f,
                "the V placement needs exactly 2 stages on every rank, this rank holds \
                 {local_stages}"
            ),
            PipelineProblem::Groups => {
                write!(f, "the stages were made over different process groups")
            }
            PipelineProblem::NoStages => write!(f, "the schedule was given no stage"),
            PipelineProblem::ZeroMicrobatches => write!(f, "n_microbatches must be at least 1"),
            PipelineProblem::FewerMicrobatchesThanStages {
                n_microbatches,
                num_stages,
            } => write!(
                f,
                "{n_microbatches} microbatches are fewer than the {num_stages} stages (1F1B \
                 needs at least one per stage)"
            ),
            PipelineProblem::Rounds {
                n_microbatches,
                rounds,
            } => write!(
                f,
                "{n_microbatches} microbatches are not a multiple of the schedule's {rounds} \
                 rounds"
            ),
            PipelineProblem::TooManyTags {
                num_stages,
                n_microbatches,
            } => write!(
                f,
                "{num_stages} stages x {n_microbatches} microbatches need more message tags \
                 than 32 bits hold"
            ),
            PipelineProblem::Disagree {
                setting,
                this,
                other_rank,
                other,
            } => write!(
                f,
                "this rank was given {setting} {this}, rank {other_rank} was given {other} \
                 (every rank of the pipeline must agree)"
            ),
            PipelineProblem::PeerRefused { peer } => {
                write!(f, "rank {peer} refused the pipeline (its error says why)")
            }
            PipelineProblem::BatchNotDivisible {
                batch,
                n_microbatches,
            } => write!(
                f,
                "a batch of {batch} does not split into {n_microbatches} equal microbatches"
            ),
            PipelineProblem::GradDisabled => write!(
                f,
                "a training step needs grad mode, but it is off on this thread (the step is \
                 inside `tch::no_grad`); call step outside it"
            ),
            PipelineProblem::MissingInput => write!(f, "the first stage needs an input"),
            PipelineProblem::MissingTarget => write!(f, "the last stage needs a target"),
            PipelineProblem::TargetBatch { input, target } => write!(
                f,
                "the input's batch is {input} but the target's is {target}"
            ),
            PipelineProblem::Scalar => write!(
                f,
                "the input and target need a dim 0 to split into microbatches"
            ),
        }
    }
}
