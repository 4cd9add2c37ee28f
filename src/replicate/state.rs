//! [`ReplicateState`]: what replicate keeps per model (the reducer, the managed
//! tensors, the forward-side work), and [`set_up`], the one implementation behind both
//! forms: every check, the start-up broadcast, the reducer.

use tch::{Device, Tensor};
use tch_dist_core::hooks::RemovableHandle;
use tch_dist_runtime::{
    DistError, ProcessGroup, Reducer, ReducerOptions, ReducerStats, BROADCAST_BUCKET_BYTES,
};

use super::collect::Found;
use super::{DeviceId, Options, ReplicateError, ReplicateProblem};
use crate::state_dict::managed::{managed_by, register, ManagingApi, Registration};
use tch_dist_runtime::fsdp::tensor_identity;

/// What replicate keeps per model: see [`state`](crate::replicate::state) (the derive form) and
/// [`Replicated::state`](crate::replicate::Replicated::state) (the wrapper form).
pub struct ReplicateState {
    pub(super) reducer: Reducer,
    pub(super) param_fqns: Vec<String>,
    pub(super) buffer_fqns: Vec<String>,
    /// Handles on the managed buffers (behind a mutex: tch tensors are Send, not Sync).
    pub(super) buffers: std::sync::Mutex<Vec<Tensor>>,
    /// Whether each forward broadcasts rank 0's buffers first.
    pub(super) broadcast_buffers: bool,
    /// Where inputs are moved before the forward (a CUDA `device_id`).
    pub(super) input_device: Option<Device>,
    /// The derive form's forward pre-hook; `None` for a wrapper, whose `forward` does its
    /// work.
    pub(super) pre_hook: Option<RemovableHandle>,
    /// This state's parameters in the registry of managed parameters, across both forms:
    /// a parameter is replicated once (the reducer holds the tensors, so no other tensor
    /// can take one of their identities while they are there).
    pub(super) _registration: Registration,
}

impl std::fmt::Debug for ReplicateState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplicateState")
            .field("param_fqns", &self.param_fqns)
            .field("buffer_fqns", &self.buffer_fqns)
            .finish()
    }
}

impl ReplicateState {
    /// FQNs of the parameters whose gradients replicate averages, in registration order
    /// (walk order for [`apply`](crate::replicate::apply); for [`wrap`](crate::replicate::wrap), the `VarStore`'s creation order with each
    /// layer's `weight` before its `bias`, the same order for the same model).
    ///
    /// ```no_run
    /// # use tch::nn;
    /// # use tch_dist::replicate;
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # tch_dist::init_process_group(tch_dist::Backend::Gloo)?;
    /// let vs = nn::VarStore::new(tch::Device::Cpu);
    /// let net = nn::seq().add(nn::linear(vs.root() / "fc", 4, 2, Default::default()));
    /// let model = replicate::wrap(net, &vs, replicate::Options::default())?;
    /// assert_eq!(model.state().param_fqns(), ["fc.weight", "fc.bias"]);
    /// # Ok(()) }
    /// ```
    pub fn param_fqns(&self) -> &[String] {
        &self.param_fqns
    }

    /// FQNs of the buffers replicate broadcasts from rank 0 (at start-up, and before each
    /// forward with `broadcast_buffers`), in walk order for [`apply`](crate::replicate::apply), sorted for [`wrap`](crate::replicate::wrap).
    ///
    /// ```no_run
    /// # use tch::nn;
    /// # use tch_dist::replicate;
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # tch_dist::init_process_group(tch_dist::Backend::Gloo)?;
    /// let vs = nn::VarStore::new(tch::Device::Cpu);
    /// let net = nn::seq_t().add(nn::batch_norm1d(vs.root() / "bn", 4, Default::default()));
    /// let model = replicate::wrap_t(net, &vs, replicate::Options::default())?;
    /// assert_eq!(model.state().buffer_fqns(), ["bn.running_mean", "bn.running_var"]);
    /// # Ok(()) }
    /// ```
    pub fn buffer_fqns(&self) -> &[String] {
        &self.buffer_fqns
    }

    /// The bucket layout: FQNs per bucket, in launch order.
    ///
    /// ```no_run
    /// # use tch_dist::{replicate, Shardable};
    /// # fn demo<M: Shardable>(model: &M) {
    /// for bucket in replicate::state(model).unwrap().buckets() {
    ///     println!("{}", bucket.join(", "));
    /// }
    /// # }
    /// ```
    pub fn buckets(&self) -> Vec<Vec<String>> {
        self.reducer.bucket_fqns()
    }

    /// Figures of the last synchronised step (buckets, bytes, communication and overlap).
    ///
    /// ```no_run
    /// # use tch_dist::{replicate, Shardable};
    /// # fn demo<M: Shardable>(model: &M) {
    /// println!("{:?}", replicate::state(model).unwrap().stats());
    /// # }
    /// ```
    pub fn stats(&self) -> ReducerStats {
        self.reducer.stats()
    }

    /// Whether the backward passes from now on average the gradients (the default) or
    /// accumulate them locally in `.grad` until a synchronised one (PyTorch 2.11's
    /// composable `replicate`'s `set_requires_gradient_sync`; [`no_sync`](crate::replicate::no_sync)
    /// as a setting). Read when each backward begins, so a pipeline stage sets it before
    /// each microbatch's backward: off for all but the last
    /// ([`PipelineStage::on_backward`](crate::pipelining::PipelineStage::on_backward)), so
    /// that the gradients are averaged once per step.
    ///
    /// ```no_run
    /// # use tch_dist::{replicate, Shardable};
    /// # fn demo<M: Shardable>(model: &M) {
    /// let state = replicate::state(model).unwrap();
    /// state.set_requires_gradient_sync(false); // accumulate locally
    /// // ... backward passes ...
    /// state.set_requires_gradient_sync(true); // the next backward averages the sum
    /// # }
    /// ```
    pub fn set_requires_gradient_sync(&self, requires_gradient_sync: bool) {
        self.reducer.set_require_sync(requires_gradient_sync);
    }

    /// The group gradients are averaged over.
    ///
    /// ```no_run
    /// # use tch_dist::{replicate, Shardable};
    /// # fn demo<M: Shardable>(model: &M) {
    /// let world = replicate::state(model).unwrap().group().world_size();
    /// # }
    /// ```
    pub fn group(&self) -> &ProcessGroup {
        self.reducer.group()
    }

    /// Removes replicate's forward hook (gradient hooks go when the state is dropped).
    /// Returns whether it was still registered; always false for a wrapper, which has no
    /// hook (its `forward` does the work).
    ///
    /// ```no_run
    /// # use tch_dist::{replicate, Shardable};
    /// # fn demo<M: Shardable>(model: &M) {
    /// assert!(replicate::state(model).unwrap().remove_forward_hook());
    /// # }
    /// ```
    pub fn remove_forward_hook(&self) -> bool {
        self.pre_hook.as_ref().is_some_and(RemovableHandle::remove)
    }

    /// replicate's work before a forward, shared by the derive form's pre-hook and the
    /// wrapper's `forward`: the previous iteration's unfinished-reduction check, the buffer
    /// broadcast, and the input's move to `device_id` (`Some` when it moved).
    /// Over every input of the call (`Some`: the inputs moved to `input_device`).
    pub(super) fn pre_forward(&self, xs: &[Tensor]) -> Result<Option<Vec<Tensor>>, DistError> {
        self.reducer.prepare_for_forward()?;
        if self.broadcast_buffers {
            // The buffers' sizes are not the backward's: the step check comes first.
            self.reducer.check_forward_step()?;
            let buffers = self.buffers.lock().unwrap_or_else(|e| e.into_inner());
            let buffers: Vec<&Tensor> = buffers.iter().collect();
            self.reducer
                .group()
                .broadcast_coalesced(&buffers, 0, BROADCAST_BUCKET_BYTES)?;
        }
        Ok(move_inputs(self.input_device, xs))
    }

    /// Runs `f` with gradient synchronisation off, then restores it (also on a panic).
    pub(super) fn without_sync<R>(&self, f: impl FnOnce() -> R) -> R {
        struct Restore<'a>(&'a Reducer, bool);
        impl Drop for Restore<'_> {
            fn drop(&mut self) {
                self.0.set_require_sync(self.1);
            }
        }
        let _restore = Restore(&self.reducer, self.reducer.require_sync());
        self.reducer.set_require_sync(false);
        f()
    }
}

/// Every input of `xs` moved to `device`, when one is on another device.
pub(super) fn move_inputs(device: Option<Device>, xs: &[Tensor]) -> Option<Vec<Tensor>> {
    device
        .filter(|d| xs.iter().any(|x| x.device() != *d))
        .map(|d| xs.iter().map(|x| x.to_device(d)).collect())
}

/// `device_id`'s default: a module on CUDA uses its group's bound device (the device
/// `init_process_group` bound from LOCAL_RANK or its `device_id`), as PyTorch users pass
/// `device_ids=[local_rank]`; a CPU module (or a group without a device) has none.
fn default_device(group: &ProcessGroup, params: &[(String, Tensor)]) -> Option<Device> {
    group
        .bound_device()
        .filter(|_| params.iter().any(|(_, t)| t.device().is_cuda()))
}

/// The one implementation behind both forms, from the tensors a form found: every check
/// (on every rank together, before anything is sent or changed), the start-up broadcast of
/// rank 0's parameters and buffers (unless `init_sync` is off), and the [`Reducer`]. The
/// derive form adds its forward pre-hook; the wrapper calls
/// [`ReplicateState::pre_forward`] from its `forward`.
pub(super) fn set_up(
    group: ProcessGroup,
    found: Found,
    opts: &Options,
) -> Result<ReplicateState, ReplicateError> {
    let Found {
        params,
        buffers,
        problem,
    } = found;
    // Every option is checked before anything is sent or changed.
    let reducer_opts = ReducerOptions {
        bucket_cap_mb: opts.bucket_cap_mb,
        bucket_cap_mb_list: opts.bucket_cap_mb_list.clone(),
        find_unused_parameters: opts.find_unused_parameters,
        skip_all_reduce_unused_params: opts.skip_all_reduce_unused_params,
        gradient_as_bucket_view: opts.gradient_as_bucket_view,
        static_graph: opts.static_graph,
        comm_hook: opts.comm_hook,
        in_place_min_bytes: opts.in_place_min_bytes,
        ..ReducerOptions::default()
    };
    let device = opts
        .device_id
        .map(DeviceId::device)
        .or_else(|| default_device(&group, &params));
    // Checks each rank makes on its own, shared so that every rank fails together before
    // anything is sent or changed.
    let rank = group.rank();
    let identities: Vec<(u64, String)> = params
        .iter()
        .map(|(fqn, t)| (tensor_identity(t), fqn.clone()))
        .collect();
    let taken = identities
        .iter()
        .find(|(id, _)| managed_by(*id, ManagingApi::Replicate).is_some())
        .map(|(_, fqn)| fqn.clone());
    let misplaced = device
        .filter(|d| d.is_cuda())
        .and_then(|d| params.iter().find(|(_, t)| t.device() != d).map(|p| (d, p)));
    let problem = problem.or(taken.map(|fqn| ReplicateProblem::AlreadyReplicated { fqn }.on(rank)));
    let local = match (reducer_opts.validate(), problem, misplaced) {
        (Err(problem), _, _) => Err(ReplicateError::from(DistError::InvalidArgument {
            rank,
            op: "replicate",
            problem: Box::new(problem),
        })),
        (Ok(()), Some(problem), _) => Err(problem),
        (Ok(()), None, Some((device_id, (fqn, t)))) => Err(ReplicateProblem::DeviceMismatch {
            device_id,
            fqn: fqn.clone(),
            device: t.device(),
        }
        .on(rank)),
        (Ok(()), None, None) if params.is_empty() => {
            Err(ReplicateProblem::NothingToReplicate.on(rank))
        }
        (Ok(()), None, None) => Ok(()),
    };
    group.agree("replicate", local)?;
    // The same options on every rank, or ranks would bucket, wait and reduce differently
    // (mismatched collectives abort Gloo or hang until the timeout).
    let options = [
        ("bucket_cap_mb", opts.bucket_cap_mb.to_string()),
        (
            "bucket_cap_mb_list",
            format!("{:?}", opts.bucket_cap_mb_list),
        ),
        ("init_sync", opts.init_sync.to_string()),
        (
            "skip_all_reduce_unused_params",
            opts.skip_all_reduce_unused_params.to_string(),
        ),
        (
            "find_unused_parameters",
            opts.find_unused_parameters.to_string(),
        ),
        ("static_graph", opts.static_graph.to_string()),
        (
            "gradient_as_bucket_view",
            opts.gradient_as_bucket_view.to_string(),
        ),
        ("broadcast_buffers", opts.broadcast_buffers.to_string()),
        ("comm_hook", format!("{:?}", opts.comm_hook)),
        ("in_place_min_bytes", opts.in_place_min_bytes.to_string()),
        ("ignored_params", format!("{:?}", opts.ignored_params)),
    ];
    let options: Vec<(String, String)> = options
        .into_iter()
        .map(|(name, value)| (name.to_string(), value))
        .collect();
    group.verify_same_options("replicate", &options)?;
    let named: Vec<(&str, &Tensor)> = params.iter().map(|(n, t)| (n.as_str(), t)).collect();
    group.verify_same_tensors("replicate", "parameters", 0, &named)?;
    // The buffers are broadcast as one coalesced list: the same names, shapes and dtypes on
    // every rank, or the broadcast would fail without a name (or mix values up).
    let named: Vec<(&str, &Tensor)> = buffers.iter().map(|(n, t)| (n.as_str(), t)).collect();
    group.verify_same_tensors("replicate", "buffers", 0, &named)?;
    if opts.init_sync {
        let states: Vec<&Tensor> = params
            .iter()
            .chain(buffers.iter())
            .map(|(_, t)| t)
            .collect();
        group.broadcast_coalesced(&states, 0, BROADCAST_BUCKET_BYTES)?;
    }

    let param_fqns: Vec<String> = params.iter().map(|(n, _)| n.clone()).collect();
    let buffer_fqns: Vec<String> = buffers.iter().map(|(n, _)| n.clone()).collect();
    let reducer = Reducer::new(params, group.clone(), reducer_opts)?;
    // Registered only once nothing can fail any more; the check above ran on every rank.
    // Replicated, not sharded: no layer in the placement record.
    let entries = identities
        .into_iter()
        .map(|(id, fqn)| (id, fqn, None))
        .collect();
    let registration = register(ManagingApi::Replicate, group.global_ranks(), entries);
    let broadcast_buffers =
        opts.broadcast_buffers && !group.skips_communication() && !buffers.is_empty();
    Ok(ReplicateState {
        reducer,
        param_fqns,
        buffer_fqns,
        buffers: std::sync::Mutex::new(buffers.into_iter().map(|(_, t)| t).collect()),
        broadcast_buffers,
        input_device: device.filter(|d| d.is_cuda()),
        pre_hook: None,
        _registration: registration,
    })
}
