//! The state dict flattened, as DCP saves it: every tensor of the model (and of its
//! optimizer's state, under PyTorch's flattened names `optim.state.<fqn>.<name>`, laid out
//! as its parameter) as one [`Entry`], this rank's part with its place in the global tensor
//! and [`Part`] (who writes it). What `checkpoint` writes and fills, and nothing but the
//! placement record goes into it.

use std::collections::{BTreeMap, HashMap, HashSet};

use tch::Tensor;
use tch_dist_core::Shardable;

use super::Placements;
use crate::optim::{Optimizer, ParamState};

/// The prefix of optimizer state keys: PyTorch's flattened
/// `{"optim": get_optimizer_state_dict(model, optim)}`, `optim.state.<fqn>.<name>`.
pub const OPTIM_STATE_PREFIX: &str = "optim.state.";

/// What this rank's part of a global tensor is, for a checkpoint: who writes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Part {
    /// The whole tensor (not sharded): written once, by the lowest rank that holds it.
    Whole,
    /// This rank's shard: written by this rank.
    Shard,
    /// A shard another replica holds too (HSDP: the ranks of a 2-D mesh's replicate dim hold
    /// the same shards): written only by the first replica, so the checkpoint holds each
    /// piece once, as DCP's de-duplicated save plans do.
    ReplicaCopy,
}

impl Part {
    /// Whether it is a piece of a sharded tensor (read and written at its offsets).
    pub(crate) fn is_shard(self) -> bool {
        !matches!(self, Part::Whole)
    }
}

/// One tensor of the state dict as a checkpoint sees it: this rank's part of a global
/// tensor.
pub(crate) struct Entry {
    /// The FQN (`optim.state.<fqn>.<name>` for optimizer state).
    pub fqn: String,
    /// This rank's part (the whole tensor when not sharded).
    pub tensor: Tensor,
    /// Where this rank's part starts in the global tensor.
    pub offsets: Vec<i64>,
    /// The global tensor's shape.
    pub global: Vec<i64>,
    /// Who writes it.
    pub part: Part,
}

impl Clone for Entry {
    /// The same entry, its tensor the same storage.
    fn clone(&self) -> Self {
        Entry {
            fqn: self.fqn.clone(),
            tensor: self.tensor.shallow_clone(),
            offsets: self.offsets.clone(),
            global: self.global.clone(),
            part: self.part,
        }
    }
}

/// The model's parameters and buffers as entries, with this rank's place in each global
/// tensor from `placements` (a tied parameter's second name is the same tensor, so saved
/// as the shard it is too).
pub(crate) fn model_entries<M: Shardable + ?Sized>(
    module: &M,
    placements: &Placements,
) -> Vec<Entry> {
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
        let (offsets, global, part) = match placements.get(t) {
            Some(p) => {
                let part = if p.is_replica_copy() {
                    Part::ReplicaCopy
                } else {
                    Part::Shard
                };
                (p.offsets.clone(), p.global_shape.clone(), part)
            }
            None => (vec![0; t.dim()], t.size(), Part::Whole),
        };
        out.push(Entry {
            fqn,
            tensor: t.shallow_clone(),
            offsets,
            global,
            part,
        });
    }
    out
}

/// `module`'s tensors that this rank holds as several blocks of the whole, with how many
/// (see [`ParamPlacement::blocks`](super::ParamPlacement::blocks)), by its placement record.
pub(crate) fn split_tensors<M: Shardable + ?Sized>(
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

/// `optim.state.<fqn>.<name>`.
pub(crate) fn state_key(fqn: &str, name: &str) -> String {
    format!("{OPTIM_STATE_PREFIX}{fqn}.{name}")
}

/// An optimizer state key's parameter and state name (`optim.state.<fqn>.<name>`; a key
/// without a name is its parameter's with an empty name), `None` for a model key: the
/// inverse of [`state_key`].
pub(crate) fn state_key_parts(key: &str) -> Option<(&str, &str)> {
    let rest = key.strip_prefix(OPTIM_STATE_PREFIX)?;
    Some(rest.rsplit_once('.').unwrap_or((rest, "")))
}

/// The parameter an optimizer state key belongs to (`optim.state.<fqn>.<name>` -> `fqn`),
/// else the key itself.
pub(crate) fn owner_fqn(key: &str) -> &str {
    state_key_parts(key).map_or(key, |(fqn, _)| fqn)
}

/// Where a state tensor of shape `shape` (`None`: a scalar) of the parameter `param` lies:
/// one of the parameter's (local) shape is laid out as the parameter (sharded with it); a
/// scalar (`step`) is whole on every rank; any other shape has no place (`None`).
pub(crate) fn laid_out_as(param: &Entry, shape: &[i64]) -> Option<(Vec<i64>, Vec<i64>, Part)> {
    if shape.is_empty() {
        Some((vec![], vec![], Part::Whole))
    } else if shape == param.tensor.size().as_slice() {
        Some((param.offsets.clone(), param.global.clone(), param.part))
    } else {
        None
    }
}

/// Why an optimizer's state has no place in the flattened state dict: the parameter's FQN
/// and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct StateProblem {
    pub fqn: String,
    pub problem: String,
}

/// The optimizer's state tensors as entries, each laid out as its parameter in `model`.
pub(crate) fn optimizer_entries(
    model: &[Entry],
    opt: &Optimizer,
) -> Result<Vec<Entry>, StateProblem> {
    let by_fqn: HashMap<&str, &Entry> = model.iter().map(|t| (t.fqn.as_str(), t)).collect();
    let mut out = Vec::new();
    for (fqn, state) in opt.states() {
        let param = by_fqn.get(fqn).ok_or_else(|| StateProblem {
            fqn: fqn.to_string(),
            problem: "the optimizer has state for it, but the model has no such parameter".into(),
        })?;
        for (name, t) in state.iter() {
            let (offsets, global, part) =
                laid_out_as(param, &t.size()).ok_or_else(|| StateProblem {
                    fqn: fqn.to_string(),
                    problem: format!(
                        "`{}` is {:?}, neither the parameter's shape {:?} nor a scalar",
                        state_key(fqn, name),
                        t.size(),
                        param.tensor.size()
                    ),
                })?;
            out.push(Entry {
                fqn: state_key(fqn, name),
                tensor: t.shallow_clone(),
                offsets,
                global,
                part,
            });
        }
    }
    Ok(out)
}

/// The loaded optimizer state, unflattened: each entry's values (in `values`, in the same
/// order) under its parameter's FQN and its state name.
pub(crate) fn unflatten_state(
    entries: &[Entry],
    values: &[(Tensor, Tensor)],
) -> BTreeMap<String, ParamState> {
    let mut by_fqn: BTreeMap<String, BTreeMap<String, Tensor>> = BTreeMap::new();
    for (t, (_, values)) in entries.iter().zip(values) {
        let key = t.fqn.strip_prefix(OPTIM_STATE_PREFIX);
        if let Some((fqn, name)) = key.and_then(|k| k.rsplit_once('.')) {
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
