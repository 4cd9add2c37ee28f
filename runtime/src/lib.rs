//! tch-dist's runtime: the C++ shim over libtorch's c10d and autograd, process groups,
//! collectives, and the helpers that run ranks as real processes.
//!
//! All `unsafe` code talks to the shim (csrc/shim.cpp) through [`ffi`]; everything public
//! returns [`Result`] with a [`DistError`] naming the rank, the operation and the cause.

mod collectives;
mod env;
mod error;
#[doc(hidden)]
pub mod ffi;
mod powersgd;
mod process_group;
mod reducer;
pub mod sharding;
mod store;
pub mod testing;

pub use collectives::{ReduceOp, Work};
pub use env::{LaunchEnv, DEFAULT_MASTER_PORT, DEFAULT_TIMEOUT};
pub use error::{DistError, Result};
pub use powersgd::PowerSgdOptions;
pub use process_group::{
    default_group, destroy_process_group, init_process_group, init_process_group_with,
    is_initialized, Backend, InitOptions, ProcessGroup,
};
pub use reducer::{
    assign_buckets, CommHook, GradReadyHook, Reducer, ReducerOptions, ReducerStats,
    DEFAULT_FIRST_BUCKET_BYTES,
};
pub use store::Store;
