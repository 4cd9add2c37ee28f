//! The instance table: one entry per keyed module instance holding what composable APIs
//! attached to it (the applied APIs in order, each API's typed state) and its forward hooks.
//!
//! One `Mutex<HashMap<ModuleKey, Entry>>` for everything, so that moving an instance to a new
//! key ([`InstanceTable::rekey`]) moves its registry, states and hooks together. A `Mutex` rather
//! than an `RwLock` because entries pin a `tch::Tensor`, which is `Send` but not `Sync`;
//! the lock is only held to read or update entries, never while user code (an API body, a
//! hook) runs.

use std::any::Any;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock, Mutex, MutexGuard, PoisonError};

use tch::Tensor;

use crate::hooks::wrap::StoredWrapper;
use crate::hooks::ForwardError;
use crate::key::ModuleKey;
use crate::walk::Shardable;

/// A stored forward pre-hook, over every input of a call (one-tensor and infallible hooks are
/// stored as hooks of this form).
pub(crate) type PreHook = Arc<
    dyn Fn(&dyn Shardable, &[Tensor]) -> Result<Option<Vec<Tensor>>, ForwardError> + Send + Sync,
>;
/// A stored forward (post-)hook, over every input and every output of a call.
pub(crate) type PostHook = Arc<
    dyn Fn(&dyn Shardable, &[Tensor], &[Tensor]) -> Result<Option<Vec<Tensor>>, ForwardError>
        + Send
        + Sync,
>;

pub(crate) struct Entry {
    /// A shallow clone of the module's first tensor: keeps its storage alive, so that a
    /// later module reusing the same handle addresses can be told apart.
    pin: Tensor,
    /// Names of the composable APIs applied to the instance, in order.
    pub applied: Vec<&'static str>,
    /// Each applied API's state.
    pub states: Vec<(&'static str, Arc<dyn Any + Send + Sync>)>,
    pub pre_hooks: Vec<(u64, PreHook)>,
    pub post_hooks: Vec<(u64, PostHook)>,
    /// The forward wrapper, with its hook id (at most one).
    pub wrapper: Option<(u64, StoredWrapper)>,
}

impl Entry {
    fn new(first: &Tensor) -> Self {
        Entry {
            pin: first.shallow_clone(),
            applied: Vec::new(),
            states: Vec::new(),
            pre_hooks: Vec::new(),
            post_hooks: Vec::new(),
            wrapper: None,
        }
    }

    fn num_hooks(&self) -> usize {
        self.pre_hooks.len() + self.post_hooks.len() + usize::from(self.wrapper.is_some())
    }

    fn is_empty(&self) -> bool {
        self.applied.is_empty() && self.states.is_empty() && self.num_hooks() == 0
    }

    /// Whether `first` is the tensor this entry was created for (same storage, offset,
    /// sizes and strides; the pin keeps the storage alive, so a new tensor cannot match).
    fn is_live_for(&self, first: &Tensor) -> bool {
        self.pin.f_is_set_to(first).unwrap_or(false)
    }
}

static STORE: LazyLock<Mutex<HashMap<ModuleKey, Entry>>> = LazyLock::new(Default::default);

/// How many hooks are registered, all modules together: `call` skips the store when zero.
static NUM_HOOKS: AtomicUsize = AtomicUsize::new(0);

pub(crate) fn any_hooks() -> bool {
    NUM_HOOKS.load(Ordering::Acquire) > 0
}

pub(crate) struct InstanceTable {
    map: MutexGuard<'static, HashMap<ModuleKey, Entry>>,
}

impl InstanceTable {
    pub(crate) fn lock() -> InstanceTable {
        InstanceTable {
            map: STORE.lock().unwrap_or_else(PoisonError::into_inner),
        }
    }

    fn evict(&mut self, key: &ModuleKey) {
        if let Some(e) = self.map.remove(key) {
            NUM_HOOKS.fetch_sub(e.num_hooks(), Ordering::AcqRel);
        }
    }

    /// The live entry of the instance `(key, first)`; a stale entry (left by a dropped
    /// module whose handle addresses were reused) is dropped.
    pub(crate) fn get(&mut self, key: &ModuleKey, first: &Tensor) -> Option<&mut Entry> {
        let live = self.map.get(key)?.is_live_for(first);
        if !live {
            self.evict(key);
            return None;
        }
        self.map.get_mut(key)
    }

    pub(crate) fn get_or_insert(&mut self, key: &ModuleKey, first: &Tensor) -> &mut Entry {
        if self.get(key, first).is_none() {
            self.map.insert(key.clone(), Entry::new(first));
        }
        self.map
            .entry(key.clone())
            .or_insert_with(|| Entry::new(first))
    }

    /// Drops the entry of `key` if nothing is left in it (releases the pin).
    pub(crate) fn remove_if_empty(&mut self, key: &ModuleKey) {
        if self.map.get(key).is_some_and(Entry::is_empty) {
            self.map.remove(key);
        }
    }

    /// Drops everything attached to the instance `(key, first)`.
    pub(crate) fn release(&mut self, key: &ModuleKey, first: &Tensor) -> bool {
        if self.get(key, first).is_some() {
            self.evict(key);
            true
        } else {
            false
        }
    }

    /// Moves the entry of `old` (if any) to `new`, re-pinning it on `new_first`.
    pub(crate) fn rekey(&mut self, old: &ModuleKey, new: &ModuleKey, new_first: &Tensor) {
        if old == new {
            return;
        }
        if let Some(mut e) = self.map.remove(old) {
            e.pin = new_first.shallow_clone();
            if let Some(prev) = self.map.insert(new.clone(), e) {
                NUM_HOOKS.fetch_sub(prev.num_hooks(), Ordering::AcqRel);
            }
        }
    }

    pub(crate) fn add_pre_hook(&mut self, key: &ModuleKey, first: &Tensor, id: u64, h: PreHook) {
        self.get_or_insert(key, first).pre_hooks.push((id, h));
        NUM_HOOKS.fetch_add(1, Ordering::AcqRel);
    }

    pub(crate) fn add_post_hook(&mut self, key: &ModuleKey, first: &Tensor, id: u64, h: PostHook) {
        self.get_or_insert(key, first).post_hooks.push((id, h));
        NUM_HOOKS.fetch_add(1, Ordering::AcqRel);
    }

    /// Makes `w` the wrapper of the instance; `false` if it has one already.
    pub(crate) fn set_wrapper(
        &mut self,
        key: &ModuleKey,
        first: &Tensor,
        id: u64,
        w: StoredWrapper,
    ) -> bool {
        let entry = self.get_or_insert(key, first);
        if entry.wrapper.is_some() {
            return false;
        }
        entry.wrapper = Some((id, w));
        NUM_HOOKS.fetch_add(1, Ordering::AcqRel);
        true
    }

    /// Removes hook `id`, looking first under `hint` (where it was registered), then
    /// everywhere (its module may have been re-keyed since).
    pub(crate) fn remove_hook(&mut self, hint: &ModuleKey, id: u64) -> bool {
        fn take(e: &mut Entry, id: u64) -> bool {
            let before = e.num_hooks();
            e.pre_hooks.retain(|(i, _)| *i != id);
            e.post_hooks.retain(|(i, _)| *i != id);
            if e.wrapper.as_ref().is_some_and(|(i, _)| *i == id) {
                e.wrapper = None;
            }
            e.num_hooks() != before
        }
        let mut found_at = None;
        if let Some(e) = self.map.get_mut(hint)
            && take(e, id)
        {
            found_at = Some(hint.clone());
        }
        if found_at.is_none() {
            for (k, e) in self.map.iter_mut() {
                if take(e, id) {
                    found_at = Some(k.clone());
                    break;
                }
            }
        }
        match found_at {
            Some(k) => {
                NUM_HOOKS.fetch_sub(1, Ordering::AcqRel);
                self.remove_if_empty(&k);
                true
            }
            None => false,
        }
    }
}
