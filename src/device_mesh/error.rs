//! [`MeshError`] and [`MeshProblem`]: why a mesh could not be made or used.

use std::fmt;

use tch_dist_runtime::DistError;

/// Why a mesh could not be made or used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MeshError {
    /// The mesh's description is not one PyTorch accepts (or one this rank's world fits).
    #[error("rank {rank}: {op}: {problem}")]
    Invalid {
        /// This process's rank in the default group.
        rank: usize,
        /// `init_device_mesh`, `DeviceMesh::slice`, `DeviceMesh::flatten`, ...
        op: &'static str,
        /// What is wrong.
        problem: MeshProblem,
    },
    /// No dimension of the mesh has this name.
    #[error(
        "rank {rank}: {op}: the mesh has no dim named `{name}` (its dims: {})",
        Names(dims)
    )]
    UnknownDim {
        /// This process's rank in the default group.
        rank: usize,
        /// The operation.
        op: &'static str,
        /// The name asked for.
        name: String,
        /// The mesh's dim names.
        dims: Vec<String>,
    },
    /// The ranks could not agree on the call (a rank left before it said what it asked for,
    /// or the store failed): nothing was created.
    #[error("rank {rank}: {op}: the ranks could not agree on the mesh")]
    Agreement {
        /// This process's rank in the default group.
        rank: usize,
        /// The operation.
        op: &'static str,
        /// What the engine said (boxed, so that every `Result` stays small).
        #[source]
        source: Box<DistError>,
    },
    /// Creating a mesh dim's groups (or the default group) failed.
    #[error("rank {rank}: {op}: creating the process groups of mesh dim `{dim}` failed")]
    Group {
        /// This process's rank in the default group.
        rank: usize,
        /// The operation.
        op: &'static str,
        /// The mesh dim.
        dim: String,
        /// What the engine said (boxed, so that every `Result` stays small).
        #[source]
        source: Box<DistError>,
    },
}

/// What is wrong with a mesh's description ([`MeshError::Invalid`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum MeshProblem {
    /// The shape has no dimension.
    EmptyShape,
    /// A dimension of size 0.
    ZeroSize {
        /// The dim's position.
        dim: usize,
    },
    /// The shape's ranks are not the world's.
    WorldMismatch {
        /// The shape.
        shape: Vec<usize>,
        /// The default group's size.
        world_size: usize,
    },
    /// Names and shape of different lengths.
    NamesLength {
        /// How many names.
        names: usize,
        /// How many dims.
        dims: usize,
    },
    /// A name given twice.
    RepeatedName {
        /// The name.
        name: String,
    },
    /// The device type is not a plain type name (`"cuda:0"`: PyTorch refuses an index too).
    DeviceType {
        /// What was given.
        given: String,
    },
    /// Slice names out of the mesh's order (PyTorch requires them in order).
    SliceOrder {
        /// The names given.
        names: Vec<String>,
    },
    /// Slicing or flattening a mesh whose dims have no names.
    NoNames,
    /// A flattened dim's name is already a dim of the root mesh, or names another flattening.
    FlattenName {
        /// The name.
        name: String,
    },
    /// Another rank made another call (another shape, other names or another order of them,
    /// another device type; another flattening): every rank must make the same one.
    Disagree {
        /// The first rank whose call differs.
        other_rank: usize,
        /// This rank's call.
        this: String,
        /// That rank's call.
        other: String,
    },
    /// Another rank refused the call (its error says why).
    PeerRefused {
        /// The first rank that refused.
        peer: usize,
    },
}

impl fmt::Display for MeshProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MeshProblem::EmptyShape => write!(f, "the mesh shape has no dimension"),
            MeshProblem::ZeroSize { dim } => write!(f, "mesh dim {dim} has size 0"),
            MeshProblem::WorldMismatch { shape, world_size } => match super::ranks_in(shape) {
                Some(ranks) => write!(
                    f,
                    "a mesh of shape {shape:?} holds {ranks} ranks, the world has {world_size}"
                ),
                None => write!(
                    f,
                    "a mesh of shape {shape:?} holds more ranks than a usize counts, the world \
                     has {world_size}"
                ),
            },
            MeshProblem::NamesLength { names, dims } => write!(
                f,
                "{names} mesh dim names for a mesh of {dims} dims (give one name per dim, or none)"
            ),
            MeshProblem::RepeatedName { name } => {
                write!(
                    f,
                    "the mesh dim name `{name}` is given twice (each must be unique)"
                )
            }
            MeshProblem::DeviceType { given } => write!(
                f,
                "device type {given:?} is not a device type name (\"cpu\" or \"cuda\", without \
                 an index)"
            ),
            MeshProblem::SliceOrder { names } => {
                write!(f, "the dims {} are not in the mesh's order", Names(names))
            }
            MeshProblem::NoNames => write!(f, "the mesh's dims have no names"),
            MeshProblem::FlattenName { name } => write!(
                f,
                "`{name}` is already a dim of the root mesh or another flattening's name"
            ),
            MeshProblem::Disagree {
                other_rank,
                this,
                other,
            } => write!(
                f,
                "rank {other_rank} asked for {other}, this rank for {this} (every rank must make \
                 the same call, in the same order)"
            ),
            MeshProblem::PeerRefused { peer } => {
                write!(f, "rank {peer} refused the call (its error says why)")
            }
        }
    }
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
