//! The whole model from its pieces ([`full_state_dict`]), and every sharded tensor back on
//! its shards before a checkpoint reads or writes them ([`reshard_all`]): both through the
//! holders the APIs registered, never the APIs themselves.

use std::collections::HashMap;
use std::sync::Arc;

use tch::Tensor;
use tch_dist_core::Shardable;
use tch_dist_runtime::fsdp::tensor_identity;
use tch_dist_runtime::DistError;

use super::managed::{self, ShardHolder};
use super::placements;

/// Why the state dict could not be made: an API's collective failed while gathering a
/// tensor's pieces or putting them back.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StateDictError {
    /// Gathering a sharded parameter's pieces failed (a collective over the group of the
    /// API that split it); the collective's error is the
    /// [`source`](std::error::Error::source).
    #[error("state dict: gathering `{fqn}` failed")]
    Gather {
        /// The parameter.
        fqn: String,
        /// What the collective said.
        #[source]
        source: DistError,
    },
    /// Putting the sharded parameters back on their shards failed.
    #[error("state dict: putting the parameters back on their shards failed")]
    Reshard {
        /// What the engine said.
        #[source]
        source: DistError,
    },
}

/// Every parameter and buffer of `module` with its full value, in walk order (PyTorch's
/// full `state_dict`, for evaluation or export; a tied parameter under each of its names).
/// A collective: every rank calls it, and every rank gets the full values. Parameters
/// sharded by `fully_shard` or `shard_module` are all-gathered; the others are copied.
///
/// ```no_run
/// # fn demo<M: tch_dist::Shardable>(model: &M) -> Result<(), tch_dist::state_dict::StateDictError> {
/// let full = tch_dist::state_dict::full_state_dict(model)?;
/// for (fqn, t) in &full { println!("{fqn}: {:?}", t.size()); }
/// # Ok(()) }
/// ```
pub fn full_state_dict<M: Shardable + ?Sized>(
    module: &M,
) -> Result<Vec<(String, Tensor)>, StateDictError> {
    let placements = placements(module);
    // A tied parameter is gathered once, under its first name.
    let mut gathered: HashMap<u64, Tensor> = HashMap::new();
    let mut out = Vec::new();
    for (fqn, t) in module.named_parameters() {
        let id = tensor_identity(t);
        let full = if let Some(full) = gathered.get(&id) {
            full.shallow_clone()
        } else if let Some(p) = placements.get(t) {
            // Outermost first: fully_shard's gather gives the piece shard_module split off
            // (FSDP x TP) or the whole tensor; shard_module's gathers that.
            let mut full = tch::no_grad(|| t.detach());
            for layer in p.layers.iter().rev() {
                full = layer.holder.gather(layer.index, &full).map_err(|source| {
                    StateDictError::Gather {
                        fqn: fqn.clone(),
                        source,
                    }
                })?;
            }
            gathered.insert(id, full.shallow_clone());
            full
        } else {
            tch::no_grad(|| t.detach().copy())
        };
        out.push((fqn, full));
    }
    for (fqn, b) in module.named_buffers() {
        out.push((fqn, tch::no_grad(|| b.detach().copy())));
    }
    Ok(out)
}

/// Puts every sharded parameter of `module` back on its shards (a checkpoint reads and
/// writes shards; a fully_shard group may hold its whole parameters between an explicit
/// unshard and its next reshard), each holder once, in walk order.
pub(crate) fn reshard_all<M: Shardable + ?Sized>(module: &M) -> Result<(), DistError> {
    let mut done: Vec<Arc<dyn ShardHolder>> = Vec::new();
    for (_, t) in module.named_parameters() {
        for layer in managed::layers_of(tensor_identity(t)) {
            if done.iter().any(|h| Arc::ptr_eq(h, &layer.holder)) {
                continue;
            }
            layer.holder.reshard()?;
            done.push(layer.holder);
        }
    }
    Ok(())
}
