//! Broadcasting many tensors as a few flat buffers (PyTorch's `_broadcast_coalesced`, which
//! DDP uses for the module's parameters at start and its buffers before every forward).
//!
//! One collective per tensor costs a round trip each; a model with many small buffers
//! (BatchNorm's running statistics) spends more time in those round trips than in moving
//! bytes. Tensors of one dtype and device are packed, in order, into flat buffers of at most
//! `bucket_bytes` (a tensor is never split), each broadcast once, and unpacked on the
//! receiving ranks.

use tch::{Device, Kind, Tensor};

use crate::c10d::group::ProcessGroup;
use crate::error::Result;

/// PyTorch's bucket size for synchronising module states (`_DEFAULT_BROADCAST_BUCKET_SIZE`
/// is 250 MiB in `torch.distributed.utils._sync_module_states`).
pub const BROADCAST_BUCKET_BYTES: usize = 250 * 1024 * 1024;

impl ProcessGroup {
    /// Copies every tensor of `tensors` from rank `src` to every rank, in place, as a few
    /// flat broadcasts (tensors of one dtype and device packed into buffers of at most
    /// `bucket_bytes`). Every rank must pass tensors of the same shapes, dtypes and order.
    ///
    /// ```no_run
    /// # let pg = tch_dist_runtime::default_group()?;
    /// let mean = tch::Tensor::zeros([64], tch::kind::FLOAT_CPU);
    /// let var = tch::Tensor::ones([64], tch::kind::FLOAT_CPU);
    /// pg.broadcast_coalesced(&[&mean, &var], 0, tch_dist_runtime::BROADCAST_BUCKET_BYTES)?;
    /// # Ok::<(), tch_dist_runtime::DistError>(())
    /// ```
    pub fn broadcast_coalesced(
        &self,
        tensors: &[&Tensor],
        src: usize,
        bucket_bytes: usize,
    ) -> Result<()> {
        self.check_rank("broadcast", "source rank", src)?;
        if self.skips_communication() || tensors.is_empty() {
            return Ok(());
        }
        let receiving = self.rank() != src;
        tch::no_grad(|| {
            let buckets = pack(tensors, bucket_bytes);
            let flats: Vec<Tensor> = buckets
                .iter()
                .map(|b| {
                    let parts: Vec<Tensor> = b
                        .members
                        .iter()
                        .map(|&i| tensors[i].reshape([-1]))
                        .collect();
                    if receiving {
                        Tensor::empty([b.numel], (b.kind, b.device))
                    } else {
                        Tensor::cat(&parts, 0)
                    }
                })
                .collect();
            let works = flats
                .iter()
                .map(|f| self.broadcast_async(f, src))
                .collect::<Result<Vec<_>>>()?;
            works.into_iter().try_for_each(|w| w.wait())?;
            if receiving {
                for (b, flat) in buckets.iter().zip(&flats) {
                    let mut offset = 0;
                    for &i in &b.members {
                        let t = tensors[i];
                        let n = t.numel() as i64;
                        t.shallow_clone()
                            .copy_(&flat.narrow(0, offset, n).view_as(t));
                        offset += n;
                    }
                }
            }
            Ok(())
        })
    }
}

/// One flat buffer: which tensors it holds (indices, in order) and its element count.
struct Packed {
    members: Vec<usize>,
    numel: i64,
    kind: Kind,
    device: Device,
}

/// Packs tensors in order into buffers of one dtype and device, each at most `bucket_bytes`
/// (a larger tensor gets a buffer of its own).
fn pack(tensors: &[&Tensor], bucket_bytes: usize) -> Vec<Packed> {
    let mut done: Vec<Packed> = Vec::new();
    let mut open: Vec<(Packed, usize)> = Vec::new();
    for (i, t) in tensors.iter().enumerate() {
        let (kind, device) = (t.kind(), t.device());
        let bytes = t.numel() * kind.elt_size_in_bytes();
        let pos = match open
            .iter()
            .position(|(p, _)| p.kind == kind && p.device == device)
        {
            Some(pos) if open[pos].1 + bytes <= bucket_bytes || open[pos].0.members.is_empty() => {
                pos
            }
            Some(pos) => {
                let (full, _) = open.swap_remove(pos);
                done.push(full);
                open.push((
                    Packed {
                        members: Vec::new(),
                        numel: 0,
                        kind,
                        device,
                    },
                    0,
                ));
                open.len() - 1
            }
            None => {
                open.push((
                    Packed {
                        members: Vec::new(),
                        numel: 0,
                        kind,
                        device,
                    },
                    0,
                ));
                open.len() - 1
            }
        };
        let (p, used) = &mut open[pos];
        p.members.push(i);
        p.numel += t.numel() as i64;
        *used += bytes;
    }
    done.extend(open.into_iter().map(|(p, _)| p));
    // Every rank packs the same list the same way, so the buffers line up; launch them in
    // the order of their first member.
    done.sort_by_key(|p| p.members[0]);
    done
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packs_by_dtype_within_the_cap() {
        let f = |n: i64| Tensor::zeros([n], (Kind::Float, Device::Cpu));
        let d = Tensor::zeros([3], (Kind::Double, Device::Cpu));
        let (a, b, c, e) = (f(10), f(10), f(100), f(1));
        let tensors = [&a, &d, &b, &c, &e];
        let layout: Vec<Vec<usize>> = pack(&tensors, 80).into_iter().map(|p| p.members).collect();
        // floats: a (40 B) + b (40 B) fill 80; c (400 B) alone; e with nothing open after c.
        assert_eq!(layout, vec![vec![0, 2], vec![1], vec![3], vec![4]]);
        let layout: Vec<Vec<usize>> = pack(&tensors, usize::MAX)
            .into_iter()
            .map(|p| p.members)
            .collect();
        assert_eq!(layout, vec![vec![0, 2, 3, 4], vec![1]]);
    }
}
