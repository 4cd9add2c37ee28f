//! The engine side of `fully_shard` (PyTorch's FSDP2): parameter groups sharded along dim 0
//! over a process group, gathered around their module's forward and backward, with
//! gradients reduce-scattered to the shards while backward runs.
//!
//! - [`layout`](ShardLayout): where each rank's rows of a parameter sit (`torch.chunk`,
//!   padded);
//! - `group` ([`FsdpGroup`]): one call's parameters, the state machine (sharded or
//!   gathered), the all-gathers and reduce-scatters;
//! - `backward`: the pass across all groups and its end-of-backward callback;
//! - `hooks`: the libtorch hooks (gradient interceptor, pre-backward hook, storage release);
//! - `steps`: which pass this process is in, and the step check before each pass's first
//!   collective.
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
