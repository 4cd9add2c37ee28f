//! The engine side of `fully_shard` (PyTorch's FSDP2): parameter groups sharded along dim 0
//! over a process group, gathered around their module's forward and backward, with
//! gradients reduce-scattered to the shards while backward runs.
//!
//! | file | what it does | PyTorch's counterpart (`torch/distributed/fsdp/_fully_shard/`) |
//! |---|---|---|
//! | `layout.rs` ([`ShardLayout`]) | where each rank's rows of a parameter sit (`torch.chunk`, padded; core's chunk arithmetic) and the copies in and out of the collectives' rank-major buffers | `FSDPParam._init_sharded_param`'s arithmetic |
//! | `param.rs` ([`ManagedParam`], [`ShardInfo`]) | one parameter: its place in its bucket's flat shard, its three tensors (handle, rows, full) and the moves between them | `_fsdp_param.py` (`FSDPParam`, `to_sharded`, `to_unsharded`) |
//! | `collectives.rs` | the all-gathers and their copy-out, the reduce-scatters with their copy-in, the divisions (`Divide`), the HSDP all-reduce or partial sum, the all-reduce hook, and the reduced shards' copy-out into `.grad` | `_fsdp_collectives.py` (`foreach_all_gather`, `foreach_all_gather_copy_out`, `foreach_reduce`, `_get_gradient_divide_factors`) |
//! | `group.rs` | one call's `ParamGroup` (what its hooks share) and its state machine: `ShardedState` (sharded, sharded over the post-forward group, unsharded) and `BackwardState` (idle, expected, handed over), the moves forward and backward drive | `_fsdp_param_group.py` (`FSDPParamGroup`, `ShardedState`, `TrainingState`) |
//! | `module.rs` ([`FsdpGroup`], [`FsdpGroupOptions`]) | the handle the facade holds: pre/post-forward, unshard/reshard, setters, full values | `_fully_shard.py` (`FSDPModule`'s methods) |
//! | `context.rs` | one root's backward pass, handed down to the groups under it: join order, prefetches, the end-of-backward callback | `_fsdp_state.py` (`_state_ctx`, `_root_post_backward_final_callback`) |
//! | `hooks.rs` | the group's autograd callbacks (gradient interceptor, pre-backward hook), registered through `crate::autograd` | `FSDPParamGroup.pre_backward`, `_register_post_backward_hook` |
//!
//! The facade's `tch_dist::fully_shard` decides what each group manages and drives it from
//! forward hooks.

mod collectives;
mod context;
mod group;
mod hooks;
mod layout;
mod module;
mod param;

pub use crate::autograd::{is_float, storage_nbytes, tensor_identity, tensor_use_count};
pub use group::AllReduceHook;
pub use layout::ShardLayout;
pub use module::{FsdpGroup, FsdpGroupOptions};
pub use param::{ManagedParam, ShardInfo};
