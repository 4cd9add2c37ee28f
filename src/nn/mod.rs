//! Layers: tch's layers as [`Shardable`](crate::Shardable) modules and the walkable
//! drop-ins for its recurrent layers (core's, re-exported), and the layers that run
//! collectives themselves.
//!
//! | file | what it does | PyTorch's counterpart |
//! | --- | --- | --- |
//! | `tch_dist_core::nn` (re-exported) | `Shardable` for tch's layers with PyTorch's names, [`lstm`], [`gru`], the layers' typed paths | `torch/nn/modules/*` (the names of their tensors) |
//! | `attention.rs` | [`scaled_dot_product_attention`]: the attention a model's blocks call, routed through context parallelism inside a `context_parallel` region | `torch.nn.functional.scaled_dot_product_attention` (as `context_parallel` patches it) |
//! | `moe/` | [`moe::MoE`]: a mixture-of-experts feed-forward (router, grouped experts, shared expert, load balancing), a table of its own | torchtitan's `models/common/moe.py` |
//! | `sync_batch_norm.rs` | [`SyncBatchNorm`]: batch normalisation over every rank's batch | `torch/nn/modules/batchnorm.py` (`SyncBatchNorm`), `torch/nn/modules/_functions.py` (`SyncBatchNorm`'s autograd function) |
//!
//! [`sync_batch_norm`] is also at the deprecated `tch_dist::sync_batch_norm`, its path before
//! this folder.

pub use tch_dist_core::nn::*;

mod attention;
pub mod moe;
pub mod sync_batch_norm;

pub use attention::{f_scaled_dot_product_attention, scaled_dot_product_attention};
pub use sync_batch_norm::{SyncBatchNorm, SyncBatchNormError};
