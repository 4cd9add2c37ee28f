//! The c10d layer: tch-dist's bindings of libtorch's `torch/csrc/distributed/c10d` (stores,
//! process groups, collectives) and the Python-side logic PyTorch keeps in
//! `torch/distributed/` (launch variables, rendezvous, the default group, object
//! collectives), over the shim's store, group and collectives sections.
//!
//! | file | what it does | PyTorch's counterpart |
//! |---|---|---|
//! | `env.rs` | the launch environment: torchrun's variables, then Slurm's; debug level, switches, default timeouts | `torch/distributed/rendezvous.py` (`_env_rendezvous_handler`), `distributed_c10d.py`'s `_get_default_timeout` |
//! | `rendezvous.rs` | the rendezvous steps, each by one deadline: resolving MASTER_ADDR, waiting for a listener, the run id, join keys, who never came, the store-based barrier, every member connected (`all_connected`) | `rendezvous.py`, `distributed_c10d.py`'s `_store_based_barrier` |
//! | `interface.rs` | the address a rank's Gloo devices bind: `GLOO_SOCKET_IFNAME`'s interfaces, else the source address of the route to `MASTER_ADDR` | `ProcessGroupGloo::createDefaultDevice` (which binds the hostname's address, even loopback) |
//! | `store.rs` | `Store`: the TCPStore and prefix stores | `torch/csrc/distributed/c10d/TCPStore.hpp`, `PrefixStore.hpp` |
//! | `group/` | `ProcessGroup`, `Backend`, `InitOptions`/`GroupOptions`, creating groups, the default group (its own table) | `ProcessGroup.hpp`, `distributed_c10d.py` (`init_process_group`, `new_group`, `_world`) |
//! | `collectives.rs` | collectives on `tch::Tensor`, blocking and async (`Work`) | `distributed_c10d.py`'s collectives, `Work.hpp` |
//! | `coalesced.rs` | broadcasting many tensors as a few flat buffers | `_broadcast_coalesced` (`torch/csrc/distributed/c10d/comm.cpp`) |
//! | `objects.rs` | object collectives that meet PyTorch's on the wire (strings, bytes) | `broadcast_object_list`, `all_gather_object` |
//! | `verify.rs` | every rank passes the same tensors (name, shape, dtype), the same options; ranks agree on a check each made and on integer settings (`agree`, `agree_on_values`) | `_verify_param_shape_across_processes` |
//! | `desync.rs` | reading the shim's `TCH_DIST_DEBUG=DETAIL` reports into `Desync` values | `ProcessGroupWrapper.cpp` |
//! | `devices.rs` | each rank's claim on its GPU; no two ranks of an NCCL group on one GPU | `torch.cuda.set_device`, NCCL's "Duplicate GPU detected" |
//! | `step_check/` | the step check that runs always: before the first collective of each pass over a group, every rank all-gathers one fixed-size header (where it is, what the pass runs) and fails on a difference (its own table) | (none: `TCH_DIST_DEBUG=DETAIL`'s fingerprints are `ProcessGroupWrapper.cpp`'s) |
//! | `exchange.rs` | what the tch-dist ranks of a group tell each other through the store (agreements a PyTorch rank takes no part in) | (none) |
//! | `heartbeat.rs` | each rank's heartbeat into the store, and what the watches have seen of the members': a lost host noticed in bounded time | (none: torchrun's rendezvous keep-alive, NCCL's heartbeat monitor) |
//! | `departures.rs` | who left the job or stopped taking part in a group (the launcher's and the ranks' keys in the store), and the watch a long wait keeps over it | (none: PyTorch's ranks wait out the timeout) |

pub(crate) mod coalesced;
pub(crate) mod collectives;
pub(crate) mod departures;
pub(crate) mod desync;
pub(crate) mod devices;
pub(crate) mod env;
pub(crate) mod exchange;
pub(crate) mod group;
pub(crate) mod heartbeat;
pub(crate) mod interface;
pub(crate) mod objects;
pub(crate) mod rendezvous;
pub(crate) mod step_check;
pub(crate) mod store;
pub(crate) mod verify;
