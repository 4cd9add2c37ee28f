//! The ranks' load, as named steps (as `protocol.rs` holds the save's): the targets from the
//! placement record, who holds what anywhere (a pipeline's other stages), one agreement on
//! what the checkpoint holds and fits (the model's keys, shapes and dtypes; the optimizer's
//! class, settings and state; the train state), then the reads (each rank its own, or
//! striped and broadcast), a second agreement, and the copies in place. DCP's
//! `state_dict_loader.py` (`_load_state_dict`: local plan, global plan, read, finish).

use std::collections::{BTreeMap, HashSet};
use std::path::Path;

use tch::Tensor;
use tch_dist_core::Shardable;
use tch_dist_runtime::{DistError, ProcessGroup};

use super::reader::{self, LoadStats, Opened};
use super::storage::{self, TensorEntry};
use super::CheckpointProblem;
use super::{plan, striped, CheckpointError, LoadOptions, Reads, State, TRAIN_STATE};
use crate::optim::Algorithm;
use crate::state_dict::flat::{self, Entry, OPTIM_STATE_PREFIX};

/// The collectives' name in errors.
const OP: &str = "checkpoint.load";

/// A collective's failure during the load of `path` (a dead peer), naming the checkpoint;
/// other ranks' failures (`PeersFailed`) and this rank's own errors as they are.
fn loading(rank: usize, path: &Path) -> impl Fn(CheckpointError) -> CheckpointError + '_ {
    move |e| match e {
        CheckpointError::Dist(source) if !matches!(source, DistError::PeersFailed { .. }) => {
            CheckpointProblem::Load {
                dir: path.to_path_buf(),
                source: Box::new(source),
            }
            .on(rank)
        }
        e => e,
    }
}

/// What one rank found the checkpoint to hold for it, before reading a value: the opened
/// folder, every target (the model's, then the optimizer state's), how many are the model's,
/// the keys to read, the optimizer's saved settings, the train state.
struct Prepared {
    opened: Opened,
    targets: Vec<Entry>,
    model_count: usize,
    tensors: BTreeMap<String, TensorEntry>,
    settings: Option<(Algorithm, f64)>,
    train_state: Option<serde_json::Value>,
}

/// [`load`](super::load)'s steps.
pub(super) fn run<M: Shardable + ?Sized>(
    path: &Path,
    state: &mut State<'_, M>,
    group: &ProcessGroup,
    opts: &LoadOptions,
) -> Result<LoadStats, CheckpointError> {
    let (rank, module) = (group.rank(), state.model);
    crate::state_dict::reshard_all(module)?;
    let placements = crate::state_dict::placements(module);
    let targets = flat::model_entries(module, &placements);
    let split = flat::split_tensors(module, &placements);
    let held = plan::held_anywhere(&targets, &split, group).map_err(loading(rank, path))?;
    // Every rank must share the reads the same way: a striped rank's all-gather of its
    // whole tensors' digest would otherwise meet another rank's reads.
    let reads = [("reads".to_string(), format!("{:?}", opts.reads))];
    group
        .verify_same_options(OP, &reads)
        .map_err(|e| loading(rank, path)(e.into()))?;
    let mut reader = reader::Reader::new(rank);
    let with_optimizer = state.optimizer().is_some();
    let prepared = prepare(&mut reader, path, state, targets, held);
    let prepared = group.agree(OP, prepared).map_err(loading(rank, path))?;
    let readers = match opts.reads {
        Reads::Striped
            if striped::same_on_every_rank(group, &prepared.targets)
                .map_err(loading(rank, path))? =>
        {
            striped::readers(&prepared.targets, group.world_size())
        }
        _ => vec![None; prepared.targets.len()],
    };
    let local = read(&mut reader, &prepared, &readers, rank);
    let staged = group.agree(OP, local).map_err(loading(rank, path))?;
    striped::broadcast(group, &readers, &staged).map_err(loading(rank, path))?;
    let (model, optim) = staged.split_at(prepared.model_count);
    tch::no_grad(|| {
        for (target, values) in model {
            target.shallow_clone().copy_(values);
        }
    });
    if let (Some(optimizer), Some((algorithm, lr))) = (state.optimizer_mut(), prepared.settings) {
        let entries = &prepared.targets[prepared.model_count..];
        optimizer.restore(algorithm, lr, flat::unflatten_state(entries, optim));
    }
    debug_assert!(with_optimizer || optim.is_empty());
    state.train_state = prepared.train_state;
    Ok(reader.stats)
}

/// This rank's view of the checkpoint, checked: the model's targets (and with an optimizer,
/// its saved settings checked against the optimizer's, and its state's targets) against
/// the checkpoint's keys, shapes and dtypes; the train state parsed.
fn prepare<M: Shardable + ?Sized>(
    reader: &mut reader::Reader,
    path: &Path,
    state: &State<'_, M>,
    mut targets: Vec<Entry>,
    mut held: HashSet<String>,
) -> Result<Prepared, CheckpointError> {
    let rank = reader.rank();
    let opened = reader.open(path)?;
    let mut tensors = opened.tensors.clone();
    let model_count = targets.len();
    let settings = match state.optimizer() {
        Some(optimizer) => {
            let (algorithm, lr) =
                plan::saved_settings(rank, path, opened.manifest.as_ref(), optimizer)?;
            let optim =
                plan::state_targets(rank, path, &targets, &tensors, &held, &algorithm, optimizer)?;
            // Other ranks' optimizer state is theirs to load, as their parameters are.
            let theirs: Vec<String> = tensors
                .keys()
                .filter(|k| held.contains(flat::owner_fqn(k)))
                .cloned()
                .collect();
            held.extend(theirs);
            targets.extend(optim);
            Some((algorithm, lr))
        }
        None => {
            // A model-only load leaves the optimizer's state aside.
            tensors.retain(|k, _| !k.starts_with(OPTIM_STATE_PREFIX));
            None
        }
    };
    super::reshard::check(rank, &targets, &held, &tensors)?;
    let train_state = train_state(rank, path, &opened)?;
    Ok(Prepared {
        opened,
        targets,
        model_count,
        tensors,
        settings,
        train_state,
    })
}

/// The train state the checkpoint holds (`None` without one, and for a folder without a
/// manifest: PyTorch's, or a one-file `VarStore::save`).
fn train_state(
    rank: usize,
    path: &Path,
    opened: &Opened,
) -> Result<Option<serde_json::Value>, CheckpointError> {
    let Some(manifest) = opened.manifest.as_ref() else {
        return Ok(None);
    };
    let Some(bytes) = storage::read_sidecar(rank, path, manifest, TRAIN_STATE)? else {
        return Ok(None);
    };
    serde_json::from_slice(&bytes).map(Some).map_err(|e| {
        CheckpointProblem::Format {
            path: path.join(TRAIN_STATE),
            cause: e.to_string(),
        }
        .on(rank)
    })
}

/// This rank's reads: the targets it reads itself (all, or those `readers` gives it), and
/// placeholders for the others, which the broadcast fills.
fn read(
    reader: &mut reader::Reader,
    prepared: &Prepared,
    readers: &[Option<usize>],
    rank: usize,
) -> Result<Vec<(Tensor, Tensor)>, CheckpointError> {
    let mine: Vec<bool> = readers
        .iter()
        .map(|r| r.is_none_or(|r| r == rank))
        .collect();
    let own: Vec<Entry> = prepared
        .targets
        .iter()
        .zip(&mine)
        .filter(|(_, m)| **m)
        .map(|(t, _)| t.clone())
        .collect();
    let mut read = reader
        .read(&prepared.opened, &own, &prepared.tensors)?
        .into_iter();
    Ok(prepared
        .targets
        .iter()
        .zip(&mine)
        .map(|(t, m)| match m {
            true => read.next().expect("one value per own target"),
            false => (t.tensor.shallow_clone(), t.tensor.detach().empty_like()),
        })
        .collect())
}

/// The train state of the checkpoint folder `dir`, without the model, read on every rank of
/// `group` (an error on one is an error on all): what the previous release's
/// `load_train_state` returned.
pub(super) fn train_state_only(
    dir: &Path,
    group: &ProcessGroup,
) -> Result<Option<serde_json::Value>, CheckpointError> {
    let rank = group.rank();
    let local = (|| {
        let manifest = storage::read_manifest(rank, dir)?;
        let Some(bytes) = storage::read_sidecar(rank, dir, &manifest, TRAIN_STATE)? else {
            return Ok(None);
        };
        serde_json::from_slice(&bytes).map(Some).map_err(|e| {
            CheckpointProblem::Format {
                path: dir.join(TRAIN_STATE),
                cause: e.to_string(),
            }
            .on(rank)
        })
    })();
    group.agree("checkpoint.load_train_state", local)
}
