//! Sharders for embedding tables (`nn::Embedding`'s `weight` `[num_embeddings,
//! embedding_dim]`), as PyTorch's `ColwiseParallel` / `RowwiseParallel` shard an
//! `nn.Embedding`: [`ColwiseEmbedding`] splits the embedding dim, every rank looks up its
//! columns of every token; [`RowwiseEmbedding`] splits the vocabulary (Megatron's
//! `VocabParallelEmbedding`), every rank looks up the tokens in its rows, zeros the others,
//! and the partial results are summed over the ranks.

use std::sync::Arc;

use tch::{Kind, Tensor};
use tch_dist_core::hooks::{register_fallible_forward_hook, register_fallible_forward_pre_hook};
use tch_dist_core::sharding::chunk::{chunk_offsets, chunk_sizes};
use tch_dist_core::Shardable;
use tch_dist_runtime::ProcessGroup;

use super::error::{ForwardProblem, HookSite, ShardError, SharderError};
use super::output::OutputLayout;
use super::sharder::{
    first_submodule, hook_error, refused, shard_along, PerCall, ShardedModule, Sharder,
};

/// Column-parallel embedding (PyTorch's `ColwiseParallel` on an `nn.Embedding`): `weight`
/// `[num_embeddings, embedding_dim]` split along `embedding_dim`; each rank's output is its
/// columns of every token's embedding (gathered, or handed on as they are with
/// `return_local_tensor`, as a column-parallel linear layer's).
///
/// ```
/// use tch_dist::sharding::{ColwiseEmbedding, Sharder};
/// assert_eq!(ColwiseEmbedding.name(), "colwise_embedding");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ColwiseEmbedding;

/// Row-parallel (vocab-parallel) embedding (PyTorch's `RowwiseParallel` on an
/// `nn.Embedding`, Megatron's `VocabParallelEmbedding`): `weight` split along
/// `num_embeddings`; each rank looks up the ids in its rows, zeros the others' tokens, and
/// the output is the sum over the ranks (an all-reduce, whose backward hands every rank the
/// whole gradient, so each row's gradient comes from its own tokens only).
///
/// ```
/// use tch_dist::sharding::{RowwiseEmbedding, Sharder};
/// assert_eq!(RowwiseEmbedding.name(), "rowwise_embedding");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RowwiseEmbedding;

/// An embedding table's one parameter, or why the module is not one.
fn embedding_weight(module: &dyn Shardable) -> Result<Tensor, SharderError> {
    let kind = module.type_name();
    let not = |found: String| SharderError::NotAnEmbedding { kind, found };
    if let Some(child) = first_submodule(module) {
        return Err(not(format!("a submodule `{child}`")));
    }
    let mut weight = None;
    for (name, t) in module.named_parameters() {
        match name.as_str() {
            "weight" => weight = Some(t.shallow_clone()),
            _ => return Err(not(format!("a parameter `{name}`"))),
        }
    }
    let weight = weight.ok_or_else(|| not("no `weight`".into()))?;
    if weight.dim() != 2 {
        return Err(not(format!("a `weight` of shape {:?}", weight.size())));
    }
    Ok(weight)
}

fn checked_weight(
    sharder: &dyn Sharder,
    fqn: &str,
    module: &dyn Shardable,
    group: &ProcessGroup,
) -> Result<Tensor, ShardError> {
    embedding_weight(module).map_err(|source| refused(group, fqn, sharder.name(), source))
}

impl Sharder for ColwiseEmbedding {
    fn name(&self) -> String {
        "colwise_embedding".into()
    }

    fn check(
        &self,
        _fqn: &str,
        module: &dyn Shardable,
        _group: &ProcessGroup,
    ) -> Result<(), SharderError> {
        embedding_weight(module).map(|_| ())
    }

    fn splits_output(&self) -> bool {
        true
    }

    fn shard(
        &self,
        fqn: &str,
        module: &dyn Shardable,
        src_rank: usize,
        group: &ProcessGroup,
    ) -> Result<ShardedModule, ShardError> {
        let weight = checked_weight(self, fqn, module, group)?;
        let dim = weight.size()[1];
        let params = vec![(
            "weight".to_string(),
            shard_along(fqn, "weight", &weight, 1, src_rank, group)?,
        )];
        Ok(ShardedModule {
            params,
            output: OutputLayout::Sharded {
                dim: -1,
                sizes: chunk_sizes(dim, group.world_size()),
                order: None,
            },
            hooks: Vec::new(),
        })
    }
}

impl Sharder for RowwiseEmbedding {
    fn name(&self) -> String {
        "rowwise_embedding".into()
    }

    fn check(
        &self,
        _fqn: &str,
        module: &dyn Shardable,
        _group: &ProcessGroup,
    ) -> Result<(), SharderError> {
        embedding_weight(module).map(|_| ())
    }

    fn shard(
        &self,
        fqn: &str,
        module: &dyn Shardable,
        src_rank: usize,
        group: &ProcessGroup,
    ) -> Result<ShardedModule, ShardError> {
        let weight = checked_weight(self, fqn, module, group)?;
        let vocab = weight.size()[0];
        let (rank, world) = (group.rank(), group.world_size());
        let (lo, rows) = (
            chunk_offsets(vocab, world)[rank],
            chunk_sizes(vocab, world)[rank],
        );
        let params = vec![(
            "weight".to_string(),
            shard_along(fqn, "weight", &weight, 0, src_rank, group)?,
        )];
        let unhookable = |source| ShardError::unhookable(group, fqn, source);
        let masks: Arc<PerCall<Tensor>> = Arc::new(PerCall::default());
        let (g, name, inside) = (group.clone(), fqn.to_string(), masks.clone());
        let pre = register_fallible_forward_pre_hook(module, move |_m, ids| {
            if !matches!(ids.kind(), Kind::Int64 | Kind::Int) {
                let problem = ForwardProblem::NotIds {
                    dtype: format!("{:?}", ids.kind()),
                };
                return Err(hook_error(&g, &name, HookSite::VocabParallel, problem));
            }
            if let Some(bad) = out_of_range(ids, vocab) {
                let problem = ForwardProblem::IdOutOfRange { id: bad, vocab };
                return Err(hook_error(&g, &name, HookSite::VocabParallel, problem));
            }
            // This rank's rows: ids lo..lo+rows; the others looked up as row 0, zeroed after.
            let mine = ids.ge(lo).logical_and(&ids.lt(lo + rows));
            let local = (ids - lo).where_self(&mine, &ids.zeros_like());
            inside.push(mine);
            Ok(Some(local))
        })
        .map_err(unhookable)?;
        let (g, name) = (group.clone(), fqn.to_string());
        let post = register_fallible_forward_hook(module, move |_m, _ids, out| {
            let Some(mine) = masks.pop() else {
                let problem = ForwardProblem::LookupWithoutInputHook;
                return Err(hook_error(&g, &name, HookSite::VocabParallel, problem));
            };
            Ok(Some(out * mine.unsqueeze(-1).to_kind(out.kind())))
        })
        .map_err(unhookable)?;
        Ok(ShardedModule {
            params,
            output: OutputLayout::Partial { replicated: None },
            hooks: vec![pre, post],
        })
    }
}

/// The first id outside `0..vocab`, if any (an id another rank's table does not hold either
/// would be silently zero).
fn out_of_range(ids: &Tensor, vocab: i64) -> Option<i64> {
    if ids.numel() == 0 {
        return None;
    }
    let bad = ids.lt(0).logical_or(&ids.ge(vocab));
    if bad.any().int64_value(&[]) == 0 {
        return None;
    }
    Some(ids.masked_select(&bad).int64_value(&[0]))
}
