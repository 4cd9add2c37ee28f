//! One managed parameter (PyTorch's `FSDPParam`): what it is (its FQN, its layout over the
//! group, where its padded shard sits in its bucket's flat shard) and its three tensors (the
//! module's handle, this rank's rows, the full tensor), with the two moves between them.
//!
//! Parameters of one dtype and device form a bucket ([`BucketMeta`]): their padded shards lie
//! end to end in one flat shard, which is the all-gather's input as it is.

use tch::{Device, Kind, Tensor};

use super::layout::ShardLayout;
use super::FsdpGroupOptions;
use crate::autograd::{self, is_float};
use crate::c10d::group::ProcessGroup;
use crate::error::{DistError, Result};

/// A parameter handed to [`FsdpGroup::new`](super::FsdpGroup::new): its FQN (for errors)
/// and the tensor the model, the `VarStore` and the optimizer hold.
pub struct ManagedParam {
    /// Its FQN in the model.
    pub fqn: String,
    /// The parameter (full-sized, the same on every rank).
    pub param: Tensor,
    /// The dimension to shard (0, PyTorch's default; another one must divide evenly over
    /// the ranks, which the caller checked).
    pub dim: usize,
}

/// Where one managed parameter's shard sits ([`FsdpGroup::params`](super::FsdpGroup::params)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardInfo {
    /// Its FQN in the model.
    pub fqn: String,
    /// The full shape.
    pub shape: Vec<i64>,
    /// The sharded dimension.
    pub dim: usize,
    /// Where this rank's shard starts in the full tensor (a distributed checkpoint's
    /// offsets).
    pub offsets: Vec<i64>,
    /// The shape of this rank's shard.
    pub local_shape: Vec<i64>,
}

/// What a parameter is, apart from its tensors.
#[derive(Debug, Clone)]
pub(crate) struct ParamMeta {
    pub fqn: String,
    pub layout: ShardLayout,
    pub requires_grad: bool,
    /// Its bucket and its padded shard's offset in that bucket's flat shard.
    pub bucket: usize,
    pub offset: i64,
    /// Its layout over the post-forward group, and its offset in that flat shard.
    pub post_forward: Option<(ShardLayout, i64)>,
}

impl ParamMeta {
    /// Where this rank's rows sit.
    pub(crate) fn info(&self) -> ShardInfo {
        let l = &self.layout;
        ShardInfo {
            fqn: self.fqn.clone(),
            shape: l.shape().to_vec(),
            dim: l.dim(),
            offsets: l.offsets(),
            local_shape: l.local_shape(),
        }
    }
}

/// The parameters of one dtype and device, gathered and reduced together.
#[derive(Debug, Clone)]
pub(crate) struct BucketMeta {
    pub kind: Kind,
    /// The dtype gathered in (`param_dtype`) and reduced in (`reduce_dtype`).
    pub gather_kind: Kind,
    pub reduce_kind: Kind,
    pub device: Device,
    /// Elements of one rank's flat shard (and of its post-forward flat shard).
    pub numel: i64,
    pub post_forward_numel: i64,
    pub params: Vec<usize>,
}

impl BucketMeta {
    /// Whether a parameter of the bucket takes a gradient (else nothing is reduced).
    pub(crate) fn trains(&self, meta: &[ParamMeta]) -> bool {
        self.params.iter().any(|&i| meta[i].requires_grad)
    }
}

/// Every parameter's place over `group` (and the post-forward group), in buckets of one
/// dtype and device, in the order given.
pub(crate) fn plan(
    params: &[ManagedParam],
    group: &ProcessGroup,
    options: &FsdpGroupOptions,
) -> (Vec<ParamMeta>, Vec<BucketMeta>) {
    let (world, rank) = (group.world_size(), group.rank());
    let mut meta = Vec::with_capacity(params.len());
    let mut buckets: Vec<BucketMeta> = Vec::new();
    for (i, p) in params.iter().enumerate() {
        let (kind, device) = (p.param.kind(), p.param.device());
        let b = match buckets
            .iter()
            .position(|b| b.kind == kind && b.device == device)
        {
            Some(b) => b,
            None => {
                let float = is_float(kind);
                let gather_kind = options.param_dtype.filter(|_| float).unwrap_or(kind);
                let reduce_kind = options
                    .reduce_dtype
                    .or(options.param_dtype)
                    .filter(|_| float)
                    .unwrap_or(kind);
                buckets.push(BucketMeta {
                    kind,
                    gather_kind,
                    reduce_kind,
                    device,
                    numel: 0,
                    post_forward_numel: 0,
                    params: Vec::new(),
                });
                buckets.len() - 1
            }
        };
        let layout = ShardLayout::along(&p.param.size(), p.dim, world, rank);
        let offset = buckets[b].numel;
        buckets[b].numel += layout.padded_numel();
        buckets[b].params.push(i);
        let post_forward = options.post_forward_group.as_ref().map(|g| {
            let l = ShardLayout::along(&p.param.size(), p.dim, g.world_size(), g.rank());
            let off = buckets[b].post_forward_numel;
            buckets[b].post_forward_numel += l.padded_numel();
            (l, off)
        });
        meta.push(ParamMeta {
            fqn: p.fqn.clone(),
            layout,
            requires_grad: p.param.requires_grad(),
            bucket: b,
            offset,
            post_forward,
        });
    }
    (meta, buckets)
}

/// A parameter's tensors.
pub(crate) struct ParamTensors {
    /// The module's own tensor object.
    pub handle: Tensor,
    /// This rank's rows: a view into its bucket's flat shard.
    pub local: Tensor,
    /// The full tensor; its storage holds no memory while sharded.
    pub full: Tensor,
}

/// Copies this rank's padded shards out of the full parameters: per bucket the flat shard,
/// and per parameter its tensors (the handle still full-sized; [`ParamTensors::to_sharded`]
/// points it at its rows).
pub(crate) fn shard_in(
    meta: &[ParamMeta],
    buckets: &[BucketMeta],
    params: &[ManagedParam],
) -> (Vec<Tensor>, Vec<ParamTensors>) {
    let flats: Vec<Tensor> = buckets
        .iter()
        .map(|b| Tensor::zeros([b.numel], (b.kind, b.device)))
        .collect();
    let mut tensors = Vec::with_capacity(params.len());
    tch::no_grad(|| {
        for (m, p) in meta.iter().zip(params) {
            let l = &m.layout;
            let local = flats[m.bucket]
                .narrow(0, m.offset, l.local_numel())
                .view(l.local_shape().as_slice());
            if l.local_rows() > 0 {
                local
                    .shallow_clone()
                    .copy_(&l.local_of(&p.param).reshape(l.local_shape().as_slice()));
            }
            tensors.push(ParamTensors {
                handle: p.param.shallow_clone(),
                local,
                // A tensor with a version counter of its own (a `detach` would share the
                // parameter's, and filling it would then fail the backward of tensors saved
                // in forward); its memory is released at once.
                full: Tensor::empty(
                    p.param.size(),
                    (buckets[m.bucket].gather_kind, p.param.device()),
                ),
            });
        }
    });
    (flats, tensors)
}

impl ParamTensors {
    /// Points the parameter at this rank's rows and frees the full tensor's memory
    /// (PyTorch's `FSDPParam.to_sharded`).
    pub(crate) fn to_sharded(&self, group: &ProcessGroup) -> Result<()> {
        autograd::set_data(&self.handle, &self.local).map_err(|e| engine(group, e.message))?;
        autograd::release_storage(&self.full).map_err(|e| engine(group, e.message))
    }

    /// Gives the full tensor its memory back, ready to be filled
    /// ([`to_unsharded`](Self::to_unsharded) then points the parameter at it).
    pub(crate) fn alloc_full(&self, group: &ProcessGroup) -> Result<()> {
        autograd::restore_storage(&self.full).map_err(|e| engine(group, e.message))
    }

    /// Points the parameter at its (filled) full tensor (PyTorch's `to_unsharded`).
    pub(crate) fn to_unsharded(&self, group: &ProcessGroup) -> Result<()> {
        autograd::set_data(&self.handle, &self.full).map_err(|e| engine(group, e.message))
    }
}

/// An engine failure of fully_shard's own tensor moves, as a [`DistError`].
pub(crate) fn engine(group: &ProcessGroup, cause: impl ToString) -> DistError {
    DistError::Collective {
        rank: group.rank(),
        op: "fully_shard",
        cause: cause.to_string(),
    }
}
