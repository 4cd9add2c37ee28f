//! The reducer's state machine during a backward pass: a gradient becomes ready, buckets are
//! launched in order, and the end-of-backward callback finishes the pass (PyTorch's
//! `autograd_hook`, `mark_variable_ready` and `finalize_backward`).

use std::sync::atomic::Ordering;
use std::time::Instant;

use tch::Tensor;

use crate::c10d::collectives::ReduceOp;
use crate::c10d::step_check;
use crate::error::{DistError, MisuseProblem, Phase, ReducerError, Result, StepPosition};
use crate::reducer::autograd;
use crate::reducer::buckets::{rebuild_order, Layout};
use crate::reducer::comm_hooks::{BucketHook, GradBucket};
use crate::reducer::pass::{InPlaceFlight, Pass};
use crate::reducer::unused::{self, StaticGraphUse};
use crate::reducer::{grads, lock, ReducerInner, State};

/// Bucket `b` as its communication hook sees it.
fn grad_bucket(layout: &Layout, b: usize) -> GradBucket<'_> {
    let bucket = &layout.buckets[b];
    GradBucket {
        index: b,
        buffer: &bucket.flat,
        gradients: &bucket.views,
    }
}

impl ReducerInner {
    /// Parameter `index`'s gradient was accumulated (its gradient-ready hook). A failure is
    /// kept: the engine abandons the pass, so every later pass reports it.
    pub(crate) fn mark_ready(&self, index: usize) -> Result<()> {
        let mut st = lock(&self.state);
        if !self.require_sync.load(Ordering::SeqCst) {
            // no_sync: gradients accumulate locally in .grad, which now exists.
            if let Some(fresh) = st.fresh_grads.get_mut(index) {
                *fresh = false;
            }
            return Ok(());
        }
        let result = self.mark_ready_locked(&mut st, index);
        if let Err(e) = &result {
            st.failed.get_or_insert_with(|| e.clone());
        }
        result
    }

    fn mark_ready_locked(&self, st: &mut State, index: usize) -> Result<()> {
        if let Some(e) = &st.failed {
            return Err(e.clone());
        }
        let State {
            layout,
            hook,
            pass,
            fresh_grads,
            ready_order,
            static_graph,
            skip_unused,
            forwards,
            backwards,
            ..
        } = st;
        let pass = match pass {
            Some(pass) => pass,
            None => {
                // The pass's first hook: the step check starts; the pass's first launch waits
                // for it (`Pass::note_launch`), so that backward computes meanwhile.
                *backwards += 1;
                let me = StepPosition::now(Phase::Backward, *forwards, *backwards);
                let step_check =
                    step_check::begin(&self.group, self.opts.api, me, Default::default())?;
                autograd::queue_end_of_backward(self).map_err(|e| DistError::Collective {
                    rank: self.rank(),
                    op: self.opts.api,
                    cause: e.message,
                })?;
                let mut fresh = Pass::new(layout, &std::mem::take(fresh_grads), step_check);
                unused::presume_static_unused(layout, &mut fresh, static_graph.as_ref());
                pass.insert(fresh)
            }
        };
        let static_graph = static_graph.as_ref();
        if unused::presumed_unused(static_graph, index) {
            return Err(ReducerError::GraphChanged {
                rank: self.rank(),
                op: self.opts.api,
                fqn: layout.params[index].fqn.clone(),
                used_in_first_pass: false,
            }
            .into());
        }
        let as_view = self.opts.gradient_as_bucket_view;
        let in_place = layout.params[index].in_place;
        if pass.params[index].ready {
            // The same parameter accumulated twice in one pass (e.g. reentrant backward): its
            // bucket slice already took the first gradient; refresh it with the final one. An
            // in-place gradient is read at launch, so only a launched one is a problem.
            if in_place && pass.params[index].launched && !self.group.skips_communication() {
                return Err(ReducerError::GradientAfterLaunch {
                    rank: self.rank(),
                    op: self.opts.api,
                    fqn: layout.params[index].fqn.clone(),
                }
                .into());
            }
            if pass.params[index].released {
                grads::add_second_gradient(layout, index, self.rank())?;
            } else if !in_place {
                grads::copy_grad_into_bucket(layout, index, as_view, self.rank())?;
            }
            return Ok(());
        }
        pass.params[index].ready = true;
        if let Some(order) = ready_order {
            order.push(index);
        }
        if !in_place {
            grads::copy_grad_into_bucket(layout, index, as_view, self.rank())?;
            if !as_view {
                grads::release_fresh_grad(layout, pass, index, self.rank())?;
            }
        }
        pass.pending[layout.params[index].bucket] -= 1;
        self.launch_ready(
            layout,
            hook.as_mut(),
            pass,
            static_graph,
            skip_unused.as_deref(),
        )
    }

    /// Launches in order while the next one is ready: bucket by bucket, its in-place
    /// gradients one by one, then its flat buffer (through the hook) once every member is
    /// ready. A bucket `skip_unused` skips (`skip_all_reduce_unused_params`: its parameters
    /// got no gradient on any rank in the previous pass) is passed over at once, on every
    /// rank alike.
    fn launch_ready(
        &self,
        layout: &Layout,
        hook: &mut dyn BucketHook,
        pass: &mut Pass,
        static_graph: Option<&StaticGraphUse>,
        skip_unused: Option<&[bool]>,
    ) -> Result<()> {
        while pass.next_bucket < layout.buckets.len() {
            let b = pass.next_bucket;
            if unused::skips_bucket(layout, b, skip_unused) {
                pass.skipped[b] = true;
                pass.next_bucket += 1;
                pass.next_in_place = 0;
                continue;
            }
            while let Some(&i) = layout.buckets[b].in_place.get(pass.next_in_place) {
                if !pass.params[i].ready
                    && !pass.flushing
                    && !unused::presumed_unused(static_graph, i)
                {
                    return Ok(());
                }
                self.launch_in_place(layout, pass, i)?;
                pass.next_in_place += 1;
            }
            if pass.pending[b] != 0 {
                return Ok(());
            }
            if layout.buckets[b].flat.numel() > 0 {
                pass.note_launch()?;
                pass.in_flight[b] = Some(hook.launch(&self.group, &grad_bucket(layout, b))?);
            }
            pass.buckets_reduced += 1;
            pass.next_bucket += 1;
            pass.next_in_place = 0;
        }
        Ok(())
    }

    /// At the end of backward, after the used map: a skipped bucket one of whose parameters
    /// got a gradient on some rank after all is communicated now (every rank knows it from
    /// the same map, and launches such buckets in bucket order), its members without a
    /// gradient as zeros.
    fn launch_skipped(
        &self,
        layout: &Layout,
        hook: &mut dyn BucketHook,
        pass: &mut Pass,
        b: usize,
    ) -> Result<()> {
        for &i in &layout.buckets[b].in_place {
            self.launch_in_place(layout, pass, i)?;
        }
        if layout.buckets[b].flat.numel() > 0 {
            pass.note_launch()?;
            pass.in_flight[b] = Some(hook.launch(&self.group, &grad_bucket(layout, b))?);
        }
        pass.skipped[b] = false;
        pass.buckets_reduced += 1;
        Ok(())
    }

    /// All-reduces parameter `i`'s gradient in place (a zero buffer when it has none; a
    /// contiguous copy when `.grad` is not contiguous). In a group of one the gradient already
    /// is the average: nothing to do (unless the group takes no shortcuts).
    fn launch_in_place(&self, layout: &Layout, pass: &mut Pass, i: usize) -> Result<()> {
        pass.params[i].launched = true;
        if self.group.skips_communication() {
            return Ok(());
        }
        let p = &layout.params[i];
        let grad = p.tensor.grad();
        pass.note_launch()?;
        let ready = pass.params[i].ready;
        let usable = ready
            && grad.defined()
            && grad.is_contiguous()
            && grad.kind() == p.tensor.kind()
            && grad.device() == p.tensor.device();
        let buffer = if usable {
            None
        } else if ready && grad.defined() {
            Some(tch::no_grad(|| grad.contiguous().to_kind(p.tensor.kind())))
        } else {
            Some(tch::no_grad(|| p.tensor.zeros_like()))
        };
        let work = self
            .group
            .all_reduce_async(buffer.as_ref().unwrap_or(&grad), ReduceOp::Avg)?;
        pass.in_place_flight.push(InPlaceFlight {
            param: i,
            work: Some(work),
            buffer,
        });
        Ok(())
    }

    /// The end-of-backward callback: finishes the pass in progress, whose state goes with
    /// it. A failure is kept and reported by every later pass.
    pub(crate) fn finalize_backward(&self) -> Result<()> {
        let backward_end = Instant::now();
        let mut st = lock(&self.state);
        let Some(pass) = st.pass.take() else {
            return Ok(());
        };
        if let Some(start) = pass.started_us {
            // The backward pass as the reducer saw it: from its first gradient to the end of
            // backward (before the waits that finish the pass).
            let end = tch_dist_core::trace::now_us();
            tch_dist_core::trace::complete("backward (replicate)", "backward", start, end, &[]);
        }
        let result = self.finalize(&mut st, pass, backward_end);
        if let Err(e) = &result {
            st.failed = Some(e.clone());
        }
        result
    }

    fn finalize(&self, st: &mut State, mut pass: Pass, backward_end: Instant) -> Result<()> {
        // Before the pass's end sends anything (a pass may end without a launch).
        pass.finish_step_check()?;
        let unready = pass.unready();
        if !unready.is_empty() && !self.opts.tolerates_unused() {
            // PyTorch leaves the stalled buckets unlaunched and fails the next iteration.
            st.unfinished = Some(
                ReducerError::UnfinishedReduction {
                    rank: self.rank(),
                    op: self.opts.api,
                    fqns: unready
                        .iter()
                        .map(|&i| st.layout.params[i].fqn.clone())
                        .collect(),
                    indices: unready,
                }
                .into(),
            );
            self.wait_all(st, &mut pass)?;
            return grads::restore_released(&st.layout, &pass, self.rank());
        }
        // Which parameters got a gradient on some rank (only known when unused are allowed).
        let mut globally_used = None;
        if self.opts.tolerates_unused() {
            let static_graph = st.static_graph.as_ref();
            // Presumed unused ones were counted as zero when the pass began.
            let unready: Vec<usize> = unready
                .into_iter()
                .filter(|&i| !unused::presumed_unused(static_graph, i))
                .collect();
            unused::count_as_zero(&st.layout, &mut pass, &unready);
            // In-place parameters without a gradient are launched as zeros.
            pass.flushing = true;
            let skip_unused = st.skip_unused.as_deref();
            self.launch_ready(
                &st.layout,
                st.hook.as_mut(),
                &mut pass,
                static_graph,
                skip_unused,
            )?;
            let used = match &st.static_graph {
                // A static graph: the first pass's answer holds.
                Some(seen) => seen.global.clone(),
                None => {
                    let used = self.all_reduce_used_map(&pass.ready_map())?;
                    if self.opts.static_graph {
                        st.static_graph = Some(StaticGraphUse {
                            global: used.clone(),
                            local: pass.ready_map(),
                        });
                    }
                    used
                }
            };
            for b in 0..st.layout.buckets.len() {
                if pass.skipped[b] && st.layout.buckets[b].params.iter().any(|&i| used[i]) {
                    self.launch_skipped(&st.layout, st.hook.as_mut(), &mut pass, b)?;
                }
            }
            if self.opts.skip_all_reduce_unused_params {
                // The next pass skips what no rank used in this one.
                st.skip_unused = Some(used.iter().map(|u| !u).collect());
            }
            globally_used = Some(used);
        }
        if pass.next_bucket != st.layout.buckets.len() {
            return Err(DistError::Internal {
                rank: self.rank(),
                op: self.opts.api,
                what: "not every bucket was launched",
            });
        }
        self.wait_all(st, &mut pass)?;
        let done = Instant::now();
        grads::write_back(
            &st.layout,
            &mut pass,
            globally_used.as_deref(),
            self.opts.gradient_as_bucket_view,
            self.rank(),
        )?;
        st.unfinished = None;
        // After every collective, so that a rank whose graph changed does not leave the
        // others waiting in this pass.
        if let Some(seen) = &st.static_graph
            && let Some(i) = (0..pass.params.len()).find(|&i| seen.local[i] != pass.params[i].ready)
        {
            return Err(ReducerError::GraphChanged {
                rank: self.rank(),
                op: self.opts.api,
                fqn: st.layout.params[i].fqn.clone(),
                used_in_first_pass: seen.local[i],
            }
            .into());
        }
        let first = pass.first_launch.unwrap_or(done);
        st.stats.steps += 1;
        st.stats.buckets_reduced = pass.buckets_reduced;
        st.stats.comm_time = done.saturating_duration_since(first);
        st.stats.overlapped_time = backward_end.min(done).saturating_duration_since(first);
        st.hook.step_done();
        if let Some(order) = st.ready_order.take() {
            self.rebuild_buckets(st, &order)?;
        }
        Ok(())
    }

    /// Waits for every in-place all-reduce, then completes every launched bucket through
    /// the hook (bucket order, the same on every rank).
    fn wait_all(&self, st: &mut State, pass: &mut Pass) -> Result<()> {
        for f in pass.in_place_flight.iter_mut() {
            if let Some(work) = f.work.take() {
                work.wait()?;
            }
        }
        for b in 0..pass.in_flight.len() {
            if let Some(in_flight) = pass.in_flight[b].take() {
                st.hook
                    .complete(&self.group, &grad_bucket(&st.layout, b), in_flight)?;
            }
        }
        Ok(())
    }

    /// Once, after the first synchronised iteration: rank 0's gradient-ready order becomes
    /// every rank's bucket order.
    fn rebuild_buckets(&self, st: &mut State, ready_order: &[usize]) -> Result<()> {
        let order = rebuild_order(ready_order, st.layout.params.len());
        let t = Tensor::from_slice(&order.iter().map(|&i| i as i64).collect::<Vec<_>>());
        self.group.broadcast(&t, 0)?;
        let order: Vec<usize> = Vec::<i64>::try_from(&t)
            .map_err(|e| DistError::Collective {
                rank: self.rank(),
                op: self.opts.api,
                cause: format!("reading rank 0's gradient order: {e}"),
            })?
            .iter()
            .map(|&i| i as usize)
            .collect();
        let n = st.layout.params.len();
        let mut seen = vec![false; n];
        if order.len() != n
            || order
                .iter()
                .any(|&i| i >= n || std::mem::replace(&mut seen[i], true))
        {
            return Err(DistError::Misuse {
                rank: self.rank(),
                op: self.opts.api,
                problem: Box::new(MisuseProblem::GradientOrder),
            });
        }
        st.stats.rebuilt = true;
        if st.layout.rebuild(&order, &self.opts.bucket_limits()) {
            st.hook.buckets_rebuilt();
            st.stats.buckets = st.layout.buckets.len();
            if self.opts.gradient_as_bucket_view {
                grads::adopt_bucket_views(&st.layout, self.rank())?;
            }
        }
        Ok(())
    }
}
