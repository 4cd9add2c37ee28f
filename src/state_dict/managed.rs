//! The one registry of managed parameters: which API manages which tensor object, by the
//! tensor's identity (its `TensorImpl`, which `set_data` keeps: a parameter stays the same
//! key whether it holds its shard or its whole value), with the FQN it was managed under,
//! the global ranks of the group it is spread or averaged over, and, for the APIs that
//! shard it, how ([`Layer`]: this rank's piece of what the API splits, and the
//! [`ShardHolder`] that gathers it back). The placement record ([`placements`](super::placements))
//! is built from these layers alone, as DCP reads only a DTensor's placements. It is also how
//! a call on a submodule learns that an enclosing module's `shard_module` call split one of
//! its parameters, and over which ranks.
//!
//! `replicate`, `fully_shard` and `shard_module` enter their parameters once a call
//! succeeded and remove them when the call's state is dropped ([`Registration`]); each
//! consults it before changing anything: a parameter is replicated once, fully-sharded once,
//! and `shard_module` refuses one another API already manages (PyTorch applies tensor
//! parallelism first, then FSDP). The APIs' states hold the tensors, so no other tensor can
//! take an identity while its entry exists.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use tch::Tensor;
use tch_dist_runtime::DistError;

use super::MeshDimPlacement;

/// An API that manages parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ManagingApi {
    /// `replicate` (DDP).
    Replicate,
    /// `fully_shard` (FSDP2).
    FullyShard,
    /// `shard_module` / `parallelize_module` (tensor parallelism).
    ShardModule,
    /// A MoE layer's expert parallelism (`MoE::parallelize_experts`): its experts split
    /// along dim 0 over the expert-parallel ranks.
    ExpertParallel,
}

impl ManagingApi {
    /// PyTorch's name of the API.
    pub fn name(self) -> &'static str {
        match self {
            ManagingApi::Replicate => "replicate",
            ManagingApi::FullyShard => "fully_shard",
            ManagingApi::ShardModule => "shard_module",
            ManagingApi::ExpertParallel => "expert_parallel",
        }
    }
}

/// What an API that shards tensors does for the state dict, behind its [`Layer`]s: gather a
/// tensor's whole (what the API split) from this rank's piece, and put its tensors back on
/// their shards. The API registers one at apply time; the state dict, the checkpoint and
/// `clip_grad_norm` reach the APIs only through it.
pub(crate) trait ShardHolder: Send + Sync {
    /// Tensor `index`'s whole from this rank's `piece` of it (a collective over the API's
    /// group: every rank of it calls it).
    fn gather(&self, index: usize, piece: &Tensor) -> Result<Tensor, DistError>;
    /// Puts every tensor it holds back on its shards (a checkpoint reads and writes shards);
    /// nothing to do for an API whose tensors always are.
    fn reshard(&self) -> Result<(), DistError>;
}

/// How one API splits a tensor it shards: one level of a DTensor's placements (a tensor
/// `shard_module` split and `fully_shard` split again has two, innermost first).
#[derive(Clone)]
pub(crate) struct Layer {
    /// Its mesh dims, outermost first, each with this rank's group along it.
    pub dims: Vec<MeshDimPlacement>,
    /// What it splits: the whole tensor, or the piece an API applied before it left.
    pub whole: Vec<i64>,
    /// Where this rank's piece starts in `whole`.
    pub offsets: Vec<i64>,
    /// The shape of this rank's piece.
    pub local: Vec<i64>,
    /// How many separate blocks of `whole` this rank's piece joins along dim 0 (a fused
    /// column-parallel layer's parts; 1 otherwise).
    pub blocks: usize,
    /// The API's holder, and the tensor's index in it.
    pub holder: Arc<dyn ShardHolder>,
    pub index: usize,
}

/// One API's hold on a parameter.
#[derive(Clone)]
pub(crate) struct Managed {
    /// The FQN it was managed under (within the module the API was applied to).
    pub fqn: String,
    /// The global ranks of the API's group.
    pub ranks: Arc<[usize]>,
    /// How it shards the tensor (`None`: it does not, `replicate`).
    pub layer: Option<Layer>,
}

impl std::fmt::Debug for Managed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Managed")
            .field("fqn", &self.fqn)
            .field("ranks", &self.ranks)
            .field("sharded", &self.layer.is_some())
            .finish()
    }
}

/// One tensor an API enters: its identity, its FQN, and how the API shards it.
pub(crate) type Entry = (u64, String, Option<Layer>);

/// Identity → the APIs managing it.
type Table = HashMap<u64, Vec<(ManagingApi, Managed)>>;

static MANAGED: Mutex<Option<Table>> = Mutex::new(None);

fn table() -> MutexGuard<'static, Option<Table>> {
    MANAGED.lock().unwrap_or_else(PoisonError::into_inner)
}

/// `api`'s hold on the tensor of identity `id`, if it manages it.
pub(crate) fn managed_by(id: u64, api: ManagingApi) -> Option<Managed> {
    table()
        .as_ref()?
        .get(&id)?
        .iter()
        .find(|(a, _)| *a == api)
        .map(|(_, m)| m.clone())
}

/// The first of `apis` that manages the tensor of identity `id`, with its hold.
pub(crate) fn first_manager(id: u64, apis: &[ManagingApi]) -> Option<(ManagingApi, Managed)> {
    apis.iter()
        .find_map(|&api| managed_by(id, api).map(|m| (api, m)))
}

/// How the APIs shard the tensor of identity `id`, innermost (first applied) first.
pub(crate) fn layers_of(id: u64) -> Vec<Layer> {
    let t = table();
    let Some(held) = t.as_ref().and_then(|t| t.get(&id)) else {
        return Vec::new();
    };
    held.iter().filter_map(|(_, m)| m.layer.clone()).collect()
}

/// Whether any API manages any tensor in this process.
pub(crate) fn any() -> bool {
    table().as_ref().is_some_and(|t| !t.is_empty())
}

/// One call's entries; removed on drop.
#[derive(Debug)]
pub(crate) struct Registration {
    api: ManagingApi,
    ids: Vec<u64>,
}

/// Enters `entries` (identity, FQN, how it is sharded) as managed by `api` over the global
/// `ranks`.
pub(crate) fn register(api: ManagingApi, ranks: &[usize], entries: Vec<Entry>) -> Registration {
    let ranks: Arc<[usize]> = ranks.into();
    let mut t = table();
    let t = t.get_or_insert_with(HashMap::new);
    let ids = entries.iter().map(|(id, _, _)| *id).collect();
    for (id, fqn, layer) in entries {
        let ranks = Arc::clone(&ranks);
        t.entry(id)
            .or_default()
            .push((api, Managed { fqn, ranks, layer }));
    }
    Registration { api, ids }
}

impl Drop for Registration {
    fn drop(&mut self) {
        let mut t = table();
        let Some(t) = t.as_mut() else { return };
        for id in &self.ids {
            if let Some(v) = t.get_mut(id) {
                if let Some(i) = v.iter().position(|(a, _)| *a == self.api) {
                    v.remove(i);
                }
                if v.is_empty() {
                    t.remove(id);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_live_as_long_as_their_registration() {
        let (a, b) = (u64::MAX - 1, u64::MAX - 2);
        let tp = register(
            ManagingApi::ShardModule,
            &[0, 1],
            vec![(a, "fc1.weight".into(), None)],
        );
        let fsdp = register(
            ManagingApi::FullyShard,
            &[0, 2],
            vec![(a, "fc1.weight".into(), None), (b, "fc1.bias".into(), None)],
        );
        let (api, held) =
            first_manager(a, &[ManagingApi::Replicate, ManagingApi::FullyShard]).unwrap();
        assert_eq!(api, ManagingApi::FullyShard);
        assert_eq!(
            (held.fqn.as_str(), &*held.ranks),
            ("fc1.weight", &[0, 2][..])
        );
        let held = managed_by(a, ManagingApi::ShardModule).unwrap();
        assert_eq!(
            (held.fqn.as_str(), &*held.ranks),
            ("fc1.weight", &[0, 1][..])
        );
        drop(fsdp);
        assert!(managed_by(a, ManagingApi::FullyShard).is_none());
        assert!(managed_by(b, ManagingApi::FullyShard).is_none());
        assert!(managed_by(a, ManagingApi::ShardModule).is_some());
        drop(tp);
        assert!(managed_by(a, ManagingApi::ShardModule).is_none());
    }
}
