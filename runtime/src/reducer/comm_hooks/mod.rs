//! Communication hooks: how a bucket's gradients become their average (PyTorch's
//! `register_comm_hook` interface and its `default_hooks` / `powerSGD_hook`).
//!
//! The reducer hands each bucket to its hook as a [`GradBucket`] when every member's
//! gradient is in the bucket, in the same bucket order on every rank; the hook starts its
//! collectives ([`BucketHook::launch`]) and, when the reducer waits at the end of backward,
//! finishes them ([`BucketHook::complete`]), leaving the average in the bucket's buffer. A
//! new hook is one file here: its state, its `launch` and `complete`, and a line in
//! [`for_options`].
//!
//! | file | what it does | PyTorch's counterpart (`torch/distributed/algorithms/ddp_comm_hooks/`) |
//! |---|---|---|
//! | `mod.rs` | [`BucketHook`], [`GradBucket`], [`for_options`]: the interface and the choice of a hook | `register_comm_hook`, `GradBucket` (`torch/csrc/distributed/c10d/comm.hpp`) |
//! | `allreduce.rs` | the default: all-reduce, divide by the world size | `default_hooks.allreduce_hook` |
//! | `compress.rs` | divide, cast to fp16 or bf16, all-reduce, cast back | `default_hooks.fp16_compress_hook`, `bf16_compress_hook` |
//! | `powersgd.rs` | [`PowerSgdOptions`]: low-rank gradient compression with error feedback | `powerSGD_hook.py` (`PowerSGDState`, `powerSGD_hook`) |

mod allreduce;
mod compress;
mod powersgd;

use tch::Tensor;

use crate::c10d::collectives::Work;
use crate::c10d::group::ProcessGroup;
use crate::error::Result;
use crate::reducer::options::CommHook;

pub use powersgd::PowerSgdOptions;

/// A bucket as a hook sees it (PyTorch's `GradBucket`).
pub(crate) struct GradBucket<'a> {
    /// The bucket's position in launch order (stable until the buckets are rebuilt).
    pub index: usize,
    /// The copied members' gradients, back to back: what the hook communicates and where
    /// it leaves the average.
    pub buffer: &'a Tensor,
    /// One slice of `buffer` per copied member, in bucket order (`GradBucket.gradients()`).
    pub gradients: &'a [Tensor],
}

/// What a launched bucket waits on: PyTorch's hooks return a future of the bucket's result;
/// here, the work to wait for and the tensor that will hold the result when it is not the
/// bucket's buffer itself (a compressed copy). A hook that communicates only when completed
/// launches nothing.
pub(crate) struct InFlight {
    pub work: Option<Work>,
    pub result: Option<Tensor>,
}

impl InFlight {
    /// Nothing launched yet: the hook does its work in `complete`.
    pub fn deferred() -> InFlight {
        InFlight {
            work: None,
            result: None,
        }
    }

    /// Waits for the work, if any.
    pub fn wait(&mut self) -> Result<()> {
        match self.work.take() {
            Some(w) => w.wait(),
            None => Ok(()),
        }
    }
}

/// A communication hook (see the module docs).
pub(crate) trait BucketHook: Send {
    /// Starts communicating `bucket`; every rank calls it for the same buckets in the same
    /// order.
    fn launch(&mut self, group: &ProcessGroup, bucket: &GradBucket) -> Result<InFlight>;

    /// Finishes what `launch` started and leaves the average in `bucket.buffer`.
    fn complete(
        &mut self,
        group: &ProcessGroup,
        bucket: &GradBucket,
        in_flight: InFlight,
    ) -> Result<()>;

    /// Whether a large gradient may skip its bucket and be all-reduced (mean) on its own,
    /// in place in `.grad`: true only where that computes what the hook would.
    fn reduces_in_place(&self) -> bool {
        false
    }

    /// A synchronised step ended.
    fn step_done(&mut self) {}

    /// The buckets were rebuilt: per-bucket memory no longer fits.
    fn buckets_rebuilt(&mut self) {}
}

/// The hook `opts` asks for.
pub(crate) fn for_options(hook: &CommHook) -> Box<dyn BucketHook> {
    match hook {
        CommHook::AllReduceMean => Box::new(allreduce::AllReduceMean),
        CommHook::Fp16Compress => Box::new(compress::Compress::fp16()),
        CommHook::Bf16Compress => Box::new(compress::Compress::bf16()),
        CommHook::PowerSgd(opts) => Box::new(powersgd::PowerSgd::new(*opts)),
    }
}
