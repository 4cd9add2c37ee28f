//! Live recovery: a replica group that is behind (restarted, or new) receives the current
//! parameters, optimizer state and step from an up-to-date member of the quorum, over the
//! quorum's own group, before it takes part in a step — no checkpoint on disk.
//!
//! The sender first sends a description (one string, `send_object_list`): the step, the
//! batches committed, and each tensor's FQN, state name (none for the parameter), shape and
//! dtype, parameters in FQN order, then each parameter's optimizer state in name order. Then
//! the tensors, in that order. The receiver checks the parameters against its own model
//! before it receives any tensor (a refusal changes nothing), then copies each parameter in
//! place and replaces its optimizer's state. torchft's transports carry pickled Python
//! objects instead, so recovery does not cross languages (docs/FROM_PYTORCH.md).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use tch::{Device, Kind, Tensor};
use tch_dist_core::sharding::Dtype;
use tch_dist_runtime::{Object, ProcessGroup};

use crate::optim::{Optimizer, ParamState};

/// One tensor of the description.
#[derive(Debug, Serialize, Deserialize, PartialEq)]
struct Entry {
    fqn: String,
    /// The optimizer state's name (`momentum_buffer`, `exp_avg`, ...); none for the
    /// parameter itself.
    state: Option<String>,
    shape: Vec<i64>,
    /// PyTorch's name (`float32`, `bfloat16`, ...).
    dtype: Dtype,
}

/// What a healing member receives first.
#[derive(Debug, Serialize, Deserialize)]
struct Description {
    step: i64,
    batches_committed: i64,
    tensors: Vec<Entry>,
}

/// The step and batch count a healed member goes on from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Healed {
    pub(super) step: i64,
    pub(super) batches_committed: i64,
}

/// Why the received state does not fit (a peer's problem: the receiver changes nothing).
#[derive(Debug)]
pub(super) enum HealFailure {
    /// The transfer itself failed.
    Transfer(tch_dist_runtime::DistError),
    /// The description does not fit this model: which FQN, and how.
    Misfit(String),
}

impl From<tch_dist_runtime::DistError> for HealFailure {
    fn from(e: tch_dist_runtime::DistError) -> Self {
        HealFailure::Transfer(e)
    }
}

/// The trainable parameters by FQN (sorted).
pub(super) fn parameters(opt: &Optimizer, vs: &tch::nn::VarStore) -> Vec<(String, Tensor)> {
    let variables = vs.variables();
    let mut out: Vec<(String, Tensor)> = opt
        .param_names()
        .filter_map(|fqn| {
            variables
                .get(fqn)
                .map(|t| (fqn.to_string(), t.shallow_clone()))
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// `t` as it travels: detached, contiguous, in host memory (the quorum's group is Gloo's,
/// which sends host memory; the receiver puts each tensor on its own parameter's device).
fn on_cpu(t: &Tensor) -> Tensor {
    t.detach().to_device(Device::Cpu).contiguous()
}

/// Sends this member's live state to replica rank `dst` of `pg`.
pub(super) fn send(
    pg: &ProcessGroup,
    dst: usize,
    healed: Healed,
    vs: &tch::nn::VarStore,
    opt: &Optimizer,
) -> tch_dist_runtime::Result<()> {
    let params = parameters(opt, vs);
    let mut tensors: Vec<Tensor> = Vec::new();
    let mut entries = Vec::new();
    for (fqn, p) in &params {
        entries.push(Entry {
            fqn: fqn.clone(),
            state: None,
            shape: p.size(),
            dtype: Dtype(p.kind()),
        });
        tensors.push(on_cpu(p));
    }
    for (fqn, _) in &params {
        if let Some(state) = opt.state(fqn) {
            for (name, t) in state.iter() {
                entries.push(Entry {
                    fqn: fqn.clone(),
                    state: Some(name.to_string()),
                    shape: t.size(),
                    dtype: Dtype(t.kind()),
                });
                tensors.push(on_cpu(t));
            }
        }
    }
    let description = Description {
        step: healed.step,
        batches_committed: healed.batches_committed,
        tensors: entries,
    };
    let text = serde_json::to_string(&description).unwrap_or_default();
    pg.send_object_list(&[Object::from(text.as_str())], dst)?;
    for t in &tensors {
        pg.send(t, dst, 0)?;
    }
    Ok(())
}

/// Receives an up-to-date member's live state from replica rank `src` of `pg` into `vs` and
/// `opt`.
pub(super) fn receive(
    pg: &ProcessGroup,
    src: usize,
    vs: &tch::nn::VarStore,
    opt: &mut Optimizer,
) -> Result<Healed, HealFailure> {
    let mut got = [Object::from("")];
    pg.recv_object_list(&mut got, src)?;
    let description: Description = got[0]
        .as_str()
        .and_then(|s| serde_json::from_str(s).ok())
        .ok_or_else(|| HealFailure::Misfit("the description does not parse".into()))?;
    let params = parameters(opt, vs);
    let sent_params: Vec<&Entry> = description
        .tensors
        .iter()
        .filter(|e| e.state.is_none())
        .collect();
    // Every check before the first tensor arrives: a misfit changes nothing here.
    for (fqn, p) in &params {
        let Some(e) = sent_params.iter().find(|e| &e.fqn == fqn) else {
            return Err(HealFailure::Misfit(format!("`{fqn}` was not sent")));
        };
        if e.shape != p.size() || e.dtype != Dtype(p.kind()) {
            return Err(HealFailure::Misfit(format!(
                "`{fqn}` is {:?} {} there, {:?} {} here",
                e.shape,
                e.dtype,
                p.size(),
                Dtype(p.kind())
            )));
        }
    }
    // Optimizer state only for this model's parameters, also checked before anything
    // arrives.
    if let Some(e) = description
        .tensors
        .iter()
        .find(|e| !params.iter().any(|(f, _)| f == &e.fqn))
    {
        return Err(HealFailure::Misfit(format!(
            "`{}` is not a parameter here",
            e.fqn
        )));
    }
    // Everything arrives before anything is applied: a source that fails mid-transfer
    // leaves this member as it was, never half its parameters replaced (it may go on
    // alone with them).
    let mut arrived: Vec<(Tensor, Tensor)> = Vec::new();
    let mut states: BTreeMap<String, BTreeMap<String, Tensor>> = BTreeMap::new();
    for e in &description.tensors {
        let Some((_, p)) = params.iter().find(|(f, _)| f == &e.fqn) else {
            // Refused above, before anything arrived.
            return Err(HealFailure::Misfit(format!(
                "`{}` is not a parameter here",
                e.fqn
            )));
        };
        // Each tensor in its own dtype (a float32 `step` of a bfloat16 parameter's state).
        let buffer = Tensor::empty(e.shape.as_slice(), (Kind::from(e.dtype), Device::Cpu));
        pg.recv(&buffer, src, 0)?;
        match &e.state {
            None => arrived.push((p.shallow_clone(), buffer)),
            Some(name) => {
                states
                    .entry(e.fqn.clone())
                    .or_default()
                    .insert(name.clone(), buffer.to_device(p.device()));
            }
        }
    }
    for (p, value) in arrived {
        tch::no_grad(|| {
            let mut p = p;
            p.copy_(&value);
        });
    }
    let state = states
        .into_iter()
        .map(|(fqn, entries)| (fqn, ParamState::from_map(entries)))
        .collect();
    let (algorithm, lr) = (*opt.algorithm(), opt.lr());
    opt.restore(algorithm, lr, state);
    Ok(Healed {
        step: description.step,
        batches_committed: description.batches_committed,
    })
}
