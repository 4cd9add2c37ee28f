//! What a checkpoint holds and who writes it, DCP's planner (`planner.py`,
//! `default_planner.py`): the model's tensors with this rank's place in each global tensor
//! ([`Entry`]), which of them this rank writes, the optimizer's state flattened to PyTorch's
//! names (`optim.state.<fqn>.<name>`, laid out as its parameter), and, on load, the
//! optimizer state and settings a checkpoint holds, checked against the model and the
//! optimizer, and unflattened again.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;

use tch::Tensor;
use tch_dist_core::Shardable;

use super::storage::{self, Manifest, TensorEntry};
use super::CheckpointProblem;
use super::{CheckpointError, MANIFEST, OPTIMIZER_SIDECAR};
use crate::optim::{self as optimizer, Algorithm, Optimizer};
use crate::state_dict::flat::{self, owner_fqn, state_key, state_key_parts, Entry, Part};

/// The first tensor some rank holds split (the lines each rank sent: `FQN\tsplit N`), as
/// the refusal every rank returns alike.
fn first_split(rank: usize, lines: &[Vec<(String, String)>]) -> Option<CheckpointError> {
    lines.iter().enumerate().find_map(|(holder, l)| {
        l.iter().find_map(|(fqn, v)| {
            let blocks = v.strip_prefix("split ")?.parse().ok()?;
            Some(
                CheckpointProblem::SplitTensor {
                    fqn: fqn.clone(),
                    holder,
                    blocks,
                }
                .on(rank),
            )
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
    targets: &[Entry],
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

/// The optimizer's state tensors as entries, each laid out as its parameter in `model`; a
/// state with no place is an error naming its parameter.
pub(super) fn optimizer_targets(
    rank: usize,
    model: &[Entry],
    opt: &Optimizer,
) -> Result<Vec<Entry>, CheckpointError> {
    flat::optimizer_entries(model, opt).map_err(|p| {
        CheckpointProblem::OptimizerState {
            fqn: p.fqn,
            problem: p.problem,
        }
        .on(rank)
    })
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
        return Err(CheckpointProblem::NoOptimizerState {
            dir: dir.to_path_buf(),
        }
        .on(rank));
    };
    let format = |cause: String| {
        CheckpointProblem::Format {
            path: path.clone(),
            cause,
        }
        .on(rank)
    };
    let name = optimizer::sidecar::class_of(&bytes).map_err(format)?;
    let expected = optimizer.algorithm().name();
    if name != expected {
        return Err(CheckpointProblem::OptimizerKind {
            expected: expected.to_string(),
            found: name,
        }
        .on(rank));
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
    model: &[Entry],
    tensors: &BTreeMap<String, TensorEntry>,
    held: &HashSet<String>,
    algorithm: &Algorithm,
    optimizer: &Optimizer,
) -> Result<Vec<Entry>, CheckpointError> {
    let by_fqn: HashMap<&str, &Entry> = model.iter().map(|t| (t.fqn.as_str(), t)).collect();
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
            return Err(CheckpointProblem::UnexpectedKey { fqn: key.clone() }.on(rank));
        }
        if !names.contains(&name) {
            return Err(CheckpointProblem::OptimizerState {
                fqn: fqn.to_string(),
                problem: format!(
                    "the checkpoint has `{key}`, a state {} with these settings has not (it has {names:?})",
                    algorithm.name()
                ),
            }.on(rank));
        }
        saved.entry(fqn).or_default().push(name);
    }
    let mut out = Vec::new();
    for (fqn, have) in saved {
        let param = by_fqn[fqn];
        for name in names {
            if !have.contains(name) {
                return Err(CheckpointProblem::MissingKey {
                    fqn: state_key(fqn, name),
                }
                .on(rank));
            }
            let key = state_key(fqn, name);
            let entry = &tensors[&key];
            let t = if entry.shape.is_empty() {
                let kind = storage::kind_of(&entry.dtype).ok_or_else(|| {
                    CheckpointProblem::Format {
                        path: dir.join(MANIFEST),
                        cause: format!("`{key}` has dtype {}, which tch cannot hold", entry.dtype),
                    }
                    .on(rank)
                })?;
                Tensor::zeros([], (kind, param.tensor.device()))
            } else {
                param.tensor.detach().zeros_like()
            };
            // A scalar is whole everywhere; anything else must be of the parameter's global
            // shape (checked by `assemble`), laid out as the parameter.
            let (offsets, global, part) = if entry.shape.is_empty() {
                (vec![], vec![], Part::Whole)
            } else {
                (param.offsets.clone(), param.global.clone(), param.part)
            };
            out.push(Entry {
                fqn: key,
                tensor: t,
                offsets,
                global,
                part,
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
    targets: &[Entry],
    writers: &Writers,
    copy: bool,
) -> Vec<(String, Tensor, Vec<i64>)> {
    targets
        .iter()
        // An empty shard (more ranks than rows) has nothing to write.
        .filter(|t| match t.part {
            Part::Shard => t.tensor.numel() > 0,
            Part::ReplicaCopy => false,
            Part::Whole => whole_writer(writers, t) == Some(rank),
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
pub(super) fn tensor_entries(targets: &[Entry]) -> BTreeMap<String, TensorEntry> {
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

/// Which rank writes each tensor saved whole: the lowest rank of `group` that holds it
/// (rank 0 for a replicated model; a pipeline stage's first rank for its tensors, which
/// rank 0 does not hold), by FQN, for every parameter and buffer of any rank. A tensor's
/// optimizer state saved whole (a scalar `step`, the state of an unsharded parameter) is
/// written by its parameter's writer ([`whole_writer`]).
pub(super) type Writers = HashMap<String, usize>;

/// The rank that writes the whole tensor `t` (model or optimizer state) by `writers`.
pub(super) fn whole_writer(writers: &Writers, t: &Entry) -> Option<usize> {
    writers.get(owner_fqn(&t.fqn)).copied()
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
    let split = flat::split_tensors(module, &placements);
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
            return Err(CheckpointProblem::ReplicasDiffer {
                fqn: fqn.to_string(),
                first,
                ranks,
            }
            .on(group.rank()));
        }
    }
    Ok(writers)
}
