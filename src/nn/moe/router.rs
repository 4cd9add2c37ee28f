//! [`Router`]: which experts each token goes to, and with what weight (torchtitan's
//! `TokenChoiceTopKRouter`).

use std::sync::Mutex;

use tch::nn;
use tch::{Kind, Tensor};
use tch_dist_core::Shardable;

use super::{MoeConfig, ScoreFunction};

/// The gate `[experts, dim]` (HF's `mlp.gate.weight`) scoring each token against each
/// expert; the top `k` experts by score (plus the load-balancing bias, which selects but
/// does not weigh) take the token, weighted by their unbiased scores.
///
/// ```no_run
/// use tch_dist::nn::moe::{MoeConfig, Router};
/// let vs = tch::nn::VarStore::new(tch::Device::Cpu);
/// let router = Router::new(&vs.root() / "router", &MoeConfig::new(16, 32, 4, 2));
/// let x = tch::Tensor::randn([8, 16], tch::kind::FLOAT_CPU);
/// let routes = router.route(&x);
/// assert_eq!(routes.experts.size(), [8, 2]);
/// ```
#[derive(Debug, Shardable)]
#[shardable(crate = "crate")]
pub struct Router {
    /// The gate, `[experts, dim]`, no bias.
    pub gate: nn::Linear,
    #[shardable(skip)]
    pub(super) config: MoeConfig,
    /// The load-balancing bias, `[experts]` (HF's `e_score_correction_bias`): added to the
    /// scores that select experts, never to the weights.
    #[shardable(buffer)]
    pub expert_bias: Tensor,
    /// Tokens each expert took since the last bias update (under `no_grad`).
    #[shardable(skip)]
    pub(super) tokens_per_expert: Mutex<Tensor>,
}

/// Where a router sends the tokens: `[tokens, k]` experts and their weights, and the
/// scores of every expert (`[tokens, experts]`, for the auxiliary loss).
#[derive(Debug)]
pub struct Routes {
    /// The experts each token goes to, ties broken toward the lower expert.
    pub experts: Tensor,
    /// Their weights: the unbiased scores, normalised and scaled as configured.
    pub weights: Tensor,
    /// Every expert's score for every token.
    pub scores: Tensor,
}

impl Router {
    /// A router of `config.experts` experts over `config.dim` features at `path`.
    pub fn new(path: nn::Path, config: &MoeConfig) -> Router {
        let gate = nn::linear(
            &path / "gate",
            config.dim,
            config.experts,
            nn::LinearConfig {
                bias: false,
                ..Default::default()
            },
        );
        let expert_bias = path.zeros_no_train("expert_bias", &[config.experts]);
        let counts = Tensor::zeros([config.experts], (Kind::Float, path.device()));
        Router {
            gate,
            config: config.clone(),
            expert_bias,
            tokens_per_expert: Mutex::new(counts),
        }
    }

    /// The routes of `x` `[tokens, dim]`: scores in float32 (float64 for a float64 input),
    /// the top `k` experts by score plus bias, weights from the scores.
    pub fn route(&self, x: &Tensor) -> Routes {
        let kind = if x.kind() == Kind::Double {
            Kind::Double
        } else {
            Kind::Float
        };
        let logits = x.to_kind(kind).matmul(&self.gate.ws.to_kind(kind).tr());
        let scores = match self.config.score_function {
            ScoreFunction::Softmax => logits.softmax(-1, kind),
            ScoreFunction::Sigmoid => logits.sigmoid(),
        };
        let selecting = if self.config.load_balance_coeff.is_some() {
            &scores + self.expert_bias.to_kind(kind).detach()
        } else {
            scores.shallow_clone()
        };
        // A stable descending sort: equal scores keep the lower expert first, so routing is
        // the same on every rank and with or without expert parallelism (topk's tie order
        // is unspecified).
        let (_, order) = selecting.detach().sort_stable(true, -1, true);
        let experts = order.narrow(1, 0, self.config.top_k).contiguous();
        let chosen = scores.gather(1, &experts, false);
        let normalised = if self.config.route_norm {
            &chosen / (chosen.sum_dim_intlist([1].as_slice(), true, kind) + 1e-20)
        } else {
            chosen
        };
        let weights = normalised * self.config.route_scale;
        tch::no_grad(|| {
            if let Ok(mut counts) = self.tokens_per_expert.lock() {
                let taken = experts
                    .reshape([-1])
                    .bincount::<Tensor>(None, self.config.experts);
                let device = counts.device();
                *counts += taken.to_kind(Kind::Float).to_device(device);
            }
        });
        Routes {
            experts,
            weights,
            scores,
        }
    }
}
