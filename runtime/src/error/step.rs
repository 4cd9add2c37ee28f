//! [`StepPosition`], [`Phase`], [`PassProgram`], [`CollectiveSignature`]: what the always-on
//! step check compares across ranks (the values [`Mismatch::Step`](super::Mismatch::Step) and
//! [`Mismatch::Program`](super::Mismatch::Program) carry). The header that carries them over
//! the wire, and its encoding, belong to the check (`c10d/step_check/`).

use std::fmt;

use tch::Kind;

use super::mismatch::TensorSignature;

/// Which pass a rank is in when it checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Phase {
    /// A forward pass.
    Forward,
    /// A backward pass.
    Backward,
    /// Between passes (after a forward or a backward ended: a state dict, an explicit
    /// unshard).
    Between,
}

/// Where a rank is in training, as the step check compares it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepPosition {
    /// The pass it is in.
    pub phase: Phase,
    /// Forward passes begun (the current one included): the step number.
    pub forwards: u64,
    /// Backward passes begun (the current one included).
    pub backwards: u64,
    /// The caller's step number ([`set_step`](crate::set_step)), if it gave one.
    pub step: Option<u64>,
}

impl fmt::Display for StepPosition {
    /// `in the forward of step 3 (3 forward and 2 backward passes)`; with the caller's
    /// numbering, `in the forward of step 7 (set_step; 3 forward and 2 backward passes)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (forwards, backwards) = (self.forwards, self.backwards);
        let step = self.step.unwrap_or(forwards);
        match self.phase {
            Phase::Forward => write!(f, "in the forward of step {step}")?,
            Phase::Backward => write!(f, "in the backward of step {step}")?,
            Phase::Between => write!(f, "between passes after step {step}")?,
        }
        let numbered = if self.step.is_some() {
            "set_step; "
        } else {
            ""
        };
        write!(
            f,
            " ({numbered}{forwards} forward and {backwards} backward passes)"
        )
    }
}

/// A collective whose tensors the ranks compare at the start of a pass: which one, and the
/// whole tensor it moves (for an uneven all-gather, the gathered tensor: every rank's is
/// the same).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CollectiveSignature {
    /// The operation (`all_reduce (tensor parallel forward)`, ...).
    pub op: &'static str,
    /// Its tensor's shape and dtype.
    pub tensor: TensorSignature,
}

impl fmt::Display for CollectiveSignature {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} of {}", self.op, self.tensor)
    }
}

/// The operations a signature names; the step check's header carries an op as its position
/// here plus one (0: none).
pub(crate) const SIGNATURE_OPS: [&str; 8] = [
    "all_reduce (tensor-parallel forward)",
    "all_gather (tensor-parallel forward)",
    "reduce_scatter (tensor-parallel forward)",
    "all_reduce (tensor-parallel backward)",
    "all_gather (tensor-parallel backward)",
    "all_reduce (sequence-parallel gradient)",
    "all_to_all (differentiable forward)",
    "all_to_all (differentiable backward)",
];

impl CollectiveSignature {
    /// A signature of `op` (one of [`SIGNATURE_OPS`]) on `tensor`'s shape and dtype.
    pub(crate) fn new(op: &'static str, shape: Vec<i64>, kind: Kind) -> Self {
        debug_assert!(SIGNATURE_OPS.contains(&op), "unknown signature op {op}");
        CollectiveSignature {
            op,
            tensor: TensorSignature { shape, kind },
        }
    }
}

/// What a rank's pass will run, as the step check compares it beside the position: a
/// difference here is two programs in one pass (activation checkpointing or `no_grad` on
/// some ranks only, inputs of other shapes), whose collectives would meet each other.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PassProgram {
    /// The tensor-parallel collectives the forward passes recorded for this backward over
    /// the group (0 outside a backward, and for the other APIs).
    pub recorded: u64,
    /// The pass's first collective, where the API names it (tensor parallelism).
    pub first: Option<CollectiveSignature>,
    /// A fingerprint of the settings that change what the group's passes send or compute
    /// without changing their collectives' sizes (fully_shard's gradient divide factor,
    /// `unshard_in_backward`, `is_last_backward`, an all-reduce hook): 0 while none was set.
    /// Ranks that differ here would compute other numbers, or send mismatched collectives,
    /// from the same step.
    pub settings: u64,
}
