//! DDP's default hook: all-reduce the bucket and divide by the world size (`allreduce_hook`).

use super::{BucketHook, GradBucket, InFlight};
use crate::c10d::collectives::ReduceOp;
use crate::c10d::group::ProcessGroup;
use crate::error::Result;

/// The mean of the ranks' gradients, exactly.
pub(crate) struct AllReduceMean;

impl BucketHook for AllReduceMean {
    fn launch(&mut self, group: &ProcessGroup, bucket: &GradBucket) -> Result<InFlight> {
        Ok(InFlight {
            work: Some(group.all_reduce_async(bucket.buffer, ReduceOp::Avg)?),
            result: None,
        })
    }

    fn complete(
        &mut self,
        _: &ProcessGroup,
        _: &GradBucket,
        mut in_flight: InFlight,
    ) -> Result<()> {
        in_flight.wait()
    }

    fn reduces_in_place(&self) -> bool {
        true
    }
}
