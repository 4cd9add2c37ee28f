//! The engine side of tensor parallelism: [`ShardedTensor`] (scatter, gather, all-gather,
//! reshard) and the differentiable collectives of [`functional`]. The plain-data specs
//! ([`ShardingSpec`](tch_dist_core::sharding::ShardingSpec) and its metadata) live in
//! `tch_dist_core::sharding`; plans, sharders and `shard_module` in the `tch_dist` facade.

pub mod functional;
mod sharded_tensor;

pub use sharded_tensor::{Shard, ShardedTensor};
