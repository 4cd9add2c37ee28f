//! `DeviceMesh`: ranks laid out as an n-dimensional array, one process group per mesh
//! dimension (PyTorch 2.11's `torch.distributed.device_mesh`).
//!
//! [`init_device_mesh`] lays the world out as `0..world` in row-major order over `shape` and
//! creates the groups exactly as PyTorch does, so that a job mixing tch-dist and PyTorch ranks
//! agrees on every group's name and store prefix: for each mesh dim in order, a dim that spans
//! the whole world reuses the default group (PyTorch's `mesh_default` new group where CUDA is
//! available and the default group is Gloo's); any other dim takes one `new_group` per
//! subgroup, called by every rank in the same order (the subgroups ordered by their lowest
//! rank), labelled `mesh_<dim name>`. Slicing ([`DeviceMesh::dim`], [`DeviceMesh::slice`])
//! creates no group; [`DeviceMesh::flatten`] creates one, once per name.
//!
//! | file | what it does | PyTorch's counterpart |
//! |---|---|---|
//! | `mod.rs` | [`init_device_mesh`], [`DeviceMesh`] (slicing, flattening, groups); [`subgroups`] (the ranks of each subgroup of a dim) | `torch/distributed/device_mesh.py` (`init_device_mesh`, `DeviceMesh`, `_init_process_groups`, `_flatten`, `from_group`), `torch/distributed/_mesh_layout.py` (`_MeshLayout.remap_to_tensor`) |
//! | `agree.rs` | the ranks' agreement on each mesh call through the store, before any group is made | (none: PyTorch's ranks hang in the groups' creation) |
//! | `hosts.rs` | which host a rank is on (`LOCAL_WORLD_SIZE`); [`tp_group_across_hosts`], the check behind `init_device_mesh`'s warning that `tp` spans hosts | (none: PyTorch does not check) |
//! | `error.rs` | [`MeshError`], [`MeshProblem`] | the `RuntimeError`s / `ValueError`s of `device_mesh.py` |
//!
//! ```no_run
//! use tch_dist::device_mesh::init_device_mesh;
//! // 4 ranks as 2 data-parallel replicas of 2 tensor-parallel ranks.
//! let mesh = init_device_mesh("cpu", &[2, 2], &["dp", "tp"])?;
//! let tp = mesh.get_group("tp")?; // rank 0: [0, 1]; rank 2: [2, 3]
//! let dp = mesh.get_group("dp")?; // rank 0: [0, 2]; rank 1: [1, 3]
//! assert_eq!(mesh.dim("tp")?.size("tp")?, 2);
//! # Ok::<(), tch_dist::device_mesh::MeshError>(())
//! ```

use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, Mutex};

use tch_dist_runtime::{Backend, DistError, ProcessGroup};

mod agree;
mod error;
mod hosts;

use agree::agree;
pub use error::{MeshError, MeshProblem};
pub use hosts::{tp_group_across_hosts, AcrossHosts, TENSOR_PARALLEL_DIM};

/// One dimension of a mesh as this rank sees it.
#[derive(Debug)]
struct MeshDim {
    name: String,
    size: usize,
    /// This rank's group along the dim.
    group: ProcessGroup,
    /// The dims of the root mesh it stands for (one, or several for a flattened dim).
    root_dims: Vec<usize>,
}

/// What every mesh sliced or flattened from one [`init_device_mesh`] shares.
#[derive(Debug)]
struct RootMesh {
    device_type: String,
    shape: Vec<usize>,
    /// This rank's coordinate in the root mesh.
    coordinate: Vec<usize>,
    dims: Vec<Arc<MeshDim>>,
    /// Whether the root's names were given (slicing and flattening need them).
    named: bool,
    /// The default group (the world).
    world: ProcessGroup,
    /// Flattened dims, by name (PyTorch's `_flatten_mapping`).
    flattened: Mutex<BTreeMap<String, Arc<MeshDim>>>,
}

/// Ranks laid out as an n-dimensional array with a process group per dim (PyTorch's
/// `DeviceMesh`). Cloning is cheap; slices share their root's groups.
///
/// ```no_run
/// use tch_dist::device_mesh::init_device_mesh;
/// let mesh = init_device_mesh("cpu", &[2, 2], &["dp", "tp"])?;
/// let tp = mesh.dim("tp")?; // a 1-D mesh: no new group
/// assert_eq!(tp.get_local_rank("tp")?, mesh.get_coordinate()[1]);
/// # Ok::<(), tch_dist::device_mesh::MeshError>(())
/// ```
#[derive(Debug, Clone)]
pub struct DeviceMesh {
    root: Arc<RootMesh>,
    dims: Vec<Arc<MeshDim>>,
}

/// The ranks of each subgroup along `dim` of a row-major mesh of `shape`, in the order
/// PyTorch 2.11 creates them (`_MeshLayout.remap_to_tensor`): one subgroup per rank whose
/// coordinate along `dim` is 0, in increasing order of that rank, holding it and the ranks
/// that follow it along `dim`.
///
/// ```
/// use tch_dist::device_mesh::subgroups;
/// assert_eq!(subgroups(&[2, 4], &[0]), [[0, 4], [1, 5], [2, 6], [3, 7]]);
/// assert_eq!(subgroups(&[2, 4], &[1]), [[0, 1, 2, 3], [4, 5, 6, 7]]);
/// // Several dims: one subgroup over their product (a flattened dim), row-major.
/// assert_eq!(subgroups(&[2, 2, 2], &[0, 1]), [[0, 2, 4, 6], [1, 3, 5, 7]]);
/// ```
pub fn subgroups(shape: &[usize], dims: &[usize]) -> Vec<Vec<usize>> {
    // A shape of more ranks than a usize counts has no subgroups (init_device_mesh refuses it).
    let Some(world) = ranks_in(shape) else {
        return Vec::new();
    };
    let strides = row_major_strides(shape);
    let mut groups = Vec::new();
    for first in 0..world {
        if dims
            .iter()
            .any(|&d| !(first / strides[d]).is_multiple_of(shape[d]))
        {
            continue;
        }
        groups.push(along(first, shape, &strides, dims));
    }
    groups
}

/// The ranks from `first` along `dims`, row-major (the last dim varies fastest).
fn along(first: usize, shape: &[usize], strides: &[usize], dims: &[usize]) -> Vec<usize> {
    let mut ranks = vec![first];
    for &d in dims {
        let (size, stride) = (shape[d], strides[d]);
        ranks = ranks
            .iter()
            .flat_map(|&r| (0..size).map(move |k| r + k * stride))
            .collect();
    }
    ranks
}

/// The number of ranks a mesh of `shape` holds; `None` when it overflows a usize (a
/// wrapped product could equal the world's size and pass for a valid shape).
pub(crate) fn ranks_in(shape: &[usize]) -> Option<usize> {
    shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d))
}

fn row_major_strides(shape: &[usize]) -> Vec<usize> {
    let mut strides = vec![1; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        strides[d] = strides[d + 1] * shape[d + 1];
    }
    strides
}

/// Lays the world out as a mesh of `shape` (row-major) and creates one process group per
/// dim, as PyTorch's `init_device_mesh(device_type, mesh_shape, mesh_dim_names)` does
/// (initialising the default group first if there is none). `names` has one name per dim, or
/// is empty (then dims are `dim_0`, `dim_1`, ... and cannot be sliced by name, as in PyTorch).
///
/// Every rank must call it with the same arguments, in the same order relative to other
/// group creations (as PyTorch ranks do). Refused on every rank before any group is made:
/// an empty shape, a dim of size 0, a shape whose ranks are not the world's, names of
/// another length than the shape or repeated, a device type with an index.
///
/// **Across hosts**, the order of the dims decides what crosses the network: ranks are
/// numbered host by host (`LOCAL_WORLD_SIZE` each) and the last dim varies fastest, so put
/// `tp` last (within a host) and the data-parallel dims first (`["dp", "tp"]`, or
/// `["dp_replicate", "dp_shard"]` for HSDP: shard within a host, replicate across). When a
/// `tp` group would span hosts, rank 0 prints a warning naming the group
/// ([`tp_group_across_hosts`]); the mesh is still made.
///
/// ```no_run
/// use tch_dist::device_mesh::init_device_mesh;
/// let mesh = init_device_mesh("cpu", &[4], &["dp"])?; // 1-D: the default group
/// assert_eq!(mesh.size("dp")?, 4);
/// # Ok::<(), tch_dist::device_mesh::MeshError>(())
/// ```
pub fn init_device_mesh(
    device_type: &str,
    shape: &[usize],
    names: &[&str],
) -> Result<DeviceMesh, MeshError> {
    const OP: &str = "init_device_mesh";
    let world = if tch_dist_runtime::is_initialized() {
        tch_dist_runtime::default_group()
    } else {
        tch_dist_runtime::init_process_group(Backend::default_for_machine())
    }
    .map_err(|source| {
        let (dim, source) = ("default".into(), Box::new(source));
        MeshProblem::Group { dim, source }.on(0, OP)
    })?;
    let rank = world.rank();
    let local = check_request(device_type, shape, names, world.world_size());
    agree(
        &world,
        OP,
        &describe_request(device_type, shape, names),
        local,
    )?;
    // Every rank agreed on the mesh; rank 0 says once when tp would cross the network.
    if let Some(across) = hosts::local_world_size_from_env()
        .filter(|_| rank == 0)
        .and_then(|local| tp_group_across_hosts(shape, names, local))
    {
        eprintln!("tch-dist: warning: {OP}: {across}");
    }
    let dim_names: Vec<String> = (0..shape.len())
        .map(|d| {
            names
                .get(d)
                .map_or_else(|| format!("dim_{d}"), |n| n.to_string())
        })
        .collect();
    let strides = row_major_strides(shape);
    let coordinate: Vec<usize> = (0..shape.len())
        .map(|d| (rank / strides[d]) % shape[d])
        .collect();
    let mut dims = Vec::with_capacity(shape.len());
    for (d, name) in dim_names.iter().enumerate() {
        let group = dim_group(&world, shape, &[d], name).map_err(|source| {
            let (dim, source) = (name.clone(), Box::new(source));
            MeshProblem::Group { dim, source }.on(rank, OP)
        })?;
        dims.push(Arc::new(MeshDim {
            name: name.clone(),
            size: shape[d],
            group,
            root_dims: vec![d],
        }));
    }
    let root = Arc::new(RootMesh {
        device_type: device_type.to_string(),
        shape: shape.to_vec(),
        coordinate,
        dims: dims.clone(),
        named: !names.is_empty(),
        world,
        flattened: Mutex::new(BTreeMap::new()),
    });
    Ok(DeviceMesh { root, dims })
}

/// This rank's own checks of `init_device_mesh`'s arguments (PyTorch's refusals) against a
/// world of `world_size` ranks.
fn check_request(
    device_type: &str,
    shape: &[usize],
    names: &[&str],
    world_size: usize,
) -> Result<(), MeshProblem> {
    if device_type.is_empty() || !device_type.chars().all(|c| c.is_ascii_alphabetic()) {
        return Err(MeshProblem::DeviceType {
            given: device_type.to_string(),
        });
    }
    if shape.is_empty() {
        return Err(MeshProblem::EmptyShape);
    }
    if let Some(dim) = shape.iter().position(|&s| s == 0) {
        return Err(MeshProblem::ZeroSize { dim });
    }
    if !names.is_empty() {
        if names.len() != shape.len() {
            return Err(MeshProblem::NamesLength {
                names: names.len(),
                dims: shape.len(),
            });
        }
        if let Some((i, _)) = names
            .iter()
            .enumerate()
            .find(|(i, n)| names[..*i].contains(n))
        {
            return Err(MeshProblem::RepeatedName {
                name: names[i].to_string(),
            });
        }
    }
    if ranks_in(shape) != Some(world_size) {
        return Err(MeshProblem::WorldMismatch {
            shape: shape.to_vec(),
            world_size,
        });
    }
    Ok(())
}

/// `init_device_mesh`'s call as the ranks compare it: `a mesh of shape [2, 2] with dims
/// `dp`, `tp` on cpu`.
fn describe_request(device_type: &str, shape: &[usize], names: &[&str]) -> String {
    let dims = if names.is_empty() {
        "unnamed dims".to_string()
    } else {
        let quoted: Vec<String> = names.iter().map(|n| format!("`{n}`")).collect();
        format!("dims {}", quoted.join(", "))
    };
    format!("a mesh of shape {shape:?} with {dims} on {device_type}")
}

/// This rank's group along `dims` of the root mesh, created as PyTorch's
/// `_init_one_process_group` does (every rank takes part in creating every subgroup).
fn dim_group(
    world: &ProcessGroup,
    shape: &[usize],
    dims: &[usize],
    name: &str,
) -> Result<ProcessGroup, DistError> {
    let size: usize = dims.iter().map(|&d| shape[d]).product();
    if size == world.world_size() {
        // PyTorch makes a new group ("mesh_default") only where CUDA is available and the
        // default group is Gloo's alone; otherwise the dim's group is the default group.
        if tch::Cuda::is_available() && world.backend() == Backend::Gloo {
            let all: Vec<usize> = (0..size).collect();
            return member(world, world.new_group(&all, world.backend())?);
        }
        return Ok(world.clone());
    }
    let _ = name; // PyTorch's group_desc `mesh_<name>` labels logs only: nothing to send.
    let mut mine = None;
    for ranks in subgroups(shape, dims) {
        let group = world.new_group(&ranks, world.backend())?;
        if ranks.contains(&world.rank()) {
            mine = Some(member(world, group)?);
        }
    }
    mine.ok_or_else(|| DistError::Internal {
        rank: world.rank(),
        op: "new_group",
        what: "this rank is in no subgroup of the mesh dim",
    })
}

/// The group `new_group` returned to a member of the subgroup it made.
fn member(world: &ProcessGroup, group: Option<ProcessGroup>) -> Result<ProcessGroup, DistError> {
    group.ok_or_else(|| DistError::Internal {
        rank: world.rank(),
        op: "new_group",
        what: "no group returned to a member of the subgroup",
    })
}

impl DeviceMesh {
    /// Wraps an existing group as a 1-D mesh named `name`, creating no group (PyTorch's
    /// `DeviceMesh.from_group(group, device_type, mesh_dim_names=(name,))`).
    ///
    /// ```no_run
    /// use tch_dist::device_mesh::DeviceMesh;
    /// let pg = tch_dist::default_group()?;
    /// let mesh = DeviceMesh::from_group(&pg, "cpu", "dp");
    /// assert_eq!(mesh.size("dp").unwrap(), pg.world_size());
    /// # Ok::<(), tch_dist::DistError>(())
    /// ```
    pub fn from_group(group: &ProcessGroup, device_type: &str, name: &str) -> DeviceMesh {
        let dim = Arc::new(MeshDim {
            name: name.to_string(),
            size: group.world_size(),
            group: group.clone(),
            root_dims: vec![0],
        });
        let root = Arc::new(RootMesh {
            device_type: device_type.to_string(),
            shape: vec![group.world_size()],
            coordinate: vec![group.rank()],
            dims: vec![Arc::clone(&dim)],
            named: true,
            world: group.clone(),
            flattened: Mutex::new(BTreeMap::new()),
        });
        DeviceMesh {
            root,
            dims: vec![dim],
        }
    }

    /// The device type the mesh was made for (`"cpu"`, `"cuda"`).
    ///
    /// ```no_run
    /// let mesh = tch_dist::init_device_mesh("cpu", &[2, 2], &["dp", "tp"])?;
    /// assert_eq!(mesh.device_type(), "cpu");
    /// # Ok::<(), tch_dist::device_mesh::MeshError>(())
    /// ```
    pub fn device_type(&self) -> &str {
        &self.root.device_type
    }

    /// The number of dims.
    ///
    /// ```no_run
    /// let mesh = tch_dist::init_device_mesh("cpu", &[2, 2], &["dp", "tp"])?;
    /// assert_eq!(mesh.ndim(), 2);
    /// assert_eq!(mesh.dim("tp")?.ndim(), 1);
    /// # Ok::<(), tch_dist::device_mesh::MeshError>(())
    /// ```
    pub fn ndim(&self) -> usize {
        self.dims.len()
    }

    /// The size of each dim.
    ///
    /// ```no_run
    /// let mesh = tch_dist::init_device_mesh("cpu", &[2, 2], &["dp", "tp"])?;
    /// assert_eq!(mesh.shape(), [2, 2]);
    /// # Ok::<(), tch_dist::device_mesh::MeshError>(())
    /// ```
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().map(|d| d.size).collect()
    }

    /// The dims' names, in order.
    ///
    /// ```no_run
    /// let mesh = tch_dist::init_device_mesh("cpu", &[2, 2], &["dp", "tp"])?;
    /// assert_eq!(mesh.dim_names(), ["dp", "tp"]);
    /// # Ok::<(), tch_dist::device_mesh::MeshError>(())
    /// ```
    pub fn dim_names(&self) -> Vec<&str> {
        self.dims.iter().map(|d| d.name.as_str()).collect()
    }

    /// The number of ranks in the mesh.
    ///
    /// ```no_run
    /// let mesh = tch_dist::init_device_mesh("cpu", &[2, 2], &["dp", "tp"])?;
    /// assert_eq!(mesh.numel(), 4);
    /// assert_eq!(mesh.dim("tp")?.numel(), 2);
    /// # Ok::<(), tch_dist::device_mesh::MeshError>(())
    /// ```
    pub fn numel(&self) -> usize {
        self.dims.iter().map(|d| d.size).product()
    }

    /// This rank's coordinate along each dim (its rank in each dim's group).
    ///
    /// ```no_run
    /// let mesh = tch_dist::init_device_mesh("cpu", &[2, 2], &["dp", "tp"])?;
    /// let rank = tch_dist::default_group()?.rank();
    /// assert_eq!(mesh.get_coordinate(), [rank / 2, rank % 2]); // rank 3: [1, 1]
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn get_coordinate(&self) -> Vec<usize> {
        self.dims.iter().map(|d| d.group.rank()).collect()
    }

    /// The global ranks of this rank's (sub)mesh, row-major over its dims: for a slice, the
    /// ranks that share this rank's coordinates along the root's other dims.
    ///
    /// ```no_run
    /// let mesh = tch_dist::init_device_mesh("cpu", &[2, 2], &["dp", "tp"])?;
    /// assert_eq!(mesh.ranks(), [0, 1, 2, 3]);
    /// let tp = mesh.dim("tp")?.ranks(); // [0, 1] on ranks 0 and 1, [2, 3] on ranks 2 and 3
    /// # Ok::<(), tch_dist::device_mesh::MeshError>(())
    /// ```
    pub fn ranks(&self) -> Vec<usize> {
        let root_dims: Vec<usize> = self
            .dims
            .iter()
            .flat_map(|d| d.root_dims.iter().copied())
            .collect();
        let strides = row_major_strides(&self.root.shape);
        let me = self.root.world.rank();
        let first = me
            - root_dims
                .iter()
                .map(|&d| self.root.coordinate[d] * strides[d])
                .sum::<usize>();
        along(first, &self.root.shape, &strides, &root_dims)
    }

    fn find(&self, op: &'static str, name: &str) -> Result<&Arc<MeshDim>, MeshError> {
        self.dims
            .iter()
            .find(|d| d.name == name)
            .ok_or_else(|| self.unknown(op, name))
    }

    fn unknown(&self, op: &'static str, name: &str) -> MeshError {
        let dims = self.dims.iter().map(|d| d.name.clone()).collect();
        let name = name.to_string();
        self.fail(op, MeshProblem::UnknownDim { name, dims })
    }

    fn fail(&self, op: &'static str, problem: MeshProblem) -> MeshError {
        problem.on(self.root.world.rank(), op)
    }

    /// The process group of dim `name` that holds this rank (PyTorch's `get_group`).
    ///
    /// ```no_run
    /// let mesh = tch_dist::init_device_mesh("cpu", &[2, 2], &["dp", "tp"])?;
    /// let tp = mesh.get_group("tp")?; // rank 0's: ranks [0, 1]
    /// assert_eq!(tp.world_size(), 2);
    /// # Ok::<(), tch_dist::device_mesh::MeshError>(())
    /// ```
    pub fn get_group(&self, name: &str) -> Result<&ProcessGroup, MeshError> {
        Ok(&self.find("DeviceMesh::get_group", name)?.group)
    }

    /// The process groups of every dim that hold this rank, in the mesh's order (PyTorch's
    /// `get_all_groups`).
    ///
    /// ```no_run
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # tch_dist::init_process_group(tch_dist::Backend::Gloo)?;
    /// let mesh = tch_dist::device_mesh::init_device_mesh("cpu", &[2, 2], &["dp", "tp"])?;
    /// let [dp, tp] = mesh.get_all_groups()[..] else { unreachable!() };
    /// assert_eq!((dp.world_size(), tp.world_size()), (2, 2));
    /// # Ok(()) }
    /// ```
    pub fn get_all_groups(&self) -> Vec<&ProcessGroup> {
        self.dims.iter().map(|d| &d.group).collect()
    }

    /// This rank's rank along dim `name` (PyTorch's `get_local_rank`).
    ///
    /// ```no_run
    /// let mesh = tch_dist::init_device_mesh("cpu", &[2, 2], &["dp", "tp"])?;
    /// assert_eq!(mesh.get_local_rank("tp")?, mesh.get_coordinate()[1]);
    /// # Ok::<(), tch_dist::device_mesh::MeshError>(())
    /// ```
    pub fn get_local_rank(&self, name: &str) -> Result<usize, MeshError> {
        Ok(self.find("DeviceMesh::get_local_rank", name)?.group.rank())
    }

    /// The size of dim `name` (PyTorch's `size(mesh_dim)`).
    ///
    /// ```no_run
    /// let mesh = tch_dist::init_device_mesh("cpu", &[2, 2], &["dp", "tp"])?;
    /// assert_eq!(mesh.size("dp")?, 2);
    /// # Ok::<(), tch_dist::device_mesh::MeshError>(())
    /// ```
    pub fn size(&self, name: &str) -> Result<usize, MeshError> {
        Ok(self.find("DeviceMesh::size", name)?.size)
    }

    /// The 1-D mesh of dim `name` (PyTorch's `mesh["tp"]`), creating no group; a flattened
    /// dim of the root is found by its name too.
    ///
    /// ```no_run
    /// let mesh = tch_dist::init_device_mesh("cpu", &[2, 2], &["dp", "tp"])?;
    /// let tp = mesh.dim("tp")?; // shares `mesh`'s group of dim "tp"
    /// assert_eq!(tp.shape(), [2]);
    /// # Ok::<(), tch_dist::device_mesh::MeshError>(())
    /// ```
    pub fn dim(&self, name: &str) -> Result<DeviceMesh, MeshError> {
        self.slice(&[name])
    }

    /// The sub-mesh of dims `names`, given in the mesh's order (PyTorch's
    /// `mesh["dp", "cp"]`), creating no group.
    ///
    /// ```no_run
    /// let mesh = tch_dist::init_device_mesh("cpu", &[2, 2, 2], &["dp", "cp", "tp"])?;
    /// let dp_cp = mesh.slice(&["dp", "cp"])?; // the names in the mesh's order
    /// assert_eq!(dp_cp.dim_names(), ["dp", "cp"]);
    /// # Ok::<(), tch_dist::device_mesh::MeshError>(())
    /// ```
    pub fn slice(&self, names: &[&str]) -> Result<DeviceMesh, MeshError> {
        const OP: &str = "DeviceMesh::slice";
        if !self.root.named {
            return Err(self.fail(OP, MeshProblem::NoNames));
        }
        let mut dims = Vec::with_capacity(names.len());
        let mut last: Option<usize> = None;
        for name in names {
            let found = match self.dims.iter().position(|d| d.name == *name) {
                Some(i) => {
                    if last.is_some_and(|l| l >= i) {
                        return Err(self.fail(
                            OP,
                            MeshProblem::SliceOrder {
                                names: names.iter().map(|n| n.to_string()).collect(),
                            },
                        ));
                    }
                    last = Some(i);
                    Arc::clone(&self.dims[i])
                }
                None => {
                    let flat = self.flattened();
                    match flat.get(*name) {
                        Some(d) => Arc::clone(d),
                        None => return Err(self.unknown(OP, name)),
                    }
                }
            };
            dims.push(found);
        }
        if names.is_empty() {
            return Err(self.fail(OP, MeshProblem::EmptyShape));
        }
        Ok(DeviceMesh {
            root: Arc::clone(&self.root),
            dims,
        })
    }

    fn flattened(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Arc<MeshDim>>> {
        // A poisoned map holds complete entries only (each is inserted whole).
        self.root
            .flattened
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// This mesh's dims as one dim named `name` (default: the names joined by `_`), with a
    /// group of its own, created once per name on the root (PyTorch's `_flatten`); a 1-D
    /// mesh flattened to its own name is itself. Every rank must call it, in the same order
    /// relative to other group creations.
    ///
    /// ```no_run
    /// use tch_dist::device_mesh::init_device_mesh;
    /// let mesh = init_device_mesh("cpu", &[2, 2, 2], &["dp", "cp", "tp"])?;
    /// let dp_cp = mesh.slice(&["dp", "cp"])?.flatten(None)?; // rank 0: [0, 2, 4, 6]
    /// assert_eq!(dp_cp.dim_names(), ["dp_cp"]);
    /// # Ok::<(), tch_dist::device_mesh::MeshError>(())
    /// ```
    pub fn flatten(&self, name: Option<&str>) -> Result<DeviceMesh, MeshError> {
        const OP: &str = "DeviceMesh::flatten";
        let dims = self.dim_names();
        let name = name.map_or_else(|| dims.join("_"), str::to_string);
        let quoted: Vec<String> = dims.iter().map(|n| format!("`{n}`")).collect();
        let request = format!("a flattening of dims {} as `{name}`", quoted.join(", "));
        if self.root.named && self.dims.len() == 1 && self.dims[0].name == name {
            return Ok(self.clone());
        }
        let root_dims: Vec<usize> = self
            .dims
            .iter()
            .flat_map(|d| d.root_dims.iter().copied())
            .collect();
        let mut flat = self.flattened();
        // Made before, by every rank together: nothing to create, nothing to agree on.
        if let Some(existing) = flat.get(&name).filter(|e| e.root_dims == root_dims) {
            return Ok(DeviceMesh {
                root: Arc::clone(&self.root),
                dims: vec![Arc::clone(existing)],
            });
        }
        let local = if !self.root.named {
            Err(MeshProblem::NoNames)
        } else if self.root.dims.iter().any(|d| d.name == name) || flat.contains_key(&name) {
            Err(MeshProblem::FlattenName { name: name.clone() })
        } else {
            Ok(())
        };
        agree(&self.root.world, OP, &request, local)?;
        let group =
            dim_group(&self.root.world, &self.root.shape, &root_dims, &name).map_err(|source| {
                let (dim, source) = (name.clone(), Box::new(source));
                self.fail(OP, MeshProblem::Group { dim, source })
            })?;
        let dim = Arc::new(MeshDim {
            name: name.clone(),
            size: group.world_size(),
            group,
            root_dims,
        });
        flat.insert(name, Arc::clone(&dim));
        Ok(DeviceMesh {
            root: Arc::clone(&self.root),
            dims: vec![dim],
        })
    }
}

impl fmt::Display for DeviceMesh {
    /// PyTorch's repr: `DeviceMesh((dp=2, tp=2), 'cpu')`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DeviceMesh((")?;
        for (i, d) in self.dims.iter().enumerate() {
            if i > 0 {
                write!(f, ", ")?;
            }
            write!(f, "{}={}", d.name, d.size)?;
        }
        write!(f, "), '{}')", self.root.device_type)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subgroups_are_pytorchs() {
        // Pinned from PyTorch 2.11's `_MeshLayout(shape, strides)[d].nest().remap_to_tensor(
        // torch.arange(world))`.
        assert_eq!(
            subgroups(&[2, 2, 2], &[1]),
            [[0, 2], [1, 3], [4, 6], [5, 7]]
        );
        assert_eq!(
            subgroups(&[2, 2, 2], &[2]),
            [[0, 1], [2, 3], [4, 5], [6, 7]]
        );
        assert_eq!(
            subgroups(&[2, 3, 4], &[1]),
            [
                [0, 4, 8],
                [1, 5, 9],
                [2, 6, 10],
                [3, 7, 11],
                [12, 16, 20],
                [13, 17, 21],
                [14, 18, 22],
                [15, 19, 23]
            ]
        );
        assert_eq!(subgroups(&[2, 3, 4], &[0]).len(), 12);
        assert_eq!(subgroups(&[2, 3, 4], &[0])[11], [11, 23]);
        assert_eq!(subgroups(&[4, 1], &[1]), [[0], [1], [2], [3]]);
        assert_eq!(subgroups(&[2, 2, 2], &[1, 2]), [[0, 1, 2, 3], [4, 5, 6, 7]]);
    }

    #[test]
    fn problems_read_well() {
        let e = MeshProblem::WorldMismatch {
            shape: vec![2, 3],
            world_size: 4,
        }
        .on(1, "init_device_mesh");
        assert_eq!(
            e.to_string(),
            "rank 1: init_device_mesh: a mesh of shape [2, 3] holds 6 ranks, the world has 4"
        );
        let e = MeshProblem::UnknownDim {
            name: "pp".into(),
            dims: vec!["dp".into(), "tp".into()],
        }
        .on(0, "DeviceMesh::get_group");
        assert_eq!(
            e.to_string(),
            "rank 0: DeviceMesh::get_group: the mesh has no dim named `pp` (its dims: `dp`, `tp`)"
        );
    }
}
