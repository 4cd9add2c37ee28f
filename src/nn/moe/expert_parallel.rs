//! Expert parallelism: each rank of a group keeps `experts / ranks` of the routed experts,
//! and every MoE forward sends each token to the rank holding its expert and back (torchtitan's
//! `ExpertParallel` with its `AllToAllTokenDispatcher`), through
//! [`functional::all_to_all_single`], whose backward sends the gradients back the same way.

use std::sync::Arc;

use tch::Tensor;
use tch_dist_core::hooks::CallWith;
use tch_dist_runtime::sharding::functional;
use tch_dist_runtime::{DistError, ProcessGroup, Refusal};

use super::{GroupedExperts, MoeError};
use crate::state_dict::managed::{register, Layer, ManagingApi, Registration, ShardHolder};
use crate::state_dict::{MeshDimPlacement, Placement};
use tch_dist_runtime::fsdp::tensor_identity;

/// Where a layer's experts live: over `group`, this rank's `local` experts from `first`.
pub(super) struct ExpertParallel {
    pub(super) group: ProcessGroup,
    pub(super) first: i64,
    pub(super) local: i64,
    /// The experts' weights in the registry of managed parameters, split along dim 0 over
    /// `group` as tensor parallelism splits its own: `replicate` and `fully_shard` over the
    /// same ranks leave them alone (no broadcast of rank 0's experts, no averaging of other
    /// experts' gradients), the state dict and checkpoints gather and place them.
    _registration: Registration,
}

impl std::fmt::Debug for ExpertParallel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExpertParallel")
            .field("first", &self.first)
            .field("local", &self.local)
            .finish()
    }
}

/// Gathers an expert weight's whole from every rank's experts (equal pieces along dim 0).
struct Holder {
    group: ProcessGroup,
}

impl ShardHolder for Holder {
    fn gather(&self, _index: usize, piece: &Tensor) -> Result<Tensor, DistError> {
        let ranks = self.group.world_size() as i64;
        let mut shape = piece.size();
        shape[0] *= ranks;
        let whole = Tensor::zeros(shape, (piece.kind(), piece.device()));
        self.group
            .all_gather_into_tensor(&whole, &piece.contiguous())?;
        Ok(whole)
    }

    /// The experts always hold this rank's.
    fn reshard(&self) -> Result<(), DistError> {
        Ok(())
    }
}

impl ExpertParallel {
    /// Keeps this rank's experts of `experts` (their weights narrowed in place, so that the
    /// `VarStore` and an optimizer built afterwards see them): `experts / ranks` each, in
    /// rank order. Refused on every rank, nothing narrowed, when the ranks do not divide the
    /// experts or their layers differ (the experts' count or shapes, the tokens' top k: the
    /// exchanges of every forward rely on them being alike, one small all-reduce here).
    pub(super) fn shard(
        experts: &mut GroupedExperts,
        count: i64,
        top_k: i64,
        group: &ProcessGroup,
    ) -> Result<Self, MoeError> {
        let ranks = group.world_size() as i64;
        let own = (count % ranks != 0).then(|| {
            format!(
                "{count} experts cannot be split evenly over the {ranks} ranks of expert parallelism"
            )
        });
        let shape = experts.w1.size();
        let (hidden, dim) = (shape.get(1).copied(), shape.get(2).copied());
        let settings = [
            ("experts", count),
            ("expert width", hidden.unwrap_or(-1)),
            ("dim", dim.unwrap_or(-1)),
            ("top_k", top_k),
        ];
        group
            .agree_on_values("parallelize_experts", own, &settings)
            .map_err(|refusal| match refusal {
                Refusal::Own(text) => MoeError::Config(text),
                Refusal::Peer { rank } => MoeError::Config(format!(
                    "rank {rank} refused expert parallelism (its own error says why)"
                )),
                Refusal::Differs {
                    setting,
                    this,
                    other_rank,
                    other,
                } => MoeError::Config(format!(
                    "expert parallelism: {setting} is {this} here but {other} on rank {other_rank}"
                )),
                Refusal::Exchange(e) => MoeError::Collective(*e),
            })?;
        let local = count / ranks;
        let first = group.rank() as i64 * local;
        let holder: Arc<dyn ShardHolder> = Arc::new(Holder {
            group: group.clone(),
        });
        let mut entries = Vec::new();
        let weights = [
            ("experts.w1", &mut experts.w1),
            ("experts.w2", &mut experts.w2),
            ("experts.w3", &mut experts.w3),
        ];
        tch::no_grad(|| {
            for (index, (name, w)) in weights.into_iter().enumerate() {
                let whole = w.size();
                let mine = w.narrow(0, first, local).contiguous();
                w.set_data(&mine);
                let mut offsets = vec![0; whole.len()];
                offsets[0] = first;
                let layer = Layer {
                    dims: vec![MeshDimPlacement {
                        placement: Placement::Shard(0),
                        group: group.clone(),
                    }],
                    whole,
                    offsets,
                    local: w.size(),
                    blocks: 1,
                    holder: Arc::clone(&holder),
                    index,
                };
                entries.push((tensor_identity(w), name.to_string(), Some(layer)));
            }
        });
        let registration = register(ManagingApi::ExpertParallel, group.global_ranks(), entries);
        Ok(ExpertParallel {
            group: group.clone(),
            first,
            local,
            _registration: registration,
        })
    }

    /// Runs `rows`, grouped by global expert (`counts[e]` rows for expert `e`), through the
    /// experts wherever they live, and returns their outputs in the same order: the counts
    /// exchanged first, then the rows, regrouped by local expert, run, ungrouped and sent back.
    pub(super) fn run(
        &self,
        experts: &GroupedExperts,
        rows: &Tensor,
        counts: &[i64],
    ) -> Result<Tensor, MoeError> {
        let ranks = self.group.world_size();
        let local = self.local as usize;
        let to_rank: Vec<i64> = counts.chunks(local).map(|c| c.iter().sum()).collect();
        // Each rank's counts for my experts: [ranks, local], source-major (every rank sends
        // `local` counts to each: a plain all-to-all of equal chunks, no gradient).
        let mine = Tensor::from_slice(counts);
        if mine.size()[0] != (ranks * local) as i64 {
            return Err(MoeError::Config(format!(
                "{} expert counts for {ranks} ranks of {local} experts",
                mine.size()[0]
            )));
        }
        let theirs = mine.empty_like();
        self.group
            .all_to_all_single(&theirs, &mine)
            .map_err(MoeError::Collective)?;
        let theirs = Vec::<i64>::try_from(&theirs).map_err(|_| {
            MoeError::Collective(DistError::Internal {
                rank: self.group.rank(),
                op: "expert parallelism",
                what: "the exchanged counts could not be read back",
            })
        })?;
        // What each rank sends this rank: the sum of its counts for my experts.
        let from_rank: Vec<i64> = theirs.chunks(local).map(|c| c.iter().sum()).collect();
        // The rows, now that every rank knows what it receives.
        let received = functional::all_to_all_single_known(rows, &to_rank, &from_rank, &self.group)
            .map_err(MoeError::Collective)?;
        // Source-major to expert-major, so that each local expert's rows are contiguous.
        let mut source_start = vec![0i64; ranks];
        for s in 1..ranks {
            source_start[s] = source_start[s - 1] + from_rank[s - 1];
        }
        let mut order = Vec::with_capacity(from_rank.iter().sum::<i64>() as usize);
        let mut per_expert = vec![0i64; local];
        for (e, n) in per_expert.iter_mut().enumerate() {
            for s in 0..ranks {
                let before: i64 = theirs[s * local..s * local + e].iter().sum();
                let count = theirs[s * local + e];
                order.extend(source_start[s] + before..source_start[s] + before + count);
                *n += count;
            }
        }
        let order = Tensor::from_slice(&order).to_device(rows.device());
        // The experts' gradients gather every rank's tokens (the exchange's backward): scaled
        // by 1 / ranks, they are the gradients of the mean of the ranks' losses, as data
        // parallelism over these ranks averages every other parameter's.
        let grad_scale = 1.0 / ranks as f64;
        // A hooked call: the experts may be fully_shard's module of their own, over the
        // ranks that hold the same experts (torchtitan's expert data parallelism).
        let out = experts
            .f_call_with([&received.index_select(0, &order)], move |e, [rows]| {
                e.forward_grouped_scaled(rows, &per_expert, grad_scale)
            })
            .map_err(MoeError::Experts)?;
        // Back to source-major, then to the ranks the rows came from.
        let inverse = order.argsort(0, false);
        functional::all_to_all_single_known(
            &out.index_select(0, &inverse),
            &from_rank,
            &to_rank,
            &self.group,
        )
        .map_err(MoeError::Collective)
    }
}
