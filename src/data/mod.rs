//! Data loading for distributed training (PyTorch's `torch.utils.data.distributed`).
//!
//! | file | what it does | PyTorch's counterpart |
//! |---|---|---|
//! | `sampler.rs` | [`DistributedSampler`]: each rank's share of a dataset's indices, PyTorch's arithmetic, shuffled by the runtime's seeded `randperm` kernel | `torch/utils/data/distributed.py` |

mod sampler;

pub use sampler::{DistributedSampler, SamplerError, SamplerOptions};
