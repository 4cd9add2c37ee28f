//! The engine side of tensor parallelism: [`ShardedTensor`] (scatter, gather, all-gather,
//! reshard), the differentiable collectives of [`functional`], [`GradientScale`] (expert parallelism's experts, their gradients divided by the ranks), and [`GradientSum`] (sequence
//! parallelism's replicated parameters, their gradients summed over the group). The
//! plain-data specs ([`ShardingSpec`](tch_dist_core::sharding::ShardingSpec) and its
//! metadata) live in `tch_dist_core::sharding`; plans, sharders and `shard_module` in the
//! `tch_dist` facade.
//!
//! | file | what it does | PyTorch's counterpart |
//! |---|---|---|
//! | `sharded_tensor.rs` | [`ShardedTensor`], [`Shard`]: a tensor split across a group by a spec; scatter, gather, all-gather, reshard | `torch.distributed._shard.sharded_tensor.ShardedTensor` |
//! | `functional.rs` | the differentiable collectives, each a collective in forward and its conjugate in backward | `torch.distributed.nn.functional` (differentiable collectives); Megatron-LM's `mappings.py` |
//! | `grad_scale.rs` | [`GradientScale`]: a parameter's gradient multiplied by a factor before it is accumulated (expert parallelism's experts) | torchtitan's gradient divide factor for the experts |
//! | `grad_sum.rs` | [`GradientSum`]: a replicated parameter's gradient summed over the group (sequence parallelism's norms) | the `Partial` gradient of a `Replicate` DTensor parameter |

pub mod functional;
mod grad_scale;
mod grad_sum;
mod sharded_tensor;

pub use grad_scale::GradientScale;
pub use grad_sum::GradientSum;
pub use sharded_tensor::{Shard, ShardedTensor};
