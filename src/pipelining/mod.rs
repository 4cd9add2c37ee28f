//! Pipeline parallelism: a model's layers split into stages on different ranks,
//! microbatches flowing through them so that the stages work at once (PyTorch 2.11's
//! `torch.distributed.pipelining`).
//!
//! Each rank builds its part of the model under the whole model's `VarStore` paths, wraps it
//! in a [`PipelineStage`] and hands the stage to a schedule ([`ScheduleGPipe`],
//! [`Schedule1F1B`], or [`ScheduleInterleaved1F1B`] or [`ScheduleInterleavedZeroBubble`] for
//! several stages per rank, [`ScheduleZBVZeroBubble`] for two in the V placement); every step
//! then gives the batch to the first stage and the target to the last, and the optimizer
//! steps on each rank's own parameters. A pipeline's group is any process group (a mesh's
//! `"pp"` dim: `mesh.get_group("pp")`).
//!
//! | file | job | PyTorch |
//! |---|---|---|
//! | `stage.rs`: [`PipelineStage`] | a stage's part, its forward and backward per microbatch (whole or the input's only, then the weights'), what it keeps between them | `stage.py` (`PipelineStage`, `_PipelineStageBase`: `forward_one_chunk`, `backward_one_chunk`, `backward_weight_one_chunk`) |
//! | `transport.rs` | a stage's sends, receives and in-memory handoffs to its neighbours, through one route (memory or the group); tags, receives posted ahead, the metadata announced and learnt, an action's sends and handoffs for the schedule | `stage.py` (`get_fwd_send_ops`, `get_bwd_send_ops`, `get_fwd_recv_ops`, `get_bwd_recv_ops`, `set_local_fwd_input`, `set_local_bwd_input`), `schedules.py` (`_batch_p2p`, `_wait_batch_p2p`) |
//! | `meta.rs`: [`TensorMeta`] | an activation's shape and dtype, and the string that carries it ahead | `stage.py` (`_make_tensor_from_meta`, `_shape_inference`) |
//! | `placement.rs` | which rank holds each stage: the loop and V placements | `_utils.py` (`generate_stage_to_rank_mapping`) |
//! | `schedules.rs`: [`ScheduleGPipe`], [`Schedule1F1B`], [`ScheduleInterleaved1F1B`], [`ScheduleInterleavedZeroBubble`], [`ScheduleZBVZeroBubble`] | the step: the ranks' agreement on the settings, running the order of work, delivering handoffs, waiting for sends, loss and its scaling | `schedules.py` (`PipelineScheduleSingle`, `ScheduleGPipe`, `Schedule1F1B`, `ScheduleInterleaved1F1B`, `ScheduleInterleavedZeroBubble`, `ScheduleZBVZeroBubble`, `scale_grads`) |
//! | `validate.rs` | a rank's own checks of its stages and microbatch count, by what the schedule asks (plain data) | `schedules.py` (the constructors' `ValueError`s, `_validate_schedule`) |
//! | `order.rs` | each schedule's order of forwards and backwards on one rank | `schedules.py` (`_step_microbatches`, `_get_1f1b_rank_ops`, `_calculate_single_rank_operations`) |
//! | `microbatch.rs` | splitting a batch along dim 0, the step's batch check on every rank | `microbatch.py` (`split_args_kwargs_into_chunks`, `TensorChunkSpec`) |
//! | `error.rs`: [`PipelineError`] ([`OnOp`] of a [`PipelineProblem`], [`OnStage`] of a [`StageProblem`]), [`Transfer`] | why a schedule refused or a step failed, the context (rank, operation or stage) written once | the `ValueError`s / `RuntimeError`s of `schedules.py` and `stage.py` |
//!
//! Every check that all ranks make together (a schedule's settings, a step's batch) goes
//! through the runtime's `ProcessGroup::agree_on_values` / `exchange_values`.
//!
//! ```no_run
//! use tch::nn::{self, Module};
//! use tch_dist::pipelining::{PipelineStage, Schedule1F1B};
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let pg = tch_dist::init_process_group(tch_dist::Backend::Gloo)?; // 2 ranks
//! let vs = nn::VarStore::new(tch::Device::Cpu);
//! let layers = vs.root() / "layers";
//! // The whole model is layers.0 (rank 0) then layers.1 (rank 1).
//! let part = nn::seq().add(nn::linear(&layers / pg.rank(), 8, 8, Default::default()));
//! let stage = PipelineStage::new(part, pg.rank(), 2, tch::Device::Cpu, &pg);
//! let mut schedule = Schedule1F1B::new(stage, 4, |out, y| out.mse_loss(y, tch::Reduction::Mean))?;
//! let mut opt = tch_dist::optim::Sgd { momentum: 0.9, ..Default::default() }.build(&vs, 0.01)?;
//! let x = tch::Tensor::randn([16, 8], tch::kind::FLOAT_CPU);
//! let y = tch::Tensor::zeros([16, 8], tch::kind::FLOAT_CPU);
//! let mut losses = Vec::new();
//! let first = pg.rank() == 0;
//! schedule.step(first.then_some(&x), (!first).then_some(&y), &mut losses)?;
//! opt.step()?; // each rank steps its own stage's parameters
//! opt.zero_grad();
//! # Ok(()) }
//! ```

mod error;
mod meta;
mod microbatch;
mod order;
mod placement;
mod schedules;
mod stage;
mod transport;
mod validate;

pub use error::{OnOp, OnStage, PipelineError, PipelineProblem, StageProblem, Transfer};
pub use meta::TensorMeta;
pub use schedules::{
    Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
};
pub use stage::PipelineStage;
