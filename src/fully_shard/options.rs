//! The options of [`fully_shard`](super::fully_shard): PyTorch's keyword arguments
//! (`reshard_after_forward`, `ignored_params`, `mesh`'s group, `mp_policy`,
//! `shard_placement_fn`), with its defaults.

use std::sync::Arc;

use tch::{Kind, Tensor};
use tch_dist_runtime::ProcessGroup;

use crate::device_mesh::DeviceMesh;

/// Options of [`fully_shard`](super::fully_shard) (PyTorch's keyword arguments, with its defaults).
///
/// ```
/// let opts = tch_dist::FsdpOptions { reshard_after_forward: Some(false.into()), ..Default::default() };
/// assert!(opts.ignored_params.is_empty());
/// ```
#[derive(Debug, Clone, Default)]
pub struct FsdpOptions {
    /// What happens to the gathered parameters after forward ([`ReshardAfterForward`]:
    /// PyTorch's `True`, `False` or an int). `None`, the default: freed, except for the root
    /// (a call no later call encloses), which backward needs first.
    pub reshard_after_forward: Option<ReshardAfterForward>,
    /// Parameters (FQNs within the module, or module prefixes) left alone: not sharded, not
    /// synchronised.
    pub ignored_params: Vec<String>,
    /// The group to shard over (default: the default group).
    pub process_group: Option<ProcessGroup>,
    /// PyTorch's `mesh`, instead of `process_group`: a 1-D mesh shards over its group; a 2-D
    /// mesh is HSDP — parameters sharded over dim 1 (`dp_shard`) and replicated over dim 0
    /// (`dp_replicate`): each gradient is reduce-scattered over the shard group, then
    /// all-reduced over the replicate group. A 2-D mesh must span the default group.
    ///
    /// ```no_run
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use tch_dist::device_mesh::init_device_mesh;
    /// let mesh = init_device_mesh("cpu", &[2, 2], &["dp_replicate", "dp_shard"])?;
    /// let opts = tch_dist::FsdpOptions { mesh: Some(mesh), ..Default::default() };
    /// # let _ = opts; Ok(()) }
    /// ```
    pub mesh: Option<DeviceMesh>,
    /// Mixed precision (default: none).
    pub mp_policy: MixedPrecisionPolicy,
    /// Which dimension each parameter is sharded along, and over which mesh (PyTorch's
    /// `shard_placement_fn`): `None`, or the function returning `None` for a parameter,
    /// means dim 0 over [`mesh`](Self::mesh).
    pub shard_placement_fn: Option<ShardPlacementFn>,
}

/// Chooses the dimension a parameter is sharded along, from its FQN (within the module
/// passed to [`fully_shard`](crate::fully_shard())) and the parameter; `None` keeps dim 0. A dimension other than
/// 0 must divide evenly over the ranks.
///
/// ```
/// use tch_dist::fully_shard::{FsdpOptions, ShardPlacementFn};
/// // Shard weights along their input features.
/// let by_columns = ShardPlacementFn::new(|fqn, t| (fqn.ends_with("weight") && t.dim() == 2).then_some(1));
/// let opts = FsdpOptions { shard_placement_fn: Some(by_columns), ..Default::default() };
/// # let _ = opts;
/// ```
///
/// With [`with_mesh`](Self::with_mesh), a parameter may be sharded over a mesh of its own
/// (PyTorch's `ShardPlacementResult` with its `mesh_info`, pytorch#173509): torchtitan
/// shards a MoE block's experts over `efsdp` and the rest over `dp`.
#[derive(Clone)]
pub struct ShardPlacementFn(Arc<PlacementFn>);

/// Where one parameter is sharded: along `dim`, over `mesh` (`None`: the call's mesh).
///
/// ```
/// use tch_dist::fully_shard::ShardPlacement;
/// let p = ShardPlacement { dim: 0, mesh: None };
/// # let _ = p;
/// ```
#[derive(Debug, Clone)]
pub struct ShardPlacement {
    /// The dimension (0 unless it divides evenly over the ranks).
    pub dim: usize,
    /// A mesh of the parameter's own: a 1-D one, or a dim of a larger one.
    pub mesh: Option<DeviceMesh>,
}

/// The function a [`ShardPlacementFn`] wraps.
type PlacementFn = dyn Fn(&str, &Tensor) -> Option<ShardPlacement> + Send + Sync;

impl ShardPlacementFn {
    /// Wraps `f`, which chooses a dimension over the call's mesh.
    pub fn new(f: impl Fn(&str, &Tensor) -> Option<usize> + Send + Sync + 'static) -> Self {
        ShardPlacementFn(Arc::new(move |fqn, t| {
            f(fqn, t).map(|dim| ShardPlacement { dim, mesh: None })
        }))
    }

    /// Wraps `f`, which may also choose a mesh of the parameter's own. The parameters given
    /// one mesh must be whole submodules' (a MoE layer's `experts`): each such submodule
    /// becomes a `fully_shard` of its own over that mesh, before the call's, which then
    /// leaves it be (torchtitan's separate `fully_shard` on the experts, chosen from here).
    ///
    /// ```no_run
    /// use tch_dist::fully_shard::{FsdpOptions, ShardPlacement, ShardPlacementFn};
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let mesh = tch_dist::device_mesh::init_device_mesh("cpu", &[2, 2], &["efsdp", "ep"])?;
    /// let efsdp = mesh.dim("efsdp")?;
    /// let experts_on_efsdp = ShardPlacementFn::with_mesh(move |fqn, _| {
    ///     fqn.contains("experts.").then(|| ShardPlacement { dim: 0, mesh: Some(efsdp.clone()) })
    /// });
    /// let opts = FsdpOptions { shard_placement_fn: Some(experts_on_efsdp), ..Default::default() };
    /// # let _ = opts; Ok(()) }
    /// ```
    pub fn with_mesh(
        f: impl Fn(&str, &Tensor) -> Option<ShardPlacement> + Send + Sync + 'static,
    ) -> Self {
        ShardPlacementFn(Arc::new(f))
    }

    /// The dimension for parameter `fqn`.
    pub fn dim(&self, fqn: &str, t: &Tensor) -> Option<usize> {
        (self.0)(fqn, t).map(|p| p.dim)
    }

    /// The placement for parameter `fqn`.
    pub fn placement(&self, fqn: &str, t: &Tensor) -> Option<ShardPlacement> {
        (self.0)(fqn, t)
    }
}

impl std::fmt::Debug for ShardPlacementFn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ShardPlacementFn(..)")
    }
}

/// PyTorch's `reshard_after_forward`: `true`, `false`, or a number of ranks.
///
/// ```
/// use tch_dist::fully_shard::ReshardAfterForward;
/// assert_eq!(ReshardAfterForward::from(true), ReshardAfterForward::Reshard);
/// assert_eq!(ReshardAfterForward::from(8), ReshardAfterForward::ToRanks(8));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReshardAfterForward {
    /// Free the gathered parameters after forward and gather them again for backward.
    Reshard,
    /// Keep them gathered until backward.
    Keep,
    /// Keep a shard over `n` ranks (a divisor of the group's size: this rank and the
    /// `n - 1` next to it, as in one node), gathered within those ranks for backward:
    /// between forward and backward each rank holds 1/n of the parameters.
    ToRanks(usize),
}

impl From<bool> for ReshardAfterForward {
    fn from(reshard: bool) -> Self {
        if reshard {
            ReshardAfterForward::Reshard
        } else {
            ReshardAfterForward::Keep
        }
    }
}

impl From<usize> for ReshardAfterForward {
    fn from(n: usize) -> Self {
        ReshardAfterForward::ToRanks(n)
    }
}

/// Mixed precision (PyTorch's `MixedPrecisionPolicy`): the dtypes floating-point parameters
/// are gathered and computed in, and gradients reduced in. The shards, `.grad` and so the
/// optimizer stay in the parameters' own dtype.
///
/// ```
/// use tch::Kind;
/// let mp = tch_dist::fully_shard::MixedPrecisionPolicy {
///     param_dtype: Some(Kind::BFloat16),
///     reduce_dtype: Some(Kind::Float),
///     ..Default::default()
/// };
/// assert!(mp.cast_forward_inputs);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MixedPrecisionPolicy {
    /// Gather parameters in this dtype (forward and backward compute in it); `None`: their
    /// own.
    pub param_dtype: Option<Kind>,
    /// Reduce gradients in this dtype; `None`: `param_dtype`, else the parameters' own.
    pub reduce_dtype: Option<Kind>,
    /// Cast the module's floating-point outputs (each tensor of a tuple) to this dtype;
    /// `None`: leave them.
    pub output_dtype: Option<Kind>,
    /// Cast every floating-point input to `param_dtype` before the module runs (each tensor
    /// of a [`call_with`](crate::CallWith::call_with); default `true`).
    pub cast_forward_inputs: bool,
}

impl Default for MixedPrecisionPolicy {
    fn default() -> Self {
        MixedPrecisionPolicy {
            param_dtype: None,
            reduce_dtype: None,
            output_dtype: None,
            cast_forward_inputs: true,
        }
    }
}
