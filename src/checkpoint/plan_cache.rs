//! The save plan, computed once per model and layout: which of the model's tensors this
//! rank writes, where each sits in its global tensor, and the manifest's entries for them,
//! kept in a process-wide cache and reused by later saves of the same model (DCP's
//! `DefaultSavePlanner(enable_plan_caching=True)`: `SavePlanner._cached_save_plan`).
//!
//! The key is what the plan depends on: every parameter's and buffer's FQN, the identity
//! of the tensor object behind it (kept by `set_data`, so `fully_shard`'s resharding keeps
//! it), its local shape and dtype, and the rank and world size of the group. A changed
//! model (another object, a new parameter, a reshaped shard, another group size) is a new
//! key and its plan is computed afresh; the cache keeps the plans of the last
//! [`CACHED_PLANS`] keys. The key does not hold the tensors (that would keep a dropped
//! model's memory alive): what it cannot tell apart is a new model whose every tensor
//! reuses a dropped one's identity (its address) with the same FQN, local shape and dtype
//! but another layout (another global shape) at the same rank and world size.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tch::Tensor;
use tch_dist_core::Shardable;

use super::plan;
use super::storage::TensorEntry;
use crate::state_dict::flat::{self, Entry, Part};

/// How many plans the cache keeps (a job saves one model, or a few).
const CACHED_PLANS: usize = 4;

/// How often this process computed a save plan and how often a save reused one: what
/// [`plan_cache_stats`](super::plan_cache_stats) returns.
///
/// ```
/// let stats = tch_dist::checkpoint::plan_cache_stats();
/// assert!(stats.reused <= stats.computed + stats.reused);
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PlanCacheStats {
    /// Plans computed (the first save of a model and layout, or a changed one).
    pub computed: u64,
    /// Saves that reused a plan computed before.
    pub reused: u64,
}

static COMPUTED: AtomicU64 = AtomicU64::new(0);
static REUSED: AtomicU64 = AtomicU64::new(0);

pub(super) fn stats() -> PlanCacheStats {
    PlanCacheStats {
        computed: COMPUTED.load(Ordering::SeqCst),
        reused: REUSED.load(Ordering::SeqCst),
    }
}

/// One tensor of the key: FQN, identity, local shape, dtype.
type KeyEntry = (String, u64, Vec<i64>, String);

#[derive(PartialEq, Eq)]
struct Key {
    rank: usize,
    world_size: usize,
    tensors: Vec<KeyEntry>,
}

/// A computed plan: each target's place (in the key's order, which is the targets' order)
/// and the manifest's entries.
struct Plan {
    /// Per target: offsets, global shape, who writes it.
    places: Vec<(Vec<i64>, Vec<i64>, Part)>,
    entries: BTreeMap<String, TensorEntry>,
}

static CACHE: Mutex<Vec<(Key, Arc<Plan>)>> = Mutex::new(Vec::new());

/// The model's tensors in checkpoint order (parameters, then buffers; a name once).
fn named_tensors<M: Shardable + ?Sized>(module: &M) -> Vec<(String, Tensor)> {
    let mut seen = std::collections::HashSet::new();
    module
        .named_parameters()
        .into_iter()
        .chain(module.named_buffers())
        .filter(|(fqn, _)| seen.insert(fqn.clone()))
        .map(|(fqn, t)| (fqn, t.shallow_clone()))
        .collect()
}

/// The entries (`state_dict::flat::model_entries`) of `module` at `rank` of `world_size` ranks and the manifest's entries
/// for them, from the cache when this model and layout were planned before.
pub(super) fn cached_targets<M: Shardable + ?Sized>(
    module: &M,
    rank: usize,
    world_size: usize,
) -> (Vec<Entry>, BTreeMap<String, TensorEntry>) {
    let tensors = named_tensors(module);
    let key = Key {
        rank,
        world_size,
        tensors: tensors
            .iter()
            .map(|(fqn, t)| {
                (
                    fqn.clone(),
                    tch_dist_runtime::fsdp::tensor_identity(t),
                    t.size(),
                    format!("{:?}", t.kind()),
                )
            })
            .collect(),
    };
    // A poisoned lock only means a panic elsewhere while it was held: the cache's content
    // is still a list of complete plans.
    let mut cache = CACHE.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(found) = cache
        .iter()
        .find(|(k, _)| *k == key)
        .map(|(_, p)| p.clone())
    {
        drop(cache);
        REUSED.fetch_add(1, Ordering::SeqCst);
        let targets = tensors
            .into_iter()
            .zip(&found.places)
            .map(|((fqn, tensor), (offsets, global, part))| Entry {
                fqn,
                tensor,
                offsets: offsets.clone(),
                global: global.clone(),
                part: *part,
            })
            .collect();
        return (targets, found.entries.clone());
    }
    let targets = flat::model_entries(module, &crate::state_dict::placements(module));
    let entries = plan::tensor_entries(&targets);
    let computed = Plan {
        places: targets
            .iter()
            .map(|t| (t.offsets.clone(), t.global.clone(), t.part))
            .collect(),
        entries: entries.clone(),
    };
    if cache.len() >= CACHED_PLANS {
        cache.remove(0);
    }
    cache.push((key, Arc::new(computed)));
    COMPUTED.fetch_add(1, Ordering::SeqCst);
    (targets, entries)
}
