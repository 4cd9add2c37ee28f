//! Distributed checkpoints of a model's parameters and buffers that PyTorch can load
//! (`torch.distributed.checkpoint`'s safetensors layout), written without gathering
//! anything onto one rank, loaded at any world size.
//!
//! [`save`] writes one file per rank into a folder (none for a rank with nothing of its
//! own): each rank its shards of the parameters
//! [`shard_module`](crate::sharding::shard_module) or [`fully_shard`](crate::fully_shard())
//! sharded (anywhere in the model), rank 0
//! the replicated tensors, each file's `DCP_SHARDING_INFO` saying where its pieces sit in
//! the global tensors (the layout in [`file_name`] and `files.rs`). So
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
//! Crash safety: a save writes into `DIR.partial`, every file fsynced; once every rank's
//! file is written (the ranks agree on it), rank 0 writes the sidecars and `manifest.json`
//! (every file's length and SHA-256, the sidecars' too, every tensor's global shape and
//! dtype), fsyncs the folder and puts it in place as `DIR`: a rename, or an atomic swap
//! with an older `DIR`, so that a crash at any point leaves `DIR` with the old complete
//! checkpoint or the new one (`protocol.rs`; docs/ARCHITECTURE.md, "Checkpoint commit
//! protocol"). `load` refuses a folder without a manifest (an interrupted save is never
//! loaded) and every file whose length or checksum differs, sidecars included, and checks
//! the key set, global shapes and dtypes against the model before changing anything, each a
//! [`CheckpointError`] naming the FQN, on every rank. All ranks must see the same folder (one
//! machine, or a shared file system).
//!
//! [`save_with`] also writes a train state (`train_state.json`, any JSON value: step, epoch,
//! data position) and keeps only the last `k` checkpoints beside the new one; [`latest`]
//! finds the last complete one to resume from, [`latest_valid`] the last one that verifies
//! on every rank, skipping damaged newer ones. [`save_with_optimizer`] adds a
//! [`tch_dist::optim`](crate::optim) optimizer's state beside the parameters (PyTorch's
//! flattened names, `optim.state.<fqn>.exp_avg`, sharded like the parameter) and its
//! settings in the JSON sidecar `optimizer.json`; [`load_with_optimizer`] restores both at
//! any world size.
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
//! checkpoint::save("ckpt/step-00000100", &model, &pg)?;
//! checkpoint::load("ckpt/step-00000100", &model, &pg)?;
//! # Ok(()) }
//! ```

mod error;
mod files;
mod protocol;
mod retention;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};

use tch::{Kind, Tensor};
use tch_dist_core::Shardable;
use tch_dist_runtime::ProcessGroup;

pub use error::CheckpointError;
pub use files::{file_name, MANIFEST};
pub use retention::{latest, latest_valid, LatestValid, Skipped};

use files::{FileEntry, Manifest, Piece, TensorEntry};

use crate::optim::{self as optimizer, Algorithm, Optimizer, ParamState};

/// One tensor of the model as a checkpoint sees it: this rank's part of a global tensor.
struct Target {
    fqn: String,
    tensor: Tensor,
    /// Where this rank's part starts in the global tensor.
    offsets: Vec<i64>,
    global: Vec<i64>,
    /// Whether the part is a shard (written by its holder) or the whole tensor (by rank 0).
    sharded: bool,
}

/// Where this rank's part of each sharded parameter sits: FQN -> (offsets of this rank's
/// shard, the global shape). The one place that says how a parameter is sharded
/// (`shard_module`'s and `fully_shard`'s); parameters it does not list are
/// whole on every rank. Optimizer state of a parameter's shape is sharded the same way.
fn shard_layouts<M: Shardable + ?Sized>(module: &M) -> HashMap<String, (Vec<i64>, Vec<i64>)> {
    let mut shards = HashMap::new();
    for (fqn, p) in crate::sharding::sharded_params_in(module) {
        let Some(meta) = p.state.metadata(&p.local_fqn) else {
            continue;
        };
        let rank = p.state.group().rank();
        if let Some(mine) = meta
            .shards_metadata
            .iter()
            .find(|s| s.placement.rank() == rank)
        {
            shards.insert(fqn, (mine.shard_offsets.clone(), meta.size.clone()));
        }
    }
    // fully_shard's shards, found by tensor identity so that a tied parameter's second
    // name is saved as the shard it is too.
    let fsdp = crate::fully_shard::fsdp_params_in(module);
    let mut fsdp_by_identity: HashMap<u64, (Vec<i64>, Vec<i64>)> = HashMap::new();
    for (fqn, t) in module.named_parameters() {
        if let Some(p) = fsdp.get(&fqn) {
            fsdp_by_identity.insert(
                tch_dist_runtime::fsdp::tensor_identity(t),
                (p.info.offsets.clone(), p.info.shape.clone()),
            );
        }
    }
    for (fqn, t) in module.named_parameters() {
        if let Some(layout) = fsdp_by_identity.get(&tch_dist_runtime::fsdp::tensor_identity(t)) {
            shards.entry(fqn).or_insert_with(|| layout.clone());
        }
    }
    shards
}

/// The model's parameters and buffers, with this rank's place in each global tensor.
fn targets<M: Shardable + ?Sized>(module: &M) -> Vec<Target> {
    let shards = shard_layouts(module);
    let mut seen = HashSet::new();
    let mut out = Vec::new();
    for (fqn, t) in module
        .named_parameters()
        .into_iter()
        .chain(module.named_buffers())
    {
        if !seen.insert(fqn.clone()) {
            continue;
        }
        let (offsets, global, sharded) = match shards.get(&fqn) {
            Some((o, g)) => (o.clone(), g.clone(), true),
            None => (vec![0; t.dim()], t.size(), false),
        };
        out.push(Target {
            fqn,
            tensor: t.shallow_clone(),
            offsets,
            global,
            sharded,
        });
    }
    out
}

/// The prefix of optimizer state keys: PyTorch's flattened
/// `{"optim": get_optimizer_state_dict(model, optim)}`, `optim.state.<fqn>.<name>`.
pub const OPTIM_STATE_PREFIX: &str = "optim.state.";
/// The optimizer's sidecar in a checkpoint folder: the non-tensor fields (the optimizer's
/// class and PyTorch's `param_groups`), never inside a safetensors file.
pub const OPTIMIZER_SIDECAR: &str = "optimizer.json";

/// `optim.state.<fqn>.<name>`.
fn state_key(fqn: &str, name: &str) -> String {
    format!("{OPTIM_STATE_PREFIX}{fqn}.{name}")
}

/// The place of a state tensor of the parameter `param` in its global tensor: a tensor of
/// the parameter's (local) shape is laid out as the parameter (sharded with it), a scalar
/// (`step`) is whole on every rank.
fn state_layout(param: &Target, t: &Tensor) -> Option<(Vec<i64>, Vec<i64>, bool)> {
    if t.dim() > 0 && t.size() == param.tensor.size() {
        Some((param.offsets.clone(), param.global.clone(), param.sharded))
    } else if t.dim() == 0 {
        Some((vec![], vec![], false))
    } else {
        None
    }
}

/// The optimizer's state tensors as checkpoint targets, each laid out as its parameter.
fn optimizer_targets(
    rank: usize,
    model: &[Target],
    opt: &Optimizer,
) -> Result<Vec<Target>, CheckpointError> {
    let by_fqn: HashMap<&str, &Target> = model.iter().map(|t| (t.fqn.as_str(), t)).collect();
    let mut out = Vec::new();
    for (fqn, state) in opt.states() {
        let param = by_fqn
            .get(fqn)
            .ok_or_else(|| CheckpointError::OptimizerState {
                rank,
                fqn: fqn.to_string(),
                problem: "the optimizer has state for it, but the model has no such parameter"
                    .into(),
            })?;
        for (name, t) in state.iter() {
            let (offsets, global, sharded) =
                state_layout(param, t).ok_or_else(|| CheckpointError::OptimizerState {
                    rank,
                    fqn: fqn.to_string(),
                    problem: format!(
                        "`{}` is {:?}, neither the parameter's shape {:?} nor a scalar",
                        state_key(fqn, name),
                        t.size(),
                        param.tensor.size()
                    ),
                })?;
            out.push(Target {
                fqn: state_key(fqn, name),
                tensor: t.shallow_clone(),
                offsets,
                global,
                sharded,
            });
        }
    }
    Ok(out)
}

/// What [`save_with`] writes beside the model, and what it prunes.
///
/// ```
/// let opts = tch_dist::checkpoint::SaveOptions {
///     train_state: Some(serde_json::json!({"step": 100, "epoch": 3})),
///     keep_last: Some(2),
/// };
/// # let _ = opts;
/// ```
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SaveOptions {
    /// A small JSON value saved as `train_state.json` by rank 0 (step, epoch, data
    /// position, seeds, anything the loop needs to continue); [`load_train_state`] reads it.
    pub train_state: Option<serde_json::Value>,
    /// Once the new checkpoint is in place, keep only the last `k` complete checkpoints
    /// among its sibling folders (by name: `step-00000100` sorts after `step-00000090`);
    /// `None` keeps all.
    pub keep_last: Option<usize>,
}

/// The train state's file in a checkpoint folder.
pub const TRAIN_STATE: &str = "train_state.json";

/// Saves `module`'s parameters and buffers into the folder `dir` over `group`'s ranks (see
/// the [module docs](self)). Every rank of `group` calls it.
pub fn save<M: Shardable + ?Sized>(
    dir: impl AsRef<Path>,
    module: &M,
    group: &ProcessGroup,
) -> Result<(), CheckpointError> {
    save_with(dir, module, group, &SaveOptions::default())
}

/// [`save`] with a train state and pruning of older checkpoints.
///
/// ```no_run
/// # use tch::nn;
/// # use tch_dist::Shardable;
/// # #[derive(Debug, Shardable)]
/// # struct Net { fc: nn::Linear }
/// # fn demo(pg: &tch_dist::ProcessGroup, model: &Net, step: u64) -> Result<(), tch_dist::checkpoint::CheckpointError> {
/// use tch_dist::checkpoint::{self, SaveOptions};
/// let opts = SaveOptions { train_state: Some(serde_json::json!({ "step": step })), keep_last: Some(3) };
/// checkpoint::save_with(format!("ckpt/step-{step:08}"), model, pg, &opts)?;
/// # Ok(()) }
/// ```
pub fn save_with<M: Shardable + ?Sized>(
    dir: impl AsRef<Path>,
    module: &M,
    group: &ProcessGroup,
    opts: &SaveOptions,
) -> Result<(), CheckpointError> {
    save_impl(dir.as_ref(), module, None, group, opts)
}

/// [`save_with`] and the optimizer's state beside the parameters: each state tensor under
/// PyTorch's flattened name (`optim.state.fc1.weight.exp_avg`, `....step`), in the file of
/// the rank that holds it, sharded like its parameter (the same `saved_offsets`), a scalar
/// `step` once (by rank 0); the optimizer's class and `param_groups` (hyperparameters, the
/// parameters' FQNs) go into the JSON sidecar `optimizer.json`. [`load_with_optimizer`]
/// restores both, at any world size.
///
/// ```no_run
/// # use tch::nn;
/// # use tch_dist::Shardable;
/// # #[derive(Debug, Shardable)]
/// # struct Net { fc: nn::Linear }
/// # fn demo(pg: &tch_dist::ProcessGroup, model: &Net, opt: &tch_dist::optim::Optimizer) -> Result<(), tch_dist::checkpoint::CheckpointError> {
/// use tch_dist::checkpoint::{self, SaveOptions};
/// checkpoint::save_with_optimizer("ckpt/step-00000100", model, opt, pg, &SaveOptions::default())?;
/// # Ok(()) }
/// ```
pub fn save_with_optimizer<M: Shardable + ?Sized>(
    dir: impl AsRef<Path>,
    module: &M,
    optimizer: &Optimizer,
    group: &ProcessGroup,
    opts: &SaveOptions,
) -> Result<(), CheckpointError> {
    save_impl(dir.as_ref(), module, Some(optimizer), group, opts)
}

fn save_impl<M: Shardable + ?Sized>(
    dir: &Path,
    module: &M,
    optimizer: Option<&Optimizer>,
    group: &ProcessGroup,
    opts: &SaveOptions,
) -> Result<(), CheckpointError> {
    const OP: &str = "checkpoint.save";
    let rank = group.rank();
    let tmp = files::sibling(dir, protocol::PARTIAL);
    // A collective's failure names the checkpoint and the step it failed in.
    let during = |step: &'static str| {
        move |e: CheckpointError| match e {
            CheckpointError::Dist(source) => CheckpointError::Save {
                rank,
                dir: dir.to_path_buf(),
                step,
                source: Box::new(source),
            },
            e => e,
        }
    };
    // The commit protocol, step by step (docs/ARCHITECTURE.md, "Checkpoint commit
    // protocol"). 1. Rank 0 makes an empty temporary folder.
    let local = if rank == 0 {
        protocol::start(rank, &tmp)
    } else {
        Ok(())
    };
    group
        .agree(OP, local)
        .map_err(during("making the temporary folder"))?;
    // 2. Every rank writes and fsyncs its file: its shards, and rank 0 the whole tensors
    // (fully_shard parameters held gathered go back to their shards first).
    crate::fully_shard::reshard_all(module).map_err(|e| during("writing the files")(e.into()))?;
    let mut targets = targets(module);
    let path = tmp.join(file_name(rank));
    let local = (|| {
        if let Some(opt) = optimizer {
            let state = optimizer_targets(rank, &targets, opt)?;
            targets.extend(state);
        }
        let mine: Vec<(String, Tensor, Vec<i64>)> = targets
            .iter()
            // An empty shard (more ranks than rows) has nothing to write.
            .filter(|t| (t.sharded && t.tensor.numel() > 0) || (!t.sharded && rank == 0))
            .map(|t| {
                let values = t.tensor.detach().to_device(tch::Device::Cpu).contiguous();
                (t.fqn.clone(), values, t.offsets.clone())
            })
            .collect();
        if mine.is_empty() {
            // Nothing of its own to write (every tensor replicated, written by rank 0).
            return Ok(Vec::new());
        }
        let bytes = files::encode(rank, &path, &mine)?;
        protocol::write_durable(rank, &path, &bytes)?;
        serde_json::to_vec(&FileEntry::of(&bytes)).map_err(|e| CheckpointError::Format {
            rank,
            path: path.clone(),
            cause: e.to_string(),
        })
    })();
    let entry = group
        .agree(OP, local)
        .map_err(during("writing the files"))?;
    let entries = group
        .all_gather_bytes(OP, &entry)
        .map_err(|e| during("gathering the files' checksums")(e.into()))?;
    // 3. Rank 0 writes and fsyncs the sidecars, then the manifest (listing every file with
    // its checksum), then puts the folder in place and removes what it replaced.
    let local = if rank == 0 {
        (|| {
            protocol::crash_point("files-written");
            let format = |path: PathBuf| {
                move |e: serde_json::Error| CheckpointError::Format {
                    rank,
                    path,
                    cause: e.to_string(),
                }
            };
            let mut files_ = BTreeMap::new();
            for (r, e) in entries.iter().enumerate().filter(|(_, e)| !e.is_empty()) {
                let name = file_name(r);
                let entry = serde_json::from_slice(e).map_err(format(tmp.join(&name)))?;
                files_.insert(name, entry);
            }
            let mut sidecars = BTreeMap::new();
            if let Some(state) = &opts.train_state {
                let path = tmp.join(TRAIN_STATE);
                let text = serde_json::to_string_pretty(state).map_err(format(path.clone()))?;
                protocol::write_durable(rank, &path, text.as_bytes())?;
                sidecars.insert(TRAIN_STATE.to_string(), FileEntry::of(text.as_bytes()));
            }
            if let Some(opt) = optimizer {
                let path = tmp.join(OPTIMIZER_SIDECAR);
                let text = optimizer::sidecar::to_json(opt).map_err(format(path.clone()))?;
                protocol::write_durable(rank, &path, text.as_bytes())?;
                sidecars.insert(
                    OPTIMIZER_SIDECAR.to_string(),
                    FileEntry::of(text.as_bytes()),
                );
            }
            let tensors = targets
                .iter()
                .map(|t| {
                    (
                        t.fqn.clone(),
                        TensorEntry {
                            shape: t.global.clone(),
                            dtype: files::dtype_name(t.tensor.kind()),
                        },
                    )
                })
                .collect();
            let manifest = Manifest {
                format: files::FORMAT.to_string(),
                world_size: group.world_size(),
                files: files_,
                sidecars,
                tensors,
            };
            let path = tmp.join(MANIFEST);
            let text = serde_json::to_string_pretty(&manifest).map_err(format(path.clone()))?;
            // The manifest last: a folder without one is never loaded.
            protocol::write_durable(rank, &path, text.as_bytes())?;
            protocol::crash_point("manifest-written");
            protocol::replace(rank, &tmp, dir)?;
            protocol::crash_point("replaced");
            protocol::finish(rank, &tmp)?;
            if let Some(k) = opts.keep_last {
                retention::prune(rank, dir, k)?;
            }
            Ok(())
        })()
    } else {
        Ok(())
    };
    group.agree(OP, local).map_err(during("committing"))
}

/// Loads a checkpoint folder written by [`save`] at any world size (or a one-file
/// safetensors `VarStore::save`) into `module` over `group`'s ranks: each rank's tensors
/// (its shards of sharded parameters, the whole of the others) are copied in place, after
/// every check passed on every rank (see the [module docs](self)).
pub fn load<M: Shardable + ?Sized>(
    path: impl AsRef<Path>,
    module: &M,
    group: &ProcessGroup,
) -> Result<(), CheckpointError> {
    const OP: &str = "checkpoint.load";
    let (path, rank) = (path.as_ref(), group.rank());
    crate::fully_shard::reshard_all(module)?;
    let local = (|| {
        let Saved {
            pieces,
            mut tensors,
            ..
        } = read_checkpoint(rank, path)?;
        // A model-only load leaves the optimizer's state aside.
        tensors.retain(|k, _| !k.starts_with(OPTIM_STATE_PREFIX));
        assemble(rank, &targets(module), &pieces, &tensors)
    })();
    let staged = group.agree(OP, local)?;
    tch::no_grad(|| {
        for (target, values) in &staged {
            target.shallow_clone().copy_(values);
        }
    });
    Ok(())
}

/// [`load`] and the optimizer's state and settings that [`save_with_optimizer`] saved,
/// resharded to this world size like the parameters: afterwards `optimizer` has exactly the
/// checkpoint's state (parameters without saved state have none) and hyperparameters
/// (learning rate included, as PyTorch's `load_state_dict`). A checkpoint without optimizer
/// state, of another optimizer class, or whose state does not fit the model is an error on
/// every rank, and neither the model nor the optimizer changed.
///
/// ```no_run
/// # use tch::nn;
/// # use tch_dist::Shardable;
/// # #[derive(Debug, Shardable)]
/// # struct Net { fc: nn::Linear }
/// # fn demo(pg: &tch_dist::ProcessGroup, model: &Net, opt: &mut tch_dist::optim::Optimizer) -> Result<(), tch_dist::checkpoint::CheckpointError> {
/// if let Some(dir) = tch_dist::checkpoint::latest("ckpt") {
///     tch_dist::checkpoint::load_with_optimizer(&dir, model, opt, pg)?;
/// }
/// # Ok(()) }
/// ```
pub fn load_with_optimizer<M: Shardable + ?Sized>(
    path: impl AsRef<Path>,
    module: &M,
    optimizer: &mut Optimizer,
    group: &ProcessGroup,
) -> Result<(), CheckpointError> {
    const OP: &str = "checkpoint.load";
    let (path, rank) = (path.as_ref(), group.rank());
    crate::fully_shard::reshard_all(module)?;
    let local = (|| {
        let Saved {
            pieces,
            tensors,
            manifest,
        } = read_checkpoint(rank, path)?;
        let (algorithm, lr) = read_sidecar(rank, path, manifest.as_ref(), optimizer)?;
        let mut targets = targets(module);
        let model_count = targets.len();
        let state = state_targets(rank, path, &targets, &tensors, &algorithm, optimizer)?;
        targets.extend(state);
        let staged = assemble(rank, &targets, &pieces, &tensors)?;
        Ok::<_, CheckpointError>((staged, targets.split_off(model_count), algorithm, lr))
    })();
    let (staged, state_targets, algorithm, lr) = group.agree(OP, local)?;
    let (model, state) = staged.split_at(staged.len() - state_targets.len());
    tch::no_grad(|| {
        for (target, values) in model {
            target.shallow_clone().copy_(values);
        }
    });
    let mut by_fqn: BTreeMap<String, BTreeMap<String, Tensor>> = BTreeMap::new();
    for (t, (_, values)) in state_targets.iter().zip(state) {
        let key = &t.fqn[OPTIM_STATE_PREFIX.len()..];
        if let Some((fqn, name)) = key.rsplit_once('.') {
            by_fqn
                .entry(fqn.to_string())
                .or_default()
                .insert(name.to_string(), values.shallow_clone());
        }
    }
    let state = by_fqn
        .into_iter()
        .map(|(fqn, entries)| (fqn, ParamState::from_map(entries)))
        .collect();
    optimizer.restore(algorithm, lr, state);
    Ok(())
}

/// The optimizer's class and settings from the sidecar (checked against the manifest),
/// checked against `optimizer`'s.
fn read_sidecar(
    rank: usize,
    dir: &Path,
    manifest: Option<&Manifest>,
    optimizer: &Optimizer,
) -> Result<(Algorithm, f64), CheckpointError> {
    let path = dir.join(OPTIMIZER_SIDECAR);
    let bytes = match manifest {
        Some(m) => files::read_sidecar(rank, dir, m, OPTIMIZER_SIDECAR)?,
        // A one-file `VarStore::save` has no sidecar.
        None => None,
    };
    let Some(bytes) = bytes else {
        return Err(CheckpointError::NoOptimizerState {
            rank,
            dir: dir.to_path_buf(),
        });
    };
    let format = |cause: String| CheckpointError::Format {
        rank,
        path: path.clone(),
        cause,
    };
    let name = optimizer::sidecar::class_of(&bytes).map_err(format)?;
    let expected = optimizer.algorithm().name();
    if name != expected {
        return Err(CheckpointError::OptimizerKind {
            rank,
            expected: expected.to_string(),
            found: name,
        });
    }
    let (algorithm, lr) = optimizer::sidecar::settings_of(&bytes).map_err(format)?;
    optimizer::check_settings(&algorithm, lr).map_err(|e| format(e.to_string()))?;
    Ok((algorithm, lr))
}

/// Targets for the saved optimizer state (zeros laid out as their parameters), after
/// checking that every state key names a parameter of the model and of the optimizer, with
/// the algorithm's state names, all of them.
fn state_targets(
    rank: usize,
    dir: &Path,
    model: &[Target],
    tensors: &BTreeMap<String, TensorEntry>,
    algorithm: &Algorithm,
    optimizer: &Optimizer,
) -> Result<Vec<Target>, CheckpointError> {
    let by_fqn: HashMap<&str, &Target> = model.iter().map(|t| (t.fqn.as_str(), t)).collect();
    let params: HashSet<&str> = optimizer.param_names().collect();
    let names = algorithm.state_names();
    let mut saved: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for key in tensors.keys() {
        let Some(rest) = key.strip_prefix(OPTIM_STATE_PREFIX) else {
            continue;
        };
        let (fqn, name) = rest.rsplit_once('.').unwrap_or((rest, ""));
        if !by_fqn.contains_key(fqn) || !params.contains(fqn) {
            return Err(CheckpointError::UnexpectedKey {
                rank,
                fqn: key.clone(),
            });
        }
        if !names.contains(&name) {
            return Err(CheckpointError::OptimizerState {
                rank,
                fqn: fqn.to_string(),
                problem: format!(
                    "the checkpoint has `{key}`, a state {} with these settings has not (it has {names:?})",
                    algorithm.name()
                ),
            });
        }
        saved.entry(fqn).or_default().push(name);
    }
    let mut out = Vec::new();
    for (fqn, have) in saved {
        let param = by_fqn[fqn];
        for name in names {
            if !have.contains(name) {
                return Err(CheckpointError::MissingKey {
                    rank,
                    fqn: state_key(fqn, name),
                });
            }
            let key = state_key(fqn, name);
            let entry = &tensors[&key];
            let t = if entry.shape.is_empty() {
                let kind = files::kind_of(&entry.dtype).ok_or_else(|| CheckpointError::Format {
                    rank,
                    path: dir.join(MANIFEST),
                    cause: format!("`{key}` has dtype {}, which tch cannot hold", entry.dtype),
                })?;
                Tensor::zeros([], (kind, param.tensor.device()))
            } else {
                param.tensor.detach().zeros_like()
            };
            // A scalar is whole everywhere; anything else must be of the parameter's global
            // shape (checked by `assemble`), laid out as the parameter.
            let (offsets, global, sharded) = if entry.shape.is_empty() {
                (vec![], vec![], false)
            } else {
                (param.offsets.clone(), param.global.clone(), param.sharded)
            };
            out.push(Target {
                fqn: key,
                tensor: t,
                offsets,
                global,
                sharded,
            });
        }
    }
    Ok(out)
}

type Pieces = HashMap<String, Vec<Piece>>;

/// A checkpoint as read, every file checked against its manifest.
struct Saved {
    /// Every saved piece by FQN.
    pieces: Pieces,
    /// Every tensor's global shape and dtype.
    tensors: BTreeMap<String, TensorEntry>,
    /// The manifest (none for a one-file `VarStore::save`).
    manifest: Option<Manifest>,
}

/// Reads the checkpoint `path` (a folder, or a one-file `VarStore::save`).
fn read_checkpoint(rank: usize, path: &Path) -> Result<Saved, CheckpointError> {
    let mut pieces: Pieces = HashMap::new();
    if path.is_file() {
        // One safetensors file of whole tensors (`VarStore::save`).
        let bytes = files::read(rank, path)?;
        let mut tensors = BTreeMap::new();
        for (fqn, p) in files::decode(rank, path, &bytes)? {
            tensors.insert(
                fqn.clone(),
                TensorEntry {
                    shape: p.values.size(),
                    dtype: files::dtype_name(p.values.kind()),
                },
            );
            pieces.entry(fqn).or_default().push(p);
        }
        return Ok(Saved {
            pieces,
            tensors,
            manifest: None,
        });
    }
    let manifest = files::read_manifest(rank, path)?;
    for (name, entry) in &manifest.files {
        let bytes = files::read_listed(rank, path, name, entry)?;
        for (fqn, p) in files::decode(rank, &path.join(name), &bytes)? {
            pieces.entry(fqn).or_default().push(p);
        }
    }
    let tensors = manifest.tensors.clone();
    Ok(Saved {
        pieces,
        tensors,
        manifest: Some(manifest),
    })
}

/// Checks the model against the checkpoint and builds each of this rank's tensors from the
/// pieces that overlap it (nothing in the model changes here).
fn assemble(
    rank: usize,
    targets: &[Target],
    pieces: &Pieces,
    tensors: &BTreeMap<String, TensorEntry>,
) -> Result<Vec<(Tensor, Tensor)>, CheckpointError> {
    let names: HashSet<&str> = targets.iter().map(|t| t.fqn.as_str()).collect();
    if let Some(fqn) = tensors.keys().find(|k| !names.contains(k.as_str())) {
        return Err(CheckpointError::UnexpectedKey {
            rank,
            fqn: fqn.clone(),
        });
    }
    let mut out = Vec::new();
    for t in targets {
        let saved = tensors
            .get(&t.fqn)
            .ok_or_else(|| CheckpointError::MissingKey {
                rank,
                fqn: t.fqn.clone(),
            })?;
        if saved.shape != t.global {
            return Err(CheckpointError::Shape {
                rank,
                fqn: t.fqn.clone(),
                expected: t.global.clone(),
                found: saved.shape.clone(),
            });
        }
        let expected = files::dtype_name(t.tensor.kind());
        if saved.dtype != expected {
            return Err(CheckpointError::Dtype {
                rank,
                fqn: t.fqn.clone(),
                expected,
                found: saved.dtype.clone(),
            });
        }
        let size = t.tensor.size();
        let values = t.tensor.detach().zeros_like();
        let covered = Tensor::zeros(size.as_slice(), (Kind::Bool, tch::Device::Cpu));
        for p in pieces.get(&t.fqn).map(Vec::as_slice).unwrap_or(&[]) {
            let piece = p.values.size();
            if piece.len() != size.len() || p.offsets.len() != size.len() {
                continue; // not a piece of this tensor's shape: left to the coverage check
            }
            let (mut dst, mut src, mut mask) = (
                values.shallow_clone(),
                p.values.shallow_clone(),
                covered.shallow_clone(),
            );
            let mut overlaps = true;
            for d in 0..size.len() {
                let lo = t.offsets[d].max(p.offsets[d]);
                let hi = (t.offsets[d] + size[d]).min(p.offsets[d] + piece[d]);
                if hi <= lo {
                    overlaps = false;
                    break;
                }
                dst = dst.narrow(d as i64, lo - t.offsets[d], hi - lo);
                mask = mask.narrow(d as i64, lo - t.offsets[d], hi - lo);
                src = src.narrow(d as i64, lo - p.offsets[d], hi - lo);
            }
            if overlaps {
                dst.copy_(&src);
                let _ = mask.fill_(1);
            }
        }
        let covered = covered.sum(Kind::Int64).int64_value(&[]);
        let needed = t.tensor.numel() as i64;
        if covered != needed {
            return Err(CheckpointError::Incomplete {
                rank,
                fqn: t.fqn.clone(),
                covered,
                needed,
            });
        }
        out.push((t.tensor.shallow_clone(), values));
    }
    Ok(out)
}

/// The train state [`save_with`] wrote into the checkpoint folder `dir` (`None` when it
/// was saved without one), read on every rank of `group` (an error on one is an error on
/// all).
///
/// ```no_run
/// # let pg = tch_dist::default_group()?;
/// let state = tch_dist::checkpoint::load_train_state("ckpt/step-00000100", &pg)?;
/// let step = state.and_then(|s| s["step"].as_u64()).unwrap_or(0);
/// # let _ = step;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn load_train_state(
    dir: impl AsRef<Path>,
    group: &ProcessGroup,
) -> Result<Option<serde_json::Value>, CheckpointError> {
    let (dir, rank) = (dir.as_ref(), group.rank());
    let local = (|| {
        let manifest = files::read_manifest(rank, dir)?;
        let Some(bytes) = files::read_sidecar(rank, dir, &manifest, TRAIN_STATE)? else {
            return Ok(None);
        };
        serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| CheckpointError::Format {
                rank,
                path: dir.join(TRAIN_STATE),
                cause: e.to_string(),
            })
    })();
    group.agree("checkpoint.load_train_state", local)
}
