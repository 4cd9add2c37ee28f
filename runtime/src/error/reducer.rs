//! [`ReducerError`]: what the reducer itself refuses in a backward pass, named after the API
//! that runs it (`op`, from [`ReducerOptions::api`](crate::ReducerOptions::api):
//! `replicate` for tch-dist's replicate), which the runtime does not hard-code.

use super::text::Joined;
use super::DistError;

/// A backward pass the reducer refuses (reached as [`DistError::Reducer`]).
///
/// ```
/// use tch_dist_runtime::{DistError, ReducerError};
/// let e: DistError = ReducerError::GradientAfterLaunch { rank: 0, op: "replicate", fqn: "fc.weight".into() }.into();
/// assert!(e.to_string().starts_with("rank 0: replicate: parameter `fc.weight` received a gradient"));
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ReducerError {
    /// `static_graph`: a parameter's use changed after the first iteration.
    #[error(
        "rank {rank}: {op}: the training graph changed in this iteration: `{fqn}` {} in \
         the first iteration but {} in this one, which static_graph=true does not allow",
        if *used_in_first_pass { "got a gradient" } else { "got no gradient" },
        if *used_in_first_pass { "none" } else { "one" }
    )]
    GraphChanged {
        /// This process's rank.
        rank: usize,
        /// The API that runs the reducer.
        op: &'static str,
        /// The parameter whose use changed.
        fqn: String,
        /// Whether it got a gradient in the first iteration.
        used_in_first_pass: bool,
    },
    /// The previous backward pass left parameters without a gradient (PyTorch's
    /// "Expected to have finished reduction in the prior iteration" error, whose wording
    /// names the rank again where it lists the parameters).
    #[error(
        "rank {rank}: {op} failed: Expected to have finished reduction in the prior iteration \
         before starting a new one. This error indicates that your module has parameters that \
         were not used in producing loss. You can enable unused parameter detection by passing \
         `find_unused_parameters: true` in {op}::Options, and by making sure all forward \
         outputs participate in calculating loss. Parameter indices which did not receive \
         grad: {}. Parameters which did not receive grad for rank {rank}: {}",
        Joined(indices, " "),
        Joined(fqns, ", ")
    )]
    UnfinishedReduction {
        /// This process's rank.
        rank: usize,
        /// The API that runs the reducer.
        op: &'static str,
        /// The parameters' indices in registration order.
        indices: Vec<usize>,
        /// The parameters' FQNs, in the same order.
        fqns: Vec<String>,
    },
    /// A parameter's gradient changed after its all-reduce had started (it was marked ready
    /// twice in one backward pass).
    #[error(
        "rank {rank}: {op}: parameter `{fqn}` received a gradient after its all-reduce \
         had started (it was marked ready twice in one backward pass, e.g. used in several \
         reentrant backward passes or outside forward)"
    )]
    GradientAfterLaunch {
        /// This process's rank.
        rank: usize,
        /// The API that runs the reducer.
        op: &'static str,
        /// The parameter.
        fqn: String,
    },
}

impl ReducerError {
    /// The rank the message names.
    pub fn rank(&self) -> usize {
        match self {
            ReducerError::GraphChanged { rank, .. }
            | ReducerError::UnfinishedReduction { rank, .. }
            | ReducerError::GradientAfterLaunch { rank, .. } => *rank,
        }
    }
}

impl From<ReducerError> for DistError {
    fn from(e: ReducerError) -> DistError {
        DistError::Reducer(Box::new(e))
    }
}
