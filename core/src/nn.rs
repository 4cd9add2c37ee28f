//! [`Shardable`] for tch's layers, with the names PyTorch and tch's `VarStore` give their
//! tensors, and walkable drop-in replacements for tch's recurrent layers.
//!
//! | layer | parameters | buffers |
//! | --- | --- | --- |
//! | `tch::nn::Linear` | `weight`, `bias` | |
//! | `tch::nn::Conv1D/2D/3D`, `ConvTranspose1D/2D/3D` | `weight`, `bias` | |
//! | `tch::nn::BatchNorm` | `weight`, `bias` | `running_mean`, `running_var` |
//! | `tch::nn::LayerNorm`, `tch::nn::GroupNorm` | `weight`, `bias` | |
//! | `tch::nn::Embedding` | `weight` | |
//! | [`LSTM`], [`GRU`] (this module) | `weight_ih_l0`, `weight_hh_l0`, `bias_ih_l0`, `bias_hh_l0`, … (`_reverse` for the second direction) | |
//!
//! Optional tensors (`bias` of a layer built without bias, `weight`/`bias` of a
//! non-affine norm) are absent, as they are from the `VarStore`.
//!
//! Each layer also has a typed path ([`HasPath`]) with the same names:
//! [`LinearPath`], [`ConvPath`], [`ConvTransposePath`], [`LayerNormPath`], [`GroupNormPath`],
//! [`BatchNormPath`], [`EmbeddingPath`], [`RnnPath`] (`.weight_ih(k)` is `weight_ih_l{k}`).
//!
//! tch's own `nn::LSTM` and `nn::GRU` keep their weights in private fields, so they cannot be
//! walked: use [`lstm`] and [`gru`] here instead. They take the same arguments, create the
//! same variables in the `VarStore` and implement [`tch::nn::RNN`] the same way.

use std::borrow::Borrow;

use tch::nn::{self, Path, RNNConfig};
use tch::{Device, Tensor};

use crate::walk::{ModuleVisitor, ModuleVisitorMut, Shardable};

macro_rules! weight_bias_layer {
    ($(#[$doc:meta])* [$($gen:tt)*] $ty:ty, weight: $wk:ident $w:ident, bias: $b:ident) => {
        $(#[$doc])*
        impl<$($gen)*> Shardable for $ty {
            fn visit<'a>(&'a self, v: &mut dyn ModuleVisitor<'a>) {
                weight_bias_layer!(@visit $wk self.$w, v);
                if let Some(b) = &self.$b {
                    v.visit_param("bias", b);
                }
            }
            fn visit_mut<'a>(&'a mut self, v: &mut dyn ModuleVisitorMut<'a>) {
                weight_bias_layer!(@visit_mut $wk self.$w, v);
                if let Some(b) = &mut self.$b {
                    v.visit_param("bias", b);
                }
            }
        }
    };
    (@visit one $w:expr, $v:ident) => { $v.visit_param("weight", &$w) };
    (@visit opt $w:expr, $v:ident) => {
        if let Some(w) = &$w {
            $v.visit_param("weight", w);
        }
    };
    (@visit_mut one $w:expr, $v:ident) => { $v.visit_param("weight", &mut $w) };
    (@visit_mut opt $w:expr, $v:ident) => {
        if let Some(w) = &mut $w {
            $v.visit_param("weight", w);
        }
    };
}

weight_bias_layer!(
    /// `weight` `[out, in]`, `bias` `[out]` (absent without bias).
    [] nn::Linear, weight: one ws, bias: bs
);
weight_bias_layer!(
    /// `Conv1D`, `Conv2D`, `Conv3D`: `weight`, `bias` (absent without bias).
    [ND] nn::Conv<ND>, weight: one ws, bias: bs
);
weight_bias_layer!(
    /// `ConvTranspose1D/2D/3D`: `weight`, `bias` (absent without bias).
    [ND] nn::ConvTransposeND<ND>, weight: one ws, bias: bs
);
weight_bias_layer!(
    /// `weight`, `bias` (both absent when not elementwise-affine).
    [] nn::LayerNorm, weight: opt ws, bias: bs
);
weight_bias_layer!(
    /// `weight`, `bias` (both absent when not affine).
    [] nn::GroupNorm, weight: opt ws, bias: bs
);

/// `weight`, `bias` (absent when not affine); buffers `running_mean`, `running_var`.
///
/// PyTorch also has a `num_batches_tracked` buffer; tch does not create one, so it is not
/// reported (the names match tch's `VarStore`).
impl Shardable for nn::BatchNorm {
    fn visit<'a>(&'a self, v: &mut dyn ModuleVisitor<'a>) {
        if let Some(w) = &self.ws {
            v.visit_param("weight", w);
        }
        if let Some(b) = &self.bs {
            v.visit_param("bias", b);
        }
        v.visit_buffer("running_mean", &self.running_mean);
        v.visit_buffer("running_var", &self.running_var);
    }
    fn visit_mut<'a>(&'a mut self, v: &mut dyn ModuleVisitorMut<'a>) {
        if let Some(w) = &mut self.ws {
            v.visit_param("weight", w);
        }
        if let Some(b) = &mut self.bs {
            v.visit_param("bias", b);
        }
        v.visit_buffer("running_mean", &mut self.running_mean);
        v.visit_buffer("running_var", &mut self.running_var);
    }
}

/// `weight` `[num_embeddings, embedding_dim]`.
impl Shardable for nn::Embedding {
    fn visit<'a>(&'a self, v: &mut dyn ModuleVisitor<'a>) {
        v.visit_param("weight", &self.ws);
    }
    fn visit_mut<'a>(&'a mut self, v: &mut dyn ModuleVisitorMut<'a>) {
        v.visit_param("weight", &mut self.ws);
    }
}

// ---- recurrent layers -------------------------------------------------------------------

/// Names and tensors of a recurrent layer, in cuDNN's flat-weight order: per layer and
/// direction `weight_ih_l{k}{suffix}`, `weight_hh_l{k}{suffix}` and, with biases,
/// `bias_ih_l{k}{suffix}`, `bias_hh_l{k}{suffix}`; `suffix` is `_reverse` for the second
/// direction. Exactly what tch's `rnn_weights` creates, and PyTorch's names.
fn rnn_weights(
    vs: &Path,
    in_dim: i64,
    hidden_dim: i64,
    gate_dim: i64,
    c: &RNNConfig,
) -> (Vec<String>, Vec<Tensor>) {
    let num_directions = if c.bidirectional { 2 } else { 1 };
    let mut names = Vec::new();
    let mut weights = Vec::new();
    for layer_idx in 0..c.num_layers {
        for direction_idx in 0..num_directions {
            let in_dim = if layer_idx == 0 {
                in_dim
            } else {
                hidden_dim * num_directions
            };
            let suffix = if direction_idx == 1 { "_reverse" } else { "" };
            let mut add = |name: String, dims: &[i64], init: nn::Init| {
                weights.push(vs.var(&name, dims, init));
                names.push(name);
            };
            add(
                format!("weight_ih_l{layer_idx}{suffix}"),
                &[gate_dim, in_dim],
                c.w_ih_init,
            );
            add(
                format!("weight_hh_l{layer_idx}{suffix}"),
                &[gate_dim, hidden_dim],
                c.w_hh_init,
            );
            if c.has_biases {
                let zero = nn::Init::Const(0.);
                add(
                    format!("bias_ih_l{layer_idx}{suffix}"),
                    &[gate_dim],
                    c.b_ih_init.unwrap_or(zero),
                );
                add(
                    format!("bias_hh_l{layer_idx}{suffix}"),
                    &[gate_dim],
                    c.b_hh_init.unwrap_or(zero),
                );
            }
        }
    }
    (names, weights)
}

fn flatten_for_cudnn(
    device: Device,
    weights: &[Tensor],
    in_dim: i64,
    mode: i64,
    hidden_dim: i64,
    c: &RNNConfig,
) {
    if device.is_cuda() && tch::Cuda::cudnn_is_available() {
        // Same call as tch: lets cuDNN keep the weights in one contiguous chunk. A failure
        // only costs speed, so it is ignored.
        let _ = Tensor::f_internal_cudnn_rnn_flatten_weight(
            weights,
            4,
            in_dim,
            mode,
            hidden_dim,
            0,
            c.num_layers,
            c.batch_first,
            c.bidirectional,
        );
    }
}

/// A recurrent layer `$name` whose cells have `$gates` gate blocks (LSTM 4, GRU 3), run by
/// cuDNN in mode `$cudnn_mode` (`CUDNN_LSTM` 2, `CUDNN_GRU` 3).
macro_rules! rnn_layer {
    (
        $(#[$doc:meta])* $name:ident, build: $build:ident, gates: $gates:literal,
        cudnn_mode: $cudnn_mode:literal
    ) => {
        $(#[$doc])*
        #[allow(clippy::upper_case_acronyms)]
        #[derive(Debug)]
        pub struct $name {
            names: Vec<String>,
            flat_weights: Vec<Tensor>,
            hidden_dim: i64,
            config: RNNConfig,
            device: Device,
        }

        impl $name {
            /// The layer's weights made in `vs` as tch makes them, and flattened for cuDNN
            /// on a CUDA device.
            fn new(vs: &Path, in_dim: i64, hidden_dim: i64, c: RNNConfig) -> $name {
                let gate_dim = $gates * hidden_dim;
                let (names, flat_weights) = rnn_weights(vs, in_dim, hidden_dim, gate_dim, &c);
                flatten_for_cudnn(vs.device(), &flat_weights, in_dim, $cudnn_mode, hidden_dim, &c);
                $name {
                    names,
                    flat_weights,
                    hidden_dim,
                    config: c,
                    device: vs.device(),
                }
            }

            /// The flat weights, in the order `Tensor::lstm`/`Tensor::gru` expect.
            ///
            /// ```
            /// let vs = tch::nn::VarStore::new(tch::Device::Cpu);
            #[doc = concat!(
                "let layer = tch_dist_core::nn::", stringify!($build), "(vs.root(), 4, 8, Default::default());"
            )]
            /// // weight_ih_l0, weight_hh_l0, bias_ih_l0, bias_hh_l0:
            /// assert_eq!(layer.flat_weights().len(), 4);
            /// ```
            pub fn flat_weights(&self) -> &[Tensor] {
                &self.flat_weights
            }
            /// The configuration the layer was built with.
            ///
            /// ```
            /// let vs = tch::nn::VarStore::new(tch::Device::Cpu);
            /// let c = tch::nn::RNNConfig { num_layers: 2, ..Default::default() };
            #[doc = concat!(
                "let layer = tch_dist_core::nn::", stringify!($build), "(vs.root(), 4, 8, c);"
            )]
            /// assert_eq!(layer.config().num_layers, 2);
            /// ```
            pub fn config(&self) -> &RNNConfig {
                &self.config
            }
        }

        impl Shardable for $name {
            fn visit<'a>(&'a self, v: &mut dyn ModuleVisitor<'a>) {
                for (n, t) in self.names.iter().zip(&self.flat_weights) {
                    v.visit_param(n, t);
                }
            }
            fn visit_mut<'a>(&'a mut self, v: &mut dyn ModuleVisitorMut<'a>) {
                for (n, t) in self.names.iter().zip(self.flat_weights.iter_mut()) {
                    v.visit_param(n, t);
                }
            }
        }
    };
}

rnn_layer!(
    /// A Long Short-Term Memory layer, walkable: the drop-in for `tch::nn::LSTM`. Build it
    /// with [`lstm`].
    ///
    /// ```
    /// use tch::nn::RNN;
    /// let vs = tch::nn::VarStore::new(tch::Device::Cpu);
    /// let lstm = tch_dist_core::nn::lstm(vs.root() / "lstm", 4, 8, Default::default());
    /// let (out, _state) = lstm.seq(&tch::Tensor::zeros([2, 5, 4], tch::kind::FLOAT_CPU));
    /// assert_eq!(out.size(), [2, 5, 8]); // batch first, as tch's default
    /// ```
    LSTM,
    build: lstm,
    gates: 4,
    cudnn_mode: 2
);
rnn_layer!(
    /// A Gated Recurrent Unit layer, walkable: the drop-in for `tch::nn::GRU`. Build it with
    /// [`gru`].
    ///
    /// ```
    /// use tch::nn::RNN;
    /// let vs = tch::nn::VarStore::new(tch::Device::Cpu);
    /// let gru = tch_dist_core::nn::gru(vs.root() / "gru", 4, 8, Default::default());
    /// let (out, _state) = gru.seq(&tch::Tensor::zeros([2, 5, 4], tch::kind::FLOAT_CPU));
    /// assert_eq!(out.size(), [2, 5, 8]);
    /// ```
    GRU,
    build: gru,
    gates: 3,
    cudnn_mode: 3
);

/// Creates an [`LSTM`] layer: the same variables, names and behaviour as `tch::nn::lstm`.
///
/// ```
/// use tch_dist_core::Shardable;
/// let vs = tch::nn::VarStore::new(tch::Device::Cpu);
/// let lstm = tch_dist_core::nn::lstm(vs.root() / "lstm", 4, 8, Default::default());
/// let names: Vec<String> = lstm.named_parameters().into_iter().map(|(n, _)| n).collect();
/// assert_eq!(names, ["weight_ih_l0", "weight_hh_l0", "bias_ih_l0", "bias_hh_l0"]);
/// ```
pub fn lstm<'a, T: Borrow<Path<'a>>>(vs: T, in_dim: i64, hidden_dim: i64, c: RNNConfig) -> LSTM {
    LSTM::new(vs.borrow(), in_dim, hidden_dim, c)
}

/// Creates a [`GRU`] layer: the same variables, names and behaviour as `tch::nn::gru`.
///
/// ```
/// let vs = tch::nn::VarStore::new(tch::Device::Cpu);
/// let gru = tch_dist_core::nn::gru(vs.root() / "gru", 4, 8, Default::default());
/// assert_eq!(gru.flat_weights()[0].size(), [3 * 8, 4]); // weight_ih_l0: 3 gates
/// ```
pub fn gru<'a, T: Borrow<Path<'a>>>(vs: T, in_dim: i64, hidden_dim: i64, c: RNNConfig) -> GRU {
    GRU::new(vs.borrow(), in_dim, hidden_dim, c)
}

fn zero_state_shape(c: &RNNConfig, batch_dim: i64, hidden_dim: i64) -> [i64; 3] {
    let num_directions = if c.bidirectional { 2 } else { 1 };
    [c.num_layers * num_directions, batch_dim, hidden_dim]
}

impl nn::RNN for LSTM {
    type State = nn::LSTMState;

    fn zero_state(&self, batch_dim: i64) -> nn::LSTMState {
        let shape = zero_state_shape(&self.config, batch_dim, self.hidden_dim);
        let kind = self
            .flat_weights
            .first()
            .map_or(tch::Kind::Float, Tensor::kind);
        let zeros = Tensor::zeros(shape, (kind, self.device));
        nn::LSTMState((zeros.shallow_clone(), zeros))
    }

    fn step(&self, input: &Tensor, in_state: &nn::LSTMState) -> nn::LSTMState {
        let input = input.unsqueeze(1);
        let (_output, state) = self.seq_init(&input, in_state);
        state
    }

    fn seq_init(&self, input: &Tensor, in_state: &nn::LSTMState) -> (Tensor, nn::LSTMState) {
        let nn::LSTMState((h, c)) = in_state;
        let c_ = &self.config;
        let flat_weights = self.flat_weights.iter().collect::<Vec<_>>();
        let (output, h, c) = input.lstm(
            &[h, c],
            &flat_weights,
            c_.has_biases,
            c_.num_layers,
            c_.dropout,
            c_.train,
            c_.bidirectional,
            c_.batch_first,
        );
        (output, nn::LSTMState((h, c)))
    }
}

impl nn::RNN for GRU {
    type State = nn::GRUState;

    fn zero_state(&self, batch_dim: i64) -> nn::GRUState {
        let shape = zero_state_shape(&self.config, batch_dim, self.hidden_dim);
        let kind = self
            .flat_weights
            .first()
            .map_or(tch::Kind::Float, Tensor::kind);
        nn::GRUState(Tensor::zeros(shape, (kind, self.device)))
    }

    fn step(&self, input: &Tensor, in_state: &nn::GRUState) -> nn::GRUState {
        let input = input.unsqueeze(1);
        let (_output, state) = self.seq_init(&input, in_state);
        state
    }

    fn seq_init(&self, input: &Tensor, in_state: &nn::GRUState) -> (Tensor, nn::GRUState) {
        let nn::GRUState(h) = in_state;
        let c = &self.config;
        let (output, h) = input.gru(
            h,
            &self.flat_weights,
            c.has_biases,
            c.num_layers,
            c.dropout,
            c.train,
            c.bidirectional,
            c.batch_first,
        );
        (output, nn::GRUState(h))
    }
}

// ---- typed paths ----------------------------------------------------------------------------

use crate::path::{module_path_struct, BufferPath, HasPath, ParamPath};

macro_rules! layer_path {
    (
        $(#[$doc:meta])* $path:ident for $([$($gen:ident)?] $ty:ty),*
        { params: [$($p:ident),*], buffers: [$($b:ident),*] }
    ) => {
        module_path_struct!(
            $(#[$doc])*
            $path {
                $(
                    #[doc = concat!("The parameter `", stringify!($p), "`.")]
                    ///
                    /// ```
                    /// use tch_dist_core::path::PathNode;
                    #[doc = concat!(
                        "let layer = tch_dist_core::nn::", stringify!($path), "::at_prefix(\"blocks.0\".into());"
                    )]
                    #[doc = concat!(
                        "assert_eq!(layer.", stringify!($p), "(), \"blocks.0.", stringify!($p), "\");"
                    )]
                    /// ```
                    pub fn $p(&self) -> ParamPath {
                        ParamPath::in_module(self, stringify!($p))
                    }
                )*
                $(
                    #[doc = concat!("The buffer `", stringify!($b), "`.")]
                    ///
                    /// ```
                    /// use tch_dist_core::path::PathNode;
                    #[doc = concat!(
                        "let layer = tch_dist_core::nn::", stringify!($path), "::at_prefix(\"blocks.0\".into());"
                    )]
                    #[doc = concat!(
                        "assert_eq!(layer.", stringify!($b), "(), \"blocks.0.", stringify!($b), "\");"
                    )]
                    /// ```
                    pub fn $b(&self) -> BufferPath {
                        BufferPath::in_module(self, stringify!($b))
                    }
                )*
            }
        );
        $(
            impl<$($gen)?> HasPath for $ty {
                type Path = $path;
            }
        )*
    };
}

layer_path!(
    /// The path of a `tch::nn::Linear`: `weight`, `bias`.
    ///
    /// ```
    /// use tch_dist_core::path::HasPath;
    /// let p: tch_dist_core::nn::LinearPath = <tch::nn::Linear>::path();
    /// assert_eq!(p.weight(), "weight"); // the layer as the root module
    /// ```
    LinearPath for [] nn::Linear { params: [weight, bias], buffers: [] }
);
layer_path!(
    /// The path of a `tch::nn::Conv1D/2D/3D`: `weight`, `bias`.
    ///
    /// ```
    /// use tch_dist_core::path::HasPath;
    /// let p: tch_dist_core::nn::ConvPath = <tch::nn::Conv2D>::path();
    /// assert_eq!(p.weight(), "weight"); // the layer as the root module
    /// ```
    ConvPath for [ND] nn::Conv<ND> { params: [weight, bias], buffers: [] }
);
layer_path!(
    /// The path of a `tch::nn::ConvTranspose1D/2D/3D`: `weight`, `bias`.
    ///
    /// ```
    /// use tch_dist_core::path::HasPath;
    /// let p: tch_dist_core::nn::ConvTransposePath = <tch::nn::ConvTranspose2D>::path();
    /// assert_eq!(p.bias(), "bias"); // the layer as the root module
    /// ```
    ConvTransposePath for [ND] nn::ConvTransposeND<ND> { params: [weight, bias], buffers: [] }
);
layer_path!(
    /// The path of a `tch::nn::LayerNorm`: `weight`, `bias`.
    ///
    /// ```
    /// use tch_dist_core::path::HasPath;
    /// let p: tch_dist_core::nn::LayerNormPath = <tch::nn::LayerNorm>::path();
    /// assert_eq!(p.weight(), "weight"); // the layer as the root module
    /// ```
    LayerNormPath for [] nn::LayerNorm { params: [weight, bias], buffers: [] }
);
layer_path!(
    /// The path of a `tch::nn::GroupNorm`: `weight`, `bias`.
    ///
    /// ```
    /// use tch_dist_core::path::HasPath;
    /// let p: tch_dist_core::nn::GroupNormPath = <tch::nn::GroupNorm>::path();
    /// assert_eq!(p.bias(), "bias"); // the layer as the root module
    /// ```
    GroupNormPath for [] nn::GroupNorm { params: [weight, bias], buffers: [] }
);
layer_path!(
    /// The path of a `tch::nn::BatchNorm`: parameters `weight`, `bias`, buffers
    /// `running_mean`, `running_var`.
    ///
    /// ```
    /// use tch_dist_core::path::HasPath;
    /// let p: tch_dist_core::nn::BatchNormPath = <tch::nn::BatchNorm>::path();
    /// assert_eq!(p.running_var(), "running_var"); // the layer as the root module
    /// ```
    BatchNormPath for [] nn::BatchNorm {
        params: [weight, bias],
        buffers: [running_mean, running_var]
    }
);
layer_path!(
    /// The path of a `tch::nn::Embedding`: `weight`.
    ///
    /// ```
    /// use tch_dist_core::path::HasPath;
    /// let p: tch_dist_core::nn::EmbeddingPath = <tch::nn::Embedding>::path();
    /// assert_eq!(p.weight(), "weight"); // the layer as the root module
    /// ```
    EmbeddingPath for [] nn::Embedding { params: [weight], buffers: [] }
);

module_path_struct!(
    /// The path of an [`LSTM`] or a [`GRU`]: per layer `k`, `weight_ih_l{k}`,
    /// `weight_hh_l{k}`, `bias_ih_l{k}`, `bias_hh_l{k}`, and the same with `_reverse` for the
    /// second direction of a bidirectional layer.
    ///
    /// ```
    /// use tch_dist_core::path::HasPath;
    /// let p = tch_dist_core::nn::LSTM::path();
    /// assert_eq!(p.weight_hh_reverse(1), "weight_hh_l1_reverse");
    /// ```
    RnnPath {
        /// `weight_ih_l{layer}`.
        ///
        /// ```
        /// use tch_dist_core::path::HasPath;
        /// assert_eq!(tch_dist_core::nn::GRU::path().weight_ih(0), "weight_ih_l0");
        /// ```
        pub fn weight_ih(&self, layer: usize) -> ParamPath {
            self.weight("weight_ih", layer, "")
        }
        /// `weight_hh_l{layer}`.
        ///
        /// ```
        /// use tch_dist_core::path::HasPath;
        /// assert_eq!(tch_dist_core::nn::GRU::path().weight_hh(0), "weight_hh_l0");
        /// ```
        pub fn weight_hh(&self, layer: usize) -> ParamPath {
            self.weight("weight_hh", layer, "")
        }
        /// `bias_ih_l{layer}`.
        ///
        /// ```
        /// use tch_dist_core::path::HasPath;
        /// assert_eq!(tch_dist_core::nn::GRU::path().bias_ih(0), "bias_ih_l0");
        /// ```
        pub fn bias_ih(&self, layer: usize) -> ParamPath {
            self.weight("bias_ih", layer, "")
        }
        /// `bias_hh_l{layer}`.
        ///
        /// ```
        /// use tch_dist_core::path::HasPath;
        /// assert_eq!(tch_dist_core::nn::GRU::path().bias_hh(0), "bias_hh_l0");
        /// ```
        pub fn bias_hh(&self, layer: usize) -> ParamPath {
            self.weight("bias_hh", layer, "")
        }
        /// `weight_ih_l{layer}_reverse`.
        ///
        /// ```
        /// use tch_dist_core::path::HasPath;
        /// assert_eq!(tch_dist_core::nn::GRU::path().weight_ih_reverse(1), "weight_ih_l1_reverse");
        /// ```
        pub fn weight_ih_reverse(&self, layer: usize) -> ParamPath {
            self.weight("weight_ih", layer, "_reverse")
        }
        /// `weight_hh_l{layer}_reverse`.
        ///
        /// ```
        /// use tch_dist_core::path::HasPath;
        /// assert_eq!(tch_dist_core::nn::GRU::path().weight_hh_reverse(1), "weight_hh_l1_reverse");
        /// ```
        pub fn weight_hh_reverse(&self, layer: usize) -> ParamPath {
            self.weight("weight_hh", layer, "_reverse")
        }
        /// `bias_ih_l{layer}_reverse`.
        ///
        /// ```
        /// use tch_dist_core::path::HasPath;
        /// assert_eq!(tch_dist_core::nn::GRU::path().bias_ih_reverse(1), "bias_ih_l1_reverse");
        /// ```
        pub fn bias_ih_reverse(&self, layer: usize) -> ParamPath {
            self.weight("bias_ih", layer, "_reverse")
        }
        /// `bias_hh_l{layer}_reverse`.
        ///
        /// ```
        /// use tch_dist_core::path::HasPath;
        /// assert_eq!(tch_dist_core::nn::GRU::path().bias_hh_reverse(1), "bias_hh_l1_reverse");
        /// ```
        pub fn bias_hh_reverse(&self, layer: usize) -> ParamPath {
            self.weight("bias_hh", layer, "_reverse")
        }

        fn weight(&self, kind: &str, layer: usize, suffix: &str) -> ParamPath {
            ParamPath::in_module(self, &format!("{kind}_l{layer}{suffix}"))
        }
    }
);

impl HasPath for LSTM {
    type Path = RnnPath;
}

impl HasPath for GRU {
    type Path = RnnPath;
}
