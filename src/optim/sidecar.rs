//! The optimizer's checkpoint sidecar (`optimizer.json`): its PyTorch class name and
//! PyTorch's `param_groups` as `get_optimizer_state_dict` gives them (one group, the
//! parameters by FQN), written and read through derived serde structs, one per class.

use serde::{Deserialize, Serialize};

use super::{AdamW, Algorithm, Optimizer, Sgd};

/// `optimizer.json`: `{"optimizer": "SGD", "param_groups": [{...}]}`.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Sidecar<G> {
    optimizer: String,
    param_groups: Vec<G>,
}

/// The class alone, read first: a sidecar of another class is refused as such, whatever
/// its groups hold.
#[derive(Debug, Deserialize)]
struct Class {
    optimizer: String,
}

/// torch.optim.SGD's param group. Fields PyTorch writes that tch-dist does not use
/// (`foreach`, `differentiable`, `fused`) may be absent when read.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct SgdGroup {
    lr: f64,
    momentum: f64,
    dampening: f64,
    weight_decay: f64,
    nesterov: bool,
    maximize: bool,
    #[serde(default)]
    foreach: Option<bool>,
    #[serde(default)]
    differentiable: bool,
    #[serde(default)]
    fused: Option<bool>,
    params: Vec<String>,
}

/// torch.optim.AdamW's param group.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct AdamWGroup {
    lr: f64,
    betas: (f64, f64),
    eps: f64,
    weight_decay: f64,
    amsgrad: bool,
    maximize: bool,
    #[serde(default)]
    foreach: Option<bool>,
    #[serde(default)]
    capturable: bool,
    #[serde(default)]
    differentiable: bool,
    #[serde(default)]
    fused: Option<bool>,
    #[serde(default)]
    decoupled_weight_decay: Option<bool>,
    params: Vec<String>,
}

/// A sidecar of either class, as it is written (untagged: the class's own struct).
#[derive(Debug, Serialize)]
#[serde(untagged)]
pub(crate) enum OptimizerSidecar {
    /// torch.optim.SGD's.
    Sgd(Sidecar<SgdGroup>),
    /// torch.optim.AdamW's.
    AdamW(Sidecar<AdamWGroup>),
}

/// `optimizer`'s sidecar, for the checkpoint to write as JSON.
pub(crate) fn of(optimizer: &Optimizer) -> OptimizerSidecar {
    let params: Vec<String> = optimizer.param_names().map(str::to_string).collect();
    let lr = optimizer.lr();
    let name = optimizer.algorithm().name().to_string();
    match optimizer.algorithm() {
        Algorithm::Sgd(s) => OptimizerSidecar::Sgd(Sidecar {
            optimizer: name,
            param_groups: vec![SgdGroup {
                lr,
                momentum: s.momentum,
                dampening: s.dampening,
                weight_decay: s.weight_decay,
                nesterov: s.nesterov,
                maximize: s.maximize,
                foreach: None,
                differentiable: false,
                fused: Some(true),
                params,
            }],
        }),
        Algorithm::AdamW(a) => OptimizerSidecar::AdamW(Sidecar {
            optimizer: name,
            param_groups: vec![AdamWGroup {
                lr,
                betas: a.betas,
                eps: a.eps,
                weight_decay: a.weight_decay,
                amsgrad: a.amsgrad,
                maximize: a.maximize,
                foreach: None,
                capturable: false,
                differentiable: false,
                fused: Some(true),
                decoupled_weight_decay: Some(true),
                params,
            }],
        }),
    }
}

/// The PyTorch class name a sidecar names (`SGD`, `AdamW`), or what is wrong with it.
pub(crate) fn class_of(bytes: &[u8]) -> Result<String, String> {
    serde_json::from_slice::<Class>(bytes)
        .map(|c| c.optimizer)
        .map_err(|e| e.to_string())
}

/// The only group of `groups`.
fn one<G>(groups: Vec<G>) -> Result<G, String> {
    let n = groups.len();
    let mut groups = groups.into_iter();
    match (groups.next(), n) {
        (Some(g), 1) => Ok(g),
        _ => Err(format!(
            "`param_groups` has {n} groups, tch-dist writes and reads one"
        )),
    }
}

/// The algorithm and learning rate a sidecar describes, or what is wrong with it.
pub(crate) fn settings_of(bytes: &[u8]) -> Result<(Algorithm, f64), String> {
    match class_of(bytes)?.as_str() {
        "SGD" => {
            let sidecar: Sidecar<SgdGroup> =
                serde_json::from_slice(bytes).map_err(|e| e.to_string())?;
            let g = one(sidecar.param_groups)?;
            let sgd = Sgd {
                momentum: g.momentum,
                dampening: g.dampening,
                weight_decay: g.weight_decay,
                nesterov: g.nesterov,
                maximize: g.maximize,
            };
            Ok((Algorithm::Sgd(sgd), g.lr))
        }
        "AdamW" => {
            let sidecar: Sidecar<AdamWGroup> =
                serde_json::from_slice(bytes).map_err(|e| e.to_string())?;
            let g = one(sidecar.param_groups)?;
            let adamw = AdamW {
                betas: g.betas,
                eps: g.eps,
                weight_decay: g.weight_decay,
                amsgrad: g.amsgrad,
                maximize: g.maximize,
            };
            Ok((Algorithm::AdamW(adamw), g.lr))
        }
        other => Err(format!(
            "an optimizer `{other}`, which tch-dist does not have"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `param_groups` as torch 2.11 writes them for `maximize=True` (printed from the
    /// `.venv`'s `SGD(..., momentum=0.9, maximize=True, fused=True).state_dict()` and
    /// `AdamW(..., lr=0.01, maximize=True, fused=True)`, the params by FQN) are read with
    /// `maximize`, and what tch-dist writes reads back the same.
    #[test]
    fn pytorch_maximize_groups_load() {
        let sgd = br#"{"optimizer": "SGD", "param_groups": [{"lr": 0.1, "momentum": 0.9, "dampening": 0, "weight_decay": 0, "nesterov": false, "maximize": true, "foreach": null, "differentiable": false, "fused": true, "params": ["w"]}]}"#;
        let adamw = br#"{"optimizer": "AdamW", "param_groups": [{"lr": 0.01, "betas": [0.9, 0.999], "eps": 1e-08, "weight_decay": 0.01, "amsgrad": false, "maximize": true, "foreach": null, "capturable": false, "differentiable": false, "fused": true, "decoupled_weight_decay": true, "params": ["w"]}]}"#;
        let expected_sgd = Algorithm::Sgd(Sgd {
            momentum: 0.9,
            maximize: true,
            ..Default::default()
        });
        let expected_adamw = Algorithm::AdamW(AdamW {
            maximize: true,
            ..Default::default()
        });
        assert_eq!(settings_of(sgd).unwrap(), (expected_sgd, 0.1));
        assert_eq!(settings_of(adamw).unwrap(), (expected_adamw, 0.01));
        // tch-dist's own sidecar of such an optimizer says `"maximize": true` and reads back.
        for (algorithm, lr) in [(expected_sgd, 0.1), (expected_adamw, 0.01)] {
            let vs = tch::nn::VarStore::new(tch::Device::Cpu);
            let _ = vs.root().var("w", &[2], tch::nn::Init::Const(0.0));
            let opt = Optimizer::new(&vs, lr, algorithm).unwrap();
            let json = serde_json::to_vec(&of(&opt)).unwrap();
            let value: serde_json::Value = serde_json::from_slice(&json).unwrap();
            assert_eq!(value["param_groups"][0]["maximize"], true);
            assert_eq!(settings_of(&json).unwrap(), (algorithm, lr));
        }
    }
}
