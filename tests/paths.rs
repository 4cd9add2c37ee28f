//! Typed paths emitted by `#[derive(Shardable)]` and provided by core for tch's layers and the
//! containers: every typed path's FQN is the walker's name for the same item.

use std::collections::HashSet;

use tch::nn;
use tch::{Device, Tensor};
use tch_dist::path::{
    AnyModulePath, BufferPath, HasPath, ModulePath, ParamPath, PathNode, VecPath,
};
use tch_dist::Shardable;

#[path = "common/walk.rs"]
mod walk;
use walk::{buffer_names, generic, linear, module_names, param_names, Fixed, Generic};

/// What a plan builder's "param" key accepts.
fn param_key(p: impl Into<ParamPath>) -> String {
    p.into().fqn().to_owned()
}

/// What a plan builder's "buffer" key accepts.
fn buffer_key(b: impl Into<BufferPath>) -> String {
    b.into().fqn().to_owned()
}

/// What a plan builder's "module" key accepts.
fn module_key(m: impl ModulePath) -> String {
    m.fqn().to_owned()
}

#[derive(Debug, Shardable)]
struct Block {
    fc1: nn::Linear,
    fc2: nn::Linear,
    norm: nn::LayerNorm,
    #[shardable(skip)]
    #[allow(dead_code)]
    dropout: f64,
}

impl Block {
    fn new(p: nn::Path, d: i64) -> Block {
        Block {
            fc1: linear(&p / "fc1", d, d),
            fc2: linear(&p / "fc2", d, d),
            norm: nn::layer_norm(&p / "norm", vec![d], Default::default()),
            dropout: 0.0,
        }
    }
}

#[derive(Debug, Shardable)]
struct Net {
    embed: nn::Embedding,
    blocks: Vec<Block>,
    extra: Option<Block>,
    boxed: Box<nn::Linear>,
    #[shardable(rename = "lm_head")]
    head: nn::Linear,
    bn: nn::BatchNorm,
    #[shardable(param)]
    scale: Tensor,
    #[shardable(buffer, rename = "step_count")]
    steps: Tensor,
    #[shardable(param)]
    maybe: Option<Tensor>,
    r#type: nn::Linear,
}

fn net(vs: &nn::VarStore) -> Net {
    let root = vs.root();
    Net {
        embed: nn::embedding(&root / "embed", 10, 4, Default::default()),
        blocks: (0..2)
            .map(|i| Block::new(&root / "blocks" / i, 4))
            .collect(),
        extra: Some(Block::new(&root / "extra", 4)),
        boxed: Box::new(linear(&root / "boxed", 4, 4)),
        head: linear(&root / "lm_head", 4, 2),
        bn: nn::batch_norm1d(&root / "bn", 2, Default::default()),
        scale: root.var("scale", &[1], nn::Init::Const(1.)),
        steps: root.zeros_no_train("step_count", &[1]),
        maybe: Some(root.var("maybe", &[1], nn::Init::Const(0.))),
        r#type: linear(&root / "type", 4, 4),
    }
}

/// Every parameter, buffer and module of `net(..)` through its typed path, in walk order.
fn typed_params() -> Vec<ParamPath> {
    let p = Net::path();
    let mut v = vec![p.embed().weight()];
    for b in p.blocks().elements(2) {
        v.extend([b.fc1().weight(), b.fc1().bias(), b.fc2().weight()]);
        v.extend([b.fc2().bias(), b.norm().weight(), b.norm().bias()]);
    }
    let e = p.extra();
    v.extend([
        e.fc1().weight(),
        e.fc1().bias(),
        e.fc2().weight(),
        e.fc2().bias(),
    ]);
    v.extend([e.norm().weight(), e.norm().bias()]);
    v.extend([p.boxed().weight(), p.boxed().bias()]);
    v.extend([p.head().weight(), p.head().bias()]);
    v.extend([p.bn().weight(), p.bn().bias()]);
    v.extend([p.scale(), p.maybe(), p.r#type().weight(), p.r#type().bias()]);
    v
}

#[test]
fn typed_paths_are_the_walker_names() {
    let vs = nn::VarStore::new(Device::Cpu);
    let m = net(&vs);
    let typed: Vec<String> = typed_params().iter().map(|p| p.to_string()).collect();
    assert_eq!(typed, param_names(&m));

    let p = Net::path();
    assert_eq!(
        [p.bn().running_mean(), p.bn().running_var()].map(|b| b.to_string()),
        ["bn.running_mean", "bn.running_var"]
    );
    let buffers: Vec<String> = [p.bn().running_mean(), p.bn().running_var(), p.steps()]
        .iter()
        .map(|b| b.fqn().to_owned())
        .collect();
    assert_eq!(buffers, buffer_names(&m));

    let b0 = p.blocks().at(0);
    let b1 = p.blocks().at(1);
    let e = p.extra();
    let modules = [
        p.fqn().to_owned(),
        p.embed().to_string(),
        p.blocks().to_string(),
        b0.to_string(),
        b0.fc1().to_string(),
        b0.fc2().to_string(),
        b0.norm().to_string(),
        b1.to_string(),
        b1.fc1().to_string(),
        b1.fc2().to_string(),
        b1.norm().to_string(),
        e.to_string(),
        e.fc1().to_string(),
        e.fc2().to_string(),
        e.norm().to_string(),
        p.boxed().to_string(),
        p.head().to_string(),
        p.bn().to_string(),
        p.r#type().to_string(),
    ];
    assert_eq!(modules.to_vec(), module_names(&m));
}

#[test]
fn examples_from_the_issue() {
    assert_eq!(
        Net::path().blocks().at(0).fc1().weight().fqn(),
        "blocks.0.fc1.weight"
    );
    // Renamed fields: the method is the Rust field, the FQN the rename.
    assert_eq!(Net::path().head().weight(), "lm_head.weight");
    assert_eq!(Net::path().steps().fqn(), "step_count");
    // Raw identifiers lose their `r#` in the FQN.
    assert_eq!(Net::path().r#type().bias(), "type.bias");
    // The root is "", `HasPath::path()` is the same as the inherent `Net::path()`.
    assert_eq!(Net::path().fqn(), "");
    assert_eq!(<Net as HasPath>::path(), Net::path());
    assert_eq!(
        format!("{:?}", Net::path().blocks().at(1)),
        "BlockPath(\"blocks.1\")"
    );
}

#[test]
fn keys_accept_typed_paths_and_strings() {
    let p = Net::path();
    assert_eq!(
        param_key(p.blocks().at(0).fc1().weight()),
        "blocks.0.fc1.weight"
    );
    assert_eq!(param_key("blocks.0.fc1.weight"), "blocks.0.fc1.weight");
    assert_eq!(param_key(String::from("lm_head.bias")), "lm_head.bias");
    let bias = p.head().bias();
    assert_eq!(param_key(&bias), "lm_head.bias");
    assert_eq!(param_key(bias), "lm_head.bias");
    assert_eq!(buffer_key(p.bn().running_var()), "bn.running_var");
    assert_eq!(buffer_key("bn.running_var"), "bn.running_var");
    assert_eq!(module_key(p.blocks().at(1)), "blocks.1");
    assert_eq!(module_key(p.blocks()), "blocks");
    let fc1 = p.extra().fc1();
    assert_eq!(module_key(&fc1), "extra.fc1");
    assert_eq!(module_key(fc1), "extra.fc1");
    assert_eq!(module_key("blocks.1"), "blocks.1");
    assert_eq!(module_key(String::from("")), "");
    // Paths are hashable keys, and a map keyed by them can be read with &str.
    let keys: HashSet<ParamPath> = typed_params().into_iter().collect();
    assert!(keys.contains("blocks.1.fc2.bias"));
    let modules: HashSet<BlockPath> = p.blocks().elements(2).collect();
    assert!(modules.contains(&BlockPath::at_prefix("blocks.0".into())));
    // The string form is validated against the model when it is used.
    let vs = nn::VarStore::new(Device::Cpu);
    let m = net(&vs);
    let w = p.blocks().at(1).fc2().weight().find(&m).unwrap();
    assert_eq!(w.as_ptr(), m.blocks[1].fc2.ws.as_ptr());
    assert!(ParamPath::from("blocks.9.fc1.weight").find(&m).is_none());
    assert!(p.bn().running_mean().find(&m).is_some());
    // An escape hatch navigates by name.
    assert_eq!(
        p.blocks().to_untyped().at(0).child("fc1").param("weight"),
        "blocks.0.fc1.weight"
    );
}

#[test]
fn paths_mount_under_a_prefix() {
    let p = BlockPath::at_prefix("encoder.layers.3".into());
    assert_eq!(p.fc2().bias(), "encoder.layers.3.fc2.bias");
    let l = VecPath::<BlockPath>::at_prefix("layers".into());
    assert_eq!(l.at(2).norm().weight(), "layers.2.norm.weight");
}

// ---- tuple structs, arrays, enums, generics, layers -----------------------------------------

#[derive(Debug, Shardable)]
struct Seq(
    nn::Linear,
    #[shardable(skip)]
    #[allow(dead_code)]
    f64,
    nn::Linear,
    #[shardable(param)] Tensor,
);

#[test]
fn tuple_struct_methods_are_indices() {
    let vs = nn::VarStore::new(Device::Cpu);
    let root = vs.root();
    let m = Seq(
        linear(&root / "0", 2, 2),
        0.5,
        linear(&root / "2", 2, 2),
        root.var("3", &[1], nn::Init::Const(0.)),
    );
    let p = Seq::path();
    let typed: Vec<String> = [
        p._0().weight(),
        p._0().bias(),
        p._2().weight(),
        p._2().bias(),
        p._3(),
    ]
    .iter()
    .map(ToString::to_string)
    .collect();
    assert_eq!(typed, param_names(&m));
}

#[derive(Debug, Shardable)]
enum Norm {
    Layer(nn::LayerNorm),
    Batch(nn::BatchNorm),
    Identity,
}

#[derive(Debug, Shardable)]
enum Head {
    Split {
        up: nn::Linear,
        #[shardable(rename = "down_proj")]
        down: nn::Linear,
    },
    Pair(nn::Linear, nn::Linear),
    Fqn(nn::Linear),
}

#[derive(Debug, Shardable)]
struct WithEnums {
    norm: Norm,
    head: Head,
}

#[test]
fn enum_variants() {
    let vs = nn::VarStore::new(Device::Cpu);
    let root = vs.root();
    let m = WithEnums {
        norm: Norm::Batch(nn::batch_norm1d(&root / "norm", 3, Default::default())),
        head: Head::Split {
            up: linear(&root / "head" / "up", 3, 6),
            down: linear(&root / "head" / "down_proj", 6, 3),
        },
    };
    let p = WithEnums::path();
    let typed: Vec<String> = [
        p.norm().batch().weight(),
        p.norm().batch().bias(),
        p.head().split().up().weight(),
        p.head().split().up().bias(),
        p.head().split().down().weight(),
        p.head().split().down().bias(),
    ]
    .iter()
    .map(ToString::to_string)
    .collect();
    assert_eq!(typed, param_names(&m));
    assert_eq!(
        [
            p.norm().batch().running_mean(),
            p.norm().batch().running_var()
        ]
        .map(|b| b.to_string())
        .to_vec(),
        buffer_names(&m)
    );
    assert_eq!(p.norm().layer().weight(), "norm.weight");
    assert_eq!(p.head().pair()._1().bias(), "head.1.bias");
    // A variant called `Fqn` takes the name of the inherent `fqn()`; `ModulePath::fqn` stays.
    assert_eq!(p.head().fqn().weight(), "head.weight");
    assert_eq!(ModulePath::fqn(&p.head()), "head");
    assert_eq!(format!("{:?}", p.head().split()), "HeadSplitPath(\"head\")");

    let vs = nn::VarStore::new(Device::Cpu);
    let root = vs.root();
    let m = WithEnums {
        norm: Norm::Layer(nn::layer_norm(&root / "norm", vec![3], Default::default())),
        head: Head::Pair(
            linear(&root / "head" / "0", 3, 3),
            linear(&root / "head" / "1", 3, 3),
        ),
    };
    let typed: Vec<String> = [
        p.norm().layer().weight(),
        p.norm().layer().bias(),
        p.head().pair()._0().weight(),
        p.head().pair()._0().bias(),
        p.head().pair()._1().weight(),
        p.head().pair()._1().bias(),
    ]
    .iter()
    .map(ToString::to_string)
    .collect();
    assert_eq!(typed, param_names(&m));
    let modules = [
        p.fqn().to_owned(),
        p.norm().to_string(),
        p.head().to_string(),
        p.head().pair()._0().to_string(),
        p.head().pair()._1().to_string(),
    ];
    assert_eq!(modules.to_vec(), module_names(&m));

    let vs = nn::VarStore::new(Device::Cpu);
    let m = WithEnums {
        norm: Norm::Identity,
        head: Head::Fqn(linear(vs.root() / "head", 3, 3)),
    };
    let typed = [p.head().fqn().weight(), p.head().fqn().bias()].map(|x| x.to_string());
    assert_eq!(typed.to_vec(), param_names(&m));
}

#[test]
fn generic_models() {
    let vs = nn::VarStore::new(Device::Cpu);
    let m = generic(&vs);
    let p = Generic::<nn::Linear, nn::Embedding>::path();
    let typed: Vec<String> = [
        p.first().weight(),
        p.first().bias(),
        p.rest().at(0).weight(),
        p.rest().at(0).bias(),
        p.other().weight(),
    ]
    .iter()
    .map(ToString::to_string)
    .collect();
    assert_eq!(typed, param_names(&m));

    type F = Fixed<Block, 2>;
    assert_eq!(
        F::path().layers().at(1).fc1().weight(),
        "layers.1.fc1.weight"
    );
    assert_eq!(F::path().stats(), "stats");
    // A type parameter without a path still has the other methods.
    struct NoPath;
    assert_eq!(
        Generic::<nn::Linear, NoPath>::path().first().bias(),
        "first.bias"
    );
}

#[test]
fn tch_layers_and_recurrent_layers() {
    let vs = nn::VarStore::new(Device::Cpu);
    let root = vs.root();
    let c = Default::default();
    let conv = nn::conv2d(&root / "c", 2, 2, 3, c);
    let p = <nn::Conv2D as HasPath>::path();
    assert_eq!(
        [p.weight(), p.bias()].map(|x| x.to_string()).to_vec(),
        param_names(&conv)
    );
    let t = nn::conv_transpose1d(&root / "t", 2, 2, 3, Default::default());
    let p = <nn::ConvTranspose1D as HasPath>::path();
    assert_eq!(
        [p.weight(), p.bias()].map(|x| x.to_string()).to_vec(),
        param_names(&t)
    );
    let g = nn::group_norm(&root / "g", 2, 4, Default::default());
    let p = <nn::GroupNorm as HasPath>::path();
    assert_eq!(
        [p.weight(), p.bias()].map(|x| x.to_string()).to_vec(),
        param_names(&g)
    );

    let deep = nn::RNNConfig {
        num_layers: 2,
        bidirectional: true,
        ..Default::default()
    };
    let lstm = tch_dist::nn::lstm(&root / "lstm", 3, 5, deep);
    let gru = tch_dist::nn::gru(&root / "gru", 3, 5, deep);
    let p = tch_dist::nn::LSTM::path();
    let mut typed = Vec::new();
    for l in 0..2 {
        typed.extend([p.weight_ih(l), p.weight_hh(l), p.bias_ih(l), p.bias_hh(l)]);
        typed.extend([
            p.weight_ih_reverse(l),
            p.weight_hh_reverse(l),
            p.bias_ih_reverse(l),
            p.bias_hh_reverse(l),
        ]);
    }
    let typed: Vec<String> = typed.iter().map(ToString::to_string).collect();
    assert_eq!(typed, param_names(&lstm));
    assert_eq!(typed, param_names(&gru));
    assert_eq!(tch_dist::nn::GRU::path().weight_hh(1).fqn(), "weight_hh_l1");
}

/// A hand-written `Shardable` impl next to `HasPath` with an untyped path.
struct Custom {
    w: Tensor,
}

impl Shardable for Custom {
    fn visit<'a>(&'a self, v: &mut dyn tch_dist::ModuleVisitor<'a>) {
        v.visit_param("w", &self.w);
    }
    fn visit_mut<'a>(&'a mut self, v: &mut dyn tch_dist::ModuleVisitorMut<'a>) {
        v.visit_param("w", &mut self.w);
    }
}

impl HasPath for Custom {
    type Path = AnyModulePath;
}

#[derive(Shardable)]
#[shardable(path_type = "HostKeys")]
struct Host {
    custom: Custom,
    layers: Vec<Box<dyn Shardable>>,
}

#[test]
fn hand_written_impls_trait_objects_and_path_type() {
    let vs = nn::VarStore::new(Device::Cpu);
    let root = vs.root();
    let m = Host {
        custom: Custom {
            w: (&root / "custom").var("w", &[1], nn::Init::Const(0.)),
        },
        layers: vec![Box::new(linear(&root / "layers" / 0, 2, 2))],
    };
    let p: HostKeys = Host::path();
    let typed: Vec<String> = [
        p.custom().param("w"),
        p.layers().at(0).param("weight"),
        p.layers().at(0).param("bias"),
    ]
    .iter()
    .map(ToString::to_string)
    .collect();
    assert_eq!(typed, param_names(&m));
}

/// A public model with a private child type: the path and its methods have the model's
/// visibility, with no lint about the private child's path.
pub mod api {
    use tch::nn;
    use tch_dist::Shardable;

    /// A public model.
    #[derive(Debug, Shardable)]
    pub struct Public {
        inner: Inner,
        /// The head.
        pub head: nn::Linear,
    }

    #[derive(Debug, Shardable)]
    struct Inner {
        fc: nn::Linear,
    }

    /// Builds a `Public` and returns the FQN of its inner layer's weight.
    pub fn build(vs: &nn::VarStore) -> (Public, String) {
        let root = vs.root();
        let m = Public {
            inner: Inner {
                fc: nn::linear(&root / "inner" / "fc", 2, 2, Default::default()),
            },
            head: nn::linear(&root / "head", 2, 2, Default::default()),
        };
        (m, Public::path().inner().fc().weight().into_string())
    }
}

#[test]
fn public_model_with_private_children() {
    let vs = nn::VarStore::new(Device::Cpu);
    let (m, inner) = api::build(&vs);
    let names = param_names(&m);
    assert_eq!(names[0], inner);
    assert_eq!(names[2], api::Public::path().head().weight().fqn());
    let _: api::PublicPath = api::Public::path();
}
