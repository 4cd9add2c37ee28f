//! [`MeshError`] and [`MeshProblem`]: why a mesh could not be made or used.

use std::fmt;

use tch_dist_runtime::DistError;

/// Why a mesh could not be made or used, its context written once: this rank, the
/// operation, then the [`MeshProblem`]. `Display` is `rank {rank}: {op}: {problem}`; the
/// problem's cause (the engine's [`DistError`]) is the
/// [`source`](std::error::Error::source), as [`OnRank`](crate::OnRank)'s.
///
/// ```
/// use tch_dist::device_mesh::MeshProblem;
/// let e = MeshProblem::ZeroSize { dim: 1 }.on(0, "init_device_mesh");
/// assert_eq!(e.to_string(), "rank 0: init_device_mesh: mesh dim 1 has size 0");
/// assert_eq!(e.problem, MeshProblem::ZeroSize { dim: 1 });
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct MeshError {
    /// This process's rank in the default group.
    pub rank: usize,
    /// `init_device_mesh`, `DeviceMesh::slice`, `DeviceMesh::flatten`, ...
    pub op: &'static str,
    /// What went wrong.
    pub problem: MeshProblem,
}

impl fmt::Display for MeshError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rank {}: {}: {}", self.rank, self.op, self.problem)
    }
}

impl std::error::Error for MeshError {
    // The problem's cause, not the problem: its text is this error's already.
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.problem.source()
    }
}

impl MeshProblem {
    /// This problem as rank `rank`'s [`MeshError`] in `op`.
    pub fn on(self, rank: usize, op: &'static str) -> MeshError {
        MeshError {
            rank,
            op,
            problem: self,
        }
    }
}

/// What went wrong making or using a mesh ([`MeshError`] adds the rank and the operation):
/// a description PyTorch does not accept (or this rank's world does not fit), a dim name the
/// mesh does not have, or the engine's failure.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum MeshProblem {
    /// The shape has no dimension.
    #[error("the mesh shape has no dimension")]
    EmptyShape,
    /// A dimension of size 0.
    #[error("mesh dim {dim} has size 0")]
    ZeroSize {
        /// The dim's position.
        dim: usize,
    },
    /// The shape's ranks are not the world's.
    #[error(
        "a mesh of shape {shape:?} holds {}, the world has {world_size}",
        RankCount(shape)
    )]
    WorldMismatch {
        /// The shape.
        shape: Vec<usize>,
        /// The default group's size.
        world_size: usize,
    },
    /// Names and shape of different lengths.
    #[error("{names} mesh dim names for a mesh of {dims} dims (give one name per dim, or none)")]
    NamesLength {
        /// How many names.
        names: usize,
        /// How many dims.
        dims: usize,
    },
    /// A name given twice.
    #[error("the mesh dim name `{name}` is given twice (each must be unique)")]
    RepeatedName {
        /// The name.
        name: String,
    },
    /// The device type is not a plain type name (`"cuda:0"`: PyTorch refuses an index too).
    #[error(
        "device type {given:?} is not a device type name (\"cpu\" or \"cuda\", without an \
         index)"
    )]
    DeviceType {
        /// What was given.
        given: String,
    },
    /// Slice names out of the mesh's order (PyTorch requires them in order).
    #[error("the dims {} are not in the mesh's order", Names(names))]
    SliceOrder {
        /// The names given.
        names: Vec<String>,
    },
    /// Slicing or flattening a mesh whose dims have no names.
    #[error("the mesh's dims have no names")]
    NoNames,
    /// A flattened dim's name is already a dim of the root mesh, or names another flattening.
    #[error("`{name}` is already a dim of the root mesh or another flattening's name")]
    FlattenName {
        /// The name.
        name: String,
    },
    /// Another rank made another call (another shape, other names or another order of them,
    /// another device type; another flattening): every rank must make the same one.
    #[error(
        "rank {other_rank} asked for {other}, this rank for {this} (every rank must make the \
         same call, in the same order)"
    )]
    Disagree {
        /// The first rank whose call differs.
        other_rank: usize,
        /// This rank's call.
        this: String,
        /// That rank's call.
        other: String,
    },
    /// Another rank refused the call (its error says why).
    #[error("rank {peer} refused the call (its error says why)")]
    PeerRefused {
        /// The first rank that refused.
        peer: usize,
    },
    /// No dimension of the mesh has this name.
    #[error("the mesh has no dim named `{name}` (its dims: {})", Names(dims))]
    UnknownDim {
        /// The name asked for.
        name: String,
        /// The mesh's dim names.
        dims: Vec<String>,
    },
    /// The ranks could not agree on the call (a rank left before it said what it asked for,
    /// or the store failed): nothing was created.
    #[error("the ranks could not agree on the mesh")]
    Agreement {
        /// What the engine said (boxed, so that every `Result` stays small).
        #[source]
        source: Box<DistError>,
    },
    /// Creating a mesh dim's groups (or the default group) failed.
    #[error("creating the process groups of mesh dim `{dim}` failed")]
    Group {
        /// The mesh dim.
        dim: String,
        /// What the engine said (boxed, so that every `Result` stays small).
        #[source]
        source: Box<DistError>,
    },
}

/// Names as `` `a`, `b` ``.
struct Names<'a>(&'a [String]);

impl fmt::Display for Names<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, n) in self.0.iter().enumerate() {
            if i > 0 {
                write!(f, ", ")?;
            }
            write!(f, "`{n}`")?;
        }
        Ok(())
    }
}

/// The ranks a shape holds, `N ranks` (or more than a `usize` counts).
struct RankCount<'a>(&'a [usize]);

impl fmt::Display for RankCount<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match super::ranks_in(self.0) {
            Some(ranks) => write!(f, "{ranks} ranks"),
            None => f.write_str("more ranks than a usize counts"),
        }
    }
}
