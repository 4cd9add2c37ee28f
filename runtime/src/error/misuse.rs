//! [`MisuseProblem`]: what tch-dist itself refused (the `problem` of
//! [`DistError::Misuse`](super::DistError::Misuse)), as opposed to text the engine said.

/// A use of the runtime that tch-dist refuses on its own, with what it found: the ranks run
/// different builds, a gradient does not fit its shard, an index names nothing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MisuseProblem {
    /// A rank sent a record of tch-dist's own (tensor signatures, a step check, a device
    /// claim) that this rank cannot decode: the ranks run different tch-dist builds.
    #[error(
        "{} sent {what} that this rank cannot decode (another tch-dist build?)",
        Sender(*from)
    )]
    Undecodable {
        /// What was sent.
        what: &'static str,
        /// The rank that sent it, where it is known.
        from: Option<usize>,
    },
    /// A parameter's `.grad`, set by the user, does not have its shard's shape.
    #[error(
        "module `{module}`: `.grad` of `{fqn}` has shape {shape:?}, not its shard's {expected:?}"
    )]
    GradShape {
        /// The managed module.
        module: String,
        /// The parameter.
        fqn: String,
        /// The gradient's shape.
        shape: Vec<i64>,
        /// The shard's shape.
        expected: Vec<i64>,
    },
    /// A parameter index names no parameter of the module.
    #[error("no such parameter (index {index})")]
    NoSuchParameter {
        /// The index given.
        index: usize,
    },
    /// fully_shard's all-reduce hook (`set_all_reduce_hook`) returned an error, panicked,
    /// or replaced the reduced gradients by a tensor of another shape or dtype.
    #[error("the all-reduce hook of {} failed: {cause}", ModuleName(module))]
    AllReduceHook {
        /// The managed module's FQN within the outermost enclosing fully_shard call's
        /// module (`""`: that module).
        module: String,
        /// What the hook said, or what went wrong with it.
        cause: String,
    },
    /// Rank 0's gradient order (static_graph's rebuilt buckets) is not a permutation of this
    /// rank's parameters: the ranks replicate different models.
    #[error("rank 0's gradient order is not an order of this rank's parameters")]
    GradientOrder,
}

/// `rank 1`, or `a rank` when the sender is not known.
struct Sender(Option<usize>);

impl std::fmt::Display for Sender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Some(r) => write!(f, "rank {r}"),
            None => f.write_str("a rank"),
        }
    }
}

/// A module's FQN in backquotes, or `the root module` for `""`.
struct ModuleName<'a>(&'a str);

impl std::fmt::Display for ModuleName<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.0.is_empty() {
            f.write_str("the root module")
        } else {
            write!(f, "module `{}`", self.0)
        }
    }
}
