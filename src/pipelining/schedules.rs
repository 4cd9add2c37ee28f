//! The schedules: [`ScheduleGPipe`], [`Schedule1F1B`] (one stage per rank),
//! [`ScheduleInterleaved1F1B`] and [`ScheduleInterleavedZeroBubble`] (several stages per rank,
//! loop placement), as PyTorch's of the same names in
//! `torch/distributed/pipelining/schedules.py`.
//!
//! A schedule owns its stages. Its constructor checks, on every rank of the pipeline's group
//! together (one small all-reduce, `ProcessGroup::agree_on_values`), that the stages and
//! microbatch count fit (each rank's own checks: `validate.rs`) and that every rank was
//! given the same settings; [`step`](Schedule1F1B::step) checks the batch the same way
//! (`microbatch.rs`), then runs the rank's order of work (see `order.rs`), the stages'
//! transfers going through their transports (`transport.rs`).
//!
//! Loss and gradient scaling as PyTorch's `scale_grads=True` (the default): the loss is
//! computed per microbatch on the last stage, `losses` receives each microbatch's loss, and
//! the gradients are those of the mean of the microbatch losses. PyTorch divides the
//! accumulated gradients by `n_microbatches` after the last backward; here each
//! microbatch's backward starts from its loss divided by `n_microbatches` (the same
//! gradients: exactly so for a power-of-two count, otherwise up to rounding), which also
//! lets data parallelism on a stage reduce the final gradients in its last backward.

use std::panic::{catch_unwind, AssertUnwindSafe};

use tch::Tensor;
use tch_dist_core::hooks::ForwardError;
use tch_dist_core::trace;
use tch_dist_runtime::ProcessGroup;

use super::error::{PipelineError, PipelineProblem, StageProblem};
use super::microbatch::{check_step, split};
use super::order::{self, Action, Work};
use super::placement::Placement;
use super::stage::{BackwardPart, PipelineStage};
use super::transport::Outbox;
use super::validate::{self, Microbatches, Rules, StagesPerRank};

/// The loss of the last stage: `loss_fn(output, target)` for one microbatch (the mean over
/// its samples, as PyTorch's default `scale_grads=True` assumes).
type LossFn = Box<dyn Fn(&Tensor, &Tensor) -> Tensor>;

/// What every schedule shares: its stages on this rank, the order of work, the loss.
struct Runner<M> {
    /// The step's name in errors.
    op: &'static str,
    stages: Vec<PipelineStage<M>>,
    order: Vec<Action>,
    n_microbatches: usize,
    loss_fn: LossFn,
    scale_grads: bool,
    group: ProcessGroup,
    /// The batch size the stages' activation metadata was exchanged for.
    meta_batch: Option<i64>,
}

/// The schedules, as the agreement check names them.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    GPipe = 1,
    OneFOneB = 2,
    Interleaved = 3,
    ZeroBubble = 4,
    ZeroBubbleV = 5,
}

impl Kind {
    /// What the schedule asks of its stages and microbatches.
    fn rules(self) -> Rules {
        let (placement, stages_per_rank, microbatches) = match self {
            Kind::GPipe => (Placement::Loop, StagesPerRank::One, Microbatches::Any),
            Kind::OneFOneB => (
                Placement::Loop,
                StagesPerRank::One,
                Microbatches::AtLeastOnePerStage,
            ),
            Kind::Interleaved | Kind::ZeroBubble => (
                Placement::Loop,
                StagesPerRank::Several,
                Microbatches::InRounds,
            ),
            Kind::ZeroBubbleV => (Placement::V, StagesPerRank::Two, Microbatches::Any),
        };
        Rules {
            placement,
            stages_per_rank,
            microbatches,
        }
    }
}

fn panic_text(p: Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "a panic without a message".to_string())
}

impl<M: 'static> Runner<M> {
    fn new(
        (op, step_op): (&'static str, &'static str),
        kind: Kind,
        mut stages: Vec<PipelineStage<M>>,
        n_microbatches: usize,
        loss_fn: LossFn,
    ) -> Result<Self, PipelineError> {
        stages.sort_by_key(PipelineStage::stage_index);
        let rules = kind.rules();
        for s in &mut stages {
            s.set_placement(rules.placement);
        }
        let Some(first) = stages.first() else {
            let rank = tch_dist_runtime::default_group().map_or(0, |g| g.rank());
            return Err(PipelineProblem::NoStages.on(rank, op));
        };
        let group = first.group().clone();
        let (rank, group_size) = (group.rank(), group.world_size());
        let num_stages = first.num_stages();
        let own = validate::own_problem(rules, &stages, &group, n_microbatches);
        // Every rank's refusal and settings, exchanged once, so that a refusal or a
        // disagreement is the same error on every rank before any activation moves.
        group
            .agree_on_values(
                op,
                own,
                &[
                    ("num_stages", num_stages as i64),
                    ("n_microbatches", n_microbatches as i64),
                    ("schedule", kind as i64),
                    ("stages per rank", stages.len() as i64),
                ],
            )
            .map_err(|refusal| PipelineError::refused(rank, op, refusal))?;
        let order = match kind {
            Kind::GPipe => order::gpipe(first.stage_index(), n_microbatches),
            Kind::OneFOneB => order::one_f_one_b(first.stage_index(), num_stages, n_microbatches),
            Kind::Interleaved => {
                order::interleaved_1f1b(rank, group_size, stages.len(), n_microbatches)
            }
            Kind::ZeroBubble => {
                order::interleaved_zero_bubble(rank, group_size, stages.len(), n_microbatches)
            }
            Kind::ZeroBubbleV => order::zero_bubble_v(rank, group_size, n_microbatches),
        };
        Ok(Self {
            op: step_op,
            stages,
            order,
            n_microbatches,
            loss_fn,
            scale_grads: true,
            group,
            meta_batch: None,
        })
    }

    fn holds_first(&self) -> bool {
        self.stages.iter().any(PipelineStage::is_first)
    }

    fn holds_last(&self) -> bool {
        self.stages.iter().any(PipelineStage::is_last)
    }

    fn step(
        &mut self,
        input: Option<&Tensor>,
        target: Option<&Tensor>,
        losses: &mut Vec<Tensor>,
    ) -> Result<(), PipelineError> {
        let n = self.n_microbatches;
        let batch = check_step(
            &self.group,
            self.op,
            n,
            self.holds_first(),
            self.holds_last(),
            input,
            target,
        )?;
        // Every rank learnt the batch's size from the check: when it changes, the shapes do,
        // and every stage exchanges metadata again (PyTorch infers shapes once).
        if self.meta_batch != Some(batch) {
            self.stages.iter_mut().for_each(PipelineStage::reset_meta);
            self.meta_batch = Some(batch);
        }
        let inputs = input.filter(|_| self.holds_first()).map(|x| split(x, n));
        let targets = target.filter(|_| self.holds_last()).map(|y| split(y, n));
        let mut outbox = Outbox::default();
        let mut step_losses: Vec<Option<Tensor>> = (0..n).map(|_| None).collect();
        let result = self.run(
            inputs.as_deref(),
            targets.as_deref(),
            &mut outbox,
            &mut step_losses,
        );
        let rank = self.group.rank();
        // Every send is waited for, also after a failure (its own error comes second).
        let sent = outbox
            .sends
            .into_iter()
            .map(|p| p.wait(rank))
            .collect::<Result<Vec<()>, _>>();
        // A step that failed after its transfers began leaves the peers waiting for what
        // this rank will not send, and a receive of its own posted ahead: this rank takes
        // no further part in the group, and says so first, so that its peers fail within
        // seconds naming it and its error (rather than at the group's timeout, or with a
        // closed connection once the posted receives are dropped below).
        if let Some(e) = result.as_ref().err().or(sent.as_ref().err()) {
            self.group.stop_after_failure(&crate::report(e));
            self.stages.iter_mut().for_each(PipelineStage::clear);
            self.meta_batch = None;
        }
        result?;
        sent?;
        losses.extend(step_losses.into_iter().flatten());
        Ok(())
    }

    fn run(
        &mut self,
        inputs: Option<&[Tensor]>,
        targets: Option<&[Tensor]>,
        outbox: &mut Outbox,
        losses: &mut [Option<Tensor>],
    ) -> Result<(), PipelineError> {
        let n = self.n_microbatches;
        let rank = self.group.rank();
        for a in self.order.clone() {
            // What the previous action handed to a stage on this rank (the V placement's
            // turn), delivered before anything can need it.
            for h in outbox.handoffs.drain(..) {
                if let Some(to) = self.stages.iter_mut().find(|s| s.stage_index() == h.to) {
                    to.take_handoff(h);
                }
            }
            let Some(stage) = self.stages.iter_mut().find(|s| s.stage_index() == a.stage) else {
                continue;
            };
            let mb = a.microbatch;
            // PyTorch records each action under its name too (`record_function`).
            let _span =
                trace::enabled().then(|| trace::span(a.to_string(), a.work.trace_category()));
            match a.work {
                Work::Forward => {
                    let input = if stage.is_first() {
                        match inputs.and_then(|x| x.get(mb)) {
                            Some(x) => stage.place_input(x),
                            None => continue,
                        }
                    } else {
                        stage.recv_activation(mb, n)?
                    };
                    let output = forward_catching(stage, mb, input)?;
                    if stage.is_last() {
                        let Some(y) = targets.and_then(|y| y.get(mb)) else {
                            continue;
                        };
                        let loss_fn = &self.loss_fn;
                        let loss_error = |message| {
                            StageProblem::Loss {
                                microbatch: mb,
                                message,
                            }
                            .on(rank, a.stage)
                        };
                        let loss = catch_unwind(AssertUnwindSafe(|| loss_fn(&output, y)))
                            .map_err(|p| loss_error(panic_text(p)))?;
                        if loss.numel() != 1 {
                            // A backward from it would sum it (PyTorch refuses too: "grad can
                            // be implicitly created only for scalar outputs").
                            return Err(loss_error(format!(
                                "the loss must be one number (a mean), not of shape {:?}",
                                loss.size()
                            )));
                        }
                        losses[mb] = Some(loss.detach());
                        let root = if self.scale_grads {
                            loss / n as f64
                        } else {
                            loss
                        };
                        stage.set_loss(mb, root);
                    } else {
                        stage.send_activation(mb, &output, outbox)?;
                    }
                }
                Work::Backward => stage.backward_one_chunk(mb, n, BackwardPart::Whole, outbox)?,
                Work::BackwardInput => {
                    stage.backward_one_chunk(mb, n, BackwardPart::InputOnly, outbox)?
                }
                Work::BackwardWeight => stage.backward_weight_one_chunk(mb)?,
            }
        }
        Ok(())
    }
}

/// The stage's forward, with a panic inside it (libtorch refusing a shape) as its error.
fn forward_catching<M: 'static>(
    stage: &mut PipelineStage<M>,
    mb: usize,
    input: Tensor,
) -> Result<Tensor, PipelineError> {
    let rank = stage.group().rank();
    let index = stage.stage_index();
    catch_unwind(AssertUnwindSafe(|| stage.forward_one_chunk(mb, input))).unwrap_or_else(|p| {
        Err(StageProblem::Forward {
            microbatch: mb,
            source: ForwardError::new(panic_text(p)),
        }
        .on(rank, index))
    })
}

/// The methods every schedule has, over its `runner`.
macro_rules! schedule_methods {
    () => {
        /// Whether gradients are those of the mean of the microbatch losses (`true`, as
        /// PyTorch's default `scale_grads=True`) or of their sum.
        pub fn scale_grads(mut self, scale: bool) -> Self {
            self.runner.scale_grads = scale;
            self
        }

        /// One training step over a batch: `input` on the rank holding stage 0, `target` on
        /// the one holding the last stage (`None` elsewhere), split along dim 0 into the
        /// microbatches; `losses` gets each microbatch's loss on the last stage. Gradients
        /// accumulate in the stages' parameters' `.grad`; the optimizer steps afterwards.
        pub fn step(
            &mut self,
            input: Option<&Tensor>,
            target: Option<&Tensor>,
            losses: &mut Vec<Tensor>,
        ) -> Result<(), PipelineError> {
            self.runner.step(input, target, losses)
        }
    };
}

macro_rules! single_stage_schedule {
    ($(#[$doc:meta])* $name:ident, $kind:expr, $op_new:literal, $op_step:literal) => {
        $(#[$doc])*
        pub struct $name<M> {
            runner: Runner<M>,
        }

        impl<M> std::fmt::Debug for $name<M> {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.debug_struct(stringify!($name))
                    .field("stage", &self.runner.stages[0])
                    .field("n_microbatches", &self.runner.n_microbatches)
                    .finish_non_exhaustive()
            }
        }

        impl<M: 'static> $name<M> {
            /// The schedule over this rank's `stage`, splitting each batch into
            /// `n_microbatches`, with `loss_fn(output, target)` on the last stage. Every rank
            /// of the stage's group calls it together; any rank's refusal (stage count,
            /// placement, microbatch count, settings that differ between ranks) is an error on
            /// every rank.
            pub fn new(
                stage: PipelineStage<M>,
                n_microbatches: usize,
                loss_fn: impl Fn(&Tensor, &Tensor) -> Tensor + 'static,
            ) -> Result<Self, PipelineError> {
                let runner = Runner::new(
                    ($op_new, $op_step),
                    $kind,
                    vec![stage],
                    n_microbatches,
                    Box::new(loss_fn),
                )?;
                Ok(Self { runner })
            }

            schedule_methods!();

            /// This rank's stage.
            pub fn stage(&self) -> &PipelineStage<M> {
                &self.runner.stages[0]
            }

            /// This rank's stage, mutably.
            pub fn stage_mut(&mut self) -> &mut PipelineStage<M> {
                &mut self.runner.stages[0]
            }

            /// The stage, given back.
            pub fn into_stage(self) -> PipelineStage<M> {
                let mut stages = self.runner.stages;
                stages.swap_remove(0)
            }
        }
    };
}

single_stage_schedule!(
    /// GPipe (PyTorch's `ScheduleGPipe`): every microbatch's forward, then every backward
    /// (fill-drain; activations of all microbatches are alive at once).
    ///
    /// ```no_run
    /// use tch::nn::{self, Module};
    /// use tch_dist::pipelining::{PipelineStage, ScheduleGPipe};
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let pg = tch_dist::init_process_group(tch_dist::Backend::Gloo)?; // 2 ranks
    /// let vs = nn::VarStore::new(tch::Device::Cpu);
    /// let part = nn::linear(vs.root() / "layers" / pg.rank(), 4, 4, Default::default());
    /// let stage = PipelineStage::new(part, pg.rank(), 2, tch::Device::Cpu, &pg);
    /// let mut schedule = ScheduleGPipe::new(stage, 4, |out, y| out.mse_loss(y, tch::Reduction::Mean))?;
    /// let x = tch::Tensor::randn([8, 4], tch::kind::FLOAT_CPU);
    /// let mut losses = Vec::new();
    /// let first = pg.rank() == 0;
    /// schedule.step(first.then_some(&x), (!first).then_some(&x), &mut losses)?;
    /// # Ok(()) }
    /// ```
    ScheduleGPipe,
    Kind::GPipe,
    "ScheduleGPipe::new",
    "ScheduleGPipe::step"
);

single_stage_schedule!(
    /// 1F1B (PyTorch's `Schedule1F1B`): stage `s` runs `num_stages - s` warmup forwards,
    /// then one backward and one forward in turn, then the remaining backwards, so that at
    /// most `num_stages - s` microbatches' activations are alive. Needs at least as many
    /// microbatches as stages. Bubble `(p - 1) / m` of the step for `p` stages and `m`
    /// microbatches, as GPipe's, with less memory.
    ///
    /// ```no_run
    /// use tch::nn;
    /// use tch_dist::pipelining::{PipelineStage, Schedule1F1B};
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let pg = tch_dist::init_process_group(tch_dist::Backend::Gloo)?; // 2 ranks
    /// let vs = nn::VarStore::new(tch::Device::Cpu);
    /// let part = nn::linear(vs.root() / "layers" / pg.rank(), 4, 4, Default::default());
    /// let stage = PipelineStage::new(part, pg.rank(), 2, tch::Device::Cpu, &pg);
    /// let mut schedule = Schedule1F1B::new(stage, 4, |out, y| out.mse_loss(y, tch::Reduction::Mean))?;
    /// let mut opt = tch_dist::optim::Sgd { momentum: 0.9, ..Default::default() }.build(&vs, 0.1)?;
    /// let (x, y) = (tch::Tensor::randn([8, 4], tch::kind::FLOAT_CPU), tch::Tensor::zeros([8, 4], tch::kind::FLOAT_CPU));
    /// let mut losses = Vec::new();
    /// let first = pg.rank() == 0;
    /// schedule.step(first.then_some(&x), (!first).then_some(&y), &mut losses)?;
    /// opt.step()?;
    /// opt.zero_grad();
    /// # Ok(()) }
    /// ```
    Schedule1F1B,
    Kind::OneFOneB,
    "Schedule1F1B::new",
    "Schedule1F1B::step"
);

macro_rules! multi_stage_schedule {
    ($(#[$doc:meta])* $name:ident, $kind:expr, $op_new:literal, $op_step:literal) => {
        $(#[$doc])*
        pub struct $name<M> {
            runner: Runner<M>,
        }

        impl<M> std::fmt::Debug for $name<M> {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.debug_struct(stringify!($name))
                    .field("stages", &self.runner.stages)
                    .field("n_microbatches", &self.runner.n_microbatches)
                    .finish_non_exhaustive()
            }
        }

        impl<M: 'static> $name<M> {
            /// The schedule over this rank's `stages` (in any order), as
            /// [`Schedule1F1B::new`]; the stage count must be the group's size times the
            /// stages per rank, each stage on the rank the schedule's placement puts it on,
            /// and the microbatches what the schedule needs (its own documentation says).
            pub fn new(
                stages: Vec<PipelineStage<M>>,
                n_microbatches: usize,
                loss_fn: impl Fn(&Tensor, &Tensor) -> Tensor + 'static,
            ) -> Result<Self, PipelineError> {
                let runner = Runner::new(
                    ($op_new, $op_step),
                    $kind,
                    stages,
                    n_microbatches,
                    Box::new(loss_fn),
                )?;
                Ok(Self { runner })
            }

            schedule_methods!();

            /// This rank's stages, by stage index.
            pub fn stages(&self) -> &[PipelineStage<M>] {
                &self.runner.stages
            }

            /// This rank's stages, mutably.
            pub fn stages_mut(&mut self) -> &mut [PipelineStage<M>] {
                &mut self.runner.stages
            }

            /// The stages, given back.
            pub fn into_stages(self) -> Vec<PipelineStage<M>> {
                self.runner.stages
            }
        }
    };
}

multi_stage_schedule!(
    /// Interleaved 1F1B (PyTorch's `ScheduleInterleaved1F1B`, Megatron's interleaved schedule):
    /// each rank holds several stages in loop placement (rank `r` of `P`: stages `r`, `r + P`,
    /// ...), forwards go depth first in rounds of `n_microbatches / max(1, n_microbatches / P)`
    /// microbatches per local stage, then one forward and one backward in turn; the bubble
    /// shrinks by the number of stages per rank, for more messages.
    ///
    /// ```no_run
    /// use tch::nn;
    /// use tch_dist::pipelining::{PipelineStage, ScheduleInterleaved1F1B};
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let pg = tch_dist::init_process_group(tch_dist::Backend::Gloo)?; // 2 ranks, 4 stages
    /// let vs = nn::VarStore::new(tch::Device::Cpu);
    /// let (r, p) = (pg.rank(), pg.world_size());
    /// let stages: Vec<_> = [r, r + p]
    ///     .into_iter()
    ///     .map(|s| {
    ///         let part = nn::linear(vs.root() / "layers" / s, 4, 4, Default::default());
    ///         PipelineStage::new(part, s, 2 * p, tch::Device::Cpu, &pg)
    ///     })
    ///     .collect();
    /// let mut schedule =
    ///     ScheduleInterleaved1F1B::new(stages, 4, |out, y| out.mse_loss(y, tch::Reduction::Mean))?;
    /// # Ok(()) }
    /// ```
    ScheduleInterleaved1F1B,
    Kind::Interleaved,
    "ScheduleInterleaved1F1B::new",
    "ScheduleInterleaved1F1B::step"
);

multi_stage_schedule!(
    /// Interleaved zero bubble (PyTorch's `ScheduleInterleavedZeroBubble`, the ZB1P schedule
    /// of Qi et al., "Zero Bubble Pipeline Parallelism"): as [`ScheduleInterleaved1F1B`]
    /// (loop placement, depth first in rounds; one stage per rank is allowed), but each
    /// backward is split in two. The input backward sends the gradient to the previous stage
    /// as soon as it is known; the weight backward (the parameters' gradients) follows later,
    /// `rank` actions late, filling the time a gradient takes to come back. Gradients are the
    /// same as 1F1B's; the bubble is about a third of it where the input and weight passes
    /// cost about the same.
    ///
    /// The split needs the stage's autograd graph to be split safely (see
    /// `tch_dist_runtime::backward_input`); a stage that synchronises gradients in its
    /// backward ([`PipelineStage::on_backward`]), or a process where `replicate`,
    /// `fully_shard` or `shard_module` manage parameters, runs each backward whole in its
    /// input slot instead (the same gradients, 1F1B's bubble).
    ///
    /// ```no_run
    /// use tch::nn;
    /// use tch_dist::pipelining::{PipelineStage, ScheduleInterleavedZeroBubble};
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let pg = tch_dist::init_process_group(tch_dist::Backend::Gloo)?; // 2 ranks, 2 stages
    /// let vs = nn::VarStore::new(tch::Device::Cpu);
    /// let part = nn::linear(vs.root() / "layers" / pg.rank(), 4, 4, Default::default());
    /// let stage = PipelineStage::new(part, pg.rank(), 2, tch::Device::Cpu, &pg);
    /// let mut schedule = ScheduleInterleavedZeroBubble::new(vec![stage], 4, |out, y| {
    ///     out.mse_loss(y, tch::Reduction::Mean)
    /// })?;
    /// let x = tch::Tensor::randn([8, 4], tch::kind::FLOAT_CPU);
    /// let mut losses = Vec::new();
    /// let first = pg.rank() == 0;
    /// schedule.step(first.then_some(&x), (!first).then_some(&x), &mut losses)?;
    /// # Ok(()) }
    /// ```
    ScheduleInterleavedZeroBubble,
    Kind::ZeroBubble,
    "ScheduleInterleavedZeroBubble::new",
    "ScheduleInterleavedZeroBubble::step"
);

multi_stage_schedule!(
    /// The V-shaped zero bubble (PyTorch's `ScheduleZBVZeroBubble`, the ZB-V schedule of Qi
    /// et al., "Zero Bubble Pipeline Parallelism", section 6): exactly two stages per rank in
    /// the V placement, rank `r` of `P` holding stages `r` and `2P - 1 - r`, so that the
    /// microbatches go down the ranks and back up, and rank 0 holds both the first stage
    /// (the input) and the last (the target and the loss). Each backward is split as in
    /// [`ScheduleInterleavedZeroBubble`], and the weight backwards fill the bubble; where a
    /// forward, an input backward and a weight backward cost the same, the V has no bubble
    /// but its warmup and cooldown, with 1F1B's peak of activations. The two stages of rank
    /// `P - 1` are neighbours: the activation and its gradient between them are handed over
    /// in memory, not sent. Any number of microbatches (PyTorch plans for at least
    /// `2P - 1` and leaves the rest out, as here).
    ///
    /// A stage whose backward cannot be split (see [`ScheduleInterleavedZeroBubble`]) runs
    /// it whole in its input slot: the same gradients.
    ///
    /// ```no_run
    /// use tch::nn;
    /// use tch_dist::pipelining::{PipelineStage, ScheduleZBVZeroBubble};
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let pg = tch_dist::init_process_group(tch_dist::Backend::Gloo)?; // 2 ranks, 4 stages
    /// let vs = nn::VarStore::new(tch::Device::Cpu);
    /// let (r, p) = (pg.rank(), pg.world_size());
    /// // Rank 0: stages 0 and 3, rank 1: stages 1 and 2.
    /// let stages: Vec<_> = [r, 2 * p - 1 - r]
    ///     .into_iter()
    ///     .map(|s| {
    ///         let part = nn::linear(vs.root() / "layers" / s, 4, 4, Default::default());
    ///         PipelineStage::new(part, s, 2 * p, tch::Device::Cpu, &pg)
    ///     })
    ///     .collect();
    /// let mut schedule =
    ///     ScheduleZBVZeroBubble::new(stages, 4, |out, y| out.mse_loss(y, tch::Reduction::Mean))?;
    /// let (x, y) = (tch::Tensor::randn([8, 4], tch::kind::FLOAT_CPU), tch::Tensor::zeros([8, 4], tch::kind::FLOAT_CPU));
    /// let mut losses = Vec::new();
    /// // Rank 0 holds the first stage and the last: the input and the target.
    /// let first = r == 0;
    /// schedule.step(first.then_some(&x), first.then_some(&y), &mut losses)?;
    /// # Ok(()) }
    /// ```
    ScheduleZBVZeroBubble,
    Kind::ZeroBubbleV,
    "ScheduleZBVZeroBubble::new",
    "ScheduleZBVZeroBubble::step"
);
