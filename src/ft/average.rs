//! tch-dist's own gradient average across the quorum ([`Wire::TchDist`](super::Wire)): one
//! buffer of every parameter's gradient and a failure flag after them, all-reduced in
//! chunks, each divided by the participants as it arrives.
//!
//! In a replica group of one rank the chunks can leave during backward
//! ([`Manager::prepare_for_backward`](super::Manager::prepare_for_backward)): a hook on each
//! parameter's gradient accumulator notes it ready, and each chunk is launched once every
//! gradient in it is there, in the buffer's order (the members' collectives must pair one
//! for one). The chunk holding the flag is launched only by `allreduce_gradients`, after
//! backward: a failure reported after backward still reaches every member. The buffer is
//! laid out last parameter first ([`buffer_order`]), so that a sequential model's first
//! chunks are the first ready.

use std::cmp::Ordering;
use std::sync::{Arc, Mutex, MutexGuard};

use tch::{Kind, Tensor};
use tch_dist_runtime::{DistError, PostAccumulateGradHooks, ProcessGroup, ReduceOp, Work};

/// The elements of one chunk of the average's all-reduce (8 MiB of f32).
pub(super) const AVERAGE_CHUNK: i64 = 1 << 21;

/// One chunk of the gradient average's all-reduce: `len` elements from `start`, the first
/// `grads` of them gradients (the rest, in the last chunk, the failure flag).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct AverageChunk {
    pub(super) start: i64,
    pub(super) len: i64,
    pub(super) grads: i64,
}

/// The chunks of at most `chunk` elements that cover `total` gradient elements and the
/// failure flag after them, in order.
pub(super) fn average_chunks(total: i64, chunk: i64) -> Vec<AverageChunk> {
    let chunk = chunk.max(1);
    (0..=total)
        .step_by(chunk as usize)
        .map(|start| {
            let len = chunk.min(total + 1 - start);
            AverageChunk {
                start,
                len,
                grads: len.min(total - start),
            }
        })
        .collect()
}

/// `a` and `b` compared as names with numbers in them: runs of digits by their value
/// (`layers.2` before `layers.10`), the rest as text.
fn natural_cmp(a: &str, b: &str) -> Ordering {
    let (mut a, mut b) = (a, b);
    loop {
        let (Some(x), Some(y)) = (a.chars().next(), b.chars().next()) else {
            return a.len().cmp(&b.len());
        };
        if x.is_ascii_digit() && y.is_ascii_digit() {
            let run = |s: &str| s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
            let (na, nb) = (run(a), run(b));
            let (da, db) = (
                a[..na].trim_start_matches('0'),
                b[..nb].trim_start_matches('0'),
            );
            let by_value = da.len().cmp(&db.len()).then_with(|| da.cmp(db));
            if by_value != Ordering::Equal {
                return by_value;
            }
            (a, b) = (&a[na..], &b[nb..]);
        } else {
            if x != y {
                return x.cmp(&y);
            }
            (a, b) = (&a[x.len_utf8()..], &b[y.len_utf8()..]);
        }
    }
}

/// The buffer's order: the parameters by FQN in natural order, reversed. A sequential
/// model's gradients become ready last layer first, so its first chunks are ready first.
/// A function of the names alone: every member, a restarted one too, lays it out alike.
pub(super) fn buffer_order(mut params: Vec<(String, Tensor)>) -> Vec<(String, Tensor)> {
    params.sort_by(|a, b| natural_cmp(&b.0, &a.0));
    params
}

/// The average's buffer, kept between steps: the gradients in [`buffer_order`], then the
/// failure flag.
pub(super) struct Buffer {
    pub(super) flat: Tensor,
    pub(super) kind: Kind,
    /// The gradient elements (the flag is at this offset).
    pub(super) total: i64,
    /// The parameters, in the buffer's order, and their FQNs.
    pub(super) params: Vec<Tensor>,
    pub(super) fqns: Arc<Vec<String>>,
    /// Each parameter's slice of `flat`.
    pub(super) slots: Vec<Tensor>,
    pub(super) chunks: Vec<AverageChunk>,
    /// Each parameter's first and last chunk.
    pub(super) spans: Vec<(usize, usize)>,
    /// Per chunk, the parameters with elements in it.
    pub(super) members: Vec<usize>,
}

impl Buffer {
    /// A new buffer for `params` (in the buffer's order) of dtype `kind`; each `.grad` that
    /// can be is made its slice: backward then accumulates into the buffer, and the average
    /// is left in the gradients with no copy either way (DDP's `gradient_as_bucket_view`).
    pub(super) fn new(params: &[(String, Tensor)], kind: Kind, rank: usize) -> Buffer {
        let total: i64 = params.iter().map(|(_, p)| p.numel() as i64).sum();
        let flat = Tensor::zeros([total + 1], (kind, tch::Device::Cpu));
        let chunks = average_chunks(total, AVERAGE_CHUNK);
        let last = chunks.len() - 1;
        let mut offset = 0i64;
        let mut slots = Vec::with_capacity(params.len());
        let mut spans = Vec::with_capacity(params.len());
        for (_, p) in params {
            let n = p.numel() as i64;
            let slot = flat.narrow(0, offset, n);
            let chunk_of = |at: i64| ((at / AVERAGE_CHUNK) as usize).min(last);
            spans.push((chunk_of(offset), chunk_of(offset + (n - 1).max(0))));
            offset += n;
            let g = p.grad();
            if g.defined() {
                tch::no_grad(|| slot.view_as(p).copy_(&g));
            }
            if p.device() == tch::Device::Cpu && p.kind() == kind {
                // Where it cannot be, the gradient is copied each step.
                let _ = tch_dist_runtime::set_grad_for(
                    p,
                    Some(&slot.view_as(p)),
                    rank,
                    "fault tolerance",
                );
            }
            slots.push(slot);
        }
        let mut members = vec![0usize; chunks.len()];
        for &(a, b) in &spans {
            for m in &mut members[a..=b] {
                *m += 1;
            }
        }
        Buffer {
            flat,
            kind,
            total,
            params: params.iter().map(|(_, p)| p.shallow_clone()).collect(),
            fqns: Arc::new(params.iter().map(|(fqn, _)| fqn.clone()).collect()),
            slots,
            chunks,
            spans,
            members,
        }
    }

    /// Handles of its own on the same tensors (and a copy of the layout).
    fn handles(&self) -> Buffer {
        Buffer {
            flat: self.flat.shallow_clone(),
            kind: self.kind,
            total: self.total,
            params: self.params.iter().map(Tensor::shallow_clone).collect(),
            fqns: self.fqns.clone(),
            slots: self.slots.iter().map(Tensor::shallow_clone).collect(),
            chunks: self.chunks.clone(),
            spans: self.spans.clone(),
            members: self.members.clone(),
        }
    }

    /// Whether this buffer serves `params` of dtype `kind` (the same parameters, in order).
    pub(super) fn serves(&self, params: &[(String, Tensor)], kind: Kind) -> bool {
        self.kind == kind
            && self.params.len() == params.len()
            && self
                .params
                .iter()
                .zip(params)
                .all(|(a, (_, b))| a.data_ptr() == b.data_ptr() && a.size() == b.size())
    }
}

/// One step's average on its way: which gradients are in the buffer, which chunks left.
/// It holds handles of its own on the buffer's tensors, not the buffer: the hooks reach it
/// from autograd's thread, and a tch `Tensor` is `Send` but not `Sync`.
pub(super) struct Step {
    pg: ProcessGroup,
    buffer: Buffer,
    /// Per chunk, its parameters whose gradient is not in the buffer yet.
    waiting: Vec<usize>,
    /// Per parameter: `None` until its gradient is in the buffer, then whether `.grad` is
    /// its slice (else it was copied in, and the average is copied back out).
    in_buffer: Vec<Option<bool>>,
    /// The chunks launched, a prefix, with their works.
    launched: Vec<Work>,
    /// A launch that failed: no later chunk is launched.
    failure: Option<DistError>,
    /// A parameter whose gradient was accumulated again after it was in the buffer.
    again: Option<usize>,
}

impl Step {
    pub(super) fn new(pg: &ProcessGroup, buffer: &Buffer) -> Step {
        Step {
            pg: pg.clone(),
            buffer: buffer.handles(),
            waiting: buffer.members.clone(),
            in_buffer: vec![None; buffer.params.len()],
            launched: Vec::new(),
            failure: None,
            again: None,
        }
    }

    /// Whether this step runs on `buffer`.
    pub(super) fn serves(&self, buffer: &Buffer) -> bool {
        self.buffer.flat.data_ptr() == buffer.flat.data_ptr()
    }

    /// Whether parameter `i`'s `.grad` is its slice of the buffer.
    fn grad_is_slice(&self, i: usize) -> bool {
        let (p, slot) = (&self.buffer.params[i], &self.buffer.slots[i]);
        let g = p.grad();
        p.numel() == 0
            || (g.defined()
                && g.data_ptr() == slot.data_ptr()
                && g.size() == p.size()
                && g.is_contiguous()
                && g.kind() == self.buffer.kind)
    }

    /// Puts parameter `i`'s gradient in the buffer (copied where `.grad` is not its slice;
    /// zeros where it has none, or where `contributes` is false).
    fn take_gradient(&mut self, i: usize, contributes: bool) {
        let in_place = self.grad_is_slice(i);
        let mut slot = self.buffer.slots[i].shallow_clone();
        let g = self.buffer.params[i].grad();
        if contributes && !in_place && g.defined() {
            tch::no_grad(|| slot.copy_(&g.reshape([-1])));
        } else if !contributes || !in_place {
            // Nothing to send, or no gradient this step (an unused parameter): zeros.
            let _ = slot.zero_();
        }
        self.in_buffer[i] = Some(in_place);
        let (a, b) = self.buffer.spans[i];
        for w in &mut self.waiting[a..=b] {
            *w = w.saturating_sub(1);
        }
    }

    /// Launches chunk after chunk while the next is complete, up to `last` (exclusive).
    fn launch_ready(&mut self, last: usize) {
        while self.launched.len() < last
            && self.failure.is_none()
            && self.waiting[self.launched.len()] == 0
        {
            let c = self.buffer.chunks[self.launched.len()];
            match self
                .pg
                .all_reduce_async(&self.buffer.flat.narrow(0, c.start, c.len), ReduceOp::Sum)
            {
                Ok(work) => self.launched.push(work),
                Err(e) => self.failure = Some(e),
            }
        }
    }

    /// The hook's part: parameter `i`'s gradient was accumulated during backward.
    fn gradient_ready(&mut self, i: usize) {
        if self.in_buffer[i].is_some() {
            // Accumulated again (a second backward): what left with its chunk is stale.
            self.again.get_or_insert(i);
            return;
        }
        self.take_gradient(i, true);
        // Never the last chunk: it carries the flag, known only after backward.
        self.launch_ready(self.buffer.chunks.len() - 1);
    }

    /// A parameter accumulated again after its gradient left (a backward after the one
    /// `prepare_for_backward` armed): its FQN.
    pub(super) fn accumulated_again(&self) -> Option<&str> {
        self.again
            .and_then(|i| self.buffer.fqns.get(i))
            .map(String::as_str)
    }

    /// The rest of the average, after backward: the gradients not yet in the buffer (zeros
    /// where `contributes` is false; a member whose step `failed` sends its flag set), the
    /// remaining chunks launched, every chunk waited for and divided by `participants`
    /// (unless `failed`), the average copied out to the gradients that are not their slice.
    /// Returns the members that failed this step (the flag's sum), or the collective's
    /// failure.
    pub(super) fn finish(
        mut self,
        contributes: bool,
        failed: bool,
        participants: i64,
        rank: usize,
    ) -> Result<f64, String> {
        // A chunk that left carries gradients already; zeros now could not reach it, and a
        // member that failed is told apart by the flag anyway.
        for i in 0..self.buffer.params.len() {
            if self.in_buffer[i].is_none() {
                self.take_gradient(i, contributes);
            }
        }
        let _ = self
            .buffer
            .flat
            .narrow(0, self.buffer.total, 1)
            .fill_(if failed { 1.0 } else { 0.0 });
        self.launch_ready(self.buffer.chunks.len());
        if self.failure.is_none() && self.launched.len() < self.buffer.chunks.len() {
            self.failure = Some(DistError::Internal {
                rank,
                op: "fault tolerance's average",
                what: "a chunk whose gradients are all in the buffer was not launched",
            });
        }
        let participants = participants.max(1) as f64;
        let mut failure = self.failure.take().map(|e| e.to_string());
        // Every launched chunk is waited for, whatever failed: none may outlive this call.
        for (chunk, work) in self
            .buffer
            .chunks
            .iter()
            .zip(std::mem::take(&mut self.launched))
        {
            match work.wait() {
                Ok(()) if failure.is_none() && !failed => {
                    if chunk.grads > 0 {
                        let _ = self
                            .buffer
                            .flat
                            .narrow(0, chunk.start, chunk.grads)
                            .g_div_scalar_(participants);
                    }
                }
                Ok(()) => {}
                Err(e) => {
                    failure.get_or_insert(e.to_string());
                }
            }
        }
        if let Some(e) = failure {
            return Err(e);
        }
        let members_failed = self.buffer.flat.double_value(&[self.buffer.total]);
        if members_failed > 0.0 || failed {
            return Ok(members_failed);
        }
        for (i, p) in self.buffer.params.iter().enumerate() {
            if self.in_buffer[i] != Some(false) {
                continue;
            }
            let mut g = p.grad();
            let slot = &self.buffer.slots[i];
            if g.defined() {
                tch::no_grad(|| g.copy_(&slot.view_as(&g)));
            } else {
                // Every member steps this parameter with the average, this one too.
                let average = slot.view_as(p).to_device(p.device()).to_kind(p.kind());
                tch_dist_runtime::set_grad_for(p, Some(&average), rank, "fault tolerance")
                    .map_err(|e| format!("setting an averaged gradient: {e}"))?;
            }
        }
        Ok(0.0)
    }

    /// Waits for every launched chunk (a step that never finished its average).
    pub(super) fn drain(self) {
        for work in self.launched {
            let _ = work.wait();
        }
    }
}

/// The hooks of [`prepare_for_backward`](super::Manager::prepare_for_backward) and the step
/// they feed while armed.
pub(super) struct Overlap {
    armed: Arc<Mutex<Option<Step>>>,
    /// The buffer the hooks' indices refer to (its address).
    for_buffer: usize,
    _hooks: PostAccumulateGradHooks,
}

fn locked(armed: &Mutex<Option<Step>>) -> MutexGuard<'_, Option<Step>> {
    armed
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Overlap {
    /// Hooks every parameter of `buffer` that requires grad (one that does not has no
    /// accumulator: its gradient goes in after backward).
    pub(super) fn new(buffer: &Buffer, rank: usize) -> Result<Overlap, DistError> {
        let armed: Arc<Mutex<Option<Step>>> = Arc::new(Mutex::new(None));
        let fed = armed.clone();
        let hooked: Vec<usize> = (0..buffer.params.len())
            .filter(|&i| buffer.params[i].requires_grad())
            .collect();
        let tensors: Vec<Tensor> = hooked
            .iter()
            .map(|&i| buffer.params[i].shallow_clone())
            .collect();
        let hooks = PostAccumulateGradHooks::register(&tensors, rank, move |j| {
            if let (Some(step), Some(&i)) = (locked(&fed).as_mut(), hooked.get(j)) {
                step.gradient_ready(i);
            }
        })?;
        Ok(Overlap {
            armed,
            for_buffer: buffer.flat.data_ptr() as usize,
            _hooks: hooks,
        })
    }

    /// Whether these hooks are on `buffer`'s parameters.
    pub(super) fn serves(&self, buffer: &Buffer) -> bool {
        self.for_buffer == buffer.flat.data_ptr() as usize
    }

    /// Feeds `step` from the hooks until [`take`](Self::take).
    pub(super) fn arm(&self, step: Step) {
        if let Some(old) = locked(&self.armed).replace(step) {
            old.drain();
        }
    }

    /// The armed step, if any; the hooks feed nothing after this.
    pub(super) fn take(&self) -> Option<Step> {
        locked(&self.armed).take()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_average_s_chunks_cover_the_gradients_then_the_flag() {
        let plan = |total, chunk| -> Vec<(i64, i64, i64)> {
            average_chunks(total, chunk)
                .into_iter()
                .map(|c| (c.start, c.len, c.grads))
                .collect()
        };
        // No gradients: the flag alone.
        assert_eq!(plan(0, 4), [(0, 1, 0)]);
        // The flag fits the last chunk of gradients.
        assert_eq!(plan(6, 4), [(0, 4, 4), (4, 3, 2)]);
        // The gradients fill their chunks exactly: the flag is a chunk of its own.
        assert_eq!(plan(8, 4), [(0, 4, 4), (4, 4, 4), (8, 1, 0)]);
        assert_eq!(plan(7, 4), [(0, 4, 4), (4, 4, 3)]);
        assert_eq!(plan(3, 1 << 21), [(0, 4, 3)]);
    }

    #[test]
    fn the_buffer_is_laid_out_last_parameter_first_numbers_by_value() {
        let t = || Tensor::zeros([1], tch::kind::FLOAT_CPU);
        let names = [
            "layers.10.weight",
            "layers.2.bias",
            "layers.2.weight",
            "head",
            "emb",
        ];
        let ordered: Vec<String> =
            buffer_order(names.iter().map(|n| (n.to_string(), t())).collect())
                .into_iter()
                .map(|(n, _)| n)
                .collect();
        assert_eq!(
            ordered,
            [
                "layers.10.weight",
                "layers.2.weight",
                "layers.2.bias",
                "head",
                "emb"
            ]
        );
        assert_eq!(natural_cmp("a01", "a1b"), Ordering::Less);
        assert_eq!(natural_cmp("x9", "x10"), Ordering::Less);
        assert_eq!(natural_cmp("x", "x0"), Ordering::Less);
    }
}
