//! [`PipelineStage`]: one stage's part of the model, its forward and backward per
//! microbatch, and the point-to-point transfers with its neighbours (PyTorch's
//! `torch/distributed/pipelining/stage.py`, `PipelineStage`).
//!
//! The protocol between stage `s` and stage `s + 1` on other ranks (in loop placement stage `s`
//! is on rank `s % P`; see [`Placement`]):
//!
//! - once, before the first microbatch's activation of the first step (and again at a step
//!   whose batch size differs from the last exchange's, which every rank learns from the
//!   step's check): its metadata (shape and dtype) as one string object over the object
//!   channel (`send_object_list`; PyTorch's runtime shape inference also goes by
//!   `recv_object_list`), so that the receiver can allocate its buffers;
//! - per microbatch `m`: the activation with tag `tag(s, m, forward)`, and later the
//!   gradient of that activation back with `tag(s + 1, m, backward)`: distinct per stage,
//!   microbatch and direction, so that the transfers of several stages between the same two
//!   ranks (interleaved schedules) never match the wrong receive.
//!
//! Sends are asynchronous (waited for at the end of the step, as PyTorch's schedules wait for
//! their send works late); receives are waited for before the compute that needs them. With
//! a schedule whose order respects the data dependencies, no rank then waits for a rank that
//! waits for it.
//!
//! Two neighbouring stages on one rank (the V placement's turn, stages `P - 1` and `P` on
//! rank `P - 1`) exchange nothing over the group: the activation and its gradient are handed
//! over in memory ([`Handoff`], PyTorch's `set_local_fwd_input` / `set_local_bwd_input`).

use std::collections::BTreeMap;
use std::fmt;

use tch::nn::ModuleT;
use tch::{Device, Kind, Tensor};
use tch_dist_core::hooks::{catch_forward_errors, ForwardError};
use tch_dist_core::trace;
use tch_dist_runtime::{backward_input, DistError, Object, ProcessGroup, WeightBackward, Work};

use super::error::{PipelineError, Transfer};

/// The shape and dtype of one activation, as the first microbatch had it (PyTorch's
/// `_make_tensor_from_meta` goes by the same two).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorMeta {
    /// The activation's shape (the microbatch's, dim 0 included).
    pub shape: Vec<i64>,
    /// Its dtype.
    pub kind: Kind,
}

/// The dtypes an activation may have, with PyTorch's names (what the metadata string says).
const KINDS: [(Kind, &str); 10] = [
    (Kind::Float, "float32"),
    (Kind::Double, "float64"),
    (Kind::Half, "float16"),
    (Kind::BFloat16, "bfloat16"),
    (Kind::Int64, "int64"),
    (Kind::Int, "int32"),
    (Kind::Int16, "int16"),
    (Kind::Int8, "int8"),
    (Kind::Uint8, "uint8"),
    (Kind::Bool, "bool"),
];

/// What the metadata string starts with (a version, so that a change is an error, not a
/// misread).
const META_PREFIX: &str = "tch-dist-pipelining-meta-v1";

impl TensorMeta {
    /// The metadata of `t`.
    pub fn of(t: &Tensor) -> Self {
        Self {
            shape: t.size(),
            kind: t.kind(),
        }
    }

    fn kind_name(&self) -> String {
        KINDS
            .iter()
            .find(|(k, _)| *k == self.kind)
            .map_or_else(|| format!("{:?}", self.kind), |(_, n)| n.to_string())
    }

    /// The string sent ahead: `tch-dist-pipelining-meta-v1 float32 4,16`.
    pub(crate) fn encode(&self) -> String {
        let dims: Vec<String> = self.shape.iter().map(i64::to_string).collect();
        format!("{META_PREFIX} {} {}", self.kind_name(), dims.join(","))
    }

    /// The metadata a string from [`encode`](Self::encode) describes.
    pub(crate) fn decode(text: &str) -> Option<Self> {
        let mut words = text.split(' ');
        if words.next()? != META_PREFIX {
            return None;
        }
        let name = words.next()?;
        let kind = KINDS.iter().find(|(_, n)| *n == name)?.0;
        let dims = words.next()?;
        let shape = if dims.is_empty() {
            Vec::new()
        } else {
            dims.split(',')
                .map(|d| d.parse::<i64>().ok().filter(|&d| d >= 0))
                .collect::<Option<Vec<i64>>>()?
        };
        words.next().is_none().then_some(Self { shape, kind })
    }
}

impl fmt::Display for TensorMeta {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{:?}", self.kind_name(), self.shape)
    }
}

/// The direction of a transfer, for its tag.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Direction {
    Forward = 0,
    Backward = 1,
}

/// The message tag of what stage `sender` sends for `microbatch` in `direction` (tag 0 is
/// the object channel's).
pub(crate) fn tag(
    num_stages: usize,
    sender: usize,
    microbatch: usize,
    direction: Direction,
) -> i32 {
    (1 + 2 * (microbatch * num_stages + sender) + direction as usize) as i32
}

/// The largest `stages x microbatches` whose tags fit an `i32`.
pub(crate) fn tags_fit(num_stages: usize, n_microbatches: usize) -> bool {
    n_microbatches
        .checked_mul(num_stages)
        .and_then(|n| n.checked_mul(2))
        .is_some_and(|n| n < i32::MAX as usize - 2)
}

/// Which rank of the pipeline's group holds each stage (PyTorch's
/// `generate_stage_to_rank_mapping` styles); the schedule that takes the stages sets it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Placement {
    /// Stage `s` on rank `s % P` (PyTorch's "loop"): every schedule but the V-shaped one.
    Loop,
    /// Two stages per rank, down then back up (PyTorch's "v"): rank `r` holds stages `r` and
    /// `2P - 1 - r`, so that rank 0 holds the first and the last.
    V,
}

impl Placement {
    /// The rank of a group of `group_size` that holds `stage`.
    pub(crate) fn rank_of(self, stage: usize, group_size: usize) -> usize {
        match self {
            Placement::Loop => stage % group_size,
            Placement::V => {
                let s = stage % (2 * group_size);
                if s < group_size {
                    s
                } else {
                    2 * group_size - 1 - s
                }
            }
        }
    }
}

/// An activation or gradient for a stage on this same rank, handed over in memory instead
/// of sent: the schedule gives it to stage `to` (see [`PipelineStage::take_handoff`]).
pub(crate) struct Handoff {
    pub to: usize,
    pub direction: Direction,
    pub microbatch: usize,
    pub tensor: Tensor,
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

/// A send in flight, with the tensor it reads (kept alive until it completes).
pub(crate) struct PendingSend {
    work: Work,
    _tensor: Tensor,
    stage: usize,
    transfer: Transfer,
    microbatch: usize,
    peer_stage: usize,
    peer_rank: usize,
}

impl PendingSend {
    /// Waits for the send; its failure names both stages.
    pub(crate) fn wait(self, rank: usize) -> Result<(), PipelineError> {
        let PendingSend {
            work,
            stage,
            transfer,
            microbatch,
            peer_stage,
            peer_rank,
            ..
        } = self;
        work.wait().map_err(|e| PipelineError::Transfer {
            rank,
            stage,
            transfer,
            microbatch,
            peer_stage,
            peer_rank,
            source: Box::new(e),
        })
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
    stage_index: usize,
    num_stages: usize,
    device: Device,
    group: ProcessGroup,
    /// What the previous stage said its activations are (first step).
    input_meta: Option<TensorMeta>,
    /// What this stage told the next one.
    output_meta: Option<TensorMeta>,
    chunks: BTreeMap<usize, Chunk>,
    /// Receives posted ahead of the compute that needs them, by direction and microbatch:
    /// a transfer starts once both ends have posted (Gloo's receiver says it is ready), so
    /// a receive posted early lets the data move while this stage computes (PyTorch's 1F1B
    /// posts the gradient's receive with the activation's send, in one batch).
    posted: BTreeMap<(Direction, usize), (Tensor, Work)>,
    /// The weight passes of split input backwards, by microbatch.
    weight_passes: BTreeMap<usize, WeightBackward>,
    /// Where the stages of this stage's schedule live.
    placement: Placement,
    /// What a neighbouring stage on this rank handed over, by direction and microbatch.
    handed: BTreeMap<(Direction, usize), Tensor>,
    /// How many backwards ran split.
    split_backwards: u64,
}

impl<M> fmt::Debug for PipelineStage<M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PipelineStage")
            .field("stage_index", &self.stage_index)
            .field("num_stages", &self.num_stages)
            .field("device", &self.device)
            .field("rank", &self.group.rank())
            .field("input_meta", &self.input_meta)
            .field("output_meta", &self.output_meta)
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
            stage_index,
            num_stages,
            device,
            group: group.clone(),
            input_meta: None,
            output_meta: None,
            chunks: BTreeMap::new(),
            posted: BTreeMap::new(),
            weight_passes: BTreeMap::new(),
            placement: Placement::Loop,
            handed: BTreeMap::new(),
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
        self.stage_index
    }

    /// The number of stages of the pipeline.
    pub fn num_stages(&self) -> usize {
        self.num_stages
    }

    /// Whether this is stage 0.
    pub fn is_first(&self) -> bool {
        self.stage_index == 0
    }

    /// Whether this is the last stage.
    pub fn is_last(&self) -> bool {
        self.stage_index + 1 == self.num_stages
    }

    /// The pipeline's group.
    pub fn group(&self) -> &ProcessGroup {
        &self.group
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
        self.input_meta.as_ref()
    }

    fn rank_of(&self, stage: usize) -> usize {
        self.placement.rank_of(stage, self.group.world_size())
    }

    /// Whether `stage` lives on this rank (its transfers with this stage are handoffs).
    fn is_local(&self, stage: usize) -> bool {
        self.rank_of(stage) == self.group.rank()
    }

    /// Sets where the schedule's stages live (before its checks).
    pub(crate) fn set_placement(&mut self, placement: Placement) {
        self.placement = placement;
    }

    /// The rank of the group that holds this stage in its schedule's placement.
    pub(crate) fn expected_rank(&self) -> usize {
        self.rank_of(self.stage_index)
    }

    /// Keeps what a stage on this rank handed over for this one.
    pub(crate) fn take_handoff(&mut self, handoff: Handoff) {
        self.handed
            .insert((handoff.direction, handoff.microbatch), handoff.tensor);
    }

    /// Microbatch `mb`'s activation or gradient in `direction` that a stage on this rank
    /// handed over; its absence is a schedule whose order does not fit (an internal error).
    fn handed_over(
        &mut self,
        direction: Direction,
        mb: usize,
        transfer: Transfer,
    ) -> Result<Tensor, PipelineError> {
        let (from, _) = self.recv_from(direction);
        self.handed.remove(&(direction, mb)).ok_or_else(|| {
            self.transfer_error(
                transfer,
                mb,
                from,
                DistError::Internal {
                    rank: self.group.rank(),
                    op: "handoff",
                    what: "the stage on this rank has not handed it over yet (the schedule's \
                           order does not fit)",
                },
            )
        })
    }

    fn transfer_error(
        &self,
        transfer: Transfer,
        microbatch: usize,
        peer_stage: usize,
        e: DistError,
    ) -> PipelineError {
        PipelineError::Transfer {
            rank: self.group.rank(),
            stage: self.stage_index,
            transfer,
            microbatch,
            peer_stage,
            peer_rank: self.rank_of(peer_stage),
            source: Box::new(e),
        }
    }

    /// The stage a receive in `direction` comes from, and the transfer it is in errors.
    fn recv_from(&self, direction: Direction) -> (usize, Transfer) {
        match direction {
            Direction::Forward => (self.stage_index - 1, Transfer::RecvActivation),
            Direction::Backward => (self.stage_index + 1, Transfer::RecvGradient),
        }
    }

    /// Posts the receive of microbatch `mb`'s transfer in `direction` into a new buffer of
    /// `meta`'s shape, unless it is posted already.
    fn post_recv(
        &mut self,
        direction: Direction,
        mb: usize,
        meta: &TensorMeta,
    ) -> Result<(), PipelineError> {
        if self.posted.contains_key(&(direction, mb)) {
            return Ok(());
        }
        let (from, transfer) = self.recv_from(direction);
        let buffer = Tensor::empty(meta.shape.as_slice(), (meta.kind, self.device));
        let t = tag(self.num_stages, from, mb, direction);
        let work = self
            .group
            .recv_async(&buffer, self.rank_of(from), t)
            .map_err(|e| self.transfer_error(transfer, mb, from, e))?;
        self.posted.insert((direction, mb), (buffer, work));
        Ok(())
    }

    /// Waits for microbatch `mb`'s receive in `direction` (posted now if it was not) and
    /// returns its buffer.
    fn wait_recv(
        &mut self,
        direction: Direction,
        mb: usize,
        meta: &TensorMeta,
    ) -> Result<Tensor, PipelineError> {
        self.post_recv(direction, mb, meta)?;
        let (buffer, work) = self
            .posted
            .remove(&(direction, mb))
            .expect("posted just above");
        let (from, transfer) = self.recv_from(direction);
        let _wait = trace::enabled().then(|| {
            let what = match direction {
                Direction::Forward => "activation",
                Direction::Backward => "gradient",
            };
            trace::span(format!("wait {what} {mb} from stage {from}"), "wait")
        });
        work.wait()
            .map_err(|e| self.transfer_error(transfer, mb, from, e))?;
        Ok(buffer)
    }

    /// Receives microbatch `mb`'s activation from the previous stage (its metadata first, on
    /// the first step): a leaf that requires grad where it is floating point. The receive
    /// of the next microbatch's (of `n` this step) is posted before this one is waited for.
    pub(crate) fn recv_activation(&mut self, mb: usize, n: usize) -> Result<Tensor, PipelineError> {
        let prev = self.stage_index - 1;
        if self.is_local(prev) {
            let handed = self.handed_over(Direction::Forward, mb, Transfer::RecvActivation)?;
            return Ok(input_leaf(handed));
        }
        let peer = self.rank_of(prev);
        let meta = match &self.input_meta {
            Some(meta) => meta.clone(),
            None => {
                let mut got = [Object::from("")];
                self.group
                    .recv_object_list(&mut got, peer)
                    .map_err(|e| self.transfer_error(Transfer::RecvMetadata, mb, prev, e))?;
                let text = got[0].as_str().unwrap_or_default().to_string();
                let meta = TensorMeta::decode(&text).ok_or_else(|| PipelineError::Metadata {
                    rank: self.group.rank(),
                    stage: self.stage_index,
                    from_stage: prev,
                    text: text.clone(),
                })?;
                self.input_meta = Some(meta.clone());
                meta
            }
        };
        self.post_recv(Direction::Forward, mb, &meta)?;
        if mb + 1 < n {
            self.post_recv(Direction::Forward, mb + 1, &meta)?;
        }
        let buffer = self.wait_recv(Direction::Forward, mb, &meta)?;
        Ok(input_leaf(buffer))
    }

    /// Runs the part on microbatch `mb`'s input, keeping what its backward needs.
    pub(crate) fn forward_one_chunk(
        &mut self,
        mb: usize,
        input: Tensor,
    ) -> Result<Tensor, PipelineError> {
        let output = (self.forward)(&self.module, &input, true).map_err(|source| {
            PipelineError::Forward {
                rank: self.group.rank(),
                stage: self.stage_index,
                microbatch: mb,
                source,
            }
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

    /// Sends microbatch `mb`'s output to the next stage (its metadata ahead, on the first
    /// microbatch this stage ever sends).
    pub(crate) fn send_activation(
        &mut self,
        mb: usize,
        output: &Tensor,
        pending: &mut Vec<PendingSend>,
        handoffs: &mut Vec<Handoff>,
    ) -> Result<(), PipelineError> {
        let next = self.stage_index + 1;
        if self.is_local(next) {
            handoffs.push(Handoff {
                to: next,
                direction: Direction::Forward,
                microbatch: mb,
                tensor: output.detach(),
            });
            return Ok(());
        }
        let peer = self.rank_of(next);
        let meta = TensorMeta::of(output);
        match &self.output_meta {
            Some(expected) if *expected != meta => {
                return Err(PipelineError::ShapeMismatch {
                    rank: self.group.rank(),
                    stage: self.stage_index,
                    next_stage: next,
                    microbatch: mb,
                    expected: expected.clone(),
                    got: meta,
                })
            }
            Some(_) => {}
            None => {
                self.group
                    .send_object_list(&[Object::from(meta.encode())], peer)
                    .map_err(|e| self.transfer_error(Transfer::SendMetadata, mb, next, e))?;
                self.output_meta = Some(meta.clone());
            }
        }
        let data = output.detach();
        let t = tag(self.num_stages, self.stage_index, mb, Direction::Forward);
        let work = self
            .group
            .send_async(&data, peer, t)
            .map_err(|e| self.transfer_error(Transfer::SendActivation, mb, next, e))?;
        pending.push(PendingSend {
            work,
            _tensor: data,
            stage: self.stage_index,
            transfer: Transfer::SendActivation,
            microbatch: mb,
            peer_stage: next,
            peer_rank: peer,
        });
        // Its gradient comes back in the output's shape: its receive posted now.
        self.post_recv(Direction::Backward, mb, &meta)
    }

    /// Microbatch `mb`'s backward: from its loss on the last stage, else from the gradient
    /// of its output received from the next stage; the gradient of its input goes back to
    /// the previous stage; parameters' gradients accumulate in their `.grad`.
    ///
    /// Where the stage's backward splits (see [`split_backward`](Self::split_backward)),
    /// the input's gradient is computed and sent first, then, with `defer_weights` false, the
    /// parameters' right away (PyTorch's schedules run the whole backward before sending:
    /// the previous stage here waits a weight pass less for every gradient); with
    /// `defer_weights` (a zero-bubble schedule's input backward), in
    /// [`backward_weight_one_chunk`](Self::backward_weight_one_chunk).
    pub(crate) fn backward_one_chunk(
        &mut self,
        mb: usize,
        last_backward: bool,
        defer_weights: bool,
        pending: &mut Vec<PendingSend>,
        handoffs: &mut Vec<Handoff>,
    ) -> Result<(), PipelineError> {
        let rank = self.group.rank();
        let stage = self.stage_index;
        let backward_error = |source| PipelineError::Backward {
            rank,
            stage,
            microbatch: mb,
            source,
        };
        let Some(chunk) = self.chunks.remove(&mb) else {
            return Err(backward_error(tch::TchError::Kind(format!(
                "microbatch {mb} has no forward on stage {stage} (an internal schedule error)"
            ))));
        };
        if let Some(f) = self.on_backward.as_mut() {
            f(last_backward).map_err(|source| PipelineError::GradientSync {
                rank,
                stage,
                microbatch: mb,
                source,
            })?;
        }
        let grad = if self.is_last() {
            chunk.output.ones_like()
        } else if self.is_local(stage + 1) {
            self.handed_over(Direction::Backward, mb, Transfer::RecvGradient)?
        } else {
            self.wait_recv(Direction::Backward, mb, &TensorMeta::of(&chunk.output))?
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
            let prev = stage - 1;
            // The part did not use its input (or it is not floating point): the previous
            // stage's backward still waits for a gradient.
            let grad = input_grad.unwrap_or_else(|| input.zeros_like());
            if self.is_local(prev) {
                handoffs.push(Handoff {
                    to: prev,
                    direction: Direction::Backward,
                    microbatch: mb,
                    tensor: grad,
                });
            } else {
                let t = tag(self.num_stages, stage, mb, Direction::Backward);
                let peer = self.rank_of(prev);
                let work = self
                    .group
                    .send_async(&grad, peer, t)
                    .map_err(|e| self.transfer_error(Transfer::SendGradient, mb, prev, e))?;
                pending.push(PendingSend {
                    work,
                    _tensor: grad,
                    stage,
                    transfer: Transfer::SendGradient,
                    microbatch: mb,
                    peer_stage: prev,
                    peer_rank: peer,
                });
            }
        }
        if defer_weights {
            Ok(())
        } else {
            self.backward_weight_one_chunk(mb)
        }
    }

    /// Microbatch `mb`'s weight backward: the parameters' gradients its split input backward
    /// left (none where that backward was whole).
    pub(crate) fn backward_weight_one_chunk(&mut self, mb: usize) -> Result<(), PipelineError> {
        match self.weight_passes.remove(&mb) {
            Some(weights) => {
                let _span =
                    trace::enabled().then(|| trace::span(format!("weight pass {mb}"), "backward"));
                weights.run().map_err(|e| PipelineError::Backward {
                    rank: self.group.rank(),
                    stage: self.stage_index,
                    microbatch: mb,
                    source: tch::TchError::Kind(e.to_string()),
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
        self.input_meta = None;
        self.output_meta = None;
    }

    /// Forgets every microbatch kept and every receive posted ahead (after a failed step,
    /// whose peers fail too: a receive posted ahead that a peer's send never matched stays
    /// with the engine, so a later step on the same group would wait for its data in vain
    /// and fail at the timeout, never read it).
    pub(crate) fn clear(&mut self) {
        self.chunks.clear();
        self.posted.clear();
        self.weight_passes.clear();
        self.handed.clear();
    }

    /// Moves the first stage's microbatch input to the stage's device.
    pub(crate) fn place_input(&self, x: &Tensor) -> Tensor {
        x.to_device(self.device)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metadata_round_trips_and_refuses_what_is_not_it() {
        let meta = TensorMeta {
            shape: vec![4, 16],
            kind: Kind::Float,
        };
        assert_eq!(meta.encode(), "tch-dist-pipelining-meta-v1 float32 4,16");
        assert_eq!(TensorMeta::decode(&meta.encode()), Some(meta.clone()));
        assert_eq!(meta.to_string(), "float32[4, 16]");
        let scalar = TensorMeta {
            shape: vec![],
            kind: Kind::Int64,
        };
        assert_eq!(TensorMeta::decode(&scalar.encode()), Some(scalar));
        for bad in [
            "",
            "tch-dist-pipelining-meta-v2 float32 4",
            "tch-dist-pipelining-meta-v1 complex 4",
            "tch-dist-pipelining-meta-v1 float32 4,-1",
            "tch-dist-pipelining-meta-v1 float32 4 extra",
        ] {
            assert_eq!(TensorMeta::decode(bad), None, "{bad}");
        }
    }

    #[test]
    fn tags_are_distinct_per_stage_microbatch_and_direction() {
        let mut seen = std::collections::BTreeSet::new();
        for s in 0..4 {
            for m in 0..8 {
                for d in [Direction::Forward, Direction::Backward] {
                    let t = tag(4, s, m, d);
                    assert!(t > 0);
                    assert!(seen.insert(t));
                }
            }
        }
        assert!(tags_fit(4, 8));
        assert!(!tags_fit(1 << 16, 1 << 16));
    }
}
