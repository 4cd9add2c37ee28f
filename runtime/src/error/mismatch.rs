//! [`Mismatch`]: what differs across ranks, and the tensor signatures ranks compare.

use std::fmt;

use tch::Kind;

use super::step::{CollectiveSignature, PassProgram, StepPosition};
use super::text::RankValues;

/// A tensor's shape and dtype, as ranks compare them (written `[8, 4] (Float)`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSignature {
    /// The shape.
    pub shape: Vec<i64>,
    /// The element type.
    pub kind: Kind,
}

impl fmt::Display for TensorSignature {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?} ({:?})", self.shape, self.kind)
    }
}

/// One entry of a list of tensors the ranks compare: its name and signature.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NamedSignature {
    /// The tensor's FQN.
    pub fqn: String,
    /// Its shape and dtype.
    pub signature: TensorSignature,
}

impl fmt::Display for NamedSignature {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "`{}` with shape {:?} ({:?})",
            self.fqn, self.signature.shape, self.signature.kind
        )
    }
}

/// What differs across ranks (the `mismatch` of [`DistError::Mismatch`](crate::DistError::Mismatch)).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Mismatch {
    /// A named tensor has another shape or dtype on `other_rank` than on `reference_rank`.
    #[error(
        "{what} differ across ranks: `{fqn}` has shape {:?} ({:?}) on rank {reference_rank} but \
         shape {:?} ({:?}) on rank {other_rank}",
        reference.shape, reference.kind, other.shape, other.kind
    )]
    Tensor {
        /// What the list holds ("parameters", "buffers").
        what: &'static str,
        /// The tensor's FQN.
        fqn: String,
        /// The rank whose list is the reference.
        reference_rank: usize,
        /// The tensor there.
        reference: TensorSignature,
        /// The rank that differs.
        other_rank: usize,
        /// The tensor there.
        other: TensorSignature,
    },
    /// The ranks' lists differ in length or names; `index` is the first entry that differs.
    #[error(
        "{what} differ across ranks: rank {reference_rank} has {reference_len} {what} and rank \
         {other_rank} has {other_len}; entry {index} is {} on rank {reference_rank} but {} on \
         rank {other_rank}",
        Entry(reference_entry.as_ref()),
        Entry(other_entry.as_ref())
    )]
    List {
        /// What the list holds ("parameters", "buffers").
        what: &'static str,
        /// The rank whose list is the reference.
        reference_rank: usize,
        /// Its length.
        reference_len: usize,
        /// The rank that differs.
        other_rank: usize,
        /// Its length.
        other_len: usize,
        /// The first differing position.
        index: usize,
        /// The entry there on the reference rank (`None`: its list is shorter).
        reference_entry: Option<NamedSignature>,
        /// The entry there on the other rank.
        other_entry: Option<NamedSignature>,
    },
    /// An option has different values on different ranks.
    #[error("option `{option}` differs across ranks: {}", RankValues(values))]
    OptionValue {
        /// The option's name.
        option: String,
        /// Its value on each rank, in rank order.
        values: Vec<String>,
    },
    /// One unnamed tensor (the source of a scatter) differs.
    #[error("rank {reference_rank} passes a tensor of shape {reference}, but rank {other_rank} passed {other}")]
    Shape {
        /// The rank whose tensor is the reference (the source).
        reference_rank: usize,
        /// Its tensor.
        reference: TensorSignature,
        /// The rank that differs.
        other_rank: usize,
        /// Its tensor.
        other: TensorSignature,
    },
    /// The always-on step check (`step_check/`): another rank is at another step or in
    /// another pass; nothing of this pass was sent.
    #[error(
        "rank {other_rank} is {other} while this rank is {this} (a rank skipped or repeated \
         a step, a forward or a backward)"
    )]
    Step {
        /// The rank that differs (the lowest one).
        other_rank: usize,
        /// Where it is.
        other: StepPosition,
        /// Where this rank is.
        this: StepPosition,
    },
    /// The always-on step check: another rank is in the same pass but would run other
    /// collectives in it (it recorded another number of tensor-parallel collectives for this
    /// backward, or starts the pass with another collective or another shape); nothing of
    /// this pass was sent.
    #[error("{}", ProgramText { other_rank: *other_rank, position, other, this })]
    Program {
        /// The rank that differs (the lowest one).
        other_rank: usize,
        /// Where both are.
        position: StepPosition,
        /// What its pass runs.
        other: PassProgram,
        /// What this rank's pass runs.
        this: PassProgram,
    },
}

/// [`Mismatch::Program`]'s text: the first thing that differs, and its likely cause.
struct ProgramText<'a> {
    other_rank: usize,
    position: &'a StepPosition,
    other: &'a PassProgram,
    this: &'a PassProgram,
}

impl fmt::Display for ProgramText<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ProgramText {
            other_rank,
            position,
            other,
            this,
        } = self;
        if other.recorded != this.recorded {
            return write!(
                f,
                "rank {other_rank}'s forward recorded {} tensor-parallel collectives for its \
                 backward while this rank's recorded {}, {position} (activation checkpointing, \
                 no_grad or another model on some ranks only: the backward passes would run \
                 different collectives)",
                other.recorded, this.recorded
            );
        }
        if other.settings != this.settings {
            return write!(
                f,
                "rank {other_rank} runs this pass with other settings than this rank, {position} \
                 (a fully_shard setter, set_gradient_divide_factor, set_unshard_in_backward, \
                 set_is_last_backward or set_all_reduce_hook, was called on some ranks only or \
                 with other values: call it on every rank alike)"
            );
        }
        let first = |s: &Option<CollectiveSignature>| {
            s.as_ref()
                .map_or("no tensor-parallel collective".to_string(), |s| {
                    s.to_string()
                })
        };
        write!(
            f,
            "rank {other_rank} starts this pass with {} while this rank starts it with {}, \
             {position} (the ranks' inputs differ: every rank of a tensor-parallel group must \
             get inputs of the same shapes, and run the same layers)",
            first(&other.first),
            first(&this.first)
        )
    }
}

/// A list entry, or `missing` past the list's end.
struct Entry<'a>(Option<&'a NamedSignature>);

impl fmt::Display for Entry<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(e) => write!(f, "{e}"),
            None => f.write_str("missing"),
        }
    }
}
