//! fully_shard's forward hooks: one call scope per managed module, which gathers the
//! parameters before the call and turns the shard fences' check on for it, and after it
//! claims the call's uses of them (the autograd bypass check), hooks the output for
//! backward, and frees them where `reshard_after_forward`; and the [`CallGuard`] that turns
//! a fence's refusal into [`Composition::HooksBypassed`] (an [`FsdpError::Composition`]) and
//! puts the groups of a forward that failed back on their shards.

use std::cell::RefCell;
use std::sync::{Arc, Mutex};

use tch::Tensor;
use tch_dist_core::hooks::{CallGuard, CallScope, ForwardError};
use tch_dist_core::path::join_fqn;
use tch_dist_core::Shardable;
use tch_dist_runtime::fsdp::FsdpGroup;
use tch_dist_runtime::{
    autograd_mark, check_enter, check_exit, take_fence_hit, DistError, FenceOwner, UseGuard,
};

use super::FsdpError;
use crate::{Api, Composition, OnRank};

/// The names a call's errors give: this rank, the managed module's FQN and its managed
/// parameters' FQNs within the module (the fence's and the group's order).
pub(super) struct CallNames {
    pub rank: usize,
    /// The module's FQN within the outermost call that encloses it (set by that call; `""`
    /// for that call's own module).
    pub prefix: Mutex<String>,
    pub params: Vec<String>,
}

impl CallNames {
    /// The module's FQN.
    pub fn module(&self) -> String {
        self.prefix
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The error of a use of parameter `index` outside the module's hooked calls.
    pub fn bypassed(&self, index: usize) -> FsdpError {
        let module = self.module();
        let param = self.params.get(index).map_or("", String::as_str);
        FsdpError::from(OnRank::new(
            self.rank,
            Composition::HooksBypassed {
                api: Api::FullyShard,
                param: join_fqn(&module, param),
                module,
            },
        ))
    }
}

impl FenceOwner for CallNames {
    fn refusal(&self, index: usize) -> String {
        self.bypassed(index).to_string()
    }
}

/// The scope of one managed module's calls.
pub(super) struct Scope {
    pub group: Arc<FsdpGroup>,
    pub names: Arc<CallNames>,
    /// Over the managed parameters that require a gradient (`None`: there are none).
    pub guard: Option<Arc<UseGuard>>,
    /// The guards of every nested call, checked over the output of each call of this
    /// module: a nested module run without its hooks fails the forward.
    pub nested: Vec<NestedGuard>,
}

/// A nested call's guard, with the names its errors give.
#[derive(Clone)]
pub(super) struct NestedGuard {
    pub guard: Arc<UseGuard>,
    pub names: Arc<CallNames>,
    /// The guard's parameters' positions among the call's.
    pub trainable: Vec<usize>,
}

thread_local! {
    /// The groups whose calls entered on this thread and did not exit yet, innermost last.
    static ENTERED: RefCell<Vec<Arc<FsdpGroup>>> = const { RefCell::new(Vec::new()) };
}

impl Scope {
    fn failed(&self, source: DistError) -> ForwardError {
        ForwardError::from_error(FsdpError::Hooked {
            rank: self.names.rank,
            module: self.names.module(),
            source,
        })
    }
}

impl CallScope for Scope {
    fn enter(&self, _module: &dyn Shardable, _inputs: &[Tensor]) -> Result<u64, ForwardError> {
        self.group.pre_forward().map_err(|e| self.failed(e))?;
        ENTERED.with(|e| e.borrow_mut().push(Arc::clone(&self.group)));
        // From here to `exit`, an op using a managed parameter that holds its shard (a
        // nested module run without its hooks) is refused, in every grad mode.
        check_enter();
        Ok(autograd_mark())
    }

    /// Over every output of the call (a block returning a tuple has each hooked for
    /// backward and checked for bypassed nested calls).
    fn exit(
        &self,
        _module: &dyn Shardable,
        outputs: &[Tensor],
        mark: u64,
    ) -> Result<(), ForwardError> {
        check_exit();
        let unfinished = ENTERED.with(|e| {
            let mut e = e.borrow_mut();
            match e.iter().rposition(|g| Arc::ptr_eq(g, &self.group)) {
                Some(pos) => e.split_off(pos).split_off(1),
                None => Vec::new(),
            }
        });
        reshard_unfinished(&unfinished);
        if let Some(guard) = &self.guard {
            for output in outputs {
                guard.claim(output, mark).map_err(|e| self.failed(e))?;
            }
        }
        if !self.nested.is_empty() {
            let guards: Vec<&UseGuard> = self.nested.iter().map(|n| &*n.guard).collect();
            for output in outputs {
                let found =
                    UseGuard::first_unclaimed(&guards, output, mark).map_err(|e| self.failed(e))?;
                if let Some((i, j)) = found {
                    // Gathered parameters go back to their shards before the error returns.
                    let detached: Vec<Tensor> = outputs.iter().map(Tensor::detach).collect();
                    let _ = self
                        .group
                        .post_forward_outputs(&detached.iter().collect::<Vec<_>>());
                    let nested = &self.nested[i];
                    return Err(ForwardError::from_error(
                        nested.names.bypassed(nested.trainable[j]),
                    ));
                }
            }
        }
        let outputs: Vec<&Tensor> = outputs.iter().collect();
        self.group
            .post_forward_outputs(&outputs)
            .map_err(|e| self.failed(e))
    }
}

/// fully_shard's [`CallGuard`]: a fence's refusal (an op inside a bypassed managed module)
/// becomes [`Composition::HooksBypassed`], the error of the hooked call around it; a forward
/// that failed or unwound puts the groups it gathered back on their shards (their `exit`,
/// which would have, never ran).
pub(super) struct Guard;

/// The one [`Guard`], registered by the first `fully_shard`.
pub(super) static GUARD: Guard = Guard;

impl CallGuard for Guard {
    fn refusal(&self) -> Option<ForwardError> {
        let (names, index) = take_fence_hit::<CallNames>()?;
        Some(ForwardError::from_error(names.bypassed(index)))
    }

    fn outermost_call_ended(&self) {
        let entered = ENTERED.with(|e| std::mem::take(&mut *e.borrow_mut()));
        reshard_unfinished(&entered);
    }
}

/// Puts the groups of calls that never reached their `exit` (their forward failed or
/// unwound) back on their shards, innermost first. The forward's own error is what the
/// caller got; a reshard failing here shows again at the group's next use.
fn reshard_unfinished(groups: &[Arc<FsdpGroup>]) {
    for group in groups.iter().rev() {
        let _ = group.reshard();
    }
}
