//! [`FtError`]: what fault tolerance's training side reports, each naming the replica group
//! and rank it happened on.

use tch_dist_runtime::DistError;

/// A failure of fault-tolerant training.
///
/// A failed collective inside a step is no error of this type: it makes the step not commit
/// ([`Manager::should_commit`](super::Manager::should_commit) returns false on every member)
/// and the next quorum leaves the failed group out.
///
/// ```
/// use tch_dist::ft::FtError;
/// let e = FtError::DifferentModel {
///     replica: "replica_0:1".into(),
///     group_rank: 0,
///     other: "replica_1:2".into(),
/// };
/// assert_eq!(
///     e.to_string(),
///     "replica replica_0:1, group rank 0: replica group replica_1:2 trains another model \
///      (other parameter names, shapes or dtypes)"
/// );
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FtError {
    /// The lighthouse or a manager could not be reached or answered an error.
    #[error(
        "replica {replica}, group rank {group_rank}: the fault-tolerance control plane failed"
    )]
    Control {
        /// This replica group's id.
        replica: String,
        /// This rank in its group.
        group_rank: usize,
        /// What the control plane said.
        #[source]
        source: Box<tch_dist_ft::FtError>,
    },
    /// A collective or store operation outside a step failed (joining a quorum's group,
    /// healing, the group's own store).
    #[error("replica {replica}, group rank {group_rank}: {op} failed")]
    Collective {
        /// This replica group's id.
        replica: String,
        /// This rank in its group.
        group_rank: usize,
        /// What was being done.
        op: &'static str,
        /// The runtime's error.
        #[source]
        source: Box<DistError>,
    },
    /// A member of the quorum trains a model whose parameters differ from this one's: its
    /// gradients could not be averaged with these. Every member reports it.
    #[error(
        "replica {replica}, group rank {group_rank}: replica group {other} trains another model \
         (other parameter names, shapes or dtypes)"
    )]
    DifferentModel {
        /// This replica group's id.
        replica: String,
        /// This rank in its group.
        group_rank: usize,
        /// The first member (by replica rank) whose model differs.
        other: String,
    },
    /// Two replica groups of the quorum were started under one name (`REPLICA_GROUP_ID`
    /// given twice, say): their batches and their logs could not be told apart. Every
    /// member reports it.
    #[error(
        "replica {replica}, group rank {group_rank}: two replica groups of the quorum are named \
         {name} (each needs a name of its own: REPLICA_GROUP_ID)"
    )]
    DuplicateName {
        /// This replica group's id.
        replica: String,
        /// This rank in its group.
        group_rank: usize,
        /// The shared name.
        name: String,
    },
    /// The group's rank 0 made no manager within the quorum timeout (every rank of a
    /// replica group makes its [`Manager`](super::Manager); rank 0's runs the group's
    /// manager server). A rank other than 0 reports it; a rank that makes none while rank 0
    /// does is named by rank 0's first quorum ([`FtError::Control`]).
    #[error(
        "replica {replica}, group rank {group_rank}: group rank 0 made no manager within \
         {waited:?} (every rank of a replica group makes one)"
    )]
    NoManager {
        /// This replica group's name.
        replica: String,
        /// This rank in its group.
        group_rank: usize,
        /// How long this rank waited (the quorum timeout).
        waited: std::time::Duration,
    },
    /// The state a healthy member sent for healing does not fit this model.
    #[error("replica {replica}, group rank {group_rank}: healing from {from}: {problem}")]
    Heal {
        /// This replica group's id.
        replica: String,
        /// This rank in its group.
        group_rank: usize,
        /// The member the state came from.
        from: String,
        /// What does not fit, with the parameter's FQN.
        problem: String,
    },
    /// The options are not usable: nothing started.
    #[error("fault tolerance: {0}")]
    Options(String),
}

impl FtError {
    /// [`FtError::Control`] of `replica`'s rank `group_rank`.
    pub(crate) fn control(replica: &str, group_rank: usize, source: tch_dist_ft::FtError) -> Self {
        FtError::Control {
            replica: replica.to_string(),
            group_rank,
            source: Box::new(source),
        }
    }
}
