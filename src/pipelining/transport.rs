//! A stage's transfers with its neighbouring stages: sends, receives and in-memory handoffs,
//! each decided in one place ([`Transport::route`]) (PyTorch's `stage.py`: `get_fwd_send_ops`,
//! `get_bwd_send_ops`, `get_fwd_recv_ops`, `get_bwd_recv_ops`, `set_local_fwd_input`,
//! `set_local_bwd_input`; `schedules.py`'s `_batch_p2p` / `_wait_batch_p2p`).
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

use tch::{Device, Tensor};
use tch_dist_core::trace;
use tch_dist_runtime::{DistError, Object, ProcessGroup, Work};

use super::error::{PipelineError, StageProblem, Transfer};
use super::meta::TensorMeta;
use super::placement::Placement;

/// The direction of a transfer, for its tag.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Direction {
    Forward = 0,
    Backward = 1,
}

impl Direction {
    /// What a stage sends in this direction, in errors.
    fn sent(self) -> Transfer {
        match self {
            Direction::Forward => Transfer::SendActivation,
            Direction::Backward => Transfer::SendGradient,
        }
    }

    /// What a stage receives in this direction, in errors.
    fn received(self) -> Transfer {
        match self {
            Direction::Forward => Transfer::RecvActivation,
            Direction::Backward => Transfer::RecvGradient,
        }
    }
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

/// An activation or gradient for a stage on this same rank, handed over in memory instead
/// of sent: the schedule gives it to stage `to` (see [`Transport::take_handoff`]).
pub(crate) struct Handoff {
    pub to: usize,
    pub direction: Direction,
    pub microbatch: usize,
    pub tensor: Tensor,
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
        work.wait().map_err(|e| {
            StageProblem::Transfer {
                transfer,
                microbatch,
                peer_stage,
                peer_rank,
                source: Box::new(e),
            }
            .on(rank, stage)
        })
    }
}

/// What a step's actions leave to finish: the sends in flight, waited for at the step's end,
/// and the handoffs to stages on this rank, delivered before the next action (PyTorch's
/// schedules batch each action's send ops and wait for them late).
#[derive(Default)]
pub(crate) struct Outbox {
    pub sends: Vec<PendingSend>,
    pub handoffs: Vec<Handoff>,
}

/// What a receive's buffer is shaped by, and so what it receives.
pub(crate) enum Expect<'a> {
    /// An activation from the previous stage, in the shape that stage announced (learnt on
    /// the first step); the receive of the step's next microbatch (of `n_microbatches`) is
    /// posted before this one is waited for.
    Activation { n_microbatches: usize },
    /// The gradient of this stage's output, from the next stage: in the output's shape.
    GradientOf(&'a Tensor),
}

/// How a transfer with a neighbouring stage moves.
enum Route {
    /// In memory: the neighbour lives on this rank.
    InMemory,
    /// Over the group, with the neighbour's rank.
    Rank(usize),
}

/// A stage's end of its transfers: where it and its neighbours live, the activation
/// metadata it announced and learnt, the receives posted ahead and what a stage on this rank
/// handed over.
pub(crate) struct Transport {
    group: ProcessGroup,
    stage_index: usize,
    num_stages: usize,
    device: Device,
    /// Where the stages of this stage's schedule live.
    placement: Placement,
    /// What the previous stage said its activations are (first step).
    input_meta: Option<TensorMeta>,
    /// What this stage told the next one.
    output_meta: Option<TensorMeta>,
    /// Receives posted ahead of the compute that needs them, by direction and microbatch:
    /// a transfer starts once both ends have posted (Gloo's receiver says it is ready), so
    /// a receive posted early lets the data move while this stage computes (PyTorch's 1F1B
    /// posts the gradient's receive with the activation's send, in one batch).
    posted: BTreeMap<(Direction, usize), (Tensor, Work)>,
    /// What a neighbouring stage on this rank handed over, by direction and microbatch.
    handed: BTreeMap<(Direction, usize), Tensor>,
}

impl Transport {
    /// Stage `stage_index` of `num_stages` on `group`, its buffers on `device`, in the loop
    /// placement until its schedule says otherwise.
    pub(crate) fn new(
        group: &ProcessGroup,
        stage_index: usize,
        num_stages: usize,
        device: Device,
    ) -> Self {
        Self {
            group: group.clone(),
            stage_index,
            num_stages,
            device,
            placement: Placement::Loop,
            input_meta: None,
            output_meta: None,
            posted: BTreeMap::new(),
            handed: BTreeMap::new(),
        }
    }

    pub(crate) fn group(&self) -> &ProcessGroup {
        &self.group
    }

    pub(crate) fn stage_index(&self) -> usize {
        self.stage_index
    }

    pub(crate) fn num_stages(&self) -> usize {
        self.num_stages
    }

    pub(crate) fn device(&self) -> Device {
        self.device
    }

    pub(crate) fn input_meta(&self) -> Option<&TensorMeta> {
        self.input_meta.as_ref()
    }

    pub(crate) fn output_meta(&self) -> Option<&TensorMeta> {
        self.output_meta.as_ref()
    }

    /// Sets where the schedule's stages live (before its checks).
    pub(crate) fn set_placement(&mut self, placement: Placement) {
        self.placement = placement;
    }

    /// The rank of the group that holds `stage` in the schedule's placement.
    pub(crate) fn rank_of(&self, stage: usize) -> usize {
        self.placement.rank_of(stage, self.group.world_size())
    }

    /// How a transfer with `stage` moves: the one place that decides between a handoff in
    /// memory and the group.
    fn route(&self, stage: usize) -> Route {
        match self.rank_of(stage) {
            rank if rank == self.group.rank() => Route::InMemory,
            rank => Route::Rank(rank),
        }
    }

    /// The stage a transfer in `direction` goes to.
    fn sends_to(&self, direction: Direction) -> usize {
        match direction {
            Direction::Forward => self.stage_index + 1,
            Direction::Backward => self.stage_index - 1,
        }
    }

    /// The stage a transfer in `direction` comes from.
    fn receives_from(&self, direction: Direction) -> usize {
        match direction {
            Direction::Forward => self.stage_index - 1,
            Direction::Backward => self.stage_index + 1,
        }
    }

    /// Sends microbatch `mb`'s `tensor` in `direction` (an output to the next stage, an
    /// input's gradient to the previous one), or hands it over where that stage is on this
    /// rank. An activation's metadata goes ahead of the first this stage ever sends, and the
    /// receive of its gradient, which comes back in its shape, is posted with it.
    pub(crate) fn send(
        &mut self,
        direction: Direction,
        mb: usize,
        tensor: Tensor,
        outbox: &mut Outbox,
    ) -> Result<(), PipelineError> {
        let to = self.sends_to(direction);
        let peer_rank = match self.route(to) {
            Route::InMemory => {
                outbox.handoffs.push(Handoff {
                    to,
                    direction,
                    microbatch: mb,
                    tensor,
                });
                return Ok(());
            }
            Route::Rank(rank) => rank,
        };
        let gradient_shape = match direction {
            Direction::Forward => Some(self.announce(mb, &tensor, peer_rank)?),
            Direction::Backward => None,
        };
        let transfer = direction.sent();
        let t = tag(self.num_stages, self.stage_index, mb, direction);
        let work = self
            .group
            .send_async(&tensor, peer_rank, t)
            .map_err(|e| self.transfer_error(transfer, mb, to, e))?;
        outbox.sends.push(PendingSend {
            work,
            _tensor: tensor,
            stage: self.stage_index,
            transfer,
            microbatch: mb,
            peer_stage: to,
            peer_rank,
        });
        match gradient_shape {
            Some(meta) => self.post_recv(Direction::Backward, mb, &meta),
            None => Ok(()),
        }
    }

    /// Receives microbatch `mb`'s activation or gradient, as `expect` says, or takes it
    /// where a stage on this rank handed it over.
    pub(crate) fn recv(&mut self, mb: usize, expect: Expect<'_>) -> Result<Tensor, PipelineError> {
        let direction = match expect {
            Expect::Activation { .. } => Direction::Forward,
            Expect::GradientOf(_) => Direction::Backward,
        };
        let from = self.receives_from(direction);
        let peer_rank = match self.route(from) {
            Route::InMemory => return self.handed_over(direction, mb),
            Route::Rank(rank) => rank,
        };
        let meta = match expect {
            Expect::Activation { n_microbatches } => {
                let meta = self.announced_input(mb, peer_rank)?;
                self.post_recv(direction, mb, &meta)?;
                if mb + 1 < n_microbatches {
                    self.post_recv(direction, mb + 1, &meta)?;
                }
                meta
            }
            Expect::GradientOf(output) => TensorMeta::of(output),
        };
        self.wait_recv(direction, mb, &meta)
    }

    /// Checks an activation against the metadata this stage announced to the next, by which
    /// that stage allocated its buffers, announcing it with the first; its metadata.
    fn announce(
        &mut self,
        mb: usize,
        output: &Tensor,
        peer_rank: usize,
    ) -> Result<TensorMeta, PipelineError> {
        let next = self.stage_index + 1;
        let meta = TensorMeta::of(output);
        match &self.output_meta {
            Some(expected) if *expected != meta => Err(StageProblem::ShapeMismatch {
                next_stage: next,
                microbatch: mb,
                expected: expected.clone(),
                got: meta,
            }
            .on(self.group.rank(), self.stage_index)),
            Some(_) => Ok(meta),
            None => {
                self.group
                    .send_object_list(&[Object::from(meta.encode())], peer_rank)
                    .map_err(|e| self.transfer_error(Transfer::SendMetadata, mb, next, e))?;
                self.output_meta = Some(meta.clone());
                Ok(meta)
            }
        }
    }

    /// The metadata the previous stage announced for its activations, received with the
    /// first microbatch's.
    fn announced_input(
        &mut self,
        mb: usize,
        peer_rank: usize,
    ) -> Result<TensorMeta, PipelineError> {
        if let Some(meta) = &self.input_meta {
            return Ok(meta.clone());
        }
        let prev = self.stage_index - 1;
        let mut got = [Object::from("")];
        self.group
            .recv_object_list(&mut got, peer_rank)
            .map_err(|e| self.transfer_error(Transfer::RecvMetadata, mb, prev, e))?;
        let text = got[0].as_str().unwrap_or_default().to_string();
        let meta = TensorMeta::decode(&text).ok_or_else(|| {
            StageProblem::Metadata {
                from_stage: prev,
                text: text.clone(),
            }
            .on(self.group.rank(), self.stage_index)
        })?;
        self.input_meta = Some(meta.clone());
        Ok(meta)
    }

    /// Starts the receive of microbatch `mb`'s transfer in `direction` into a new buffer of
    /// `meta`'s shape.
    fn start_recv(
        &self,
        direction: Direction,
        mb: usize,
        meta: &TensorMeta,
    ) -> Result<(Tensor, Work), PipelineError> {
        let from = self.receives_from(direction);
        let buffer = Tensor::empty(meta.shape.as_slice(), (meta.kind, self.device));
        let t = tag(self.num_stages, from, mb, direction);
        let work = self
            .group
            .recv_async(&buffer, self.rank_of(from), t)
            .map_err(|e| self.transfer_error(direction.received(), mb, from, e))?;
        Ok((buffer, work))
    }

    /// Posts the receive of microbatch `mb`'s transfer in `direction`, unless it is posted
    /// already.
    fn post_recv(
        &mut self,
        direction: Direction,
        mb: usize,
        meta: &TensorMeta,
    ) -> Result<(), PipelineError> {
        if !self.posted.contains_key(&(direction, mb)) {
            let receive = self.start_recv(direction, mb, meta)?;
            self.posted.insert((direction, mb), receive);
        }
        Ok(())
    }

    /// Waits for microbatch `mb`'s receive in `direction` (started now if it was not posted)
    /// and returns its buffer.
    fn wait_recv(
        &mut self,
        direction: Direction,
        mb: usize,
        meta: &TensorMeta,
    ) -> Result<Tensor, PipelineError> {
        let (buffer, work) = match self.posted.remove(&(direction, mb)) {
            Some(posted) => posted,
            None => self.start_recv(direction, mb, meta)?,
        };
        let from = self.receives_from(direction);
        let _wait = trace::enabled().then(|| {
            let what = match direction {
                Direction::Forward => "activation",
                Direction::Backward => "gradient",
            };
            trace::span(format!("wait {what} {mb} from stage {from}"), "wait")
        });
        work.wait()
            .map_err(|e| self.transfer_error(direction.received(), mb, from, e))?;
        Ok(buffer)
    }

    /// Keeps what a stage on this rank handed over for this one.
    pub(crate) fn take_handoff(&mut self, handoff: Handoff) {
        self.handed
            .insert((handoff.direction, handoff.microbatch), handoff.tensor);
    }

    /// Microbatch `mb`'s activation or gradient in `direction` that a stage on this rank
    /// handed over; its absence is a schedule whose order does not fit (an internal error).
    fn handed_over(&mut self, direction: Direction, mb: usize) -> Result<Tensor, PipelineError> {
        let from = self.receives_from(direction);
        self.handed.remove(&(direction, mb)).ok_or_else(|| {
            self.transfer_error(
                direction.received(),
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
        StageProblem::Transfer {
            transfer,
            microbatch,
            peer_stage,
            peer_rank: self.rank_of(peer_stage),
            source: Box::new(e),
        }
        .on(self.group.rank(), self.stage_index)
    }

    /// Forgets the activation metadata, so that the next step sends (or receives) it again:
    /// every rank does so together when the batch's size changes.
    pub(crate) fn reset_meta(&mut self) {
        self.input_meta = None;
        self.output_meta = None;
    }

    /// Forgets every receive posted ahead and every handoff (after a failed step, whose peers
    /// fail too: a receive posted ahead that a peer's send never matched stays with the
    /// engine, so a later step on the same group would wait for its data in vain and fail at
    /// the timeout, never read it).
    pub(crate) fn clear(&mut self) {
        self.posted.clear();
        self.handed.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
