//! Where every sharded parameter's pieces live — the question PyTorch answers in a DTensor's
//! mesh and placements — answered once per model: the APIs that shard tensors
//! (`shard_module`, `fully_shard`) register, when they are applied, how they split each
//! tensor and a holder that gathers it back (`managed.rs`); [`placements`] gives one
//! [`ParamPlacement`] per sharded tensor object from those alone, keyed by the tensor's
//! identity (a tied parameter is one record under each of its names). `checkpoint`,
//! `utils::clip_grad_norm` and [`full_state_dict`] read only this record, and the state dict
//! imports no API: the APIs write into it (as DCP reads only DTensors' placements).
//!
//! | file | what it does | PyTorch's counterpart |
//! |---|---|---|
//! | `managed.rs` | the registry of managed tensors: which API holds which tensor object, over which ranks, and how it splits it (`Layer`, `ShardHolder`) | a DTensor's `device_mesh` and `placements`, carried by the tensor |
//! | `placement.rs` | [`placements`]: the record, composed from the layers ([`ParamPlacement`], [`Placement`]) | `DTensor.placements`, `_StorageInfo` |
//! | `flat.rs` | the state dict flattened for a checkpoint: every tensor of the model and of its optimizer's state (`optim.state.<fqn>.<name>`, laid out as its parameter) as an entry with its place and who writes it, and back | `_flatten_state_dict`, `get_optimizer_state_dict`'s FQN keys, `planner.py`'s `WriteItem` |
//! | `full.rs` | [`full_state_dict`], and putting every tensor back on its shards before a checkpoint | `get_model_state_dict(full_state_dict=True)`, `DTensor.full_tensor` |
//!
//! ```no_run
//! # fn demo<M: tch_dist::Shardable>(model: &M) {
//! for (fqn, t) in model.named_parameters() {
//!     if let Some(p) = tch_dist::state_dict::placements(model).get(t) {
//!         println!("{fqn}: {:?} of {:?} at {:?}", p.placements(), p.global_shape, p.offsets);
//!     }
//! }
//! # }
//! ```

pub(crate) mod flat;
mod full;
pub(crate) mod managed;
mod placement;

pub use flat::OPTIM_STATE_PREFIX;
pub(crate) use full::reshard_all;
pub use full::{full_state_dict, StateDictError};
pub use managed::ManagingApi;
pub use placement::{placements, MeshDimPlacement, ParamPlacement, Placement, Placements};
