//! Distributed checkpoints of a model's parameters and buffers that PyTorch can load
//! (`torch.distributed.checkpoint`'s safetensors layout), written without gathering
//! anything onto one rank, loaded at any world size.
//!
//! [`save`] writes one file per rank into a folder (none for a rank with nothing of its
//! own): each rank its shards of the parameters
//! [`shard_module`](crate::sharding::shard_module) or [`fully_shard`](crate::fully_shard())
//! sharded (anywhere in the model), the lowest rank that holds each unsharded tensor its
//! values (rank 0 for a replicated model; ranks may hold different tensors, as pipeline
//! stages do, and the manifest lists every rank's), each file's `DCP_SHARDING_INFO` saying where its pieces sit in
//! the global tensors (the layout in [`file_name`] and `storage.rs`). So
//!
//! ```python
//! dcp.load(model.state_dict(), storage_reader=HuggingFaceStorageReader(dir))
//! ```
//!
//! loads a tch-dist checkpoint into a PyTorch model, plain or `fully_shard`ed, at any world
//! size. [`load`] reads such a folder (or a one-file `VarStore::save`) back into a model at
//! any world size, replicated, tensor-parallel or fully sharded: each rank assembles the part it holds
//! from whichever saved pieces overlap it.
//!
//! **A load reads only what its rank needs.** It reads the manifest and each file's
//! safetensors header (8 bytes, then the JSON with `DCP_SHARDING_INFO`), makes a *read
//! plan* from them and this rank's targets (`read_plan.rs`: for each of its tensors, the
//! saved pieces that overlap it and, of each, the dim-0 rows that overlap, one contiguous
//! byte range), reads those ranges with positioned reads straight into this rank's staged
//! values where they are whole rows of them, else into one buffer whose overlap is copied
//! into place; nothing is decoded whole to be narrowed, and a load holds its staged values
//! and one read. A tensor sharded on dim 0
//! (fully_shard, colwise) costs a rank its share; one sharded on another dim (rowwise) the
//! overlapping rows whole. The [`LoadStats`] [`load`] returns say how many bytes and files a
//! rank read.
//!
//! **What is verified when.** Per-file SHA-256s cannot check a partial read, so the
//! manifest (format `tch-dist checkpoint 3`) also holds each file's header digest and, per
//! piece, the SHA-256 of each block of whole dim-0 rows of at most [`DIGEST_BLOCK_BYTES`].
//! A load checks exactly what it reads: the header, each block its ranges cover (a range
//! is widened to whole blocks: at most one block more at each end), the sidecars it uses
//! whole. The cost: one digest per 64 KiB in the manifest, and a damaged byte in a slice no
//! rank of this load reads (another layout's, the optimizer state on a model-only load)
//! goes unnoticed by the load: [`verify`] (every file and sidecar, every byte, against its
//! whole-file SHA-256) and [`latest_valid`] find it. A checkpoint of format 2 (no piece
//! digests) still loads, every file read whole and checked against its SHA-256.
//!
//! **What PyTorch wrote loads too**: a folder from `dcp.save(sd,
//! storage_writer=HuggingFaceStorageWriter(dir))` (also `save_distributed=True`) has no
//! manifest and no checksums, so it is read by the same plan and checked against nothing.
//! Every file tch-dist writes carries `TCH_DIST_FORMAT` in its `__metadata__`, so a folder
//! of tch-dist files without a manifest (or named `DIR.partial`) is still refused as an
//! interrupted save.
//!
//! Crash safety: a save writes into `DIR.partial`, every file fsynced; once every rank's
//! file is written (the ranks agree on it), rank 0 writes the sidecars and `manifest.json`
//! (every file's length and SHA-256 and its digests, the sidecars' too, every tensor's
//! global shape and dtype), fsyncs the folder and puts it in place as `DIR`: a rename, or an atomic swap
//! with an older `DIR`, so that a crash at any point leaves `DIR` with the old complete
//! checkpoint or the new one (`protocol.rs`; docs/design/checkpoints.md, "Checkpoint
//! commit protocol"). `load` refuses a folder of tch-dist files without a manifest (an interrupted save is
//! never loaded) and every file whose length, header or read bytes differ, sidecars included, and checks
//! the key set, global shapes and dtypes against the model before changing anything, each a
//! [`CheckpointError`] naming the FQN, on every rank. All ranks must see the same folder (one
//! machine, or a shared file system).
//!
//! **Async save**: [`async_save`](async_save()) (PyTorch's `dcp.async_save`) copies this rank's pieces
//! to host memory and returns an [`AsyncSave`]; a background thread writes, agrees and
//! commits by the same steps over a Gloo group of the same ranks of its own (created at the
//! first `async_save` over a group), so that its collectives never interleave with
//! training's. One is in flight at a time per process (the next waits for it); a crash
//! during it leaves what a crash of [`save`] leaves: [`latest`] stays on the previous
//! checkpoint. **Plan once**: the save plan of a model and layout is computed at its first
//! save and reused by later ones ([`plan_cache_stats`]).
//!
//! **One description, three verbs.** A [`State`] says what a checkpoint holds: the model,
//! optionally a [`tch_dist::optim`](crate::optim) optimizer (its state beside the
//! parameters under PyTorch's flattened names, `optim.state.<fqn>.exp_avg`, sharded like
//! the parameter; its settings in the JSON sidecar `optimizer.json`), optionally a train
//! state (`train_state.json`, any JSON value: step, epoch, data position). [`save`],
//! [`async_save`](async_save()) and [`load`] take it, as PyTorch's `dcp.save`/`dcp.load`
//! take one state dict; [`SaveOptions::keep_last`] keeps only the last `k` checkpoints
//! beside the new one. [`latest`] finds the last complete one to resume from,
//! [`latest_valid`] the last one that verifies on every rank, skipping damaged newer ones.
//! The previous release's one function per combination (`save_with_optimizer`,
//! `load_train_state`, ...) are deprecated wrappers (`deprecated.rs`).
//!
//! | file | what it does | PyTorch's counterpart (`torch/distributed/checkpoint/`) |
//! | --- | --- | --- |
//! | `mod.rs` | the API: [`save`], [`async_save`](async_save()), [`load`], [`verify`], [`plan_cache_stats`], the options | `state_dict_saver.py` (`save`, `async_save`), `state_dict_loader.py` (`load`) |
//! | `state.rs` | [`State`]: the model, optimizer and train state a checkpoint holds | `state_dict.py` (`get_state_dict(model, optimizers)`), `stateful.py` |
//! | `load.rs` | a load's steps: open, plan, check, read, agree, then change the model, the optimizer and the train state | `state_dict_loader.py` (`_load_state_dict`) |
//! | `deprecated.rs` | the previous release's functions, as wrappers of the three verbs | (none) |
//! | `async_save.rs` | [`AsyncSave`]: staging, the one save in flight per process, the background group and thread | `state_dict_saver.py` (`async_save`), `staging.py` (`DefaultStager`), `_async_thread_executor.py` |
//! | `plan_cache.rs` | the save plan cached per model and layout ([`PlanCacheStats`]) | `default_planner.py` (`enable_plan_caching`, `_cached_save_plan`) |
//! | `plan.rs` | what a checkpoint holds and who writes it: the model's tensors with this rank's place in each global one, the optimizer's state flattened to PyTorch's names and back | `planner.py`, `default_planner.py` (`create_local_plan`, `flatten_state_dict`) |
//! | `index.rs` | a safetensors header parsed without the data; the pieces' block digests ([`DIGEST_BLOCK_BYTES`]) | `_hf_storage.py` (`_get_safetensors_file_metadata`) |
//! | `read_plan.rs` | the read plan: the overlapping pieces of each target and the rows of each to read, as byte ranges (pure, unit-tested) | `default_planner.py` (`create_default_local_load_plan`), `reshard.py` |
//! | `striped.rs` | [`Reads::Striped`]: who reads each whole tensor, the check that every rank holds the same ones, the broadcast | (none: torchtitan's RFC #4035, striped I/O + collective broadcast) |
//! | `reader.rs` | a load's I/O: manifest, headers, positioned reads of the planned ranges into the staged values (or one buffer of the rows read), each checked, counted in [`LoadStats`]; format 2 read whole | `_hf_storage.py` (`HuggingFaceStorageReader.read_data`) |
//! | `reshard.rs` | a rank's part assembled from the saved pieces that overlap it (pure offset arithmetic, unit-tested), filled as the reads arrive (`Staged`'s coverage from the regions filled), and the checks of the model against the checkpoint | `default_planner.py`, `_reshard`, `resharding.py` (`_check_shard_metadata_pair_overlap`) |
//! | `protocol.rs` | the ranks' save, as named steps | `state_dict_saver.py` (`_save_state_dict`'s steps) |
//! | `fs.rs` | the file-system moves that make a save crash-safe (fsyncs, the temporary folder, the rename or swap into place, removals manifest first) | `filesystem.py` |
//! | `storage.rs` | the files: the safetensors layout, `DCP_SHARDING_INFO`, the manifest and sidecars through their serde structs, whole files against their checksums ([`verify`], format 2) | `_hf_storage.py` / `hf_storage.py` (`HuggingFaceStorageReader`/`Writer`), `storage.py`, `metadata.py` |
//! | `retention.rs` | [`latest`], [`latest_valid`], pruning to `keep_last` | (none: torchtitan's checkpoint manager keeps the last k) |
//! | `error.rs` | [`CheckpointError`] | DCP's `CheckpointException` |
//!
//! ```no_run
//! use tch::nn;
//! use tch_dist::{checkpoint, Shardable};
//!
//! #[derive(Debug, Shardable)]
//! struct Net { fc: nn::Linear }
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let pg = tch_dist::init_process_group(tch_dist::Backend::Gloo)?;
//! let vs = nn::VarStore::new(tch::Device::Cpu);
//! let model = Net { fc: nn::linear(vs.root() / "fc", 4, 2, Default::default()) };
//! let saved = checkpoint::State::new(&model);
//! checkpoint::save("ckpt/step-00000100", &saved, &pg, &Default::default())?;
//! let mut state = checkpoint::State::new(&model);
//! checkpoint::load("ckpt/step-00000100", &mut state, &pg, &Default::default())?;
//! # Ok(()) }
//! ```

mod async_save;
mod deprecated;
mod error;
mod fs;
mod index;
mod load;
mod plan;
mod plan_cache;
mod protocol;
mod read_plan;
mod reader;
mod reshard;
mod retention;
mod state;
mod storage;
mod striped;

use std::collections::BTreeMap;
use std::path::Path;

use tch::Tensor;
use tch_dist_core::Shardable;
use tch_dist_runtime::ProcessGroup;

pub use async_save::AsyncSave;
#[allow(deprecated)]
pub use deprecated::{
    async_save_with, async_save_with_optimizer, load_train_state, load_with, load_with_optimizer,
    load_with_stats, save_with, save_with_optimizer,
};
pub use error::{CheckpointError, CheckpointProblem};
pub use index::DIGEST_BLOCK_BYTES;
pub use plan_cache::PlanCacheStats;
pub use reader::LoadStats;
pub use retention::{latest, latest_valid, LatestValid, Skipped};
pub use state::State;

use load::train_state_only;
pub use storage::{file_name, MANIFEST};

use crate::optim::Optimizer;

pub use crate::state_dict::OPTIM_STATE_PREFIX;
/// The optimizer's sidecar in a checkpoint folder: the non-tensor fields (the optimizer's
/// class and PyTorch's `param_groups`), never inside a safetensors file.
pub const OPTIMIZER_SIDECAR: &str = "optimizer.json";

/// The train state's file in a checkpoint folder.
pub const TRAIN_STATE: &str = "train_state.json";

/// How a save ends: what it prunes once the new checkpoint is in place.
///
/// ```
/// let opts = tch_dist::checkpoint::SaveOptions { keep_last: Some(2) };
/// # let _ = opts;
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SaveOptions {
    /// Once the new checkpoint is in place, keep only the last `k` complete checkpoints
    /// among its sibling folders (by name: `step-00000100` sorts after `step-00000090`);
    /// `None` keeps all.
    pub keep_last: Option<usize>,
}

/// Saves `state` (the model's parameters and buffers; its optimizer's state and settings and
/// a train state when it holds them) into the folder `dir` over `group`'s ranks, as
/// PyTorch's `dcp.save(state_dict, checkpoint_id=dir)` (see the [module docs](self)). Every
/// rank of `group` calls it. The optimizer's state tensors go under PyTorch's flattened
/// names (`optim.state.fc1.weight.exp_avg`, `....step`), sharded like their parameters, its
/// class and `param_groups` into the JSON sidecar `optimizer.json`; the train state into
/// `train_state.json`.
///
/// ```no_run
/// # use tch::nn;
/// # use tch_dist::Shardable;
/// # #[derive(Debug, Shardable)]
/// # struct Net { fc: nn::Linear }
/// # fn demo(pg: &tch_dist::ProcessGroup, model: &Net, opt: &mut tch_dist::optim::Optimizer, step: u64) -> Result<(), tch_dist::checkpoint::CheckpointError> {
/// use tch_dist::checkpoint::{self, SaveOptions, State};
/// let state = State::new(model)
///     .with_optimizer(opt)
///     .with_train_state(serde_json::json!({ "step": step }));
/// checkpoint::save(format!("ckpt/step-{step:08}"), &state, pg, &SaveOptions { keep_last: Some(3) })?;
/// # Ok(()) }
/// ```
pub fn save<M: Shardable + ?Sized>(
    dir: impl AsRef<Path>,
    state: &State<'_, M>,
    group: &ProcessGroup,
    opts: &SaveOptions,
) -> Result<(), CheckpointError> {
    let parts = Parts::of(state);
    save_parts(dir.as_ref(), &parts, group, opts)
}

/// What a save writes, borrowed from a [`State`] (or given piece by piece, by the previous
/// release's functions).
struct Parts<'a, M: ?Sized> {
    model: &'a M,
    optimizer: Option<&'a Optimizer>,
    train_state: Option<&'a serde_json::Value>,
}

impl<'a, M: Shardable + ?Sized> Parts<'a, M> {
    fn of(state: &'a State<'_, M>) -> Self {
        Parts {
            model: state.model,
            optimizer: state.optimizer(),
            train_state: state.train_state(),
        }
    }
}

/// [`save`]'s steps (`protocol.rs`; docs/design/checkpoints.md, "Checkpoint commit protocol").
fn save_parts<M: Shardable + ?Sized>(
    dir: &Path,
    parts: &Parts<'_, M>,
    group: &ProcessGroup,
    opts: &SaveOptions,
) -> Result<(), CheckpointError> {
    // An async save in flight first (it may write the same folder).
    async_save::wait_in_flight();
    let (pieces, tensors) = stage(dir, parts.model, parts.optimizer, group, false);
    let sidecars = protocol::Sidecars {
        train_state: parts.train_state,
        optimizer: parts.optimizer.map(crate::optim::sidecar::of),
    };
    protocol::Save::new(dir, group).run(pieces, tensors, sidecars, opts.keep_last)
}

/// [`save`], asynchronously (PyTorch's `dcp.async_save`): returns once this rank's tensors
/// are staged, a copy in host memory (the next optimizer step may change the parameters:
/// the checkpoint holds the values at the call; the optimizer's settings and the train state
/// are taken at the call too); a background thread then writes this rank's file into
/// `DIR.partial`, agrees with the other ranks and commits, the same crash-safe steps as
/// [`save`]. [`AsyncSave::wait`] returns the outcome. Every rank of `group` calls it.
///
/// - The background's collectives run over a Gloo group of `group`'s ranks of its own,
///   created at the first `async_save` over `group` (a collective: every rank of `group`
///   makes that call) and reused: c10d wants one order of collectives per group on every
///   rank, and training's collectives on `group` go on meanwhile.
/// - One async save at a time per process: a second `async_save` (or a [`save`]) while one
///   is in flight waits for it first (its outcome stays with its handle), so at most one
///   staged copy (this rank's shard) is held; it is freed once the file is written.
/// - Dropping the [`AsyncSave`] without `wait` waits too, printing an error it ended in.
/// - A crash before the commit leaves `DIR.partial`, which [`latest`] never returns:
///   `latest` stays on the previous checkpoint.
///
/// ```no_run
/// # use tch::nn;
/// # use tch_dist::Shardable;
/// # #[derive(Debug, Shardable)]
/// # struct Net { fc: nn::Linear }
/// # fn demo(pg: &tch_dist::ProcessGroup, model: &Net) -> Result<(), tch_dist::checkpoint::CheckpointError> {
/// use tch_dist::checkpoint::{self, SaveOptions, State};
/// let pending = checkpoint::async_save("ckpt/step-00000100", &State::new(model), pg, &SaveOptions::default())?;
/// // ... training goes on; the parameters may change, the checkpoint does not ...
/// pending.wait()?;
/// # Ok(()) }
/// ```
pub fn async_save<M: Shardable + ?Sized>(
    dir: impl AsRef<Path>,
    state: &State<'_, M>,
    group: &ProcessGroup,
    opts: &SaveOptions,
) -> Result<AsyncSave, CheckpointError> {
    async_save::start(dir.as_ref(), &Parts::of(state), group, opts)
}

/// How many save plans this process computed and how many saves reused one (the plan of a
/// model and layout is computed at its first save and cached; see `plan_cache.rs`).
///
/// ```
/// let before = tch_dist::checkpoint::plan_cache_stats();
/// # let _ = before;
/// ```
pub fn plan_cache_stats() -> PlanCacheStats {
    plan_cache::stats()
}

/// One piece a rank writes: the key, its values, its offsets in the global tensor.
type Written = (String, Tensor, Vec<i64>);

/// What this rank writes (its pieces: FQN, values on the CPU, offsets; or this rank's
/// error, which the save's first agreement makes every rank's) and the manifest's
/// `tensors`, from the cached save plan (`plan_cache.rs`). With `copy`, every piece is a
/// copy in host memory that nothing else holds (an async save's staging); else a piece
/// may share the parameter's memory (a CPU tensor is not copied). First, on every rank
/// (a collective), the check that each parameter saved whole is the same on every rank
/// that holds it, and who writes it (`plan::replicas_agree`: the lowest of them). The
/// manifest's `tensors` are this rank's; the protocol merges every rank's.
fn stage<M: Shardable + ?Sized>(
    dir: &Path,
    module: &M,
    optimizer: Option<&Optimizer>,
    group: &ProcessGroup,
    copy: bool,
) -> (
    Result<Vec<Written>, CheckpointError>,
    BTreeMap<String, storage::TensorEntry>,
) {
    let rank = group.rank();
    let writers = match plan::replicas_agree(module, group) {
        Ok(w) => w,
        Err(e) => return (Err(e), BTreeMap::new()),
    };
    // fully_shard parameters held gathered go back to their shards first.
    if let Err(e) = crate::state_dict::reshard_all(module) {
        let failed = protocol::Save::new(dir, group).failed("writing the files");
        return (Err(failed(e.into())), BTreeMap::new());
    }
    let (mut targets, mut tensors) = plan_cache::cached_targets(module, rank, group.world_size());
    let pieces = match optimizer {
        Some(opt) => plan::optimizer_targets(rank, &targets, opt).map(|state| {
            tensors.extend(plan::tensor_entries(&state));
            targets.extend(state);
        }),
        None => Ok(()),
    }
    .map(|()| plan::to_write(rank, &targets, &writers, copy));
    (pieces, tensors)
}

/// Loads the checkpoint folder `dir` (written by [`save`] at any world size, by PyTorch's
/// `dcp.save` with `HuggingFaceStorageWriter`, or a one-file `VarStore::save`) into `state`
/// over `group`'s ranks, as PyTorch's `dcp.load(state_dict, checkpoint_id=dir)`: the model's
/// tensors (each rank's shards of sharded parameters, the whole of the others) copied in
/// place; with an optimizer in `state`, its state and settings, resharded to this world size
/// like the parameters (afterwards the optimizer has exactly the checkpoint's state and
/// hyperparameters, learning rate included, as PyTorch's `load_state_dict`); and the train
/// state the checkpoint holds ([`State::train_state`], `None` without one). Everything is
/// checked on every rank before anything changes (see the [module docs](self)); a checkpoint
/// without optimizer state when one is asked for, of another optimizer class, or whose state
/// does not fit the model is an error on every rank, and nothing changed. Each rank reads the
/// manifest, each file's header and only the rows of the saved pieces that overlap its
/// tensors, checked against the manifest's digests; the returned [`LoadStats`] says how much
/// ([`verify`] checks every byte).
///
/// ```no_run
/// # use tch::nn;
/// # use tch_dist::Shardable;
/// # #[derive(Debug, Shardable)]
/// # struct Net { fc: nn::Linear }
/// # fn demo(pg: &tch_dist::ProcessGroup, model: &Net, opt: &mut tch_dist::optim::Optimizer) -> Result<(), tch_dist::checkpoint::CheckpointError> {
/// use tch_dist::checkpoint::{self, LoadOptions, State};
/// if let Some(dir) = checkpoint::latest("ckpt") {
///     let mut state = State::new(model).with_optimizer(opt);
///     let stats = checkpoint::load(&dir, &mut state, pg, &LoadOptions::default())?;
///     let step = state.train_state().and_then(|s| s["step"].as_u64()).unwrap_or(0);
///     println!("resumed at step {step}, {} bytes read", stats.bytes_read);
/// }
/// # Ok(()) }
/// ```
pub fn load<M: Shardable + ?Sized>(
    dir: impl AsRef<Path>,
    state: &mut State<'_, M>,
    group: &ProcessGroup,
    opts: &LoadOptions,
) -> Result<LoadStats, CheckpointError> {
    load::run(dir.as_ref(), state, group, opts)
}

/// How the ranks of a load share the reads of the tensors every rank needs whole (a
/// replicated model's, the unsharded parts of a sharded one); shards are always read by
/// their holder alone. See [`LoadOptions`].
///
/// ```
/// assert_eq!(tch_dist::checkpoint::Reads::default(), tch_dist::checkpoint::Reads::EachRank);
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Reads {
    /// Every rank reads what it needs itself: the default, and the faster where the files
    /// are on a local disk or in the page cache (docs/PERFORMANCE.md, "Checkpoints").
    #[default]
    EachRank,
    /// torchtitan's striped I/O + collective broadcast: each whole tensor is read by one
    /// rank (assigned by bytes) and broadcast to the others, so the ranks together read it
    /// once; for a shared file system, where N ranks reading the same bytes costs N times.
    /// Where the ranks do not hold the same whole tensors (pipeline stages), each reads
    /// its own, as with [`Reads::EachRank`].
    Striped,
}

/// The options of [`load`].
///
/// ```
/// let opts = tch_dist::checkpoint::LoadOptions { reads: tch_dist::checkpoint::Reads::Striped };
/// # let _ = opts;
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LoadOptions {
    /// Who reads the tensors every rank needs whole: with [`Reads::Striped`], each is read
    /// by one rank and broadcast, after every rank's reads were checked (a damaged byte in a
    /// tensor another rank reads is still an error on every rank, nothing changed); the
    /// bytes in [`LoadStats`] are then this rank's reads alone.
    pub reads: Reads,
}

/// Checks every byte of the checkpoint folder `dir` against its manifest: every
/// safetensors file and sidecar it lists has its length and SHA-256, and no sidecar is
/// there unlisted. A [`load`] checks only what it reads (the manifest, the headers, the
/// blocks of the slices each rank needs, the sidecars it uses), so a damaged byte in a
/// piece no rank of this world size needs is found here, not by the load: run it where a
/// checkpoint is kept for long, or before loading at a new world size. One process
/// (errors say rank 0), one read of the whole checkpoint, a block at a time.
///
/// ```no_run
/// if let Err(e) = tch_dist::checkpoint::verify("ckpt/step-00000100") {
///     eprintln!("damaged: {e}");
/// }
/// ```
pub fn verify(dir: impl AsRef<Path>) -> Result<(), CheckpointError> {
    storage::verify(0, dir.as_ref())
}
