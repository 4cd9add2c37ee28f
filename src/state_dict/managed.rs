//! The one registry of managed parameters: which API manages which tensor object, by the
//! tensor's identity (its `TensorImpl`, which `set_data` keeps: a parameter stays the same
//! key whether it holds its shard or its whole value), with the FQN it was managed under and
//! the global ranks of the group it is spread or averaged over. It is also how a call on a
//! submodule learns that an enclosing module's `shard_module` call split one of its
//! parameters, and over which ranks.
//!
//! `replicate`, `fully_shard` and `shard_module` enter their parameters once a call
//! succeeded and remove them when the call's state is dropped ([`Registration`]); each
//! consults it before changing anything: a parameter is replicated once, fully-sharded once,
//! and `shard_module` refuses one another API already manages (PyTorch applies tensor
//! parallelism first, then FSDP). The APIs' states hold the tensors, so no other tensor can
//! take an identity while its entry exists.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

/// An API that manages parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ManagingApi {
    /// `replicate` (DDP).
    Replicate,
    /// `fully_shard` (FSDP2).
    FullyShard,
    /// `shard_module` / `parallelize_module` (tensor parallelism).
    ShardModule,
}

impl ManagingApi {
    /// PyTorch's name of the API.
    pub fn name(self) -> &'static str {
        match self {
            ManagingApi::Replicate => "replicate",
            ManagingApi::FullyShard => "fully_shard",
            ManagingApi::ShardModule => "shard_module",
        }
    }
}

/// One API's hold on a parameter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Managed {
    /// The FQN it was managed under (within the module the API was applied to).
    pub fqn: String,
    /// The global ranks of the API's group.
    pub ranks: Arc<[usize]>,
}

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

/// Enters `entries` (identity, FQN) as managed by `api` over the global `ranks`.
pub(crate) fn register(
    api: ManagingApi,
    ranks: &[usize],
    entries: Vec<(u64, String)>,
) -> Registration {
    let ranks: Arc<[usize]> = ranks.into();
    let mut t = table();
    let t = t.get_or_insert_with(HashMap::new);
    let ids = entries.iter().map(|(id, _)| *id).collect();
    for (id, fqn) in entries {
        let ranks = Arc::clone(&ranks);
        t.entry(id).or_default().push((api, Managed { fqn, ranks }));
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
            vec![(a, "fc1.weight".into())],
        );
        let fsdp = register(
            ManagingApi::FullyShard,
            &[0, 2],
            vec![(a, "fc1.weight".into()), (b, "fc1.bias".into())],
        );
        assert_eq!(
            first_manager(a, &[ManagingApi::Replicate, ManagingApi::FullyShard]),
            Some((
                ManagingApi::FullyShard,
                Managed {
                    fqn: "fc1.weight".into(),
                    ranks: [0, 2].into()
                }
            ))
        );
        let held = managed_by(a, ManagingApi::ShardModule).unwrap();
        assert_eq!(
            (held.fqn.as_str(), &*held.ranks),
            ("fc1.weight", &[0, 1][..])
        );
        drop(fsdp);
        assert_eq!(managed_by(a, ManagingApi::FullyShard), None);
        assert_eq!(managed_by(b, ManagingApi::FullyShard), None);
        assert!(managed_by(a, ManagingApi::ShardModule).is_some());
        drop(tp);
        assert_eq!(managed_by(a, ManagingApi::ShardModule), None);
    }
}
