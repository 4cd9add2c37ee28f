//! The engine side of tensor parallelism: [`ShardedTensor`] (scatter, gather, all-gather,
//! reshard), the differentiable collectives of [`functional`], and [`GradientSum`] (sequence
//! parallelism's replicated parameters, their gradients summed over the group). The
//! plain-data specs ([`ShardingSpec`](tch_dist_core::sharding::ShardingSpec) and its
//! metadata) live in `tch_dist_core::sharding`; plans, sharders and `shard_module` in the
//! `tch_dist` facade.

pub mod functional;
mod grad_sum;
mod sharded_tensor;

pub use grad_sum::GradientSum;
pub use sharded_tensor::{Shard, ShardedTensor};
