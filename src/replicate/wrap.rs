//! replicate's wrapper form, PyTorch's `DistributedDataParallel(module)`: any
//! [`Module`]/[`ModuleT`] (`nn::seq()`, `nn::seq_t()`, `nn::func`, a function returning
//! `impl Module`) together with the [`VarStore`] that owns its variables. It shares
//! [`set_up`](super::set_up) and [`ReplicateState`] with the derive form ([`apply`](super::apply)):
//! the same checks, the same start-up broadcast, the same reducer and the same forward-side
//! work, run by the wrapper's `forward` instead of a forward pre-hook.

use std::collections::HashMap;

use tch::nn::{Module, ModuleT, VarStore};
use tch::Tensor;
use tch_dist_core::hooks::{catch_forward_errors, raise_forward_error, ForwardError};

use super::{
    group_of, is_ignored, set_up, unknown_ignored, Found, Options, ReplicateError,
    ReplicateProblem, ReplicateState,
};

/// What replicate manages in `vs`: parameters are its trainable variables that require a
/// gradient, in creation order (as PyTorch registers parameters; a layer's weight before its
/// bias, see [`weight_before_bias`]), under their store names; buffers are its other variables, sorted by
/// name (the same order on every rank). Trainable variables that are frozen are neither, as
/// frozen parameters are left alone by the derive form.
fn found_in(vs: &VarStore, opts: &Options, rank: usize) -> Found {
    let mut named: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    let seen: Vec<String> = named.iter().map(|(n, _)| n.clone()).collect();
    // `variables()` and `trainable_variables()` hand out shallow clones (new handles on the
    // same tensors): match them by storage, offset, sizes and strides (`is_set_to`),
    // looking among the variables with the same data pointer only.
    let mut by_ptr: HashMap<usize, Vec<usize>> = HashMap::new();
    for (i, (_, t)) in named.iter().enumerate() {
        by_ptr.entry(t.data_ptr() as usize).or_default().push(i);
    }
    let mut trainable = vec![false; named.len()];
    let mut created: Vec<(String, Tensor)> = Vec::new();
    for t in vs.trainable_variables() {
        let candidates = by_ptr.get(&(t.data_ptr() as usize));
        let index = candidates.and_then(|c| {
            c.iter()
                .copied()
                .find(|&i| !trainable[i] && named[i].1.is_set_to(&t))
        });
        // Every trainable variable is also a named one (`Path::add` inserts both).
        let Some(i) = index else { continue };
        trainable[i] = true;
        created.push((named[i].0.clone(), t));
    }
    weight_before_bias(&mut created);
    let params = created
        .into_iter()
        .filter(|(name, t)| t.requires_grad() && !is_ignored(name, &opts.ignored_params))
        .collect();
    let buffers = named
        .into_iter()
        .zip(trainable)
        .filter(|((name, _), trainable)| !trainable && !is_ignored(name, &opts.ignored_params))
        .map(|(nt, _)| nt)
        .collect();
    let problem = if opts.ignored_modules.is_empty() {
        unknown_ignored(&opts.ignored_params, &seen)
            .map(|name| ReplicateProblem::UnknownIgnoredParam { name: name.clone() }.on(rank))
    } else {
        Some(
            ReplicateProblem::IgnoredModulesInWrap {
                modules: opts.ignored_modules.iter().map(|k| k.type_name()).collect(),
            }
            .on(rank),
        )
    };
    Found {
        params,
        buffers,
        problem,
    }
}

/// PyTorch registers a layer's `weight` before its `bias`; tch's `nn::linear` and
/// `nn::conv*` create the bias first. A `P.bias` created just before `P.weight` is put after
/// it, so that the wrapper lists a store's parameters as the derive form (and PyTorch) lists
/// the same model's.
fn weight_before_bias(vars: &mut [(String, Tensor)]) {
    let module = |name: &str, leaf: &str| {
        name.strip_suffix(leaf)
            .filter(|p| p.is_empty() || p.ends_with('.'))
            .map(str::to_owned)
    };
    let mut i = 0;
    while i + 1 < vars.len() {
        let bias = module(&vars[i].0, "bias");
        if bias.is_some() && bias == module(&vars[i + 1].0, "weight") {
            vars.swap(i, i + 1);
            i += 2;
        } else {
            i += 1;
        }
    }
}

fn state_for(vs: &VarStore, opts: Options) -> Result<ReplicateState, ReplicateError> {
    let group = group_of(&opts)?;
    let found = found_in(vs, &opts, group.rank());
    set_up(group, found, &opts)
}

/// Replicates `module`, an [`nn::Module`](Module) built from `vs`: PyTorch's
/// `DistributedDataParallel(module)`, for models that are not `#[derive(Shardable)]`
/// structs (`nn::seq()`, `nn::func`, any `impl Module`).
///
/// Parameters are the trainable variables of `vs` that require a gradient, under their store
/// names (PyTorch's FQNs when the model was built with `vs.root() / "name"`), in creation
/// order (a layer's `weight` before its `bias`, as PyTorch registers them); buffers are its other variables. Everything else is [`apply`](super::apply)'s, by
/// the same code: every option (except `ignored_modules`, which needs a walk: name variables
/// in `ignored_params` instead), the checks across ranks (a variable that differs is named),
/// the broadcast of rank 0's parameters and buffers, and the reducer. The returned wrapper
/// owns `module`; its `forward` does what the derive form's forward hook does, then the
/// module's. `vs` must be the store the module was built from: variables of `vs` the module
/// does not use are unused parameters (see `find_unused_parameters`).
///
/// ```no_run
/// use tch::nn;
/// use tch_dist::{optim, replicate};
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// tch_dist::init_process_group(tch_dist::Backend::Gloo)?;
/// let vs = nn::VarStore::new(tch::Device::Cpu);
/// let net = nn::seq()
///     .add(nn::linear(vs.root() / "fc1", 4, 8, Default::default()))
///     .add_fn(|xs| xs.relu())
///     .add(nn::linear(vs.root() / "fc2", 8, 2, Default::default()));
/// let model = replicate::wrap(net, &vs, replicate::Options::default())?;
/// let mut opt = optim::Sgd::default().build(&vs, 0.1)?;
/// let x = tch::Tensor::randn([16, 4], tch::kind::FLOAT_CPU);
/// let y = tch::Tensor::zeros([16], tch::kind::INT64_CPU);
/// opt.backward_step(&model.f_forward(&x)?.cross_entropy_for_logits(&y))?;
/// # Ok(()) }
/// ```
pub fn wrap<M: Module>(
    module: M,
    vs: &VarStore,
    opts: Options,
) -> Result<Replicated<M>, ReplicateError> {
    Ok(Replicated {
        module,
        state: state_for(vs, opts)?,
    })
}

/// [`wrap`] for an [`nn::ModuleT`](ModuleT) (a model with a train flag: `nn::seq_t()`,
/// batch norm, dropout, `nn::func_t`).
///
/// ```no_run
/// use tch::nn::{self, ModuleT};
/// use tch_dist::replicate;
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// tch_dist::init_process_group(tch_dist::Backend::Gloo)?;
/// let vs = nn::VarStore::new(tch::Device::Cpu);
/// let net = nn::seq_t()
///     .add(nn::linear(vs.root() / "fc", 4, 8, Default::default()))
///     .add(nn::batch_norm1d(vs.root() / "bn", 8, Default::default()));
/// // The running statistics are broadcast from rank 0 before each forward.
/// let model = replicate::wrap_t(net, &vs, replicate::Options::default())?;
/// let ys = model.forward_t(&tch::Tensor::randn([16, 4], tch::kind::FLOAT_CPU), true);
/// # Ok(()) }
/// ```
pub fn wrap_t<M: ModuleT>(
    module: M,
    vs: &VarStore,
    opts: Options,
) -> Result<ReplicatedT<M>, ReplicateError> {
    Ok(ReplicatedT {
        module,
        state: state_for(vs, opts)?,
    })
}

/// replicate's forward-side work on `xs` (the previous iteration's unfinished-reduction
/// check, the buffer broadcast, the move to `device_id`), then `forward`.
fn run(
    state: &ReplicateState,
    xs: &Tensor,
    forward: impl FnOnce(&Tensor) -> Tensor,
) -> Result<Tensor, ForwardError> {
    let moved = state
        .pre_forward(std::slice::from_ref(xs))
        .map_err(ForwardError::from_error)?;
    Ok(forward(
        moved.as_ref().and_then(|m| m.first()).unwrap_or(xs),
    ))
}

/// A replicated [`Module`], made by [`wrap`]: PyTorch's `DistributedDataParallel`.
///
/// It implements [`Module`] (and so `ModuleT`), so `model.forward(&x)` and `x.apply(&model)`
/// run replicate's forward-side work, then the wrapped module's. A failure there (the
/// previous backward left parameters without gradients, a buffer broadcast failed) panics
/// with its message, as PyTorch raises from `forward`; [`f_forward`](Replicated::f_forward)
/// returns it instead.
///
/// ```no_run
/// use tch::nn::{self, Module};
/// use tch_dist::replicate;
///
/// fn net(p: nn::Path) -> impl Module {
///     let fc = nn::linear(p / "fc", 4, 2, Default::default());
///     nn::func(move |xs| xs.apply(&fc).tanh())
/// }
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// tch_dist::init_process_group(tch_dist::Backend::Gloo)?;
/// let vs = nn::VarStore::new(tch::Device::Cpu);
/// let model = replicate::wrap(net(vs.root()), &vs, replicate::Options::default())?;
/// let ys = model.f_forward(&tch::Tensor::ones([3, 4], tch::kind::FLOAT_CPU))?;
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct Replicated<M> {
    module: M,
    state: ReplicateState,
}

impl<M: Module> Replicated<M> {
    /// `forward`, with a failure of replicate's forward-side work (or of a hook of a child
    /// that the module calls with `call`) as a value, as `f_call` is for the derive form. The
    /// error is a [`ForwardError`]; replicate's typed error comes back with
    /// `err.downcast_ref::<tch_dist::DistError>()`.
    ///
    /// ```no_run
    /// # use tch::nn;
    /// # use tch_dist::replicate;
    /// # fn demo(model: &replicate::Replicated<nn::Sequential>, x: &tch::Tensor) {
    /// match model.f_forward(x) {
    ///     Ok(ys) => println!("{:?}", ys.size()),
    ///     Err(e) => eprintln!("error: {e}"), // e.g. "Expected to have finished reduction ..."
    /// }
    /// # }
    /// ```
    pub fn f_forward(&self, xs: &Tensor) -> Result<Tensor, ForwardError> {
        catch_forward_errors(|| run(&self.state, xs, |x| self.module.forward(x)))
    }
}

impl<M: Module> Module for Replicated<M> {
    /// See [`Replicated`]: replicate's forward-side work, then the module's `forward`.
    ///
    /// # Panics
    ///
    /// With the message of a failure of replicate's forward-side work;
    /// [`f_forward`](Replicated::f_forward) returns it instead.
    fn forward(&self, xs: &Tensor) -> Tensor {
        run(&self.state, xs, |x| self.module.forward(x)).unwrap_or_else(|e| raise_forward_error(e))
    }
}

/// A replicated [`ModuleT`], made by [`wrap_t`]: as [`Replicated`], with `forward_t`.
///
/// ```no_run
/// use tch::nn::{self, ModuleT};
/// use tch_dist::replicate;
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// tch_dist::init_process_group(tch_dist::Backend::Gloo)?;
/// let vs = nn::VarStore::new(tch::Device::Cpu);
/// let net = nn::seq_t()
///     .add(nn::linear(vs.root() / "fc", 4, 8, Default::default()))
///     .add_fn_t(|xs, train| xs.dropout(0.5, train));
/// let model = replicate::wrap_t(net, &vs, replicate::Options::default())?;
/// let ys = model.f_forward_t(&tch::Tensor::ones([3, 4], tch::kind::FLOAT_CPU), true)?;
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct ReplicatedT<M> {
    module: M,
    state: ReplicateState,
}

impl<M: ModuleT> ReplicatedT<M> {
    /// `forward_t`, with a failure as a value, as [`Replicated::f_forward`].
    ///
    /// ```no_run
    /// # use tch::nn;
    /// # use tch_dist::replicate;
    /// # fn demo(model: &replicate::ReplicatedT<nn::SequentialT>, x: &tch::Tensor) -> Result<(), tch_dist::ForwardError> {
    /// let ys = model.f_forward_t(x, true)?;
    /// # Ok(()) }
    /// ```
    pub fn f_forward_t(&self, xs: &Tensor, train: bool) -> Result<Tensor, ForwardError> {
        catch_forward_errors(|| run(&self.state, xs, |x| self.module.forward_t(x, train)))
    }
}

impl<M: ModuleT> ModuleT for ReplicatedT<M> {
    /// See [`ReplicatedT`]: replicate's forward-side work, then the module's `forward_t`.
    ///
    /// # Panics
    ///
    /// With the message of a failure of replicate's forward-side work;
    /// [`f_forward_t`](ReplicatedT::f_forward_t) returns it instead.
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        run(&self.state, xs, |x| self.module.forward_t(x, train))
            .unwrap_or_else(|e| raise_forward_error(e))
    }
}

/// The methods both wrappers share, with the derive form's free functions' meaning.
macro_rules! wrapper_methods {
    ($wrapper:ident, $example_ty:ty) => {
        impl<M> $wrapper<M> {
            /// What replicate keeps for the model: FQNs, buckets, per-step stats (the derive
            /// form's `replicate::state(&model)`).
            ///
            /// ```no_run
            /// # use tch::nn;
            /// # use tch_dist::replicate;
            #[doc = concat!("# fn demo(model: &replicate::", stringify!($wrapper), "<", stringify!($example_ty), ">) {")]
            /// println!("{:?} in {:?}", model.state().param_fqns(), model.state().buckets());
            /// # }
            /// ```
            pub fn state(&self) -> &ReplicateState {
                &self.state
            }

            /// Runs `f` without gradient synchronisation (gradient accumulation, DDP's
            /// `with model.no_sync():`): gradients accumulate locally and the next
            /// synchronised backward averages the sum.
            ///
            /// ```no_run
            /// # use tch::nn;
            /// # use tch_dist::replicate;
            #[doc = concat!("# fn demo(model: &replicate::", stringify!($wrapper), "<", stringify!($example_ty), ">, micro_batches: &[tch::Tensor]) {")]
            /// model.no_sync(|| {
            ///     for loss in micro_batches { loss.backward(); }
            /// });
            /// # }
            /// ```
            pub fn no_sync<R>(&self, f: impl FnOnce() -> R) -> R {
                self.state.without_sync(f)
            }

            /// The check the forward makes first, as a value: PyTorch's "Expected to have
            /// finished reduction in the prior iteration..." when the last backward left
            /// parameters without gradients (and `find_unused_parameters` is off).
            ///
            /// ```no_run
            /// # use tch::nn;
            /// # use tch_dist::replicate;
            #[doc = concat!("# fn demo(model: &replicate::", stringify!($wrapper), "<", stringify!($example_ty), ">) -> Result<(), replicate::ReplicateError> {")]
            /// model.prepare_forward()?;
            /// # Ok(()) }
            /// ```
            pub fn prepare_forward(&self) -> Result<(), ReplicateError> {
                self.state.reducer.prepare_for_forward()?;
                Ok(())
            }

            /// The wrapped module (DDP's `model.module`). Calling its `forward` directly skips
            /// replicate's forward-side work.
            ///
            /// ```no_run
            /// # use tch::nn;
            /// # use tch_dist::replicate;
            #[doc = concat!("# fn demo(model: &replicate::", stringify!($wrapper), "<", stringify!($example_ty), ">) {")]
            /// println!("{:?}", model.module());
            /// # }
            /// ```
            pub fn module(&self) -> &M {
                &self.module
            }

            /// Ends replication and hands the module back: the gradient hooks are removed,
            /// later backward passes leave `.grad` as each rank computed it.
            ///
            /// ```no_run
            /// # use tch::nn;
            /// # use tch_dist::replicate;
            #[doc = concat!("# fn demo(model: replicate::", stringify!($wrapper), "<", stringify!($example_ty), ">) {")]
            /// let net = model.into_inner();
            /// # }
            /// ```
            pub fn into_inner(self) -> M {
                self.module
            }
        }
    };
}

wrapper_methods!(Replicated, nn::Sequential);
wrapper_methods!(ReplicatedT, nn::SequentialT);
