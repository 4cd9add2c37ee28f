//! Forward hooks and [`Call`]/[`CallT`]: the Rust analogue of calling `module(x)` in PyTorch.
//!
//! `model.call(&xs)` runs the forward pre-hooks registered for that module instance (each may
//! replace the input), then `forward`, then the forward hooks (each may replace the output).
//! Calling `forward` directly bypasses the hooks, as calling `module.forward(x)` does in
//! PyTorch. Inside a model's own `forward`, call children with `self.fc1.call(&x)` so that
//! composable APIs can hook them.
//!
//! A block whose forward takes several tensors (`forward(x, mask)`) and returns one or a
//! tuple is called with [`CallWith::call_with`]
//! (`block.call_with([&x, &mask], |b, [x, mask]| b.forward(x, mask))`); its hooks see every
//! input and output ([`register_forward_pre_hook_n`], [`register_forward_hook_n`]), and a
//! one-tensor hook refuses such a call rather than see part of it ([`CallError`]).
//!
//! Hooks may fail ([`register_fallible_forward_pre_hook`], [`register_fallible_forward_hook`]):
//! [`Call::f_call`] returns the [`ForwardError`] (also one raised by a child's hook inside
//! `forward`), [`Call::call`] panics with its message, as PyTorch's `module(x)` raises.
//!
//! A [`CallScope`] ([`register_call_scope`]) brackets every hooked call of a module with a
//! pre-hook and a forward hook that share a per-call mark, for APIs that must see what a
//! call did between its start and its end.
//!
//! Hooks are stored per module instance (by [`ModuleKey`](crate::ModuleKey)) in the same
//! store as composable API state, so they follow the instance when it moves. When no hook is
//! registered anywhere in the program, `call` is `forward` plus one atomic load.
//!
//! ```
//! use tch::{nn, nn::Module, Device, Tensor};
//! use tch_dist_core::hooks::{register_forward_hook, register_forward_pre_hook, Call};
//!
//! let vs = nn::VarStore::new(Device::Cpu);
//! let fc = nn::linear(vs.root() / "fc", 3, 2, Default::default());
//! // Feed zeros instead of the input; then double the output.
//! let pre = register_forward_pre_hook(&fc, |_m, xs| Some(xs.zeros_like())).unwrap();
//! let post = register_forward_hook(&fc, |_m, _input, out| Some(out * 2.0)).unwrap();
//! let xs = Tensor::ones([1, 3], tch::kind::FLOAT_CPU);
//! let ys = fc.call(&xs);
//! assert!(ys.allclose(&(fc.bs.as_ref().unwrap() * 2.0), 1e-6, 1e-6, false));
//! pre.remove();
//! post.remove();
//! assert!(fc.call(&xs).allclose(&fc.forward(&xs), 1e-6, 1e-6, false));
//! ```
//!
//! | file | what it does | PyTorch's counterpart |
//! |---|---|---|
//! | `mod.rs` | this table, the re-exports | the hooks of `torch/nn/modules/module.py` |
//! | `register.rs` | registering forward pre-hooks and forward hooks (one tensor or every input and output, infallible or fallible), [`RemovableHandle`], [`HookError`], [`num_forward_hooks`] | `Module.register_forward_pre_hook`, `Module.register_forward_hook`; `RemovableHandle` (`torch/utils/hooks.py`) |
//! | `call.rs` | [`Call`] and [`CallT`]: `module(x)` for tch's `Module` and `ModuleT` | `Module.__call__` |
//! | `call_with.rs` | [`CallWith`]: calls of several inputs, returning one tensor or several ([`CallOutput`]); [`CallError`] | `Module.__call__(*args)` |
//! | `run.rs` | a hooked call's steps: pre-hooks, the forward (or its wrapper), forward hooks; the refusal of a guard as the call's error | `Module._call_impl` |
//! | `forward_error.rs` | [`ForwardError`]; a failure returned by the innermost `f_call` ([`catch_forward_errors`]) or raised as a panic at the top ([`raise_forward_error`]) | an exception raised in a hook, out of `module(x)` |
//! | `outermost.rs` | the hooked calls running on a thread: how many, the outermost one's module ([`fqn_in_outermost_call`]) | (none) |
//! | `wrap.rs` | [`ForwardWrapper`]: an API that runs a module's forward itself | the composable `checkpoint`'s pre-hook and hook around the forward (`torch/distributed/_composable/checkpoint_activation.py`) |
//! | `scope.rs` | [`CallScope`]: a pre-hook and a forward hook sharing a per-call mark | FSDP2's `FSDPState._pre_forward` / `_post_forward` pair |
//! | `guard.rs` | [`CallGuard`]: an API's per-thread check of what runs inside hooked calls | (none) |

mod call;
mod call_with;
mod forward_error;
mod guard;
mod outermost;
mod register;
mod run;
mod scope;
pub(crate) mod wrap;

pub use call::{Call, CallT};
pub use call_with::{CallError, CallOutput, CallWith};
pub use forward_error::{catch_forward_errors, raise_forward_error, ForwardError};
pub use guard::{register_call_guard, CallGuard};
pub use outermost::fqn_in_outermost_call;
pub use register::{
    num_forward_hooks, register_fallible_forward_hook, register_fallible_forward_hook_n,
    register_fallible_forward_pre_hook, register_fallible_forward_pre_hook_n,
    register_forward_hook, register_forward_hook_n, register_forward_pre_hook,
    register_forward_pre_hook_n, HookError, RemovableHandle,
};
pub use scope::{register_call_scope, CallScope};
pub use wrap::{register_forward_wrapper, FirstRun, Forward, ForwardWrapper, Recompute};
