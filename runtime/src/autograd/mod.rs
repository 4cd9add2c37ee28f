//! The autograd bindings the engines (the reducer, fully_shard, tensor parallelism) share: how
//! libtorch's callbacks come back into Rust, the hooks they register, the tensor primitives
//! they need, and the two checks that a sharded parameter is used only inside its module's
//! hooked call (the use guard, in the graph; the shard fence, at the dispatcher).
//!
//! | file | what it does | PyTorch's counterpart |
//! |---|---|---|
//! | `callback.rs` | every libtorch callback's trampoline (a hook's `Callback`, a recomputation's `Forward`): context back to its Rust value, `catch_unwind`, the reply (null or a message) to the shim | pybind11's exception translation around Python hooks |
//! | `hooks.rs` | grad-ready hook, gradient interceptor, output-grad hook, end-of-backward callback, assigning `.grad` | `AccumulateGrad` post hooks, `register_post_accumulate_grad_hook`, `Tensor.register_hook`, `Variable._execution_engine.queue_callback` |
//! | `tensor.rs` | storage release/restore, `set_data` keeping the accumulator, identity, use count, version, `is_float` | `_free_storage` / `_alloc_storage`, `Tensor.data =`, `_version`, `torch.is_floating_point` |
//! | `function.rs` | custom autograd functions with both passes in Rust: a forward returning its outputs and its backward (a closure owning what it saved) | `torch.autograd.Function` |
//! | `recompute.rs` | activation recomputation (the facade's `checkpoint_activations`): a forward run without keeping activations, run again and differentiated in backward | `torch.utils.checkpoint` (`use_reentrant=True`'s `CheckpointFunction`) |
//! | `split_backward.rs` | a backward in two passes, the input's gradient first and the parameters' later (zero-bubble pipeline schedules) | `torch.distributed.pipelining._backward` (`stage_backward_input`, `stage_backward_weight`) |
//! | `shard_fence.rs` | shard fences: an op that uses an armed parameter (one holding only its shard) outside its module's hooked call is refused at libtorch's dispatcher, `no_grad` included | (none: PyTorch's FSDP2 does not check) |
//! | `use_guard.rs` | a module's parameters used in the graph only through its hooked calls | (none: PyTorch's FSDP2 does not check) |

mod callback;
mod function;
mod hooks;
mod recompute;
mod shard_fence;
mod split_backward;
mod tensor;
mod use_guard;

pub(crate) use callback::{
    describe_trampoline, release, share, trampoline, Callback, DescribeFailure, Reply,
};
pub use function::{apply_function, Backward, FunctionForward};
pub(crate) use hooks::{add_output_grad_hook, queue_end_of_backward, GradReadyHook, Interceptor};
pub use hooks::{set_grad_for, PostAccumulateGradHooks};
#[allow(deprecated)]
pub use recompute::checkpointed;
pub use recompute::{recomputed, Recomputation};
pub use shard_fence::{check_enter, check_exit, take_fence_hit, unfenced, FenceOwner, ShardFence};
pub use split_backward::{backward_input, WeightBackward};
pub use tensor::{is_float, storage_nbytes, tensor_identity, tensor_use_count};
pub(crate) use tensor::{release_storage, restore_storage, set_data, tensor_version};
pub use use_guard::{autograd_mark, UseGuard};
