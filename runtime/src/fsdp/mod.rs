//! The engine side of `fully_shard` (PyTorch's FSDP2): parameter groups sharded along dim 0
//! over a process group, gathered around their module's forward and backward, with
//! gradients reduce-scattered to the shards while backward runs.
//!
//! | file | what it does | PyTorch's counterpart |
//! |---|---|---|
//! | `layout.rs` ([`ShardLayout`]) | where each rank's rows of a parameter sit (`torch.chunk`, padded; core's chunk arithmetic) and the copies in and out of the collectives' buffers | `FSDPParam._init_sharded_param`, `_fsdp_collectives.py` copy-in/out |
//! | `group.rs` ([`FsdpGroup`]) | one call's parameters, the state machine (sharded or gathered), the all-gathers and reduce-scatters, `.grad` | `_fsdp_param_group.py`, `_fsdp_param.py`, `_fsdp_collectives.py` |
//! | `backward.rs` | the pass across all groups: join order, prefetches, the end-of-backward callback | `FSDPState._root_post_backward_final_callback`, `_state_ctx` |
//! | `hooks.rs` | the group's autograd callbacks (gradient interceptor, pre-backward hook), registered through `crate::autograd` | `FSDPParamGroup.pre_backward`, `_register_post_backward_hook` |
//! | `steps.rs` | which pass this process is in, and the step check before each pass's first collective | (none: tch-dist's step check) |
//!
//! The facade's `tch_dist::fully_shard` decides what each group manages and drives it from
//! forward hooks.

mod backward;
mod group;
mod hooks;
mod layout;
mod steps;

pub use crate::autograd::{is_float, storage_nbytes, tensor_identity};
pub use group::{FsdpGroup, FsdpGroupOptions, ManagedParam, ShardInfo};
pub use layout::ShardLayout;
