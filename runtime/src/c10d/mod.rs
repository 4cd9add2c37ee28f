//! The c10d layer: tch-dist's bindings of libtorch's `torch/csrc/distributed/c10d` (stores,
//! process groups, collectives) and the Python-side logic PyTorch keeps in
//! `torch/distributed/` (launch variables, rendezvous, the default group, object
//! collectives), over the shim's store, group and collectives sections.

pub(crate) mod coalesced;
pub(crate) mod collectives;
pub(crate) mod desync;
pub(crate) mod devices;
pub(crate) mod env;
pub(crate) mod group;
pub(crate) mod objects;
pub(crate) mod rendezvous;
pub(crate) mod store;
pub(crate) mod verify;
