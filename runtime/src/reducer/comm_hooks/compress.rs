//! `fp16_compress_hook` and `bf16_compress_hook`: divide by the world size, cast to a 16-bit
//! float, all-reduce (sum), cast back into the bucket.

use tch::Kind;

use super::{BucketHook, GradBucket, InFlight};
use crate::c10d::collectives::ReduceOp;
use crate::c10d::group::ProcessGroup;
use crate::error::Result;

/// Communicates in `kind` (half the bytes of fp32), averaging before the cast so that the
/// sum stays in range.
pub(crate) struct Compress {
    kind: Kind,
}

impl Compress {
    pub fn fp16() -> Compress {
        Compress { kind: Kind::Half }
    }

    pub fn bf16() -> Compress {
        Compress {
            kind: Kind::BFloat16,
        }
    }
}

impl BucketHook for Compress {
    fn launch(&mut self, group: &ProcessGroup, bucket: &GradBucket) -> Result<InFlight> {
        let world = group.world_size() as f64;
        let compressed = tch::no_grad(|| bucket.buffer.to_kind(self.kind) / world);
        Ok(InFlight {
            work: Some(group.all_reduce_async(&compressed, ReduceOp::Sum)?),
            result: Some(compressed),
        })
    }

    fn complete(
        &mut self,
        _: &ProcessGroup,
        bucket: &GradBucket,
        mut in_flight: InFlight,
    ) -> Result<()> {
        in_flight.wait()?;
        if let Some(c) = in_flight.result {
            tch::no_grad(|| bucket.buffer.shallow_clone().copy_(&c));
        }
        Ok(())
    }
}
