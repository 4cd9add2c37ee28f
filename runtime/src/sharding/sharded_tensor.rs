//! [`ShardedTensor`]: a tensor split across the ranks of a group by a
//! [`ShardingSpec`], each rank holding its shards (PyTorch's
//! `torch.distributed._shard.sharded_tensor.ShardedTensor`).

use tch::{Device, Tensor};
use tch_dist_core::sharding::{Dtype, ShardMetadata, ShardedTensorMetadata, ShardingSpec};

use crate::error::{ArgumentError, DistError, Result, TensorSignature};
use crate::process_group::ProcessGroup;

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
                    let piece = region(&source, m).contiguous();
                    sends.push((group.send_async(&piece, owner, 0)?, piece));
                } else if rank == owner {
                    let buf =
                        Tensor::empty(m.shard_sizes.as_slice(), (tensor.kind(), source.device()));
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
            if let Device::Cuda(_) = m.placement.device() {
                if !tch::Cuda::is_available() {
                    return Err(invalid(
                        group,
                        op,
                        ArgumentError::PlacementNeedsCuda {
                            placement: m.placement,
                        },
                    ));
                }
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

    /// Where gathered tensors are assembled: the device of this rank's first shard (CPU
    /// when it holds none).
    fn home_device(&self) -> Device {
        self.local_shards
            .first()
            .map_or(Device::Cpu, |s| s.tensor.device())
    }
}
