//! `tch_dist::optim` against the `.venv`'s torch.optim: SGD (plain, momentum with dampening,
//! Nesterov with weight decay) and AdamW (defaults, amsgrad with weight decay), and each
//! with `maximize` (SGD plain, with momentum, dampening and weight decay, Nesterov; AdamW
//! with weight decay, with amsgrad), over 12 steps from the same values and gradients, with a
//! learning-rate change, a parameter that gets its first gradient at step 3 and one that
//! never gets one: every parameter and every state tensor within 1e-6 of PyTorch's. Then the settings PyTorch refuses, refused with its
//! messages.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use tch::nn::VarStore;
use tch::{Device, Kind, Tensor};
use tch_dist::optim::{AdamW, OptimError, Optimizer, Sgd};

const STEPS: usize = 12;
/// The learning rate changes to this at step 5 (`set_lr`).
const LR_AT_5: f64 = 0.03;

/// The parameters (name, shape) and the first step at which each gets a gradient.
const PARAMS: [(&str, &[i64], Option<usize>); 4] = [
    ("a.weight", &[4, 3], Some(0)),
    ("a.bias", &[4], Some(0)),
    ("late.weight", &[2, 2], Some(3)),
    ("frozen.weight", &[3], None),
];

struct Inputs {
    init: BTreeMap<String, Tensor>,
    /// (step, name) -> gradient.
    grads: BTreeMap<(usize, String), Tensor>,
}

fn inputs() -> Inputs {
    tch::manual_seed(7);
    let mut init = BTreeMap::new();
    let mut grads = BTreeMap::new();
    for (name, shape, first) in PARAMS {
        init.insert(
            name.to_string(),
            Tensor::randn(shape, (Kind::Float, Device::Cpu)),
        );
        if let Some(first) = first {
            for step in first..STEPS {
                let g = Tensor::randn(shape, (Kind::Float, Device::Cpu));
                grads.insert((step, name.to_string()), g);
            }
        }
    }
    Inputs { init, grads }
}

/// Runs `build`'s optimizer over the inputs; returns the store (for the parameters) and the
/// optimizer (for its state).
fn run_rust(inputs: &Inputs, build: impl Fn(&VarStore) -> Optimizer) -> (VarStore, Optimizer) {
    let vs = VarStore::new(Device::Cpu);
    let mut vars = BTreeMap::new();
    for (name, t) in &inputs.init {
        let (module, leaf) = name.split_once('.').unwrap();
        vars.insert(name.clone(), (vs.root() / module).var_copy(leaf, t));
    }
    let mut opt = build(&vs);
    for step in 0..STEPS {
        if step == 5 {
            opt.set_lr(LR_AT_5).unwrap();
        }
        opt.zero_grad();
        // The gradient of sum(p * g) is g: each parameter gets exactly the input gradient,
        // and a parameter left out of the sum gets none.
        let terms: Vec<Tensor> = vars
            .iter()
            .filter_map(|(name, p)| {
                let g = inputs.grads.get(&(step, name.clone()))?;
                Some((p * g).sum(Kind::Float))
            })
            .collect();
        Tensor::stack(&terms, 0).sum(Kind::Float).backward();
        opt.step().unwrap();
    }
    (vs, opt)
}

/// torch.optim on the same inputs, one Python run for every case.
fn run_pytorch(inputs: &Inputs, cases: &serde_json::Value) -> BTreeMap<String, Tensor> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("optim_parity");
    std::fs::create_dir_all(&dir).unwrap();
    let (input_path, output_path) = (
        dir.join("inputs.safetensors"),
        dir.join("outputs.safetensors"),
    );
    let mut named: Vec<(String, &Tensor)> = inputs
        .init
        .iter()
        .map(|(n, t)| (format!("init.{n}"), t))
        .collect();
    named.extend(
        inputs
            .grads
            .iter()
            .map(|((s, n), t)| (format!("grad.{s}.{n}"), t)),
    );
    let refs: Vec<(&str, &Tensor)> = named.iter().map(|(n, t)| (n.as_str(), *t)).collect();
    Tensor::write_safetensors(&refs, &input_path).unwrap();
    let python = root.join(".venv/bin/python");
    assert!(python.exists(), "the .venv's python (run `make setup`)");
    let out = Command::new(python)
        .arg(root.join("tests/optim/reference.py"))
        .arg(&input_path)
        .arg(&output_path)
        .arg(cases.to_string())
        .env("OMP_NUM_THREADS", "1")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "python failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Tensor::read_safetensors(&output_path)
        .unwrap()
        .into_iter()
        .collect()
}

fn close(what: &str, ours: &Tensor, theirs: &Tensor) {
    assert_eq!(ours.size(), theirs.size(), "{what}: shape");
    let diff = (ours.to_kind(Kind::Double) - theirs.to_kind(Kind::Double))
        .abs()
        .max()
        .double_value(&[]);
    assert!(diff <= 1e-6, "{what}: differs from PyTorch's by {diff}");
}

#[test]
fn sgd_and_adamw_match_torch_optim() {
    let inputs = inputs();
    let lr_at = serde_json::json!({ "5": LR_AT_5 });
    type Build = Box<dyn Fn(&VarStore) -> Optimizer>;
    let cases: Vec<(serde_json::Value, Build)> = vec![
        (
            serde_json::json!({"opt": "SGD", "kwargs": {"lr": 0.1}, "lr_at": lr_at}),
            Box::new(|vs| Sgd::default().build(vs, 0.1).unwrap()),
        ),
        (
            serde_json::json!({"opt": "SGD", "kwargs": {"lr": 0.1, "momentum": 0.9, "dampening": 0.2}, "lr_at": lr_at}),
            Box::new(|vs| {
                Sgd {
                    momentum: 0.9,
                    dampening: 0.2,
                    ..Default::default()
                }
                .build(vs, 0.1)
                .unwrap()
            }),
        ),
        (
            serde_json::json!({"opt": "SGD", "kwargs": {"lr": 0.05, "momentum": 0.8, "nesterov": true, "weight_decay": 0.01}, "lr_at": lr_at}),
            Box::new(|vs| {
                Sgd {
                    momentum: 0.8,
                    nesterov: true,
                    weight_decay: 0.01,
                    ..Default::default()
                }
                .build(vs, 0.05)
                .unwrap()
            }),
        ),
        (
            serde_json::json!({"opt": "AdamW", "kwargs": {}, "lr_at": lr_at}),
            Box::new(|vs| AdamW::default().build(vs, 1e-3).unwrap()),
        ),
        (
            serde_json::json!({"opt": "AdamW", "kwargs": {"lr": 0.01, "betas": [0.8, 0.99], "eps": 1e-6, "weight_decay": 0.1, "amsgrad": true}, "lr_at": lr_at}),
            Box::new(|vs| {
                AdamW {
                    betas: (0.8, 0.99),
                    eps: 1e-6,
                    weight_decay: 0.1,
                    amsgrad: true,
                    maximize: false,
                }
                .build(vs, 0.01)
                .unwrap()
            }),
        ),
        // maximize: the gradient negated for the update (through momentum, dampening and
        // weight decay for SGD; through both moments and amsgrad's maximum for AdamW).
        (
            serde_json::json!({"opt": "SGD", "kwargs": {"lr": 0.1, "maximize": true}, "lr_at": lr_at}),
            Box::new(|vs| {
                Sgd {
                    maximize: true,
                    ..Default::default()
                }
                .build(vs, 0.1)
                .unwrap()
            }),
        ),
        (
            serde_json::json!({"opt": "SGD", "kwargs": {"lr": 0.05, "momentum": 0.9, "dampening": 0.1, "weight_decay": 0.01, "maximize": true}, "lr_at": lr_at}),
            Box::new(|vs| {
                Sgd {
                    momentum: 0.9,
                    dampening: 0.1,
                    weight_decay: 0.01,
                    maximize: true,
                    ..Default::default()
                }
                .build(vs, 0.05)
                .unwrap()
            }),
        ),
        (
            serde_json::json!({"opt": "SGD", "kwargs": {"lr": 0.05, "momentum": 0.8, "nesterov": true, "maximize": true}, "lr_at": lr_at}),
            Box::new(|vs| {
                Sgd {
                    momentum: 0.8,
                    nesterov: true,
                    maximize: true,
                    ..Default::default()
                }
                .build(vs, 0.05)
                .unwrap()
            }),
        ),
        (
            serde_json::json!({"opt": "AdamW", "kwargs": {"lr": 0.01, "weight_decay": 0.1, "maximize": true}, "lr_at": lr_at}),
            Box::new(|vs| {
                AdamW {
                    weight_decay: 0.1,
                    maximize: true,
                    ..Default::default()
                }
                .build(vs, 0.01)
                .unwrap()
            }),
        ),
        (
            serde_json::json!({"opt": "AdamW", "kwargs": {"lr": 0.01, "betas": [0.8, 0.99], "amsgrad": true, "maximize": true}, "lr_at": lr_at}),
            Box::new(|vs| {
                AdamW {
                    betas: (0.8, 0.99),
                    amsgrad: true,
                    maximize: true,
                    ..Default::default()
                }
                .build(vs, 0.01)
                .unwrap()
            }),
        ),
    ];
    let specs = serde_json::Value::Array(cases.iter().map(|c| c.0.clone()).collect());
    let theirs = run_pytorch(&inputs, &specs);
    for (c, (spec, build)) in cases.iter().enumerate() {
        let (vs, opt) = run_rust(&inputs, build);
        let vars = vs.variables();
        for (name, _, first) in PARAMS {
            let what = format!("case {spec}: {name}");
            close(&what, &vars[name], &theirs[&format!("{c}.param.{name}")]);
            // The state: exactly PyTorch's keys, within 1e-6.
            let expected: BTreeMap<&str, &Tensor> = theirs
                .iter()
                .filter_map(|(k, t)| Some((k.strip_prefix(&format!("{c}.state.{name}."))?, t)))
                .collect();
            let ours: BTreeMap<&str, &Tensor> = opt
                .state(name)
                .map(|s| s.iter().collect())
                .unwrap_or_default();
            assert_eq!(
                ours.keys().collect::<Vec<_>>(),
                expected.keys().collect::<Vec<_>>(),
                "{what}: state keys"
            );
            for (k, t) in &ours {
                close(&format!("{what}: {k}"), t, expected[k]);
            }
            if first.is_none() {
                assert!(
                    vars[name].equal(&inputs.init[name]),
                    "{what}: moved without a gradient"
                );
                assert!(
                    opt.state(name).is_none(),
                    "{what}: state without a gradient"
                );
            }
        }
        // The step counts are real values: 12 steps, 9 for the late parameter.
        if spec["opt"] == "AdamW" {
            let step = |n: &str| opt.state(n).unwrap().get("step").unwrap().double_value(&[]);
            assert_eq!((step("a.weight"), step("late.weight")), (12.0, 9.0));
        }
    }
}

#[test]
fn settings_pytorch_refuses_are_refused() {
    let vs = VarStore::new(Device::Cpu);
    let _ = vs.root().var("w", &[2], tch::nn::Init::Const(1.0));
    let sgd = |s: Sgd, lr: f64| s.build(&vs, lr).unwrap_err();
    let adamw = |a: AdamW| a.build(&vs, 1e-3).unwrap_err();
    let cases: Vec<(OptimError, &str)> = vec![
        (sgd(Sgd::default(), -0.1), "Invalid learning rate: -0.1"),
        (sgd(Sgd::default(), f64::NAN), "Invalid learning rate: NaN"),
        (
            sgd(
                Sgd {
                    momentum: -0.5,
                    ..Default::default()
                },
                0.1,
            ),
            "Invalid momentum value: -0.5",
        ),
        (
            sgd(
                Sgd {
                    weight_decay: -1.0,
                    ..Default::default()
                },
                0.1,
            ),
            "Invalid weight_decay value: -1",
        ),
        (
            sgd(
                Sgd {
                    nesterov: true,
                    momentum: 0.9,
                    dampening: 0.1,
                    ..Default::default()
                },
                0.1,
            ),
            "Nesterov momentum requires a momentum and zero dampening",
        ),
        (
            sgd(
                Sgd {
                    dampening: f64::INFINITY,
                    momentum: 0.9,
                    ..Default::default()
                },
                0.1,
            ),
            "Invalid dampening value: inf",
        ),
        (
            adamw(AdamW {
                eps: -1e-8,
                ..Default::default()
            }),
            "Invalid epsilon value: -0.00000001",
        ),
        (
            adamw(AdamW {
                betas: (1.0, 0.999),
                ..Default::default()
            }),
            "Invalid beta parameter at index 0: 1",
        ),
        (
            adamw(AdamW {
                betas: (0.9, -0.1),
                ..Default::default()
            }),
            "Invalid beta parameter at index 1: -0.1",
        ),
        (
            adamw(AdamW {
                weight_decay: f64::NAN,
                ..Default::default()
            }),
            "Invalid weight_decay value: NaN",
        ),
    ];
    for (err, text) in &cases {
        assert_eq!(err.to_string(), *text);
    }
    assert!(
        matches!(cases[3].0, OptimError::InvalidWeightDecay { weight_decay } if weight_decay == -1.0)
    );
    assert!(matches!(
        cases[8].0,
        OptimError::InvalidBeta { index: 1, .. }
    ));
    // set_lr refuses too, and keeps the old rate.
    let mut opt = Sgd::default().build(&vs, 0.1).unwrap();
    assert_eq!(
        opt.set_lr(-1.0).unwrap_err(),
        OptimError::InvalidLr { lr: -1.0 }
    );
    assert_eq!(opt.lr(), 0.1);
}

/// A gradient of another shape than its parameter is an error naming the FQN, and nothing
/// moves.
#[test]
fn a_gradient_that_does_not_fit_is_refused() {
    let vs = VarStore::new(Device::Cpu);
    let w = vs.root().var("w", &[2], tch::nn::Init::Const(1.0));
    let b = vs.root().var("b", &[3], tch::nn::Init::Const(1.0));
    let mut opt = AdamW::default().build(&vs, 0.1).unwrap();
    (&w * 2.0).sum(Kind::Float).backward();
    (&b * 2.0).sum(Kind::Float).backward();
    // A gradient of another dtype: a double gradient written by hand.
    let mut g = b.grad();
    tch::no_grad(|| {
        g.set_data(&Tensor::ones([3], (Kind::Double, Device::Cpu)));
    });
    let before = w.copy();
    let err = opt.step().unwrap_err();
    assert_eq!(
        err.to_string(),
        "optimizer step: `b`'s gradient is Double but the parameter is Float"
    );
    assert!(
        w.equal(&before) && opt.state("w").is_none(),
        "nothing changed"
    );
}

#[test]
fn zero_grad_keeps_gradients_that_are_views_of_a_bucket() {
    // replicate's gradient_as_bucket_view and fault tolerance's average make each `.grad` a
    // slice of one buffer; zero_grad zeroes it in place (PyTorch detaches only a grad with
    // a grad_fn, which a view cannot be), and backward goes on accumulating into the buffer.
    let vs = tch::nn::VarStore::new(tch::Device::Cpu);
    let w = vs.root().ones("w", &[3]);
    let bucket = tch::Tensor::full([4], 7.0, tch::kind::FLOAT_CPU);
    tch_dist_runtime::set_grad_for(&w, Some(&bucket.narrow(0, 1, 3)), 0, "test").unwrap();
    let mut opt = tch_dist::optim::Sgd::default().build(&vs, 0.1).unwrap();
    opt.zero_grad();
    assert_eq!(Vec::<f32>::try_from(&bucket).unwrap(), [7.0, 0.0, 0.0, 0.0]);
    (&w * 2.0).sum(tch::Kind::Float).backward();
    assert_eq!(Vec::<f32>::try_from(&bucket).unwrap(), [7.0, 2.0, 2.0, 2.0]);
}
