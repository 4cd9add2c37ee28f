//! The group's collectives and their copies in and out (PyTorch's `_fsdp_collectives.py`):
//! the all-gather of the flat shards and the copy-out into the full tensors, the same within
//! the post-forward group, and the reduce-scatter of the gradients with its copy-in and the
//! averaged shards' copy-out into `.grad`.

use tch::Tensor;

use super::param::{BucketMeta, ParamMeta, ParamTensors};
use crate::autograd;
use crate::autograd::ShardFence;
use crate::c10d::collectives::{ReduceOp, Work};
use crate::c10d::group::ProcessGroup;
use crate::c10d::step_check::passes::{self as steps, Api};
use crate::error::{DistError, MisuseProblem, Result};

/// An all-gather of the group's shards in flight.
pub(crate) struct Gather {
    works: Vec<Work>,
    /// Per bucket: every rank's padded shards.
    gathered: Vec<Tensor>,
    /// Per bucket: the input (a cast copy of the flat shard under mixed precision), alive
    /// until the gather is done.
    _inputs: Vec<Tensor>,
    /// The parameters' versions when it started: a shard changed since (an optimizer step,
    /// a checkpoint load) makes the gather stale.
    versions: Vec<u64>,
}

impl Gather {
    /// Whether a shard changed since the gather started.
    pub(crate) fn is_stale(&self, tensors: &[ParamTensors]) -> bool {
        tensors
            .iter()
            .zip(&self.versions)
            .any(|(t, v)| autograd::tensor_version(&t.handle) != *v)
    }

    /// Waits for the gather; returns per bucket every rank's padded shards.
    pub(crate) fn wait(self) -> Result<Vec<Tensor>> {
        for w in self.works {
            w.wait()?;
        }
        Ok(self.gathered)
    }
}

/// Starts the all-gather of every bucket's flat shard over `group` (PyTorch's
/// `foreach_all_gather`), cast to the bucket's gather dtype.
pub(crate) fn all_gather(
    group: &ProcessGroup,
    buckets: &[BucketMeta],
    flats: &[Tensor],
    tensors: &[ParamTensors],
) -> Result<Gather> {
    steps::before_collective(group, Api::FullyShard, None)?;
    let world = group.world_size() as i64;
    let mut gathered = Vec::with_capacity(buckets.len());
    let mut works = Vec::with_capacity(buckets.len());
    let mut inputs = Vec::with_capacity(buckets.len());
    for (b, flat) in buckets.iter().zip(flats) {
        let out = Tensor::empty([world * b.numel], (b.gather_kind, b.device));
        let input = if b.gather_kind == b.kind {
            flat.shallow_clone()
        } else {
            tch::no_grad(|| flat.to_kind(b.gather_kind))
        };
        works.push(group.all_gather_into_tensor_async(&out, &input)?);
        gathered.push(out);
        inputs.push(input);
    }
    Ok(Gather {
        works,
        gathered,
        _inputs: inputs,
        versions: tensors
            .iter()
            .map(|t| autograd::tensor_version(&t.handle))
            .collect(),
    })
}

/// Where a parameter's shard sits in a gathered row: its layout, its offset and the row's
/// length (over the whole group, or over the post-forward group).
pub(crate) type Place<'m> = (&'m super::ShardLayout, i64, i64);

/// Restores the full tensors from `gathered` (per bucket, `ranks` rows of padded shards end
/// to end; `place` says where each parameter's shard sits in a row) and points each
/// parameter at its full tensor (PyTorch's `foreach_all_gather_copy_out`), disarming its
/// fence first.
pub(crate) fn copy_out<'m>(
    group: &ProcessGroup,
    meta: &'m [ParamMeta],
    tensors: &[ParamTensors],
    fence: Option<&ShardFence>,
    gathered: &[Tensor],
    ranks: i64,
    place: impl Fn(&'m ParamMeta) -> Option<Place<'m>>,
) -> Result<()> {
    tch::no_grad(|| -> Result<()> {
        for (i, (m, t)) in meta.iter().zip(tensors).enumerate() {
            let Some((l, offset, width)) = place(m) else {
                continue;
            };
            if let Some(fence) = fence {
                fence.set_armed(i, false)?;
            }
            t.alloc_full(group)?;
            let rows = gathered[m.bucket]
                .view([ranks, width])
                .narrow(1, offset, l.padded_numel());
            l.copy_from_rank_major(&t.full, &rows);
            t.to_unsharded(group)?;
        }
        Ok(())
    })
}

/// This rank's padded shards over the post-forward group, copied out of the gathered
/// parameters (before they are freed after forward), per bucket.
pub(crate) fn post_forward_shards(
    meta: &[ParamMeta],
    buckets: &[BucketMeta],
    tensors: &[ParamTensors],
) -> Vec<Tensor> {
    let flats: Vec<Tensor> = buckets
        .iter()
        .map(|b| Tensor::zeros([b.post_forward_numel], (b.gather_kind, b.device)))
        .collect();
    tch::no_grad(|| {
        for (m, t) in meta.iter().zip(tensors) {
            let Some((l, off)) = &m.post_forward else {
                continue;
            };
            if l.local_rows() > 0 {
                flats[m.bucket]
                    .narrow(0, *off, l.local_numel())
                    .view(l.local_shape().as_slice())
                    .copy_(&l.local_of(&t.full).reshape(l.local_shape().as_slice()));
            }
        }
    });
    flats
}

/// Gathers the post-forward shards `flats` within `sub` (the post-forward group); the step
/// check runs over `group`, whose members `sub`'s are.
pub(crate) fn all_gather_post_forward(
    group: &ProcessGroup,
    sub: &ProcessGroup,
    buckets: &[BucketMeta],
    flats: &[Tensor],
) -> Result<Vec<Tensor>> {
    steps::before_collective(group, Api::FullyShard, None)?;
    let n = sub.world_size() as i64;
    let mut gathered = Vec::with_capacity(flats.len());
    let mut works = Vec::with_capacity(flats.len());
    for (b, flat) in buckets.iter().zip(flats) {
        let out = Tensor::empty([n * b.post_forward_numel], (b.gather_kind, b.device));
        works.push(sub.all_gather_into_tensor_async(&out, flat)?);
        gathered.push(out);
    }
    for w in works {
        w.wait()?;
    }
    Ok(gathered)
}

/// Reduce-scatters in flight, finished at the end of the backward pass.
pub(crate) struct Reduction {
    works: Vec<Work>,
    /// Per bucket: this rank's flat shard of the summed gradients (`None`: nothing to
    /// reduce, every parameter frozen).
    outputs: Vec<Option<Tensor>>,
}

/// Pads each parameter's full gradient (`grads`, plus what `stash` accumulated without
/// gradient sync; both taken) into its bucket's rank-major input, in the bucket's reduce
/// dtype, and starts the reduce-scatters (PyTorch's `foreach_reduce`, first half). A
/// parameter autograd did not reach counts as zeros, on every rank alike.
pub(crate) fn reduce_scatter(
    group: &ProcessGroup,
    meta: &[ParamMeta],
    buckets: &[BucketMeta],
    grads: &mut [Option<Tensor>],
    stash: &mut [Option<Tensor>],
) -> Result<Reduction> {
    steps::before_collective(group, Api::FullyShard, None)?;
    let world = group.world_size() as i64;
    let mut works = Vec::new();
    let mut outputs = Vec::with_capacity(buckets.len());
    for b in buckets {
        if !b.trains(meta) {
            outputs.push(None);
            continue;
        }
        let input = Tensor::zeros([world * b.numel], (b.reduce_kind, b.device));
        let per_rank = input.view([world, b.numel]);
        tch::no_grad(|| {
            for &i in &b.params {
                let m = &meta[i];
                let l = &m.layout;
                let g = match (grads[i].take(), stash[i].take()) {
                    (Some(g), Some(s)) => g + s,
                    (Some(g), None) | (None, Some(g)) => g,
                    (None, None) => continue,
                };
                let g = if g.kind() == b.reduce_kind {
                    g
                } else {
                    g.to_kind(b.reduce_kind)
                };
                l.copy_to_rank_major(&per_rank.narrow(1, m.offset, l.padded_numel()), &g);
            }
        });
        let out = Tensor::empty([b.numel], (b.reduce_kind, b.device));
        works.push(group.reduce_scatter_tensor_async(&out, &input, ReduceOp::Sum)?);
        outputs.push(Some(out));
    }
    Ok(Reduction { works, outputs })
}

impl Reduction {
    /// Waits for the reduce-scatters and installs each trainable parameter's averaged shard
    /// as its `.grad`, or adds it to the `.grad` it has (PyTorch's `foreach_reduce`, second
    /// half). With `replicas` (HSDP: the group of ranks holding the same shards), each
    /// reduced shard is first all-reduced over them, so the average is over every rank of
    /// both groups. `fqn` names a parameter in errors.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn finish(
        self,
        group: &ProcessGroup,
        replicas: Option<&ProcessGroup>,
        module: &str,
        meta: &[ParamMeta],
        buckets: &[BucketMeta],
        tensors: &[ParamTensors],
        fqn: impl Fn(&ParamMeta) -> String,
    ) -> Result<()> {
        for w in self.works {
            w.wait()?;
        }
        let mut world = group.world_size() as f64;
        if let Some(replicas) = replicas {
            steps::before_collective(replicas, Api::FullyShard, None)?;
            let mut works = Vec::new();
            for out in self.outputs.iter().flatten() {
                works.push(replicas.all_reduce_async(out, ReduceOp::Sum)?);
            }
            for w in works {
                w.wait()?;
            }
            world *= replicas.world_size() as f64;
        }
        let rank = group.rank();
        for (b, out) in buckets.iter().zip(self.outputs) {
            let Some(mut out) = out else { continue };
            tch::no_grad(|| {
                let _ = out.g_div_scalar_(world);
            });
            for &i in &b.params {
                let m = &meta[i];
                if !m.requires_grad {
                    continue;
                }
                let l = &m.layout;
                let shard = out
                    .narrow(0, m.offset, l.local_numel())
                    .view(l.local_shape().as_slice());
                // Reduced in `reduce_dtype`, installed in the parameter's own.
                let shard = if shard.kind() == b.kind {
                    shard
                } else {
                    shard.to_kind(b.kind)
                };
                let handle = &tensors[i].handle;
                let existing = handle.grad();
                if existing.defined() {
                    if existing.size() != shard.size() {
                        return Err(DistError::Misuse {
                            rank,
                            op: "fully_shard",
                            problem: Box::new(MisuseProblem::GradShape {
                                module: module.to_string(),
                                fqn: fqn(m),
                                shape: existing.size(),
                                expected: shard.size(),
                            }),
                        });
                    }
                    tch::no_grad(|| {
                        let mut e = existing;
                        let _ = e.g_add_(&shard);
                    });
                } else {
                    // A tensor of its own, not a view of the flat output: tch's zero_grad
                    // detaches `.grad` in place, which libtorch refuses for views.
                    let own = if shard.is_contiguous() && shard.kind() != b.reduce_kind {
                        shard
                    } else {
                        shard.copy()
                    };
                    autograd::set_grad_for(handle, Some(&own), rank, "fully_shard")?;
                }
            }
        }
        Ok(())
    }
}

/// The full value of one parameter, gathered from every rank's shard of it (`local`, this
/// rank's rows) over `group` (a collective).
pub(crate) fn gather_full(
    group: &ProcessGroup,
    meta: &ParamMeta,
    bucket: &BucketMeta,
    local: &Tensor,
) -> Result<Tensor> {
    let l = &meta.layout;
    let world = l.world();
    let padded = Tensor::zeros([l.padded_numel()], (bucket.kind, local.device()));
    tch::no_grad(|| {
        padded
            .narrow(0, 0, l.local_numel())
            .copy_(&local.reshape([-1]))
    });
    let out = padded.new_empty([world * l.padded_numel()], (padded.kind(), padded.device()));
    steps::before_collective(group, Api::FullyShard, None)?;
    group.all_gather_into_tensor(&out, &padded)?;
    let full = padded.new_empty(l.shape(), (padded.kind(), padded.device()));
    tch::no_grad(|| l.copy_from_rank_major(&full, &out.view([world, l.padded_numel()])));
    Ok(full)
}
