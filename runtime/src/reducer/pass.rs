//! One backward pass's state: created fresh at the pass's first gradient-ready hook and
//! dropped when the pass ends, so nothing is reset by hand (PyTorch's reducer resets a
//! dozen fields in `prepare_for_backward`; here the next pass simply starts from a new
//! value).

use std::time::Instant;

use tch::Tensor;

use crate::c10d::collectives::Work;
use crate::c10d::step_check::PendingCheck;
use crate::error::{DistError, Result};
use crate::reducer::buckets::Layout;
use crate::reducer::comm_hooks::InFlight;

/// What one parameter did in this pass.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct ParamPass {
    /// Its gradient-ready hook ran (or it was counted as zero).
    pub ready: bool,
    /// Its in-place all-reduce was launched.
    pub launched: bool,
    /// Its `.grad` was None before the pass (noted by `prepare_for_forward`), so autograd
    /// allocated it during this backward and nobody else holds it.
    pub fresh_grad: bool,
    /// A copied member whose fresh `.grad` was released once copied into the bucket (a new
    /// one is written at the end).
    pub released: bool,
}

/// An in-place all-reduce of one parameter's gradient: the work (taken when awaited) and,
/// when `.grad` itself could not be used (no gradient, or not contiguous), the buffer that
/// was reduced instead.
pub(crate) struct InPlaceFlight {
    pub param: usize,
    pub work: Option<Work>,
    pub buffer: Option<Tensor>,
}

/// The state of the backward pass in progress.
pub(crate) struct Pass {
    /// Per parameter, in registration order.
    pub params: Vec<ParamPass>,
    /// Per bucket: members not yet ready.
    pub pending: Vec<usize>,
    /// The next bucket to launch (buckets launch strictly in order).
    pub next_bucket: usize,
    /// Position in `buckets[next_bucket].in_place` of the next in-place launch.
    pub next_in_place: usize,
    /// Per bucket: its hook's communication, once launched.
    pub in_flight: Vec<Option<InFlight>>,
    /// In-place all-reduces, in launch order.
    pub in_place_flight: Vec<InPlaceFlight>,
    /// End of backward: parameters without a gradient are launched as zeros.
    pub flushing: bool,
    /// Per bucket: passed over (`skip_all_reduce_unused_params`), not communicated.
    pub skipped: Vec<bool>,
    /// Buckets communicated so far (PyTorch's `num_buckets_reduced`).
    pub buckets_reduced: usize,
    /// When the first collective of the pass was launched.
    pub first_launch: Option<Instant>,
    /// With `TCH_DIST_TRACE`: when the pass began (its first gradient), on the trace's clock.
    pub started_us: Option<f64>,
    /// The pass's step check, in flight until the pass's first launch waits for it.
    pub step_check: Option<PendingCheck>,
    /// How the step check failed: every later launch of the pass fails with it too.
    pub step_check_failure: Option<DistError>,
}

impl Pass {
    /// A pass over `layout`'s buckets; `fresh_grads[i]` says whether parameter `i` had no
    /// `.grad` before the pass (missing entries: it had one).
    pub fn new(layout: &Layout, fresh_grads: &[bool], step_check: PendingCheck) -> Pass {
        Pass {
            params: (0..layout.params.len())
                .map(|i| ParamPass {
                    fresh_grad: fresh_grads.get(i).copied().unwrap_or(false),
                    ..ParamPass::default()
                })
                .collect(),
            pending: layout.buckets.iter().map(|b| b.params.len()).collect(),
            next_bucket: 0,
            next_in_place: 0,
            in_flight: layout.buckets.iter().map(|_| None).collect(),
            in_place_flight: Vec::new(),
            flushing: false,
            skipped: vec![false; layout.buckets.len()],
            buckets_reduced: 0,
            first_launch: None,
            started_us: tch_dist_core::trace::enabled().then(tch_dist_core::trace::now_us),
            step_check: Some(step_check),
            step_check_failure: None,
        }
    }

    /// Parameters that got no gradient this pass, in registration order.
    pub fn unready(&self) -> Vec<usize> {
        (0..self.params.len())
            .filter(|&i| !self.params[i].ready)
            .collect()
    }

    /// The ready map, one flag per parameter.
    pub fn ready_map(&self) -> Vec<bool> {
        self.params.iter().map(|p| p.ready).collect()
    }

    /// Before each collective of the pass: completes the step check (the first time), then
    /// notes the first launch.
    pub fn note_launch(&mut self) -> Result<()> {
        self.finish_step_check()?;
        self.first_launch.get_or_insert_with(Instant::now);
        Ok(())
    }

    /// Completes the step check if it is still in flight; its failure, once it failed.
    pub fn finish_step_check(&mut self) -> Result<()> {
        if let Some(e) = &self.step_check_failure {
            return Err(e.clone());
        }
        let result = self.step_check.take().map_or(Ok(()), PendingCheck::finish);
        if let Err(e) = &result {
            self.step_check_failure = Some(e.clone());
        }
        result
    }
}
