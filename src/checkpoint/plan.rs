//! What a checkpoint holds and who writes it, DCP's planner (`planner.py`,
//! `default_planner.py`): the model's tensors with this rank's place in each global tensor
//! ([`Target`]), which of them this rank writes, the optimizer's state flattened to PyTorch's
//! names (`optim.state.<fqn>.<name>`, laid out as its parameter), and, on load, the
//! optimizer state and settings a checkpoint holds, checked against the model and the
//! optimizer, and unflattened again.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;

use tch::Tensor;
use tch_dist_core::Shardable;

use super::storage::{self, Manifest, TensorEntry};
use super::{CheckpointError, MANIFEST, OPTIMIZER_SIDECAR, OPTIM_STATE_PREFIX};
use crate::optim::{self as optimizer, Algorithm, Optimizer, ParamState};
use crate::state_dict::Placements;

/// One tensor of the model as a checkpoint sees it: this rank's part of a global tensor.
pub(super) struct Target {
    /// The FQN (`optim.state.<fqn>.<name>` for optimizer state).
    pub fqn: String,
    /// This rank's part (the whole tensor when not sharded).
    pub tensor: Tensor,
    /// Where this rank's part starts in the global tensor.
    pub offsets: Vec<i64>,
    /// The global tensor's shape.
    pub global: Vec<i64>,
    /// Whether the part is a shard (written by its holder) or the whole tensor (by rank 0).
    pub sharded: bool,
    /// A shard that another replica holds too (HSDP: the ranks of a 2-D mesh's replicate
    /// dim hold the same shards): written only by the first replica, so the checkpoint holds
    /// each piece once, as DCP's de-duplicated save plans do.
    pub replica_copy: bool,
}

impl Clone for Target {
    /// The same entry, its tensor the same storage.
    fn clone(&self) -> Self {
        Target {
            fqn: self.fqn.clone(),
            tensor: self.tensor.shallow_clone(),
            offsets: self.offsets.clone(),
            global: self.global.clone(),
            sharded: self.sharded,
            replica_copy: self.replica_copy,
        }
    }
}

/// The model's parameters and buffers, with this rank's place in each global tensor.
pub(super) fn targets<M: Shardable + ?Sized>(module: &M) -> Vec<Target> {
    targets_placed(module, &crate::state_dict::placements(module))
}

/// [`targets`], with `module`'s placement record computed already.
pub(super) fn targets_placed<M: Shardable + ?Sized>(
    module: &M,
    placements: &Placements,
) -> Vec<Target> {
    // Where each sharded parameter's pieces are: the one placement record (a tied
    // parameter's second name is the same tensor, so saved as the shard it is too).
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
        let (offsets, global, sharded, replica_copy) = match placements.get(t) {
            Some(p) => (
                p.offsets.clone(),
                p.global_shape.clone(),
                true,
                p.is_replica_copy(),
            ),
            None => (vec![0; t.dim()], t.size(), false, false),
        };
        out.push(Target {
            replica_copy,
            fqn,
            tensor: t.shallow_clone(),
            offsets,
            global,
            sharded,
        });
    }
    out
}

/// `module`'s tensors that this rank holds as several blocks of the whole, with how many
/// (see [`ParamPlacement::blocks`](crate::state_dict::ParamPlacement::blocks)), by its
/// placement record.
pub(super) fn split_tensors<M: Shardable + ?Sized>(
    module: &M,
    placements: &Placements,
) -> HashMap<String, usize> {
    module
        .named_parameters()
        .into_iter()
        .filter_map(|(fqn, t)| {
            placements
                .get(t)
                .filter(|p| p.blocks > 1)
                .map(|p| (fqn, p.blocks))
        })
        .collect()
}

/// The first tensor some rank holds split (the lines each rank sent: `FQN\tsplit N`), as
/// the refusal every rank returns alike.
fn first_split(rank: usize, lines: &[Vec<(String, String)>]) -> Option<CheckpointError> {
    lines.iter().enumerate().find_map(|(holder, l)| {
        l.iter().find_map(|(fqn, v)| {
            let blocks = v.strip_prefix("split ")?.parse().ok()?;
            Some(CheckpointError::SplitTensor {
                rank,
                fqn: fqn.clone(),
                holder,
                blocks,
            })
        })
    })
}

/// Each rank's lines of an all-gather of `FQN\tVALUE` lines, in its order.
fn tab_lines(gathered: &[Vec<u8>]) -> Vec<Vec<(String, String)>> {
    gathered
        .iter()
        .map(|b| {
            String::from_utf8_lossy(b)
                .lines()
                .filter_map(|l| l.split_once('\t'))
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        })
        .collect()
}

/// The FQNs of the model tensors any rank of a load over `group` holds (one all-gather of
/// every rank's `targets`' names): a saved tensor that no rank holds is refused, one that
/// only other ranks hold (a pipeline's other stages) is theirs to load. A tensor that some
/// rank holds as several blocks (`split`, by FQN) is refused on every rank.
pub(super) fn held_anywhere(
    targets: &[Target],
    split: &HashMap<String, usize>,
    group: &tch_dist_runtime::ProcessGroup,
) -> Result<HashSet<String>, CheckpointError> {
    let names: String = targets
        .iter()
        .map(|t| match split.get(&t.fqn) {
            Some(n) => format!("{}\tsplit {n}\n", t.fqn),
            None => format!("{}\t\n", t.fqn),
        })
        .collect();
    let lines = tab_lines(&group.all_gather_bytes("checkpoint.load", names.as_bytes())?);
    if let Some(refusal) = first_split(group.rank(), &lines) {
        return Err(refusal);
    }
    Ok(lines.into_iter().flatten().map(|(fqn, _)| fqn).collect())
}

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
pub(super) fn optimizer_targets(
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
                replica_copy: sharded && param.replica_copy,
            });
        }
    }
    Ok(out)
}

/// The optimizer's class and settings from the sidecar (checked against the manifest),
/// checked against `optimizer`'s.
pub(super) fn saved_settings(
    rank: usize,
    dir: &Path,
    manifest: Option<&Manifest>,
    optimizer: &Optimizer,
) -> Result<(Algorithm, f64), CheckpointError> {
    let path = dir.join(OPTIMIZER_SIDECAR);
    let bytes = match manifest {
        Some(m) => storage::read_sidecar(rank, dir, m, OPTIMIZER_SIDECAR)?,
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
/// the algorithm's state names, all of them; the state of a parameter only other ranks of
/// the load hold (`held`, [`held_anywhere`]: a pipeline's other stages) is theirs to load.
pub(super) fn state_targets(
    rank: usize,
    dir: &Path,
    model: &[Target],
    tensors: &BTreeMap<String, TensorEntry>,
    held: &HashSet<String>,
    algorithm: &Algorithm,
    optimizer: &Optimizer,
) -> Result<Vec<Target>, CheckpointError> {
    let by_fqn: HashMap<&str, &Target> = model.iter().map(|t| (t.fqn.as_str(), t)).collect();
    let params: HashSet<&str> = optimizer.param_names().collect();
    let names = algorithm.state_names();
    let mut saved: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for key in tensors.keys() {
        let Some((fqn, name)) = state_key_parts(key) else {
            continue;
        };
        // Another rank's parameter (a pipeline's other stages): that rank loads it.
        if !by_fqn.contains_key(fqn) && held.contains(fqn) {
            continue;
        }
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
                let kind =
                    storage::kind_of(&entry.dtype).ok_or_else(|| CheckpointError::Format {
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
                replica_copy: sharded && param.replica_copy,
            });
        }
    }
    Ok(out)
}

/// What this rank writes of `targets`: its shards (an empty one has nothing to write), and
/// on rank 0 the whole tensors, as (FQN, values on the CPU, contiguous, offsets in the
/// global tensor). With `copy`, each is a copy of its own (an async save's staging: the
/// next step may change the parameter); else a contiguous CPU tensor is the parameter's
/// memory itself.
pub(super) fn to_write(
    rank: usize,
    targets: &[Target],
    writers: &Writers,
    copy: bool,
) -> Vec<(String, Tensor, Vec<i64>)> {
    targets
        .iter()
        // An empty shard (more ranks than rows) has nothing to write.
        .filter(|t| {
            (t.sharded && !t.replica_copy && t.tensor.numel() > 0)
                || (!t.sharded && whole_writer(writers, t) == Some(rank))
        })
        .map(|t| {
            let values = if copy {
                // One copy, straight into new host memory (from any device).
                let host = Tensor::empty(t.tensor.size(), (t.tensor.kind(), tch::Device::Cpu));
                tch::no_grad(|| host.shallow_clone().copy_(&t.tensor.detach()));
                host
            } else {
                t.tensor.detach().to_device(tch::Device::Cpu).contiguous()
            };
            (t.fqn.clone(), values, t.offsets.clone())
        })
        .collect()
}

/// The manifest's `tensors`: every target's global shape and dtype.
pub(super) fn tensor_entries(targets: &[Target]) -> BTreeMap<String, TensorEntry> {
    targets
        .iter()
        .map(|t| {
            (
                t.fqn.clone(),
                TensorEntry {
                    shape: t.global.clone(),
                    dtype: storage::dtype_name(t.tensor.kind()),
                },
            )
        })
        .collect()
}

/// The loaded optimizer state, unflattened: each [`state_targets`] target's values (in
/// `values`, in the same order) under its parameter's FQN and its state name.
pub(super) fn unflatten_state(
    targets: &[Target],
    values: &[(Tensor, Tensor)],
) -> BTreeMap<String, ParamState> {
    let mut by_fqn: BTreeMap<String, BTreeMap<String, Tensor>> = BTreeMap::new();
    for (t, (_, values)) in targets.iter().zip(values) {
        let key = &t.fqn[OPTIM_STATE_PREFIX.len()..];
        if let Some((fqn, name)) = key.rsplit_once('.') {
            by_fqn
                .entry(fqn.to_string())
                .or_default()
                .insert(name.to_string(), values.shallow_clone());
        }
    }
    by_fqn
        .into_iter()
        .map(|(fqn, entries)| (fqn, ParamState::from_map(entries)))
        .collect()
}

/// Which rank writes each tensor saved whole: the lowest rank of `group` that holds it
/// (rank 0 for a replicated model; a pipeline stage's first rank for its tensors, which
/// rank 0 does not hold), by FQN, for every parameter and buffer of any rank. A tensor's
/// optimizer state saved whole (a scalar `step`, the state of an unsharded parameter) is
/// written by its parameter's writer ([`whole_writer`]).
pub(super) type Writers = HashMap<String, usize>;

/// The rank that writes the whole tensor `t` (model or optimizer state) by `writers`.
pub(super) fn whole_writer(writers: &Writers, t: &Target) -> Option<usize> {
    writers.get(owner_fqn(&t.fqn)).copied()
}

/// The parameter an optimizer state key belongs to (`optim.state.<fqn>.<name>` -> `fqn`),
/// else the key itself.
pub(super) fn owner_fqn(key: &str) -> &str {
    state_key_parts(key).map_or(key, |(fqn, _)| fqn)
}

/// An optimizer state key's parameter and state name (`optim.state.<fqn>.<name>`; a key
/// without a name is its parameter's with an empty name), `None` for a model key: the
/// inverse of [`state_key`].
fn state_key_parts(key: &str) -> Option<(&str, &str)> {
    let rest = key.strip_prefix(OPTIM_STATE_PREFIX)?;
    Some(rest.rsplit_once('.').unwrap_or((rest, "")))
}

/// The [`Writers`] of `module`'s tensors over `group`, after checking that every parameter
/// that no API shards (saved whole, by one rank) has the same shape and values on every
/// rank that holds it: otherwise the other ranks' values would be lost without a word
/// (independent models, parameters left out of data parallelism). Ranks may hold different
/// tensors (pipeline stages: each saves its own part under the whole model's names). One
/// all-gather of a line per tensor (FQN, and for a whole parameter its shape, the sum and
/// the sum of squares in f64: replicas that data parallelism keeps equal are equal bit for
/// bit); every rank finds the same first difference, so fails alike.
pub(super) fn replicas_agree<M: Shardable + ?Sized>(
    module: &M,
    group: &tch_dist_runtime::ProcessGroup,
) -> Result<Writers, CheckpointError> {
    const OP: &str = "checkpoint.save";
    let placements = crate::state_dict::placements(module);
    let split = split_tensors(module, &placements);
    let mut seen = HashSet::new();
    let buffers = module
        .named_buffers()
        .into_iter()
        .map(|(fqn, _)| (fqn, None));
    let params = module
        .named_parameters()
        .into_iter()
        .map(|(fqn, t)| (fqn, Some(t)));
    let lines: String = tch::no_grad(|| {
        params
            .chain(buffers)
            .filter(|(fqn, _)| seen.insert(fqn.clone()))
            .map(|(fqn, t)| match t.filter(|t| placements.get(t).is_none()) {
                _ if split.contains_key(&fqn) => format!("{fqn}\tsplit {}\n", split[&fqn]),
                Some(t) => {
                    let d = t.detach().to_kind(tch::Kind::Double);
                    let (sum, squares) = if d.numel() == 0 {
                        (0.0, 0.0)
                    } else {
                        (
                            d.sum(tch::Kind::Double).double_value(&[]),
                            (&d * &d).sum(tch::Kind::Double).double_value(&[]),
                        )
                    };
                    format!("{fqn}\t{:?} {sum:e} {squares:e}\n", t.size())
                }
                // A shard or a buffer: only who holds it.
                None => format!("{fqn}\t\n"),
            })
            .collect()
    });
    // Each rank's lines, in its walk order.
    let lists = tab_lines(&group.all_gather_bytes(OP, lines.as_bytes())?);
    if let Some(refusal) = first_split(group.rank(), &lists) {
        return Err(refusal);
    }
    let per_rank: Vec<BTreeMap<&str, &str>> = lists
        .iter()
        .map(|l| l.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect())
        .collect();
    // Rank 0's walk order, then the names only other ranks have, by rank: the same order,
    // so the same first difference, on every rank.
    let mut names: Vec<&str> = Vec::new();
    let mut writers = Writers::new();
    for (r, (k, _)) in lists
        .iter()
        .enumerate()
        .flat_map(|(r, l)| l.iter().map(move |kv| (r, kv)))
    {
        if !writers.contains_key(k.as_str()) {
            writers.insert(k.clone(), r);
            names.push(k);
        }
    }
    for fqn in names {
        let first = writers[fqn];
        let value = per_rank[first][fqn];
        let ranks: Vec<usize> = (first + 1..per_rank.len())
            .filter(|&r| per_rank[r].get(fqn).is_some_and(|v| *v != value))
            .collect();
        if !ranks.is_empty() {
            return Err(CheckpointError::ReplicasDiffer {
                rank: group.rank(),
                fqn: fqn.to_string(),
                first,
                ranks,
            });
        }
    }
    Ok(writers)
}
