//! [`ShardedTensor`]: a tensor split across the ranks of a group by a
//! [`ShardingSpec`], each rank holding its shards (PyTorch's
//! `torch.distributed._shard.sharded_tensor.ShardedTensor`).

use tch::{Device, Tensor};
use tch_dist_core::sharding::{Dtype, ShardMetadata, ShardedTensorMetadata, ShardingSpec};

use crate::c10d::group::ProcessGroup;
use crate::error::{ArgumentError, DistError, Result, TensorSignature};

/// One shard held by this rank: its data and where it sits in the global tensor.
#[derive(Debug)]
pub struct Shard {
    /// The shard's values, of shape `metadata.shard_sizes`, on the placement's device.
    pub tensor: Tensor,
    /// Offsets, sizes and placement of the shard.
    pub metadata: ShardMetadata,
}

/// A tensor sharded across a process group: this rank's shards plus the global metadata
/// (every shard's offsets, sizes and placement, the global size and dtype), the same on
/// every rank.
///
/// ```no_run
/// use tch_dist_core::sharding::{ChunkShardingSpec, Placement, ShardingSpec};
/// use tch_dist_runtime::sharding::ShardedTensor;
/// # let pg = tch_dist_runtime::default_group()?;
/// let on = |rank| Placement::new(rank, tch::Device::Cpu);
/// let spec = ShardingSpec::Chunk(ChunkShardingSpec::new(0, vec![on(0), on(1)]));
/// let full = tch::Tensor::arange(10, (tch::Kind::Float, tch::Device::Cpu)).view([5, 2]);
/// let st = ShardedTensor::scatter(&full, &spec, 0, &pg)?; // rank 0: rows 0-2, rank 1: rows 3-4
/// assert!(st.all_gather()?.equal(&full));
/// # Ok::<(), tch_dist_runtime::DistError>(())
/// ```
#[derive(Debug)]
pub struct ShardedTensor {
    metadata: ShardedTensorMetadata,
    local_shards: Vec<Shard>,
    group: ProcessGroup,
}

fn invalid(group: &ProcessGroup, op: &'static str, problem: ArgumentError) -> DistError {
    DistError::InvalidArgument {
        rank: group.rank(),
        op,
        problem: Box::new(problem),
    }
}

/// `t`'s region described by `m` (a view).
fn region(t: &Tensor, m: &ShardMetadata) -> Tensor {
    let mut view = t.shallow_clone();
    for (d, (&off, &len)) in m.shard_offsets.iter().zip(&m.shard_sizes).enumerate() {
        view = view.narrow(d as i64, off, len);
    }
    view
}

/// The device of every transfer of a sharded tensor's collectives, decided from what every
/// rank knows alike — the global metadata — so that all ranks pick the same backend: CPU
/// (Gloo) when every shard is placed on the CPU, else CUDA (NCCL) on this rank's device:
/// `own` (a CUDA shard it holds, or the CUDA tensor it passed), else the group's `bound`
/// device, else `cuda:0`. A rank that holds no shard of a CUDA tensor thus still
/// communicates through NCCL, as its peers do.
fn transfer_device(
    metadata: &ShardedTensorMetadata,
    own: Option<Device>,
    bound: Option<Device>,
) -> Device {
    let on_cuda = metadata
        .shards_metadata
        .iter()
        .any(|m| m.placement.device().is_cuda());
    if !on_cuda {
        return Device::Cpu;
    }
    own.filter(|d| d.is_cuda())
        .or(bound)
        .unwrap_or(Device::Cuda(0))
}

impl ShardedTensor {
    /// Shards `tensor` as `spec` says, taking the values from rank `src_rank` (PyTorch's
    /// `_shard_tensor`): every rank passes a tensor of the same shape and dtype, and keeps
    /// only its own shards, moved to their placement's device. Fails on every rank when the
    /// shapes differ, the spec does not fit the tensor, or a placement names a rank outside
    /// the group.
    pub fn scatter(
        tensor: &Tensor,
        spec: &ShardingSpec,
        src_rank: usize,
        group: &ProcessGroup,
    ) -> Result<ShardedTensor> {
        const OP: &str = "shard_tensor";
        group.check_rank(OP, "src_rank", src_rank)?;
        // Every rank sees every rank's shape and dtype, so that all fail together.
        group.verify_same_shape(OP, src_rank, tensor)?;
        let size = tensor.size();
        let metadata = ShardedTensorMetadata {
            shards_metadata: spec
                .shards_metadata(&size)
                .map_err(|e| invalid(group, OP, e.into()))?,
            size: size.clone(),
            dtype: Dtype(tensor.kind()),
        };
        Self::check_placements(&metadata, group, OP)?;
        let rank = group.rank();
        let source = tensor.detach();
        // Sender and receivers transfer on devices of one kind (see `transfer_device`).
        let wire = transfer_device(&metadata, Some(source.device()), group.bound_device());
        let mut local_shards = Vec::new();
        let mut sends = Vec::new();
        tch::no_grad(|| -> Result<()> {
            for m in &metadata.shards_metadata {
                let owner = m.placement.rank();
                if m.is_empty() {
                    if owner == rank {
                        local_shards.push(Shard {
                            tensor: Tensor::empty(
                                m.shard_sizes.as_slice(),
                                (tensor.kind(), m.placement.device()),
                            ),
                            metadata: m.clone(),
                        });
                    }
                    continue;
                }
                if owner == src_rank && rank == src_rank {
                    local_shards.push(Shard {
                        tensor: region(&source, m)
                            .to_device(m.placement.device())
                            .contiguous()
                            .copy(),
                        metadata: m.clone(),
                    });
                } else if rank == src_rank {
                    let piece = region(&source, m).to_device(wire).contiguous();
                    sends.push((group.send_async(&piece, owner, 0)?, piece));
                } else if rank == owner {
                    let buf = Tensor::empty(m.shard_sizes.as_slice(), (tensor.kind(), wire));
                    group.recv(&buf, src_rank, 0)?;
                    local_shards.push(Shard {
                        tensor: buf.to_device(m.placement.device()),
                        metadata: m.clone(),
                    });
                }
            }
            Ok(())
        })?;
        for (work, _piece) in sends {
            work.wait()?;
        }
        Ok(ShardedTensor {
            metadata,
            local_shards,
            group: group.clone(),
        })
    }

    /// Builds a sharded tensor from shards every rank already holds (PyTorch's
    /// `ShardedTensor._init_from_local_shards_and_global_metadata`): checks that the
    /// metadata is valid and that this rank's shards are exactly the ones it assigns here.
    pub fn from_local_shards(
        local_shards: Vec<Shard>,
        metadata: ShardedTensorMetadata,
        group: &ProcessGroup,
    ) -> Result<ShardedTensor> {
        const OP: &str = "ShardedTensor::from_local_shards";
        metadata
            .validate()
            .map_err(|e| invalid(group, OP, e.into()))?;
        Self::check_placements(&metadata, group, OP)?;
        let expected = metadata.shards_for_rank(group.rank());
        if expected.len() != local_shards.len()
            || local_shards
                .iter()
                .any(|s| !expected.contains(&&s.metadata))
        {
            return Err(invalid(
                group,
                OP,
                ArgumentError::LocalShards {
                    expected: expected.len(),
                    got: local_shards.len(),
                },
            ));
        }
        for s in &local_shards {
            if s.tensor.size() != s.metadata.shard_sizes || s.tensor.kind() != metadata.dtype.0 {
                return Err(invalid(
                    group,
                    OP,
                    ArgumentError::LocalShardSignature {
                        actual: TensorSignature {
                            shape: s.tensor.size(),
                            kind: s.tensor.kind(),
                        },
                        expected: TensorSignature {
                            shape: s.metadata.shard_sizes.clone(),
                            kind: metadata.dtype.0,
                        },
                    },
                ));
            }
        }
        Ok(ShardedTensor {
            metadata,
            local_shards,
            group: group.clone(),
        })
    }

    fn check_placements(
        metadata: &ShardedTensorMetadata,
        group: &ProcessGroup,
        op: &'static str,
    ) -> Result<()> {
        for m in &metadata.shards_metadata {
            if m.placement.rank() >= group.world_size() {
                return Err(invalid(
                    group,
                    op,
                    ArgumentError::PlacementRank {
                        placement: m.placement,
                        world_size: group.world_size(),
                    },
                ));
            }
            if let Device::Cuda(_) = m.placement.device()
                && !tch::Cuda::is_available()
            {
                return Err(invalid(
                    group,
                    op,
                    ArgumentError::PlacementNeedsCuda {
                        placement: m.placement,
                    },
                ));
            }
        }
        Ok(())
    }

    /// The global metadata: every shard, the global size and dtype.
    pub fn metadata(&self) -> &ShardedTensorMetadata {
        &self.metadata
    }

    /// The global size.
    pub fn size(&self) -> &[i64] {
        &self.metadata.size
    }

    /// This rank's shards.
    pub fn local_shards(&self) -> &[Shard] {
        &self.local_shards
    }

    /// The group the tensor is sharded over.
    pub fn group(&self) -> &ProcessGroup {
        &self.group
    }

    /// This rank's only shard (PyTorch's `local_tensor()`); an error when the rank holds
    /// none or several.
    pub fn local_tensor(&self) -> Result<&Tensor> {
        match self.local_shards.as_slice() {
            [one] => Ok(&one.tensor),
            shards => Err(invalid(
                &self.group,
                "ShardedTensor::local_tensor",
                ArgumentError::LocalTensorCount { held: shards.len() },
            )),
        }
    }

    /// Assembles the whole tensor on rank `dst` (PyTorch's `gather`): `Some(full)` there,
    /// `None` on the other ranks. Every rank must call it.
    pub fn gather(&self, dst: usize) -> Result<Option<Tensor>> {
        self.group.check_rank("ShardedTensor::gather", "dst", dst)?;
        let rank = self.group.rank();
        let device = self.home_device();
        let full = (rank == dst).then(|| {
            Tensor::zeros(
                self.metadata.size.as_slice(),
                (self.metadata.dtype.0, device),
            )
        });
        let mut sends = Vec::new();
        tch::no_grad(|| -> Result<()> {
            for m in &self.metadata.shards_metadata {
                if m.is_empty() {
                    continue;
                }
                let owner = m.placement.rank();
                if owner == rank {
                    let local = self.local_for(m)?.to_device(device).contiguous();
                    match &full {
                        Some(f) => {
                            region(f, m).copy_(&local);
                        }
                        None => sends.push((self.group.send_async(&local, dst, 0)?, local)),
                    }
                } else if let Some(f) = &full {
                    let buf =
                        Tensor::empty(m.shard_sizes.as_slice(), (self.metadata.dtype.0, device));
                    self.group.recv(&buf, owner, 0)?;
                    region(f, m).copy_(&buf);
                }
            }
            Ok(())
        })?;
        for (work, _) in sends {
            work.wait()?;
        }
        Ok(full)
    }

    /// Assembles the whole tensor on every rank (one broadcast per shard, in metadata order).
    pub fn all_gather(&self) -> Result<Tensor> {
        let rank = self.group.rank();
        let device = self.home_device();
        let full = Tensor::zeros(
            self.metadata.size.as_slice(),
            (self.metadata.dtype.0, device),
        );
        tch::no_grad(|| -> Result<()> {
            for m in &self.metadata.shards_metadata {
                if m.is_empty() {
                    continue;
                }
                let owner = m.placement.rank();
                let buf = if owner == rank {
                    self.local_for(m)?.to_device(device).contiguous()
                } else {
                    Tensor::empty(m.shard_sizes.as_slice(), (self.metadata.dtype.0, device))
                };
                self.group.broadcast(&buf, owner)?;
                region(&full, m).copy_(&buf);
            }
            Ok(())
        })?;
        Ok(full)
    }

    /// The same values sharded by another spec (PyTorch's `reshard`). Every rank must call
    /// it with the same spec.
    pub fn reshard(&self, spec: &ShardingSpec) -> Result<ShardedTensor> {
        const OP: &str = "ShardedTensor::reshard";
        let shards = spec
            .shards_metadata(&self.metadata.size)
            .map_err(|e| invalid(&self.group, OP, e.into()))?;
        let metadata = ShardedTensorMetadata {
            shards_metadata: shards,
            size: self.metadata.size.clone(),
            dtype: self.metadata.dtype,
        };
        Self::check_placements(&metadata, &self.group, OP)?;
        let full = self.all_gather()?;
        let rank = self.group.rank();
        let local_shards = metadata
            .shards_metadata
            .iter()
            .filter(|m| m.placement.rank() == rank)
            .map(|m| Shard {
                tensor: region(&full, m)
                    .to_device(m.placement.device())
                    .contiguous()
                    .copy(),
                metadata: m.clone(),
            })
            .collect();
        Ok(ShardedTensor {
            metadata,
            local_shards,
            group: self.group.clone(),
        })
    }

    fn local_for(&self, m: &ShardMetadata) -> Result<&Tensor> {
        self.local_shards
            .iter()
            .find(|s| &s.metadata == m)
            .map(|s| &s.tensor)
            .ok_or_else(|| {
                invalid(
                    &self.group,
                    "ShardedTensor",
                    ArgumentError::MissingShard {
                        offsets: m.shard_offsets.clone(),
                    },
                )
            })
    }

    /// Where gathered tensors are assembled and transferred (see [`transfer_device`]): on
    /// CUDA when any shard is placed on CUDA, this rank's own CUDA shard's device first.
    fn home_device(&self) -> Device {
        let own = self
            .local_shards
            .iter()
            .map(|s| s.tensor.device())
            .find(|d| d.is_cuda());
        transfer_device(&self.metadata, own, self.group.bound_device())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch_dist_core::sharding::{ChunkShardingSpec, Placement};

    fn metadata(devices: &[Device]) -> ShardedTensorMetadata {
        let placements = devices
            .iter()
            .enumerate()
            .map(|(r, &d)| Placement::new(r, d))
            .collect();
        let spec = ShardingSpec::Chunk(ChunkShardingSpec::new(0, placements));
        ShardedTensorMetadata {
            shards_metadata: spec.shards_metadata(&[4, 2]).unwrap(),
            size: vec![4, 2],
            dtype: Dtype(tch::Kind::Float),
        }
    }

    /// Every rank decides from the shared metadata: a rank holding no shard of a CUDA tensor
    /// transfers on CUDA (NCCL) like its peers, never on the CPU (Gloo), which would hang them.
    #[test]
    fn the_transfer_device_follows_the_placements_not_the_local_shards() {
        let cuda = metadata(&[Device::Cuda(0), Device::Cuda(1)]);
        // Rank 1's own shard decides its device; a rank with none takes its bound device,
        // else cuda:0.
        assert_eq!(
            transfer_device(&cuda, Some(Device::Cuda(1)), Some(Device::Cuda(1))),
            Device::Cuda(1)
        );
        assert_eq!(
            transfer_device(&cuda, None, Some(Device::Cuda(3))),
            Device::Cuda(3)
        );
        assert_eq!(
            transfer_device(&cuda, Some(Device::Cpu), None),
            Device::Cuda(0)
        );
        // All on the CPU: Gloo, whatever this rank passed.
        let host = metadata(&[Device::Cpu, Device::Cpu]);
        assert_eq!(
            transfer_device(&host, Some(Device::Cuda(0)), Some(Device::Cuda(0))),
            Device::Cpu
        );
        assert_eq!(transfer_device(&host, None, None), Device::Cpu);
        // Rows 0-1 on cuda:0, rows 2-3 on rank 1's CPU: CUDA for both.
        let mixed = metadata(&[Device::Cuda(0), Device::Cpu]);
        assert_eq!(transfer_device(&mixed, None, None), Device::Cuda(0));
    }
}
