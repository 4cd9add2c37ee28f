//! The group's collectives and their copies in and out (PyTorch's `_fsdp_collectives.py`):
//! the all-gather of the flat shards and the copy-out into the full tensors, the same within
//! the post-forward group, and the reduce-scatter of the gradients with its copy-in and the
//! averaged shards' copy-out into `.grad`.

use tch::{Kind, Tensor};

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
/// `foreach_all_gather`), cast to the bucket's gather dtype; `copy_in`: from a copy of it
/// even in its own dtype (else the flat shard itself is the input, read while the gather
/// runs).
pub(crate) fn all_gather(
    group: &ProcessGroup,
    buckets: &[BucketMeta],
    flats: &[Tensor],
    tensors: &[ParamTensors],
    copy_in: bool,
) -> Result<Gather> {
    steps::before_collective(group, Api::FullyShard, None)?;
    let world = group.world_size() as i64;
    let mut gathered = Vec::with_capacity(buckets.len());
    let mut works = Vec::with_capacity(buckets.len());
    let mut inputs = Vec::with_capacity(buckets.len());
    for (b, flat) in buckets.iter().zip(flats) {
        let out = Tensor::empty([world * b.numel], (b.gather_kind, b.device));
        let input = if b.gather_kind != b.kind {
            tch::no_grad(|| flat.to_kind(b.gather_kind))
        } else if copy_in {
            tch::no_grad(|| flat.copy())
        } else {
            flat.shallow_clone()
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

/// Where reduced gradients are divided, for one bucket (PyTorch's
/// `_get_gradient_divide_factors`): with a reduce dtype of f32 or bf16 the reduce-scatter
/// and all-reduce divide (PyTorch's `AVG` or `PreMulSum` ops; here a division right after
/// each), otherwise (f16: overflow risk) the input is divided before the reduce-scatter and
/// the output after the all-reduce hook, by about the square root of the factor each.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct Divide {
    /// The reduce-scatter's input (PyTorch's `predivide_factor`).
    pub pre: Option<f64>,
    /// The reduce-scatter's output (its `AVG`, or `PreMulSum(1 / factor)`).
    pub after_reduce_scatter: Option<f64>,
    /// The all-reduce's output (HSDP's `AVG`).
    pub after_all_reduce: Option<f64>,
    /// The output once the hook ran (PyTorch's `postdivide_factor`).
    pub post: Option<f64>,
}

impl Divide {
    /// The divisions for `shard` ranks reduce-scattering, `replicas` all-reducing (HSDP),
    /// in `reduce_kind`, by `factor` (`None`: the mean over every rank).
    pub(crate) fn new(
        shard: usize,
        replicas: Option<usize>,
        reduce_kind: Kind,
        factor: Option<f64>,
    ) -> Divide {
        let overflow_risk = !matches!(reduce_kind, Kind::Float | Kind::BFloat16);
        let dp = shard * replicas.unwrap_or(1);
        let some = |f: f64| (f != 1.0).then_some(f);
        if !overflow_risk {
            return match factor {
                None => Divide {
                    after_reduce_scatter: some(shard as f64),
                    after_all_reduce: replicas.and_then(|r| some(r as f64)),
                    ..Divide::default()
                },
                Some(f) => Divide {
                    after_reduce_scatter: some(f),
                    ..Divide::default()
                },
            };
        }
        let f = factor.unwrap_or(dp as f64);
        let mut pre = 1.0;
        while f % pre == 0.0 && f / pre > pre {
            pre *= 2.0;
        }
        Divide {
            pre: some(pre),
            post: some(f / pre),
            ..Divide::default()
        }
    }
}

fn divide(t: &mut Tensor, by: Option<f64>) {
    if let Some(by) = by {
        tch::no_grad(|| {
            let _ = t.g_div_scalar_(by);
        });
    }
}

/// Reduce-scatters in flight, finished at the end of the backward pass.
pub(crate) struct Reduction {
    works: Vec<Work>,
    /// Per bucket: this rank's flat shard of the summed gradients (`None`: nothing to
    /// reduce, every parameter frozen).
    outputs: Vec<Option<Tensor>>,
    /// Per bucket: where its gradients are divided.
    divide: Vec<Divide>,
    /// HSDP: all-reduce over the replicas (PyTorch's `all_reduce_grads`, as it was when the
    /// gradients were handed over).
    all_reduce: bool,
}

/// How the reduced gradients are divided and whether HSDP all-reduces them: what
/// [`reduce_scatter`] takes from the group's state when the gradients are handed over.
pub(crate) struct ReduceSettings {
    /// PyTorch's `gradient_divide_factor` (`None`: the mean).
    pub factor: Option<f64>,
    /// HSDP: the number of replicas (`None`: plain FSDP).
    pub replicas: Option<usize>,
    /// HSDP: all-reduce over them.
    pub all_reduce: bool,
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
    settings: &ReduceSettings,
) -> Result<Reduction> {
    steps::before_collective(group, Api::FullyShard, None)?;
    let world = group.world_size() as i64;
    let mut works = Vec::new();
    let mut outputs = Vec::with_capacity(buckets.len());
    let mut divides = Vec::with_capacity(buckets.len());
    for b in buckets {
        let d = Divide::new(
            group.world_size(),
            settings.replicas,
            b.reduce_kind,
            settings.factor,
        );
        divides.push(d);
        if !b.trains(meta) {
            outputs.push(None);
            continue;
        }
        let mut input = Tensor::zeros([world * b.numel], (b.reduce_kind, b.device));
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
        divide(&mut input, d.pre);
        let out = Tensor::empty([b.numel], (b.reduce_kind, b.device));
        works.push(group.reduce_scatter_tensor_async(&out, &input, ReduceOp::Sum)?);
        outputs.push(Some(out));
    }
    Ok(Reduction {
        works,
        outputs,
        divide: divides,
        all_reduce: settings.all_reduce,
    })
}

/// What [`Reduction::finish`] needs of the group besides its parameters: the replicate
/// group (HSDP), the partial outputs kept without all-reduce, the user's hook, and the
/// names its errors give.
pub(crate) struct FinishWith<'a> {
    /// HSDP: the group of ranks holding the same shards.
    pub replicas: Option<&'a ProcessGroup>,
    /// Per bucket: what HSDP backward passes without all-reduce reduce-scattered.
    pub partial: &'a mut [Option<Tensor>],
    /// PyTorch's `all_reduce_hook`.
    pub hook: Option<&'a mut super::group::AllReduceHook>,
    /// The managed module's type (`.grad` shape errors) and FQN (hook errors).
    pub module: &'a str,
    pub module_fqn: &'a str,
}

impl Reduction {
    /// Waits for the reduce-scatters and installs each trainable parameter's reduced shard
    /// as its `.grad`, or adds it to the `.grad` it has (PyTorch's `foreach_reduce`, second
    /// half). With replicas (HSDP), each reduced shard is first all-reduced over them, so
    /// that the mean is over every rank of both groups; or, where all-reduce is off, added
    /// to the partial output and nothing is installed (PyTorch's early return). The hook
    /// runs on each bucket's output after the reduce-scatter (FSDP) or the all-reduce
    /// (HSDP). `fqn` names a parameter in errors.
    pub(crate) fn finish(
        mut self,
        group: &ProcessGroup,
        with: FinishWith<'_>,
        meta: &[ParamMeta],
        buckets: &[BucketMeta],
        tensors: &[ParamTensors],
        fqn: impl Fn(&ParamMeta) -> String,
    ) -> Result<()> {
        for w in std::mem::take(&mut self.works) {
            w.wait()?;
        }
        let rank = group.rank();
        for (out, d) in self.outputs.iter_mut().zip(&self.divide) {
            if let Some(out) = out {
                divide(out, d.after_reduce_scatter);
            }
        }
        if let Some(replicas) = with.replicas {
            if !self.all_reduce {
                for (out, partial) in self.outputs.into_iter().zip(with.partial.iter_mut()) {
                    if let Some(out) = out {
                        *partial = Some(match partial.take() {
                            Some(p) => p + out,
                            None => out,
                        });
                    }
                }
                // Counted as a pass over the replicas, so that a rank that all-reduces
                // while another does not fails the step check instead of pairing its
                // all-reduce with the other's next one.
                return steps::note_pass(replicas, Api::FullyShard);
            }
            for (out, partial) in self.outputs.iter_mut().zip(with.partial.iter_mut()) {
                if let (Some(out), Some(p)) = (out.as_mut(), partial.take()) {
                    tch::no_grad(|| {
                        let _ = out.g_add_(&p);
                    });
                }
            }
            steps::before_collective(replicas, Api::FullyShard, None)?;
            let mut works = Vec::new();
            for out in self.outputs.iter().flatten() {
                works.push(replicas.all_reduce_async(out, ReduceOp::Sum)?);
            }
            for w in works {
                w.wait()?;
            }
            for (out, d) in self.outputs.iter_mut().zip(&self.divide) {
                if let Some(out) = out {
                    divide(out, d.after_all_reduce);
                }
            }
        }
        if let Some(hook) = with.hook {
            for out in self.outputs.iter_mut().flatten() {
                run_hook(hook, out, rank, with.module_fqn)?;
            }
        }
        for (b, (out, d)) in buckets
            .iter()
            .zip(self.outputs.into_iter().zip(&self.divide))
        {
            let Some(mut out) = out else { continue };
            divide(&mut out, d.post);
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
                                module: with.module.to_string(),
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

/// Runs the user's all-reduce hook on one bucket's reduced output: its `Err`, a panic, or
/// a tensor replaced by one of another shape or dtype is an error naming the module.
fn run_hook(
    hook: &mut super::group::AllReduceHook,
    out: &mut Tensor,
    rank: usize,
    module_fqn: &str,
) -> Result<()> {
    let (shape, kind) = (out.size(), out.kind());
    let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| hook(out)));
    let cause = match ran {
        Ok(Ok(())) if out.size() == shape && out.kind() == kind => return Ok(()),
        Ok(Ok(())) => format!(
            "it replaced the reduced gradients ({shape:?}, {kind:?}) by a tensor of {:?}, \
             {:?}; change them in place",
            out.size(),
            out.kind()
        ),
        Ok(Err(text)) => text,
        Err(payload) => format!("it panicked: {}", panic_text(&*payload)),
    };
    Err(DistError::Misuse {
        rank,
        op: "fully_shard",
        problem: Box::new(MisuseProblem::AllReduceHook {
            module: module_fqn.to_string(),
            cause,
        }),
    })
}

/// A panic's message (`&str` or `String` payloads), or a placeholder.
fn panic_text(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(a panic without a message)".to_string())
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

#[cfg(test)]
mod tests {
    use super::Divide;
    use tch::Kind;

    /// PyTorch 2.11's `_get_gradient_divide_factors` on the same inputs gives these (its
    /// `AVG` ops and `PreMulSum(1 / factor)` as the divisions after each collective).
    #[test]
    fn divide_factors_follow_pytorch() {
        let d = |shard, replicas, kind, factor| Divide::new(shard, replicas, kind, factor);
        let (f32, f16) = (Kind::Float, Kind::Half);
        assert_eq!(
            d(2, Some(3), f32, None),
            Divide {
                after_reduce_scatter: Some(2.0),
                after_all_reduce: Some(3.0),
                ..Divide::default()
            }
        );
        assert_eq!(
            d(2, Some(2), Kind::BFloat16, Some(0.5)),
            Divide {
                after_reduce_scatter: Some(0.5),
                ..Divide::default()
            }
        );
        assert_eq!(d(1, None, f32, None), Divide::default());
        // f16: (pre, post) = (2, 1), (2, 2), (2, 1.5), (1, 0.5).
        let split = |pre, post| Divide {
            pre,
            post,
            ..Divide::default()
        };
        assert_eq!(d(2, None, f16, None), split(Some(2.0), None));
        assert_eq!(d(2, Some(2), f16, None), split(Some(2.0), Some(2.0)));
        assert_eq!(d(4, None, f16, Some(3.0)), split(Some(2.0), Some(1.5)));
        assert_eq!(d(2, None, f16, Some(0.5)), split(None, Some(0.5)));
    }
}
