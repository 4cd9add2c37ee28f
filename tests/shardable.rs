//! `#[derive(Shardable)]` and the hand-written impls: exact FQN lists, checked against the
//! names tch's `VarStore` gives the same tensors.

use tch::nn::{self, Module, RNN};
use tch::{Device, Kind, Tensor};
use tch_dist::{check_against_var_store, Shardable, VarStoreMismatch};

#[path = "common/walk.rs"]
mod walk;
use walk::{generic, linear, module_names, names, Fixed};

fn sorted(mut v: Vec<String>) -> Vec<String> {
    v.sort();
    v
}

/// Every tensor of `vs` is reported by `m` and vice versa, in any order.
fn assert_matches_var_store(m: &dyn Shardable, vs: &nn::VarStore) {
    if let Err(e) = check_against_var_store(m, vs) {
        panic!("{e}");
    }
}

#[derive(Debug, Shardable)]
struct Mlp {
    fc1: nn::Linear,
    fc2: nn::Linear,
}

impl Mlp {
    fn new(p: nn::Path, d: i64) -> Mlp {
        Mlp {
            fc1: linear(&p / "fc1", d, d),
            fc2: linear(&p / "fc2", d, d),
        }
    }
}

#[derive(Debug, Shardable)]
struct Net {
    encoder: Mlp,
    #[shardable(param)]
    scale: Tensor,
    #[shardable(buffer)]
    steps: Tensor,
    head: nn::Linear,
    #[shardable(skip)]
    #[allow(dead_code)]
    hidden: i64,
}

fn net(vs: &nn::VarStore) -> Net {
    let root = vs.root();
    Net {
        encoder: Mlp::new(&root / "encoder", 4),
        scale: root.var("scale", &[1], nn::Init::Const(1.)),
        steps: root.zeros_no_train("steps", &[1]),
        head: linear(&root / "head", 4, 2),
        hidden: 4,
    }
}

#[test]
fn nested_structs() {
    let vs = nn::VarStore::new(Device::Cpu);
    let m = net(&vs);
    assert_eq!(
        names(m.named_parameters()),
        [
            "encoder.fc1.weight",
            "encoder.fc1.bias",
            "encoder.fc2.weight",
            "encoder.fc2.bias",
            "scale",
            "head.weight",
            "head.bias"
        ]
    );
    assert_eq!(names(m.named_buffers()), ["steps"]);
    assert_eq!(
        module_names(&m),
        ["", "encoder", "encoder.fc1", "encoder.fc2", "head"]
    );
    let children: Vec<String> = m.named_children().into_iter().map(|(n, _)| n).collect();
    assert_eq!(children, ["encoder", "head"]);
    assert_eq!(m.parameters().len(), 7);
    assert_eq!(m.buffers().len(), 1);
    assert_matches_var_store(&m, &vs);
    // The walk hands out the model's own tensors, not copies.
    assert_eq!(m.named_parameters()[4].1.as_ptr(), m.scale.as_ptr());
    // Module references are the children themselves.
    let (name, head) = &m.named_modules()[4];
    assert_eq!(name, "head");
    assert_eq!(head.type_name(), "tch::nn::linear::Linear");
    assert_eq!(head.named_parameters()[0].1.as_ptr(), m.head.ws.as_ptr());
}

#[derive(Debug, Shardable)]
struct Stack {
    blocks: Vec<Mlp>,
    pair: [nn::Linear; 2],
}

#[test]
fn vec_and_array_elements_are_indexed() {
    let vs = nn::VarStore::new(Device::Cpu);
    let root = vs.root();
    let m = Stack {
        blocks: (0..2).map(|i| Mlp::new(&root / "blocks" / i, 3)).collect(),
        pair: [
            linear(&root / "pair" / 0, 3, 3),
            linear(&root / "pair" / 1, 3, 3),
        ],
    };
    assert_eq!(
        names(m.named_parameters()),
        [
            "blocks.0.fc1.weight",
            "blocks.0.fc1.bias",
            "blocks.0.fc2.weight",
            "blocks.0.fc2.bias",
            "blocks.1.fc1.weight",
            "blocks.1.fc1.bias",
            "blocks.1.fc2.weight",
            "blocks.1.fc2.bias",
            "pair.0.weight",
            "pair.0.bias",
            "pair.1.weight",
            "pair.1.bias",
        ]
    );
    // Like nn.ModuleList, the Vec itself is a module.
    assert_eq!(
        module_names(&m),
        [
            "",
            "blocks",
            "blocks.0",
            "blocks.0.fc1",
            "blocks.0.fc2",
            "blocks.1",
            "blocks.1.fc1",
            "blocks.1.fc2",
            "pair",
            "pair.0",
            "pair.1"
        ]
    );
    assert_matches_var_store(&m, &vs);
}

#[derive(Debug, Shardable)]
struct WithOptions {
    proj: Option<nn::Linear>,
    gate: Option<nn::Linear>,
    boxed: Box<nn::Linear>,
    #[shardable(param)]
    maybe: Option<Tensor>,
}

#[test]
fn option_and_box_are_transparent() {
    let vs = nn::VarStore::new(Device::Cpu);
    let root = vs.root();
    let m = WithOptions {
        proj: Some(linear(&root / "proj", 2, 2)),
        gate: None,
        boxed: Box::new(linear(&root / "boxed", 2, 2)),
        maybe: None,
    };
    assert_eq!(
        names(m.named_parameters()),
        ["proj.weight", "proj.bias", "boxed.weight", "boxed.bias"]
    );
    assert_eq!(module_names(&m), ["", "proj", "boxed"]);
    assert_matches_var_store(&m, &vs);
    // A Box or an Option reports the type it wraps.
    assert_eq!(m.boxed.type_name(), "tch::nn::linear::Linear");
    assert_eq!(m.proj.type_name(), "tch::nn::linear::Linear");
}

#[derive(Debug, Shardable)]
struct Seq(
    nn::Linear,
    #[shardable(skip)]
    #[allow(dead_code)]
    f64,
    nn::Linear,
);

#[test]
fn tuple_struct_fields_are_indexed() {
    let vs = nn::VarStore::new(Device::Cpu);
    let root = vs.root();
    let m = Seq(linear(&root / "0", 2, 2), 0.5, linear(&root / "2", 2, 2));
    assert_eq!(
        names(m.named_parameters()),
        ["0.weight", "0.bias", "2.weight", "2.bias"]
    );
    assert_eq!(module_names(&m), ["", "0", "2"]);
    assert_matches_var_store(&m, &vs);
}

#[derive(Debug, Shardable)]
enum Norm {
    Layer(nn::LayerNorm),
    Batch(nn::BatchNorm),
    Identity,
}

#[derive(Debug, Shardable)]
enum Head {
    Split { up: nn::Linear, down: nn::Linear },
    Pair(nn::Linear, nn::Linear),
}

#[derive(Debug, Shardable)]
struct WithEnums {
    norm: Norm,
    head: Head,
}

#[test]
fn enums() {
    let vs = nn::VarStore::new(Device::Cpu);
    let root = vs.root();
    let m = WithEnums {
        norm: Norm::Batch(nn::batch_norm1d(&root / "norm", 3, Default::default())),
        head: Head::Split {
            up: linear(&root / "head" / "up", 3, 6),
            down: linear(&root / "head" / "down", 6, 3),
        },
    };
    assert_eq!(
        names(m.named_parameters()),
        [
            "norm.weight",
            "norm.bias",
            "head.up.weight",
            "head.up.bias",
            "head.down.weight",
            "head.down.bias"
        ]
    );
    assert_eq!(
        names(m.named_buffers()),
        ["norm.running_mean", "norm.running_var"]
    );
    assert_eq!(
        module_names(&m),
        ["", "norm", "head", "head.up", "head.down"]
    );
    // The transparent variant reports the wrapped layer's type.
    assert_eq!(m.norm.type_name(), "tch::nn::batch_norm::BatchNorm");
    assert!(m.head.type_name().ends_with("Head"));
    assert_matches_var_store(&m, &vs);

    let vs = nn::VarStore::new(Device::Cpu);
    let root = vs.root();
    let m = WithEnums {
        norm: Norm::Identity,
        head: Head::Pair(
            linear(&root / "head" / "0", 3, 3),
            linear(&root / "head" / "1", 3, 3),
        ),
    };
    assert_eq!(
        names(m.named_parameters()),
        [
            "head.0.weight",
            "head.0.bias",
            "head.1.weight",
            "head.1.bias"
        ]
    );
    // A variant without fields is still a (parameter-less) module.
    assert_eq!(module_names(&m), ["", "norm", "head", "head.0", "head.1"]);
    assert_matches_var_store(&m, &vs);

    let vs = nn::VarStore::new(Device::Cpu);
    let norm = Norm::Layer(nn::layer_norm(vs.root(), vec![3], Default::default()));
    assert_eq!(names(norm.named_parameters()), ["weight", "bias"]);
    assert_matches_var_store(&norm, &vs);
}

#[test]
fn generics_get_bounds() {
    let vs = nn::VarStore::new(Device::Cpu);
    let m = generic(&vs);
    assert_eq!(
        names(m.named_parameters()),
        [
            "first.weight",
            "first.bias",
            "rest.0.weight",
            "rest.0.bias",
            "other.weight"
        ]
    );
    assert_eq!(module_names(&m), ["", "first", "rest", "rest.0", "other"]);
    // `label` is skipped, so the VarStore has a variable the model does not report.
    assert_eq!(
        check_against_var_store(&m, &vs),
        Err(VarStoreMismatch {
            only_in_model: vec![],
            only_in_var_store: vec!["unused.weight".into()]
        })
    );

    let vs = nn::VarStore::new(Device::Cpu);
    let m = Fixed {
        layers: [
            Mlp::new(vs.root() / "layers" / 0, 2),
            Mlp::new(vs.root() / "layers" / 1, 2),
        ],
        stats: vs.root().zeros_no_train("stats", &[2]),
    };
    assert_eq!(m.named_parameters().len(), 8);
    assert_eq!(names(m.named_buffers()), ["stats"]);
    assert_matches_var_store(&m, &vs);
}

#[derive(Debug, Shardable)]
struct Renamed {
    #[shardable(rename = "lm_head")]
    head: nn::Linear,
    r#type: nn::Linear,
    #[shardable(rename = "w", param)]
    weight_tensor: Tensor,
    #[shardable(skip)]
    #[allow(dead_code)]
    dropout: f64,
    #[shardable(skip)]
    #[allow(dead_code)]
    cached: Option<Tensor>,
}

#[test]
fn renamed_and_skipped_fields() {
    let vs = nn::VarStore::new(Device::Cpu);
    let root = vs.root();
    let m = Renamed {
        head: linear(&root / "lm_head", 2, 2),
        r#type: linear(&root / "type", 2, 2),
        weight_tensor: root.var("w", &[2], nn::Init::Const(0.)),
        dropout: 0.1,
        cached: Some(Tensor::zeros([1], (Kind::Float, Device::Cpu))),
    };
    assert_eq!(
        names(m.named_parameters()),
        [
            "lm_head.weight",
            "lm_head.bias",
            "type.weight",
            "type.bias",
            "w"
        ]
    );
    assert_matches_var_store(&m, &vs);
}

#[derive(Debug, Shardable)]
#[shardable(crate = "::tch_dist_core")]
struct CorePath {
    fc: nn::Linear,
}

#[test]
fn crate_path_override() {
    let vs = nn::VarStore::new(Device::Cpu);
    let m = CorePath {
        fc: linear(vs.root() / "fc", 1, 1),
    };
    assert_eq!(names(m.named_parameters()), ["fc.weight", "fc.bias"]);
}

#[test]
fn trait_objects_are_walkable() {
    let vs = nn::VarStore::new(Device::Cpu);
    let root = vs.root();
    let layers: Vec<Box<dyn Shardable>> = vec![
        Box::new(linear(&root / "0", 2, 2)),
        Box::new(nn::conv1d(&root / "1", 2, 2, 1, Default::default())),
    ];
    assert_eq!(
        names(layers.named_parameters()),
        ["0.weight", "0.bias", "1.weight", "1.bias"]
    );
    assert_eq!(module_names(&layers), ["", "0", "1"]);
    assert_matches_var_store(&layers, &vs);
}

#[test]
fn mutable_walk_replaces_tensors_in_place() {
    let vs = nn::VarStore::new(Device::Cpu);
    let mut m = net(&vs);
    for (name, t) in m.named_parameters_mut() {
        if name.ends_with("bias") {
            *t = Tensor::full([1], 7.0, (Kind::Float, Device::Cpu));
        }
    }
    assert_eq!(m.head.bs.as_ref().map(|b| b.size()), Some(vec![1]));
    for (_, t) in m.named_buffers_mut() {
        t.set_data(&Tensor::ones([3], (Kind::Float, Device::Cpu)));
    }
    assert_eq!(m.steps.size(), [3]);
    let names: Vec<String> = m
        .named_parameters_mut()
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    assert_eq!(names, names_of_net());
}

fn names_of_net() -> Vec<String> {
    let vs = nn::VarStore::new(Device::Cpu);
    names(net(&vs).named_parameters())
}

// ---- every tch layer against the names its VarStore gives ---------------------------------

/// Builds a layer under `vs.root() / "layer"` and checks its names against the VarStore.
fn check_layer<L: Shardable>(build: impl FnOnce(nn::Path) -> L, params: &[&str], buffers: &[&str]) {
    let vs = nn::VarStore::new(Device::Cpu);
    let layer = build(vs.root() / "layer");
    assert_eq!(
        names(layer.named_parameters()),
        params,
        "{}",
        layer.type_name()
    );
    assert_eq!(
        names(layer.named_buffers()),
        buffers,
        "{}",
        layer.type_name()
    );
    let vs_names = sorted(vs.variables().into_keys().collect());
    let expected = sorted(
        params
            .iter()
            .chain(buffers)
            .map(|n| format!("layer.{n}"))
            .collect(),
    );
    assert_eq!(vs_names, expected, "{}", layer.type_name());
    // Under the FQN of a parent field called "layer", the check passes.
    #[derive(Shardable)]
    struct Parent<L> {
        layer: L,
    }
    assert_matches_var_store(&Parent { layer }, &vs);
}

const WB: &[&str] = &["weight", "bias"];

#[test]
fn linear_layers() {
    check_layer(|p| linear(p, 3, 2), WB, &[]);
    check_layer(
        |p| {
            nn::linear(
                p,
                3,
                2,
                nn::LinearConfig {
                    bias: false,
                    ..Default::default()
                },
            )
        },
        &["weight"],
        &[],
    );
}

#[test]
fn conv_layers() {
    let c = Default::default();
    check_layer(|p| nn::conv1d(p, 2, 4, 3, c), WB, &[]);
    check_layer(|p| nn::conv2d(p, 2, 4, 3, c), WB, &[]);
    check_layer(|p| nn::conv3d(p, 2, 4, 3, c), WB, &[]);
    check_layer(
        |p| nn::conv2d(p, 2, 4, 3, nn::ConvConfig { bias: false, ..c }),
        &["weight"],
        &[],
    );
    let t = Default::default();
    check_layer(|p| nn::conv_transpose1d(p, 2, 4, 3, t), WB, &[]);
    check_layer(|p| nn::conv_transpose2d(p, 2, 4, 3, t), WB, &[]);
    check_layer(|p| nn::conv_transpose3d(p, 2, 4, 3, t), WB, &[]);
    check_layer(
        |p| nn::conv_transpose2d(p, 2, 4, 3, nn::ConvTransposeConfig { bias: false, ..t }),
        &["weight"],
        &[],
    );
}

#[test]
fn norm_layers() {
    let stats: &[&str] = &["running_mean", "running_var"];
    check_layer(|p| nn::batch_norm1d(p, 4, Default::default()), WB, stats);
    check_layer(|p| nn::batch_norm2d(p, 4, Default::default()), WB, stats);
    check_layer(|p| nn::batch_norm3d(p, 4, Default::default()), WB, stats);
    check_layer(
        |p| {
            nn::batch_norm2d(
                p,
                4,
                nn::BatchNormConfig {
                    affine: false,
                    ..Default::default()
                },
            )
        },
        &[],
        stats,
    );
    check_layer(|p| nn::layer_norm(p, vec![4], Default::default()), WB, &[]);
    check_layer(
        |p| {
            nn::layer_norm(
                p,
                vec![4],
                nn::LayerNormConfig {
                    elementwise_affine: false,
                    ..Default::default()
                },
            )
        },
        &[],
        &[],
    );
    check_layer(|p| nn::group_norm(p, 2, 4, Default::default()), WB, &[]);
}

#[test]
fn embedding_layer() {
    check_layer(
        |p| nn::embedding(p, 10, 4, Default::default()),
        &["weight"],
        &[],
    );
}

#[test]
fn recurrent_layers() {
    let l0: &[&str] = &["weight_ih_l0", "weight_hh_l0", "bias_ih_l0", "bias_hh_l0"];
    check_layer(|p| tch_dist::nn::lstm(p, 3, 5, Default::default()), l0, &[]);
    check_layer(|p| tch_dist::nn::gru(p, 3, 5, Default::default()), l0, &[]);
    let deep = nn::RNNConfig {
        num_layers: 2,
        bidirectional: true,
        ..Default::default()
    };
    let mut expected = Vec::new();
    for l in 0..2 {
        for suffix in ["", "_reverse"] {
            for n in ["weight_ih", "weight_hh", "bias_ih", "bias_hh"] {
                expected.push(format!("{n}_l{l}{suffix}"));
            }
        }
    }
    let expected: Vec<&str> = expected.iter().map(String::as_str).collect();
    check_layer(|p| tch_dist::nn::lstm(p, 3, 5, deep), &expected, &[]);
    check_layer(|p| tch_dist::nn::gru(p, 3, 5, deep), &expected, &[]);
    let no_bias = nn::RNNConfig {
        has_biases: false,
        ..Default::default()
    };
    check_layer(
        |p| tch_dist::nn::lstm(p, 3, 5, no_bias),
        &["weight_ih_l0", "weight_hh_l0"],
        &[],
    );
}

#[test]
fn recurrent_layers_compute_what_tch_computes() {
    tch::manual_seed(0);
    let theirs_vs = nn::VarStore::new(Device::Cpu);
    let theirs = nn::lstm(theirs_vs.root(), 3, 4, Default::default());
    let mut ours_vs = nn::VarStore::new(Device::Cpu);
    let ours = tch_dist::nn::lstm(ours_vs.root(), 3, 4, Default::default());
    ours_vs.copy(&theirs_vs).unwrap();
    let xs = Tensor::randn([2, 5, 3], (Kind::Float, Device::Cpu));
    let (a, _) = theirs.seq(&xs);
    let (b, _) = ours.seq(&xs);
    assert!(a.allclose(&b, 1e-6, 1e-6, false));

    let theirs_vs = nn::VarStore::new(Device::Cpu);
    let theirs = nn::gru(theirs_vs.root(), 3, 4, Default::default());
    let mut ours_vs = nn::VarStore::new(Device::Cpu);
    let ours = tch_dist::nn::gru(ours_vs.root(), 3, 4, Default::default());
    ours_vs.copy(&theirs_vs).unwrap();
    let (a, _) = theirs.seq(&xs);
    let (b, _) = ours.seq(&xs);
    assert!(a.allclose(&b, 1e-6, 1e-6, false));
    assert_eq!(ours.zero_state(2).0.size(), [1, 2, 4]);
}

#[test]
fn var_store_check_lists_the_names_on_each_side() {
    let vs = nn::VarStore::new(Device::Cpu);
    let root = vs.root();
    // fc2 built under the wrong path.
    let m = Mlp {
        fc1: linear(&root / "fc1", 2, 2),
        fc2: linear(&root / "second", 2, 2),
    };
    let err = check_against_var_store(&m, &vs).unwrap_err();
    assert_eq!(err.only_in_model, ["fc2.bias", "fc2.weight"]);
    assert_eq!(err.only_in_var_store, ["second.bias", "second.weight"]);
    assert_eq!(
        err.to_string(),
        "the model and its VarStore name different tensors: only in the model: \
         [\"fc2.bias\", \"fc2.weight\"]; only in the VarStore: [\"second.bias\", \"second.weight\"]"
    );
    // A layer that still works is unaffected by the walk.
    let xs = Tensor::ones([1, 2], (Kind::Float, Device::Cpu));
    assert_eq!(m.fc2.forward(&xs).size(), [1, 2]);
}
