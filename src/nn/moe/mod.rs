//! Mixture of experts: a [`MoE`] layer as DeepSeek-V3, Qwen3-MoE and torchtitan build it — a
//! [`Router`] choosing the top `k` of `experts` SwiGLU experts per token ([`GroupedExperts`],
//! 3-D weights), an optional shared expert ([`FeedForward`]) every token goes through, the
//! auxiliary-loss-free load balancing bias and an optional auxiliary loss.
//!
//! | file | what it does | PyTorch's counterpart |
//! | --- | --- | --- |
//! | `mod.rs` | [`MoeConfig`], [`MoE`]: dispatch to the experts and combine, the bias update, the auxiliary loss, HF's names | torchtitan's `models/common/moe.py` (`MoE`), `token_dispatcher.py` (`LocalTokenDispatcher`), `components/optimizer/optimizer.py` (`_update_expert_bias`), `state_dict_adapter.py` |
//! | `router.rs` | [`Router`]: scores, top-k with deterministic ties, weights | `moe.py` (`TokenChoiceTopKRouter`) |
//! | `experts.rs` | [`GroupedExperts`] (the routed experts over grouped tokens), [`FeedForward`] (the shared expert) | `moe.py` (`GroupedExperts`, `FeedForward`) |
//!
//! By default one process runs every expert; the [`ExpertParallel`](crate::sharding::ExpertParallel)
//! style (or [`MoE::parallelize_experts`] over a group) splits them over the ranks of a mesh
//! dim, the tokens exchanged by all-to-all: the layer calls its experts with the rows grouped
//! by expert and the rows per expert, as torchtitan's `GroupedExperts`, and the style's hooks
//! do the rest.
//!
//! ```no_run
//! use tch::nn::Module;
//! use tch_dist::nn::moe::{MoE, MoeConfig};
//! # fn main() -> Result<(), tch_dist::nn::moe::MoeError> {
//! let vs = tch::nn::VarStore::new(tch::Device::Cpu);
//! let config = MoeConfig { shared_hidden: Some(32), ..MoeConfig::new(16, 32, 8, 2) };
//! let moe = MoE::new(&vs.root() / "moe", config)?; // 8 experts, top-2, one shared
//! let y = moe.forward(&tch::Tensor::randn([4, 10, 16], tch::kind::FLOAT_CPU));
//! moe.update_expert_bias(None)?; // before the optimizer step: the load-balancing bias
//! # Ok(()) }
//! ```

mod experts;
mod router;

use std::collections::HashMap;
use std::sync::Mutex;

use tch::nn::{self, Module};
use tch::{Kind, Tensor};
use tch_dist_core::hooks::{CallWith, ForwardError};
use tch_dist_core::Shardable;
use tch_dist_runtime::fsdp::tensor_identity;
use tch_dist_runtime::{DistError, ProcessGroup, ReduceOp};

use crate::sharding::{shard_module, ExpertSharder, ShardError, ShardState, ShardingPlan};
use crate::state_dict::managed::{managed_by, ManagingApi};

pub use experts::{FeedForward, GroupedExperts};
pub use router::{Router, Routes};

/// How a router turns a token's gate logits into scores.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
///
/// ```
/// use tch_dist::nn::moe::{MoeConfig, ScoreFunction};
/// let qwen = MoeConfig { score_function: ScoreFunction::Softmax, ..MoeConfig::new(16, 32, 8, 2) };
/// ```
pub enum ScoreFunction {
    /// Softmax over the experts (Qwen3-MoE).
    Softmax,
    /// A sigmoid per expert (DeepSeek-V3; torchtitan's default).
    Sigmoid,
}

/// The shape and routing of a [`MoE`] layer (torchtitan's `MoEArgs`).
///
/// ```
/// use tch_dist::nn::moe::{MoeConfig, ScoreFunction};
/// let qwen3 = MoeConfig { score_function: ScoreFunction::Softmax, route_norm: true, ..MoeConfig::new(2048, 768, 128, 8) };
/// assert_eq!(qwen3.load_balance_coeff, Some(1e-3));
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct MoeConfig {
    /// The model's width.
    pub dim: i64,
    /// Each routed expert's hidden width.
    pub hidden: i64,
    /// The routed experts.
    pub experts: i64,
    /// The experts each token goes to.
    pub top_k: i64,
    /// Softmax or sigmoid scores (default sigmoid).
    pub score_function: ScoreFunction,
    /// Whether a token's `k` weights are divided by their sum (default false).
    pub route_norm: bool,
    /// A factor on the weights (default 1).
    pub route_scale: f64,
    /// The shared expert's hidden width, if there is one (default none).
    pub shared_hidden: Option<i64>,
    /// The load-balancing bias's step (`None`: no bias; default 1e-3).
    pub load_balance_coeff: Option<f64>,
    /// The auxiliary loss's weight (0: none, the default).
    pub aux_loss_alpha: f64,
}

impl MoeConfig {
    /// `experts` experts of `dim` -> `hidden` -> `dim`, `top_k` per token, torchtitan's
    /// defaults otherwise.
    ///
    /// ```
    /// let config = tch_dist::nn::moe::MoeConfig::new(16, 32, 8, 2); // 8 experts, top-2
    /// assert_eq!((config.experts, config.top_k), (8, 2));
    /// ```
    pub fn new(dim: i64, hidden: i64, experts: i64, top_k: i64) -> MoeConfig {
        MoeConfig {
            dim,
            hidden,
            experts,
            top_k,
            score_function: ScoreFunction::Sigmoid,
            route_norm: false,
            route_scale: 1.0,
            shared_hidden: None,
            load_balance_coeff: Some(1e-3),
            aux_loss_alpha: 0.0,
        }
    }

    fn check(&self) -> Result<(), MoeError> {
        let bad = |what: String| Err(MoeError::Config(what));
        if self.dim < 1 || self.hidden < 1 || self.experts < 1 {
            return bad(format!(
                "dim {}, hidden {} and experts {} must be at least 1",
                self.dim, self.hidden, self.experts
            ));
        }
        if !(1..=self.experts).contains(&self.top_k) {
            return bad(format!(
                "top_k {} must be between 1 and the {} experts",
                self.top_k, self.experts
            ));
        }
        if self.shared_hidden.is_some_and(|h| h < 1) {
            return bad("shared_hidden must be at least 1".into());
        }
        if !self.route_scale.is_finite() || self.route_scale <= 0.0 {
            return bad(format!(
                "route_scale {} must be a positive number",
                self.route_scale
            ));
        }
        if self
            .load_balance_coeff
            .is_some_and(|c| !c.is_finite() || c <= 0.0)
        {
            return bad("load_balance_coeff must be a positive number".into());
        }
        if !self.aux_loss_alpha.is_finite() || self.aux_loss_alpha < 0.0 {
            return bad(format!(
                "aux_loss_alpha {} must be 0 or more",
                self.aux_loss_alpha
            ));
        }
        Ok(())
    }
}

/// Why a [`MoE`] call refused; nothing was changed.
///
/// ```
/// use tch_dist::nn::moe::MoeError;
/// let e = MoeError::Missing("model.layers.0.mlp.gate.weight".into());
/// assert_eq!(e.to_string(), "moe: no tensor `model.layers.0.mlp.gate.weight` to load");
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MoeError {
    /// A configuration that cannot run.
    #[error("moe: {0}")]
    Config(String),
    /// A tensor of HF's names is missing.
    #[error("moe: no tensor `{0}` to load")]
    Missing(String),
    /// A tensor of HF's names has another shape.
    #[error("moe: `{name}` is {got:?}, expected {expected:?}")]
    Shape {
        /// Its HF name.
        name: String,
        /// The shape this layer holds.
        expected: Vec<i64>,
        /// The shape given.
        got: Vec<i64>,
    },
    /// A collective failed: the expert counts' all-reduce, or expert parallelism's
    /// exchanges.
    #[error("moe: a collective failed")]
    Collective(#[source] DistError),
    /// A hook of the routed experts' call failed (expert parallelism's exchanges,
    /// fully_shard's gather of the experts when they are sharded on their own mesh).
    #[error("moe: the routed experts' call failed")]
    Experts(#[source] ForwardError),
    /// [`MoE::parallelize_experts`] refused (on every rank, nothing changed).
    #[error("moe: expert parallelism refused")]
    ExpertParallel(#[source] ShardError),
}

/// A mixture-of-experts feed-forward: each token through its top `k` routed experts,
/// weighted, plus the shared expert if any (dropless: every expert takes every token routed
/// to it). Tokens are grouped by expert with a stable sort, so the order inside an expert,
/// and thus the result, is the same however the tokens are split.
#[derive(Debug, Shardable)]
#[shardable(crate = "crate")]
///
/// ```no_run
/// use tch::nn::Module;
/// let vs = tch::nn::VarStore::new(tch::Device::Cpu);
/// let moe = tch_dist::nn::moe::MoE::new(&vs.root() / "moe", tch_dist::nn::moe::MoeConfig::new(16, 32, 8, 2))?;
/// let y = moe.forward(&tch::Tensor::randn([4, 16], tch::kind::FLOAT_CPU)); // [4, 16]
/// # Ok::<(), tch_dist::nn::moe::MoeError>(())
/// ```
pub struct MoE {
    /// The router (`router.gate.weight`, buffer `router.expert_bias`).
    pub router: Router,
    /// The routed experts (`experts.w1`, `experts.w2`, `experts.w3`).
    pub experts: GroupedExperts,
    /// The shared expert (`shared_experts.w1`, ...), if configured.
    pub shared_experts: Option<FeedForward>,
    #[shardable(skip)]
    config: MoeConfig,
    #[shardable(skip)]
    aux_loss: Mutex<Option<Tensor>>,
    #[shardable(skip)]
    expert_parallel: Option<std::sync::Arc<ShardState>>,
}

impl MoE {
    /// A layer of `config` at `path`; refuses a configuration that cannot run.
    ///
    /// ```no_run
    /// use tch_dist::nn::moe::{MoE, MoeConfig};
    /// let vs = tch::nn::VarStore::new(tch::Device::Cpu);
    /// let moe = MoE::new(&vs.root() / "mlp", MoeConfig::new(16, 32, 8, 2))?; // `mlp.router.gate.weight`, ...
    /// # Ok::<(), tch_dist::nn::moe::MoeError>(())
    /// ```
    pub fn new(path: nn::Path, config: MoeConfig) -> Result<MoE, MoeError> {
        config.check()?;
        Ok(MoE {
            router: Router::new(&path / "router", &config),
            experts: GroupedExperts::new(
                &path / "experts",
                config.experts,
                config.dim,
                config.hidden,
            ),
            shared_experts: config
                .shared_hidden
                .map(|h| FeedForward::new(&path / "shared_experts", config.dim, h)),
            config,
            aux_loss: Mutex::new(None),
            expert_parallel: None,
        })
    }

    /// The configuration.
    ///
    /// ```no_run
    /// # let vs = tch::nn::VarStore::new(tch::Device::Cpu);
    /// # let moe = tch_dist::nn::moe::MoE::new(&vs.root() / "moe", tch_dist::nn::moe::MoeConfig::new(16, 32, 8, 2))?;
    /// assert_eq!(moe.config().experts, 8);
    /// # Ok::<(), tch_dist::nn::moe::MoeError>(())
    /// ```
    pub fn config(&self) -> &MoeConfig {
        &self.config
    }

    /// Expert parallelism over `group`: the [`ExpertParallel`](crate::sharding::ExpertParallel)
    /// style on this layer's experts (what `parallelize_module(&mut moe, &ep_mesh,
    /// &ParallelizePlan::new().style("experts", ExpertParallel))` does on a mesh dim), rank
    /// 0's values. This rank keeps `experts / ranks` of the routed experts (rank `r`
    /// experts `r·E/ranks ..`; their 3-D weights narrowed in place, so build the optimizer
    /// afterwards), and each forward sends every token to the rank holding its expert and
    /// back. The router and the shared expert stay whole on every rank, with rank 0's values;
    /// each rank routes its own tokens. `replicate` and `fully_shard` over the same ranks
    /// leave the experts alone (apply them after this); the state dict and checkpoints
    /// gather and place them. Every rank of `group` must call it and then run each forward;
    /// ranks that do not divide the experts, or layers that differ, are refused on every
    /// rank, nothing changed.
    ///
    /// ```no_run
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use tch_dist::nn::moe::{MoE, MoeConfig};
    /// let pg = tch_dist::init_process_group(tch_dist::Backend::Gloo)?; // 2 ranks
    /// let vs = tch::nn::VarStore::new(tch::Device::Cpu);
    /// let mut moe = MoE::new(&vs.root() / "moe", MoeConfig::new(16, 32, 8, 2))?;
    /// moe.parallelize_experts(&pg)?; // 4 experts on each rank
    /// let y = moe.f_forward(&tch::Tensor::randn([10, 16], tch::kind::FLOAT_CPU))?;
    /// # Ok(()) }
    /// ```
    pub fn parallelize_experts(&mut self, group: &ProcessGroup) -> Result<(), MoeError> {
        if self.expert_parallel.is_some() {
            return Err(MoeError::Config(
                "the experts are already expert-parallel".into(),
            ));
        }
        let plan = ShardingPlan::builder()
            .shard_module("experts", ExpertSharder::default())
            .build();
        let state = shard_module(self, &plan, 0, group).map_err(MoeError::ExpertParallel)?;
        self.expert_parallel = Some(state);
        Ok(())
    }

    /// This rank's routed experts: `first .. first + count` of the layer's (all of them
    /// without expert parallelism).
    ///
    /// ```no_run
    /// # let vs = tch::nn::VarStore::new(tch::Device::Cpu);
    /// # let moe = tch_dist::nn::moe::MoE::new(&vs.root() / "moe", tch_dist::nn::moe::MoeConfig::new(16, 32, 8, 2))?;
    /// assert_eq!(moe.local_experts(), 0..8); // all of them without expert parallelism
    /// # Ok::<(), tch_dist::nn::moe::MoeError>(())
    /// ```
    pub fn local_experts(&self) -> std::ops::Range<i64> {
        let id = tensor_identity(&self.experts.w1);
        match managed_by(id, ManagingApi::ExpertParallel).and_then(|m| m.layer) {
            Some(layer) => layer.offsets[0]..layer.offsets[0] + layer.local[0],
            None => 0..self.config.experts,
        }
    }

    /// The auxiliary load-balancing loss of the last forward (`aux_loss_alpha > 0`), taken:
    /// `alpha · Σ_e f_e · P_e` over the batch, with `f_e` the share of routed slots expert
    /// `e` took times `experts / k` and `P_e` its mean normalised score (DeepSeek-V3's
    /// balance loss over the batch); add it to the loss.
    ///
    /// ```no_run
    /// # let vs = tch::nn::VarStore::new(tch::Device::Cpu);
    /// # let moe = tch_dist::nn::moe::MoE::new(&vs.root() / "moe", tch_dist::nn::moe::MoeConfig::new(16, 32, 8, 2))?;
    /// # let loss = tch::Tensor::zeros([], tch::kind::FLOAT_CPU);
    /// let total = match moe.take_aux_loss() { Some(aux) => loss + aux, None => loss };
    /// # Ok::<(), tch_dist::nn::moe::MoeError>(())
    /// ```
    pub fn take_aux_loss(&self) -> Option<Tensor> {
        self.aux_loss.lock().ok().and_then(|mut a| a.take())
    }

    /// Tokens each expert took since the last [`update_expert_bias`](Self::update_expert_bias).
    ///
    /// ```no_run
    /// # let vs = tch::nn::VarStore::new(tch::Device::Cpu);
    /// # let moe = tch_dist::nn::moe::MoE::new(&vs.root() / "moe", tch_dist::nn::moe::MoeConfig::new(16, 32, 8, 2))?;
    /// let counts = moe.tokens_per_expert(); // [8], zeros before the first forward
    /// # Ok::<(), tch_dist::nn::moe::MoeError>(())
    /// ```
    pub fn tokens_per_expert(&self) -> Tensor {
        self.router
            .tokens_per_expert
            .lock()
            .map(|c| c.copy())
            .unwrap_or_else(|p| p.into_inner().copy())
    }

    /// The auxiliary-loss-free load balancing step (torchtitan's optimizer pre-hook
    /// `_update_expert_bias`), to call before each optimizer step: the expert counts summed
    /// over `group` (the data-parallel ranks, so that every rank moves its bias alike), then
    /// `bias += coeff · sign(mean − count)`, centred; the counts restart from zero. Without
    /// `load_balance_coeff` it only clears the counts.
    ///
    /// ```no_run
    /// # let vs = tch::nn::VarStore::new(tch::Device::Cpu);
    /// # let moe = tch_dist::nn::moe::MoE::new(&vs.root() / "moe", tch_dist::nn::moe::MoeConfig::new(16, 32, 8, 2))?;
    /// let dp = tch_dist::default_group().ok();
    /// moe.update_expert_bias(dp.as_ref())?; // before opt.step()
    /// # Ok::<(), tch_dist::nn::moe::MoeError>(())
    /// ```
    pub fn update_expert_bias(&self, group: Option<&ProcessGroup>) -> Result<(), MoeError> {
        let mut counts = self
            .router
            .tokens_per_expert
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if let Some(g) = group {
            g.all_reduce(&counts, ReduceOp::Sum)
                .map_err(MoeError::Collective)?;
        }
        if let Some(coeff) = self.config.load_balance_coeff {
            tch::no_grad(|| {
                let mean = counts.mean(Kind::Float);
                let delta = (mean - &*counts).sign() * coeff;
                let delta = &delta - delta.mean(Kind::Float);
                let mut bias = self.router.expert_bias.shallow_clone();
                let _ = bias.g_add_(&delta.to_kind(bias.kind()));
            });
        }
        let _ = counts.zero_();
        Ok(())
    }

    /// This layer's tensors under HF's names below `prefix` (`model.layers.L.mlp`; with
    /// expert parallelism, this rank's experts under their global numbers): the gate
    /// (`gate.weight`), the bias (`gate.e_score_correction_bias`, with load balancing), each
    /// expert's `experts.E.{gate,up,down}_proj.weight` (slices of the 3-D weights), the
    /// shared expert's `shared_experts.{gate,up,down}_proj.weight`.
    ///
    /// ```no_run
    /// # let vs = tch::nn::VarStore::new(tch::Device::Cpu);
    /// # let moe = tch_dist::nn::moe::MoE::new(&vs.root() / "moe", tch_dist::nn::moe::MoeConfig::new(16, 32, 8, 2))?;
    /// let hf = moe.hf_state_dict("model.layers.0.mlp");
    /// assert!(hf.iter().any(|(n, _)| n == "model.layers.0.mlp.experts.7.down_proj.weight"));
    /// # Ok::<(), tch_dist::nn::moe::MoeError>(())
    /// ```
    pub fn hf_state_dict(&self, prefix: &str) -> Vec<(String, Tensor)> {
        let mut out = vec![(
            format!("{prefix}.gate.weight"),
            self.router.gate.ws.shallow_clone(),
        )];
        if self.config.load_balance_coeff.is_some() {
            out.push((
                format!("{prefix}.gate.e_score_correction_bias"),
                self.router.expert_bias.shallow_clone(),
            ));
        }
        for (i, e) in self.local_experts().enumerate() {
            let ex = |w: &Tensor, name: &str| {
                (
                    format!("{prefix}.experts.{e}.{name}.weight"),
                    w.get(i as i64),
                )
            };
            out.push(ex(&self.experts.w1, "gate_proj"));
            out.push(ex(&self.experts.w3, "up_proj"));
            out.push(ex(&self.experts.w2, "down_proj"));
        }
        if let Some(s) = &self.shared_experts {
            for (w, name) in [
                (&s.w1, "gate_proj"),
                (&s.w3, "up_proj"),
                (&s.w2, "down_proj"),
            ] {
                out.push((
                    format!("{prefix}.shared_experts.{name}.weight"),
                    w.ws.shallow_clone(),
                ));
            }
        }
        out
    }

    /// Copies the tensors [`hf_state_dict`](Self::hf_state_dict) names from `tensors` (HF's
    /// per-expert 2-D weights stacked into the 3-D ones); checks every name and shape first,
    /// so that a refusal changes nothing.
    ///
    /// ```no_run
    /// # let vs = tch::nn::VarStore::new(tch::Device::Cpu);
    /// # let moe = tch_dist::nn::moe::MoE::new(&vs.root() / "moe", tch_dist::nn::moe::MoeConfig::new(16, 32, 8, 2))?;
    /// let tensors: std::collections::HashMap<String, tch::Tensor> = moe.hf_state_dict("model.layers.0.mlp")
    ///     .into_iter().map(|(n, t)| (n, t.copy())).collect();
    /// moe.load_hf_state_dict("model.layers.0.mlp", &tensors)?;
    /// # Ok::<(), tch_dist::nn::moe::MoeError>(())
    /// ```
    pub fn load_hf_state_dict(
        &self,
        prefix: &str,
        tensors: &HashMap<String, Tensor>,
    ) -> Result<(), MoeError> {
        let targets = self.hf_state_dict(prefix);
        for (name, mine) in &targets {
            let given = tensors
                .get(name)
                .ok_or_else(|| MoeError::Missing(name.clone()))?;
            if given.size() != mine.size() {
                return Err(MoeError::Shape {
                    name: name.clone(),
                    expected: mine.size(),
                    got: given.size(),
                });
            }
        }
        tch::no_grad(|| {
            for (name, mut mine) in targets {
                mine.copy_(&tensors[&name]);
            }
        });
        Ok(())
    }

    fn record_aux_loss(&self, routes: &Routes, counts: &Tensor, tokens: i64) {
        if self.config.aux_loss_alpha == 0.0 {
            return;
        }
        let (e, k) = (self.config.experts as f64, self.config.top_k as f64);
        let share = counts.to_kind(routes.scores.kind()) * (e / (k * tokens as f64));
        let normalised = &routes.scores
            / (routes
                .scores
                .sum_dim_intlist([1].as_slice(), true, routes.scores.kind())
                + 1e-20);
        let mean_score = normalised.mean_dim([0].as_slice(), false, normalised.kind());
        let loss = (share * mean_score).sum(normalised.kind()) * self.config.aux_loss_alpha;
        if let Ok(mut a) = self.aux_loss.lock() {
            *a = Some(loss);
        }
    }
}

impl Module for MoE {
    /// [`f_forward`](MoE::f_forward), panicking with its error (expert parallelism's
    /// exchanges can fail), as PyTorch's module call raises.
    fn forward(&self, x: &Tensor) -> Tensor {
        self.f_forward(x)
            .unwrap_or_else(|e| panic!("{}", crate::report(&e)))
    }
}

impl MoE {
    /// `x` `[..., dim]`: every token through its experts (on their ranks, with expert
    /// parallelism) and the shared expert.
    ///
    /// ```no_run
    /// # let vs = tch::nn::VarStore::new(tch::Device::Cpu);
    /// # let moe = tch_dist::nn::moe::MoE::new(&vs.root() / "moe", tch_dist::nn::moe::MoeConfig::new(16, 32, 8, 2))?;
    /// let y = moe.f_forward(&tch::Tensor::randn([2, 5, 16], tch::kind::FLOAT_CPU))?; // [2, 5, 16]
    /// # Ok::<(), tch_dist::nn::moe::MoeError>(())
    /// ```
    pub fn f_forward(&self, x: &Tensor) -> Result<Tensor, MoeError> {
        let shape = x.size();
        let x = x.reshape([-1, self.config.dim]);
        let tokens = x.size()[0];
        let routes = self.router.route(&x);
        // Group the (token, choice) slots by expert, stably: slot n is token n / k's.
        let slots = routes.experts.reshape([-1]);
        let (_, order) = slots.sort_stable(true, 0, false);
        let token = order.floor_divide_scalar(self.config.top_k);
        let counts = slots.bincount::<Tensor>(None, self.config.experts);
        let rows = x.index_select(0, &token);
        // A hooked call with torchtitan's two inputs: expert parallelism's hooks send the
        // rows to their experts' ranks (and the counts become this rank's experts'), and
        // fully_shard may hold the experts over the expert data-parallel ranks.
        let out = self
            .experts
            .f_call_with([&rows, &counts], |e, [rows, counts]| {
                let per_expert: Vec<i64> = (0..counts.numel() as i64)
                    .map(|e| counts.int64_value(&[e]))
                    .collect();
                e.forward_grouped(rows, &per_expert)
            })
            .map_err(MoeError::Experts)?;
        // Weighted in the scores' precision (float32 at least), then summed per token.
        let weights = routes.weights.reshape([-1]).index_select(0, &order);
        let weighted = out.to_kind(weights.kind()) * weights.unsqueeze(1);
        let routed = Tensor::zeros([tokens, self.config.dim], (weights.kind(), x.device()))
            .index_add(0, &token, &weighted)
            .to_kind(x.kind());
        let y = match &self.shared_experts {
            Some(shared) => routed + shared.forward(&x),
            None => routed,
        };
        self.record_aux_loss(&routes, &counts, tokens);
        Ok(y.reshape(shape))
    }
}
