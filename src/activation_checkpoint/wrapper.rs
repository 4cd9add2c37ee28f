//! The checkpoint's forward wrapper: each hooked call of a checkpointed module with grad
//! enabled runs its forward through the engine's [`recomputed`] (without keeping its
//! activations), on the caller's module; the recomputation during backward runs on a
//! [`ShallowClone`] of it taken at the call, and is checked against the first run.

use std::any::Any;
use std::sync::{Arc, Mutex, PoisonError};

use tch::{Device, Kind, Tensor};
use tch_dist_core::hooks::{Forward, ForwardError, ForwardWrapper};
use tch_dist_core::{registry, InstanceAlias, InstanceHandles, ShallowClone, Shardable};
use tch_dist_runtime::{autograd_mark, grad_enabled, recomputed, Recomputation, UseGuard};

use super::{
    ActivationCheckpointError, ActivationCheckpointProblem, CheckpointOptions, DeterminismCheck,
};

/// A module's twin (its shallow clone), seen both ways the recomputation needs it.
pub(super) trait Twin: Send {
    /// As `Any`, for the call's [`Recompute`](tch_dist_core::hooks::Recompute).
    fn any(&self) -> &dyn Any;
    /// As a module, for the [`InstanceAlias`].
    fn module(&self) -> &dyn Shardable;
}

impl<M: Shardable + Send + 'static> Twin for M {
    fn any(&self) -> &dyn Any {
        self
    }
    fn module(&self) -> &dyn Shardable {
        self
    }
}

/// A twin of the module given as `Any`, if it is of the checkpointed type.
pub(super) type Snapshot = Box<dyn Fn(&dyn Any) -> Option<Box<dyn Twin>> + Send + Sync>;

/// The [`Snapshot`] of modules of type `M`.
pub(super) fn snapshot_of<M: Shardable + ShallowClone + Send + 'static>() -> Snapshot {
    Box::new(|m: &dyn Any| {
        let m = m.downcast_ref::<M>()?;
        Some(Box::new(m.shallow_clone()) as Box<dyn Twin>)
    })
}

/// One output's shape, dtype and device, as the determinism check compares them (`None`
/// for an undefined tensor, which has none of them: the shim refuses it as an output).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Meta(Option<(Vec<i64>, Kind, Device)>);

impl Meta {
    fn of(t: &Tensor) -> Meta {
        Meta(t.defined().then(|| (t.size(), t.kind(), t.device())))
    }
}

impl std::fmt::Display for Meta {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let Some((size, kind, device)) = &self.0 else {
            return write!(f, "an undefined tensor");
        };
        let device = match device {
            Device::Cpu => "cpu".to_string(),
            Device::Cuda(i) => format!("cuda:{i}"),
            other => format!("{other:?}"),
        };
        write!(f, "{size:?} {kind:?} {device}")
    }
}

/// How errors name the checkpointed module: its FQN from the outermost call it was seen
/// in, or its type (`Block`) until then, and when it is called at the top.
#[derive(Debug)]
pub(super) struct ModuleName {
    type_label: String,
    fqn: Mutex<Option<String>>,
}

impl ModuleName {
    pub fn new(type_label: String) -> Self {
        ModuleName {
            type_label,
            fqn: Mutex::new(None),
        }
    }

    /// The FQN when known.
    pub fn fqn(&self) -> Option<String> {
        self.fqn
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// The FQN when known, else the type.
    pub fn get(&self) -> String {
        self.fqn().unwrap_or_else(|| self.type_label.clone())
    }

    /// Learns the FQN of `module` from the call running now, if it is inside another.
    fn learn(&self, module: &dyn Shardable) {
        if let Some(fqn) = tch_dist_core::hooks::fqn_in_outermost_call(module)
            && !fqn.is_empty()
        {
            *self.fqn.lock().unwrap_or_else(PoisonError::into_inner) = Some(fqn);
        }
    }
}

pub(super) struct Wrapper {
    pub rank: usize,
    /// The module's name in errors (shared with the use guard's message).
    pub name: Arc<ModuleName>,
    /// `std::any::type_name` of the checkpointed type.
    pub type_name: &'static str,
    pub options: CheckpointOptions,
    pub snapshot: Snapshot,
}

impl Wrapper {
    fn failed(&self, e: ActivationCheckpointError) -> ForwardError {
        ForwardError::from_error(e)
    }

    /// The trainable parameters of `module` (each once), or the refusal of a submodule that
    /// fully_shard manages on its own.
    fn trainable(&self, module: &dyn Shardable) -> Result<Vec<Tensor>, ActivationCheckpointError> {
        for (fqn, child) in module.named_modules() {
            if !fqn.is_empty() && registry(child).contains(&"fully_shard") {
                return Err(ActivationCheckpointProblem::NestedFullyShard {
                    module: self.name.get(),
                    child: fqn,
                }
                .on(self.rank));
            }
        }
        let mut seen = std::collections::HashSet::new();
        Ok(module
            .parameters()
            .into_iter()
            .filter(|p| {
                p.requires_grad() && seen.insert(tch_dist_runtime::fsdp::tensor_identity(p))
            })
            .map(Tensor::shallow_clone)
            .collect())
    }
}

/// What a recomputation needs to name its block and check itself, owned (it runs in
/// backward, after the call that made it has ended).
struct Recheck {
    rank: usize,
    /// The block's name in errors.
    module: String,
    /// `std::any::type_name` of the checkpointed type.
    type_name: &'static str,
    options: CheckpointOptions,
}

impl Recheck {
    /// The recomputation's check against the first run's outputs.
    fn check(&self, first: &[Meta], again: &[Tensor]) -> Result<(), ActivationCheckpointError> {
        if first.len() != again.len() {
            return Err(ActivationCheckpointProblem::OutputCount {
                module: self.module.clone(),
                first: first.len(),
                again: again.len(),
            }
            .on(self.rank));
        }
        if self.options.determinism_check == DeterminismCheck::None {
            return Ok(());
        }
        for (i, (a, t)) in first.iter().zip(again).enumerate() {
            let b = Meta::of(t);
            if *a != b {
                return Err(ActivationCheckpointProblem::Nondeterministic {
                    module: self.module.clone(),
                    output: i,
                    first: a.to_string(),
                    again: b.to_string(),
                }
                .on(self.rank));
            }
        }
        Ok(())
    }
}

impl ForwardWrapper for Wrapper {
    fn run(
        &self,
        module: &dyn Shardable,
        forward: Forward<'_>,
    ) -> Result<Vec<Tensor>, ForwardError> {
        let inputs = forward.inputs();
        let this = forward.this();
        let (first, again) = forward.split();
        self.name.learn(module);
        let this_name = self.name.get();
        if !grad_enabled() {
            // Nothing is kept without grad: the forward runs as it is (as PyTorch's).
            return Ok(first(inputs));
        }
        let params = self.trainable(module).map_err(|e| self.failed(e))?;
        if params.is_empty() && !inputs.iter().any(Tensor::requires_grad) {
            return Ok(first(inputs));
        }
        let snapshot = (self.snapshot)(this).ok_or_else(|| {
            self.failed(
                ActivationCheckpointProblem::CalledAs {
                    module: this_name.clone(),
                    expected: self.type_name,
                    got: module.type_name(),
                }
                .on(self.rank),
            )
        })?;
        let first_meta: Arc<Mutex<Vec<Meta>>> = Arc::default();
        let kept = Arc::clone(&first_meta);
        let mut run_first = |xs: &[Tensor]| {
            let outs = first(xs);
            *kept.lock().unwrap_or_else(PoisonError::into_inner) =
                outs.iter().map(Meta::of).collect();
            outs
        };
        let recompute = self.recomputation(
            snapshot,
            InstanceHandles::of(module),
            again,
            first_meta,
            this_name.clone(),
        );
        let mark = autograd_mark();
        let buffers: Vec<Tensor> = module
            .named_buffers()
            .into_iter()
            .map(|(_, b)| b.shallow_clone())
            .collect();
        let outs = recomputed(
            inputs,
            &params,
            &buffers,
            self.options.preserve_rng_state,
            &mut run_first,
            recompute,
        )
        .map_err(|e| {
            self.failed(
                ActivationCheckpointProblem::Forward {
                    module: this_name.clone(),
                    message: e.to_string(),
                }
                .on(self.rank),
            )
        })?;
        // The function's node uses the module's parameters inside this hooked call: claimed
        // for every use guard (the module's own, and those of the APIs around it).
        for out in &outs {
            UseGuard::claim_any(self.rank, "checkpoint", out, mark)
                .map_err(|e| self.failed(e.into()))?;
        }
        Ok(outs)
    }
}

impl Wrapper {
    /// The recomputation of one call: `again` on the call's snapshot, checked.
    fn recomputation(
        &self,
        snapshot: Box<dyn Twin>,
        original: InstanceHandles,
        again: tch_dist_core::hooks::Recompute,
        first: Arc<Mutex<Vec<Meta>>>,
        name: String,
    ) -> Recomputation {
        let checker = Recheck {
            rank: self.rank,
            module: name,
            type_name: self.type_name,
            options: self.options,
        };
        Box::new(move |xs: &[Tensor]| {
            if checker.options.debug {
                let shapes: Vec<Vec<i64>> = xs.iter().map(Tensor::size).collect();
                eprintln!(
                    "rank {}: checkpoint: recomputing `{}` from inputs {shapes:?}",
                    checker.rank, checker.module
                );
            }
            // The twin's submodules are the block's own: their hooks run again.
            let alias = InstanceAlias::new(snapshot.module(), &original);
            let outs = again(snapshot.any(), xs);
            drop(alias);
            let outs = outs.ok_or_else(|| {
                ActivationCheckpointProblem::CalledAs {
                    module: checker.module.clone(),
                    expected: checker.type_name,
                    got: "another type",
                }
                .on(checker.rank)
                .to_string()
            })?;
            let first = first.lock().unwrap_or_else(PoisonError::into_inner);
            checker.check(&first, &outs).map_err(|e| e.to_string())?;
            Ok(outs)
        })
    }
}
