//! A sharded module's forward hook that failed: [`OnHook`] (this rank, the hook, the module)
//! and [`ForwardProblem`] (what went wrong in it).

use std::fmt;

use tch_dist_runtime::DistError;

use super::Key;

/// A sharded module's forward hook that failed on this rank, its context written once: the
/// hook, the module and the rank, then the [`ForwardProblem`]. It reads as PyTorch's module
/// call raises it, the rank after the module: ``shard_module: row-parallel `fc2` on rank 1
/// expects ...``; a failed collective's [`DistError`] names the rank itself, so the context
/// leaves it out (``shard_module: output of `fc2`: rank 1: all_gather ...``). The problem's
/// cause is the [`source`](std::error::Error::source).
///
/// ```
/// use tch_dist::sharding::{ForwardProblem, HookSite, OnHook};
/// let e = OnHook {
///     rank: 1,
///     site: HookSite::Output,
///     fqn: "fc2".into(),
///     problem: ForwardProblem::Outputs { got: 2 },
/// };
/// assert_eq!(
///     e.to_string(),
///     "shard_module: output of `fc2` on rank 1: the plan describes one output, the call \
///      returned 2"
/// );
/// ```
#[derive(Debug, Clone)]
pub struct OnHook {
    /// This rank.
    pub rank: usize,
    /// Which of the module's hooks.
    pub site: HookSite,
    /// The module whose hook failed.
    pub fqn: String,
    /// What went wrong.
    pub problem: ForwardProblem,
}

impl fmt::Display for OnHook {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "shard_module: {} {}", self.site, Key(&self.fqn))?;
        match &self.problem {
            // `on rank R expects ...`: the width reads on from the rank.
            problem @ ForwardProblem::InputWidth { .. } => {
                write!(f, " on rank {} {problem}", self.rank)
            }
            ForwardProblem::Collective(e) if e.rank() == Some(self.rank) => write!(f, ": {e}"),
            problem => write!(f, " on rank {}: {problem}", self.rank),
        }
    }
}

impl std::error::Error for OnHook {
    // The problem's cause, not the problem: its text is this error's already.
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.problem.source()
    }
}

/// Which hook of a sharded module failed (the part of the message before its FQN).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum HookSite {
    /// A column-parallel layer's input hook.
    ColumnParallel,
    /// A row-parallel layer's input hook.
    RowParallel,
    /// The output hook that restores or reshards a module's output.
    Output,
    /// A vocab-parallel embedding's hooks (the ids' mapping to this rank's rows, the mask).
    VocabParallel,
    /// A sequence-parallel norm's input hook.
    SequenceParallel,
    /// `PrepareModuleInput`'s hook.
    Input,
    /// Expert parallelism's hooks (the tokens sent to their experts' ranks and back).
    ExpertParallel,
}

impl fmt::Display for HookSite {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            HookSite::ColumnParallel => "column-parallel",
            HookSite::RowParallel => "row-parallel",
            HookSite::Output => "output of",
            HookSite::VocabParallel => "vocab-parallel",
            HookSite::SequenceParallel => "sequence-parallel",
            HookSite::Input => "input of",
            HookSite::ExpertParallel => "expert-parallel",
        })
    }
}

/// Why a sharded module's forward hook failed (the `problem` of an [`OnHook`]).
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum ForwardProblem {
    /// A row-parallel layer's input is neither its whole input width nor this rank's slice.
    #[error("expects {full} input features (or its slice of {local}), got {width}")]
    InputWidth {
        /// The layer's input features.
        full: i64,
        /// This rank's slice of them.
        local: i64,
        /// The input's last dim.
        width: i64,
    },
    /// The `output_plan` spec's dim is not a dim of the module's output.
    #[error("output_plan's dim {dim} is out of range for an output of {ndim} dims")]
    OutputDim {
        /// The spec's dim.
        dim: i64,
        /// The output's number of dims.
        ndim: usize,
    },
    /// A module whose output the plan changes returned several outputs (a tuple): a layout
    /// describes one.
    #[error("the plan describes one output, the call returned {got}")]
    Outputs {
        /// How many outputs the call returned.
        got: usize,
    },
    /// A vocab-parallel embedding was called with something other than integer ids.
    #[error("expects integer ids (Int64 or Int), got {dtype}")]
    NotIds {
        /// The input's dtype.
        dtype: String,
    },
    /// An id outside the whole table: no rank holds its row, so its embedding would be
    /// zero without a word (one table raises on it too).
    #[error("id {id} is outside the table of {vocab} embeddings")]
    IdOutOfRange {
        /// The first such id.
        id: i64,
        /// The table's rows.
        vocab: i64,
    },
    /// A vocab-parallel embedding's output hook ran without its input hook (the call's mask
    /// is missing).
    #[error("the lookup ran without its input hook, so its tokens of other ranks are not masked")]
    LookupWithoutInputHook,
    /// A whole tensor to be split evenly along `dim` over the tensor-parallel group (a
    /// `Shard(dim)` layout: the sequence, under sequence parallelism) has a length the group's
    /// size does not divide. Every rank has the same shapes, so every rank refuses it.
    #[error(
        "cannot shard dim {dim} of length {len} over {world} ranks: sequence parallelism \
         splits it evenly, so the length must be divisible by the tensor-parallel size {world}"
    )]
    NotDivisible {
        /// The length along `dim`.
        len: i64,
        /// The dim (as the plan gives it).
        dim: i64,
        /// The tensor-parallel group's size.
        world: usize,
    },
    /// A `Shard(dim)` layout's dim is not a dim of the tensor.
    #[error("Shard({dim}) is out of range for a tensor of {ndim} dims")]
    LayoutDim {
        /// The layout's dim.
        dim: i64,
        /// The tensor's number of dims.
        ndim: usize,
    },
    /// `PrepareModuleInput` lays out another number of inputs than the call passed.
    #[error("the plan lays out {expected} inputs, the call passed {got}")]
    InputCount {
        /// `input_layouts.len()`.
        expected: usize,
        /// The call's inputs.
        got: usize,
    },
    /// `PrepareModuleOutput` lays out another number of outputs than the call returned.
    #[error("the plan lays out {expected} outputs, the call returned {got}")]
    OutputCount {
        /// `output_layouts.len()`.
        expected: usize,
        /// The call's outputs.
        got: usize,
    },
    /// Expert-parallel experts were called with other inputs than the rows grouped by
    /// expert and the rows per expert.
    #[error(
        "expects 2 inputs, the rows grouped by expert and the count of rows per expert, the \
         call passed {got}"
    )]
    ExpertInputs {
        /// The call's inputs.
        got: usize,
    },
    /// This rank's rows per expert do not describe its rows: another number of experts,
    /// or counts that do not add up to the rows (nothing was exchanged with wrong counts;
    /// every rank refused the call).
    #[error("{counts} counts adding up to {sum} for {rows} rows of {experts} experts")]
    DispatchCounts {
        /// How many counts the call passed.
        counts: i64,
        /// Their sum.
        sum: i64,
        /// The rows passed.
        rows: i64,
        /// The layer's experts over every rank.
        experts: i64,
    },
    /// Another rank's rows per expert did not describe its rows: every rank refused the
    /// call (that rank's error says why).
    #[error("rank {rank}'s counts of rows per expert do not match its rows")]
    PeerDispatchCounts {
        /// The first such rank in the group.
        rank: usize,
    },
    /// Expert parallelism's output hook ran without its input hook.
    #[error("the experts ran without the input hook that sent the tokens to them")]
    CombineWithoutDispatch,
    /// A collective failed (boxed, so that every `Result` stays small).
    #[error(transparent)]
    Collective(Box<DistError>),
}

impl ForwardProblem {
    /// A failed collective ([`Collective`](ForwardProblem::Collective)).
    pub(crate) fn collective(e: DistError) -> ForwardProblem {
        ForwardProblem::Collective(Box::new(e))
    }
}
