//! [`PipelineStage`]: one stage's part of the model and its forward and backward per
//! microbatch (PyTorch's `torch/distributed/pipelining/stage.py`, `PipelineStage`:
//! `forward_one_chunk`, `backward_one_chunk`, `backward_weight_one_chunk`). What moves
//! between stages goes through the stage's [`Transport`] (`transport.rs`).

use std::collections::BTreeMap;
use std::fmt;

use tch::nn::ModuleT;
use tch::{Device, Kind, Tensor};
use tch_dist_core::hooks::{catch_forward_errors, ForwardError};
use tch_dist_core::trace;
use tch_dist_runtime::{backward_input, ProcessGroup, WeightBackward};

use super::error::{PipelineError, StageProblem};
use super::meta::TensorMeta;
use super::placement::Placement;
use super::transport::{Direction, Expect, Handoff, Outbox, Transport};

/// Which part of a microbatch's backward an action runs (PyTorch's `full_backward`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BackwardPart {
    /// The input's gradient and the parameters' (1F1B's "B").
    Whole,
    /// The input's gradient only (zero bubble's "I"); the parameters' follow in
    /// [`PipelineStage::backward_weight_one_chunk`] ("W").
    InputOnly,
}

/// A stage's forward: the part, its input, the train flag.
type ForwardFn<M> = Box<dyn Fn(&M, &Tensor, bool) -> Result<Tensor, ForwardError>>;
/// Called before each microbatch's backward with whether it is the step's last.
type BackwardFn = Box<dyn FnMut(bool) -> Result<(), Box<dyn std::error::Error + Send + Sync>>>;

/// What a stage keeps of one microbatch between its forward and its backward.
struct Chunk {
    /// The received activation (a leaf that requires grad), on stages after the first.
    input: Option<Tensor>,
    /// The output (or, on the last stage, the loss to run backward from).
    output: Tensor,
}

/// A received (or handed over) activation as a stage's input: a leaf that requires grad
/// where it is floating point, so that its backward yields the gradient to send back.
fn input_leaf(t: Tensor) -> Tensor {
    if matches!(
        t.kind(),
        Kind::Float | Kind::Double | Kind::Half | Kind::BFloat16
    ) {
        t.set_requires_grad(true)
    } else {
        t
    }
}

/// One stage of a pipeline: it owns its part of the model (PyTorch's `PipelineStage(submodule,
/// stage_index, num_stages, device, group=...)`).
///
/// The part is any `impl Module` / `ModuleT` (`nn::seq()`, a `#[derive(Shardable)]` block
/// with a forward), built under the same `VarStore` paths as in the whole model, so that its
/// variables are named as in the whole model (`layers.2.weight` on the stage that holds
/// layer 2). Its parameters stay in the `VarStore` the user built it in, which the optimizer
/// goes by. For [`tch_dist::checkpoint`](crate::checkpoint) a `Shardable` part keeps the
/// whole model's FQNs too when it holds the whole model's slots, `None` for the layers of
/// other stages (torchtitan's deleted layers: `layers: Vec<Option<Block>>`, or a field per
/// layer of type `Option<_>`), since a `Vec` counts its elements from 0. Then
/// `checkpoint::save` over all the stages' ranks writes each tensor once (by the lowest
/// rank that holds it), and the checkpoint loads into the unsplit model, into PyTorch's by
/// `dcp.load`, and back into the stages.
///
/// Activation shapes are found at run time, as PyTorch does without example inputs: the
/// first microbatch's (shape, dtype) goes ahead to the next stage once; every later
/// microbatch must match it.
///
/// ```no_run
/// use tch::nn::{self, Module};
/// use tch_dist::pipelining::PipelineStage;
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let pg = tch_dist::init_process_group(tch_dist::Backend::Gloo)?; // 2 ranks
/// let vs = nn::VarStore::new(tch::Device::Cpu);
/// let layers = vs.root() / "layers";
/// // Rank 0 holds layer 0, rank 1 layer 1: the whole model's paths.
/// let i = pg.rank();
/// let part = nn::seq().add(nn::linear(&layers / i, 8, 8, Default::default()));
/// let stage = PipelineStage::new(part, i, 2, tch::Device::Cpu, &pg);
/// assert_eq!(stage.stage_index(), i);
/// # Ok(()) }
/// ```
pub struct PipelineStage<M> {
    module: M,
    forward: ForwardFn<M>,
    on_backward: Option<BackwardFn>,
    /// Where the stage and its neighbours live, and what moves between them.
    transport: Transport,
    chunks: BTreeMap<usize, Chunk>,
    /// The weight passes of split input backwards, by microbatch.
    weight_passes: BTreeMap<usize, WeightBackward>,
    /// How many backwards ran split.
    split_backwards: u64,
}

impl<M> fmt::Debug for PipelineStage<M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PipelineStage")
            .field("stage_index", &self.stage_index())
            .field("num_stages", &self.num_stages())
            .field("device", &self.transport.device())
            .field("rank", &self.group().rank())
            .field("input_meta", &self.transport.input_meta())
            .field("output_meta", &self.transport.output_meta())
            .finish_non_exhaustive()
    }
}

impl<M: ModuleT + 'static> PipelineStage<M> {
    /// Stage `stage_index` of `num_stages`, running `module.forward_t(x, true)`, on the
    /// pipeline's `group` (stage `s` lives on group rank `s % group.world_size()`, or in
    /// the V placement under [`ScheduleZBVZeroBubble`](super::ScheduleZBVZeroBubble)).
    ///
    /// The schedule that takes the stage checks it, on every rank of the group together (a
    /// stage index out of range, a group of one rank, a stage on the wrong rank are refused
    /// there on every rank, not here on one), because a refusal on one rank alone would leave
    /// the others waiting for its activations.
    pub fn new(
        module: M,
        stage_index: usize,
        num_stages: usize,
        device: Device,
        group: &ProcessGroup,
    ) -> Self {
        Self::with_forward(
            module,
            |m: &M, x: &Tensor, train| catch_forward_errors(|| Ok(m.forward_t(x, train))),
            stage_index,
            num_stages,
            device,
            group,
        )
    }
}

impl<M: 'static> PipelineStage<M> {
    /// [`new`](PipelineStage::new) with the stage's forward given: for a part that is no
    /// `ModuleT`, or whose hooks must run (`|m, x, train| m.f_call_t(x, train)` for a
    /// `#[derive(Shardable)]` part under `fully_shard` or `replicate`).
    ///
    /// ```no_run
    /// use tch::nn;
    /// use tch_dist::pipelining::PipelineStage;
    /// use tch_dist::Call;
    /// # let pg = tch_dist::default_group()?;
    /// let vs = nn::VarStore::new(tch::Device::Cpu);
    /// let fc = nn::linear(vs.root() / "layers" / 0, 8, 8, Default::default());
    /// let stage = PipelineStage::with_forward(
    ///     fc,
    ///     |fc, x, _train| Ok(fc.call(x).relu()),
    ///     0,
    ///     2,
    ///     tch::Device::Cpu,
    ///     &pg,
    /// );
    /// # Ok::<(), tch_dist::DistError>(())
    /// ```
    pub fn with_forward(
        module: M,
        forward: impl Fn(&M, &Tensor, bool) -> Result<Tensor, ForwardError> + 'static,
        stage_index: usize,
        num_stages: usize,
        device: Device,
        group: &ProcessGroup,
    ) -> Self {
        Self {
            module,
            forward: Box::new(forward),
            on_backward: None,
            transport: Transport::new(group, stage_index, num_stages, device),
            chunks: BTreeMap::new(),
            weight_passes: BTreeMap::new(),
            split_backwards: 0,
        }
    }
}

impl<M> PipelineStage<M> {
    /// Calls `f(last_backward)` before each microbatch's backward, `last_backward` true for
    /// the step's last microbatch: where data parallelism on the stage's module reduces
    /// gradients once per step (torchtitan's use of `set_requires_gradient_sync`, PyTorch's
    /// `backward_maybe_with_nosync`).
    ///
    /// ```no_run
    /// # use tch::nn;
    /// # let pg = tch_dist::default_group()?;
    /// # let vs = nn::VarStore::new(tch::Device::Cpu);
    /// # let part = nn::linear(vs.root() / "layers" / 0, 8, 8, Default::default());
    /// let stage = tch_dist::pipelining::PipelineStage::new(part, 0, 2, tch::Device::Cpu, &pg)
    ///     .on_backward(|last| {
    ///         // e.g. fsdp_state.set_requires_gradient_sync(last)
    ///         let _ = last;
    ///         Ok(())
    ///     });
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn on_backward(
        mut self,
        f: impl FnMut(bool) -> Result<(), Box<dyn std::error::Error + Send + Sync>> + 'static,
    ) -> Self {
        self.on_backward = Some(Box::new(f));
        self
    }

    /// The stage's part of the model.
    pub fn module(&self) -> &M {
        &self.module
    }

    /// The stage's part, mutably.
    pub fn module_mut(&mut self) -> &mut M {
        &mut self.module
    }

    /// The part, given back.
    pub fn into_module(self) -> M {
        self.module
    }

    /// This stage's index.
    pub fn stage_index(&self) -> usize {
        self.transport.stage_index()
    }

    /// The number of stages of the pipeline.
    pub fn num_stages(&self) -> usize {
        self.transport.num_stages()
    }

    /// Whether this is stage 0.
    pub fn is_first(&self) -> bool {
        self.stage_index() == 0
    }

    /// Whether this is the last stage.
    pub fn is_last(&self) -> bool {
        self.stage_index() + 1 == self.num_stages()
    }

    /// The pipeline's group.
    pub fn group(&self) -> &ProcessGroup {
        self.transport.group()
    }

    /// How many microbatch backwards of this stage ran split: the input's gradient computed
    /// and sent first, the parameters' after it (right away, or later in a zero-bubble
    /// schedule). A first stage has no input gradient to send, and a stage under data
    /// parallelism or tensor parallelism synchronises in its backward: their backwards run
    /// whole (see [`ScheduleInterleavedZeroBubble`](super::ScheduleInterleavedZeroBubble)).
    pub fn split_backwards(&self) -> u64 {
        self.split_backwards
    }

    /// The metadata of this stage's input, once the first step received it.
    pub fn input_meta(&self) -> Option<&TensorMeta> {
        self.transport.input_meta()
    }

    /// Sets where the schedule's stages live (before its checks).
    pub(crate) fn set_placement(&mut self, placement: Placement) {
        self.transport.set_placement(placement);
    }

    /// The rank of the group that holds this stage in its schedule's placement.
    pub(crate) fn expected_rank(&self) -> usize {
        self.transport.rank_of(self.stage_index())
    }

    /// Keeps what a stage on this rank handed over for this one.
    pub(crate) fn take_handoff(&mut self, handoff: Handoff) {
        self.transport.take_handoff(handoff);
    }

    /// Microbatch `mb`'s activation from the previous stage (of `n` this step): a leaf that
    /// requires grad where it is floating point.
    pub(crate) fn recv_activation(&mut self, mb: usize, n: usize) -> Result<Tensor, PipelineError> {
        let received = self
            .transport
            .recv(mb, Expect::Activation { n_microbatches: n })?;
        Ok(input_leaf(received))
    }

    /// Runs the part on microbatch `mb`'s input, keeping what its backward needs.
    pub(crate) fn forward_one_chunk(
        &mut self,
        mb: usize,
        input: Tensor,
    ) -> Result<Tensor, PipelineError> {
        let output = (self.forward)(&self.module, &input, true).map_err(|source| {
            StageProblem::Forward {
                microbatch: mb,
                source,
            }
            .on(self.group().rank(), self.stage_index())
        })?;
        let input = (!self.is_first()).then_some(input);
        self.chunks.insert(
            mb,
            Chunk {
                input,
                output: output.shallow_clone(),
            },
        );
        Ok(output)
    }

    /// The last stage: microbatch `mb`'s loss (scaled as the schedule wants) is what its
    /// backward starts from.
    pub(crate) fn set_loss(&mut self, mb: usize, loss: Tensor) {
        if let Some(chunk) = self.chunks.get_mut(&mb) {
            chunk.output = loss;
        }
    }

    /// Sends microbatch `mb`'s output to the next stage.
    pub(crate) fn send_activation(
        &mut self,
        mb: usize,
        output: &Tensor,
        outbox: &mut Outbox,
    ) -> Result<(), PipelineError> {
        self.transport
            .send(Direction::Forward, mb, output.detach(), outbox)
    }

    /// Microbatch `mb`'s backward (of `n` this step): from its loss on the last stage, else
    /// from the gradient of its output received from the next stage; the gradient of its
    /// input goes back to the previous stage; parameters' gradients accumulate in their
    /// `.grad`.
    ///
    /// Where the stage's backward splits (see [`split_backward`](Self::split_backward)),
    /// the input's gradient is computed and sent first, then, for [`BackwardPart::Whole`],
    /// the parameters' right away (PyTorch's schedules run the whole backward before
    /// sending: the previous stage here waits a weight pass less for every gradient); for
    /// [`BackwardPart::InputOnly`] (a zero-bubble schedule's input backward), in
    /// [`backward_weight_one_chunk`](Self::backward_weight_one_chunk).
    pub(crate) fn backward_one_chunk(
        &mut self,
        mb: usize,
        n: usize,
        part: BackwardPart,
        outbox: &mut Outbox,
    ) -> Result<(), PipelineError> {
        let rank = self.group().rank();
        let stage = self.stage_index();
        let backward_error = |source| {
            StageProblem::Backward {
                microbatch: mb,
                source,
            }
            .on(rank, stage)
        };
        let Some(chunk) = self.chunks.remove(&mb) else {
            return Err(backward_error(tch::TchError::Kind(format!(
                "microbatch {mb} has no forward on stage {stage} (an internal schedule error)"
            ))));
        };
        if let Some(f) = self.on_backward.as_mut() {
            f(mb + 1 == n).map_err(|source| {
                StageProblem::GradientSync {
                    microbatch: mb,
                    source,
                }
                .on(rank, stage)
            })?;
        }
        let grad = if self.is_last() {
            chunk.output.ones_like()
        } else {
            self.transport.recv(mb, Expect::GradientOf(&chunk.output))?
        };
        let (input_grad, weights) = backward_input(
            &[chunk.output],
            &[grad],
            chunk.input.as_ref(),
            self.split_backward(),
        )
        .map_err(|e| backward_error(tch::TchError::Kind(e.to_string())))?;
        if let Some(weights) = weights {
            self.weight_passes.insert(mb, weights);
            self.split_backwards += 1;
        }
        if let Some(input) = chunk.input {
            // The part did not use its input (or it is not floating point): the previous
            // stage's backward still waits for a gradient.
            let grad = input_grad.unwrap_or_else(|| input.zeros_like());
            self.transport.send(Direction::Backward, mb, grad, outbox)?;
        }
        match part {
            BackwardPart::Whole => self.backward_weight_one_chunk(mb),
            BackwardPart::InputOnly => Ok(()),
        }
    }

    /// Microbatch `mb`'s weight backward: the parameters' gradients its split input backward
    /// left (none where that backward was whole).
    pub(crate) fn backward_weight_one_chunk(&mut self, mb: usize) -> Result<(), PipelineError> {
        match self.weight_passes.remove(&mb) {
            Some(weights) => {
                let _span =
                    trace::enabled().then(|| trace::span(format!("weight pass {mb}"), "backward"));
                weights.run().map_err(|e| {
                    StageProblem::Backward {
                        microbatch: mb,
                        source: tch::TchError::Kind(e.to_string()),
                    }
                    .on(self.group().rank(), self.stage_index())
                })
            }
            None => Ok(()),
        }
    }

    /// Whether this stage's backward may split into an input pass and a weight pass: not on
    /// a stage that synchronises gradients in its backward ([`on_backward`](Self::on_backward)),
    /// nor in a process where `replicate`, `fully_shard` or `shard_module` manage parameters,
    /// whose hooks expect the whole backward in one pass (fully_shard's end-of-backward
    /// callback would reduce gradients the weight pass has not computed yet). The split itself
    /// declines a first stage (no input gradient to send) and a graph it cannot split. Where
    /// it does not split, each backward runs whole, and a zero-bubble schedule's weight
    /// backward does nothing.
    fn split_backward(&self) -> bool {
        self.on_backward.is_none() && !crate::state_dict::managed::any()
    }

    /// Forgets the activation metadata, so that the next step sends (or receives) it again:
    /// every rank does so together when the batch's size changes.
    pub(crate) fn reset_meta(&mut self) {
        self.transport.reset_meta();
    }

    /// Forgets every microbatch kept, every receive posted ahead and every handoff (after a
    /// failed step: see [`Transport::clear`]).
    pub(crate) fn clear(&mut self) {
        self.chunks.clear();
        self.transport.clear();
        self.weight_passes.clear();
    }

    /// Moves the first stage's microbatch input to the stage's device.
    pub(crate) fn place_input(&self, x: &Tensor) -> Tensor {
        x.to_device(self.transport.device())
    }
}
