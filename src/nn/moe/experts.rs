//! [`GroupedExperts`]: the routed experts' SwiGLU feed-forwards as 3-D weights, run on the
//! tokens grouped by expert (torchtitan's `GroupedExperts`), and [`FeedForward`], the shared
//! expert.

use tch::nn::{self, Module};
use tch::Tensor;
use tch_dist_core::Shardable;

use super::MoeError;

/// `experts` SwiGLU feed-forwards held as 3-D weights (torchtitan's layout, each expert's
/// slice in HF's `[out, in]` order): `w1` and `w3` `[experts, hidden, dim]` (HF's
/// `gate_proj`, `up_proj`), `w2` `[experts, dim, hidden]` (`down_proj`).
///
/// ```no_run
/// use tch_dist::nn::moe::GroupedExperts;
/// let vs = tch::nn::VarStore::new(tch::Device::Cpu);
/// let experts = GroupedExperts::new(&vs.root() / "experts", 4, 16, 32);
/// // 5 rows already grouped by expert: 2 for expert 0, 3 for expert 3.
/// let x = tch::Tensor::randn([5, 16], tch::kind::FLOAT_CPU);
/// let y = experts.forward_grouped(&x, &[2, 0, 0, 3]);
/// assert_eq!(y.size(), [5, 16]);
/// ```
#[derive(Debug, Shardable)]
#[shardable(crate = "crate")]
pub struct GroupedExperts {
    /// `[experts, hidden, dim]`: each expert's gate projection.
    #[shardable(param)]
    pub w1: Tensor,
    /// `[experts, dim, hidden]`: each expert's down projection.
    #[shardable(param)]
    pub w2: Tensor,
    /// `[experts, hidden, dim]`: each expert's up projection.
    #[shardable(param)]
    pub w3: Tensor,
}

impl GroupedExperts {
    /// `experts` experts of `dim` -> `hidden` -> `dim` at `path`, initialised as torchtitan
    /// does (normal, std 0.02).
    pub fn new(path: nn::Path, experts: i64, dim: i64, hidden: i64) -> GroupedExperts {
        let init = nn::Init::Randn {
            mean: 0.0,
            stdev: 0.02,
        };
        GroupedExperts {
            w1: path.var("w1", &[experts, hidden, dim], init),
            w2: path.var("w2", &[experts, dim, hidden], init),
            w3: path.var("w3", &[experts, hidden, dim], init),
        }
    }

    /// [`f_forward_grouped`](Self::f_forward_grouped), panicking with its error.
    pub fn forward_grouped(&self, x: &Tensor, counts: &[i64]) -> Tensor {
        self.f_forward_grouped(x, counts)
            .unwrap_or_else(|e| panic!("{}", crate::report(&e)))
    }

    /// Runs `x` `[rows, dim]`, whose first `counts[0]` rows go to expert 0, the next
    /// `counts[1]` to expert 1 and so on, through their experts (a loop of matrix products
    /// over the non-empty groups: `_grouped_mm` without its CUDA kernel). Empty groups are
    /// fine. `counts` must hold one count per expert this module holds, adding up to the
    /// rows: anything else is refused (expert-parallel experts called without their hooks
    /// get the layer's global counts, and would otherwise compute with the wrong experts).
    ///
    /// ```no_run
    /// use tch_dist::nn::moe::GroupedExperts;
    /// let vs = tch::nn::VarStore::new(tch::Device::Cpu);
    /// let experts = GroupedExperts::new(&vs.root() / "experts", 4, 16, 32);
    /// let x = tch::Tensor::randn([5, 16], tch::kind::FLOAT_CPU);
    /// assert!(experts.f_forward_grouped(&x, &[2, 3]).is_err()); // 2 counts for 4 experts
    /// ```
    pub fn f_forward_grouped(&self, x: &Tensor, counts: &[i64]) -> Result<Tensor, MoeError> {
        let held = self.w1.size().first().copied().unwrap_or(0);
        let rows = x.size().first().copied().unwrap_or(0);
        let sum: i64 = counts.iter().sum();
        if counts.len() as i64 != held || sum != rows || counts.iter().any(|&c| c < 0) {
            return Err(MoeError::Config(format!(
                "grouped experts holding {held} experts got {} counts adding up to {sum} for \
                 {rows} rows",
                counts.len()
            )));
        }
        let mut outs = Vec::with_capacity(counts.len());
        let mut start = 0;
        for (e, &n) in counts.iter().enumerate() {
            if n == 0 {
                continue;
            }
            let rows = x.narrow(0, start, n);
            let (w1, w2, w3) = (
                self.w1.get(e as i64),
                self.w2.get(e as i64),
                self.w3.get(e as i64),
            );
            let h = rows.matmul(&w1.tr()).silu() * rows.matmul(&w3.tr());
            outs.push(h.matmul(&w2.tr()));
            start += n;
        }
        if outs.is_empty() {
            return Ok(x.zeros_like());
        }
        Ok(Tensor::cat(&outs, 0))
    }
}

/// A SwiGLU feed-forward (`w2(silu(w1 x) * w3 x)`, no biases): the shared expert every
/// token goes through (HF's `shared_experts.{gate,down,up}_proj`).
///
/// ```no_run
/// use tch::nn::Module;
/// let vs = tch::nn::VarStore::new(tch::Device::Cpu);
/// let ffn = tch_dist::nn::moe::FeedForward::new(&vs.root() / "shared", 16, 32);
/// let y = ffn.forward(&tch::Tensor::randn([5, 16], tch::kind::FLOAT_CPU));
/// ```
#[derive(Debug, Shardable)]
#[shardable(crate = "crate")]
pub struct FeedForward {
    /// The gate projection `[hidden, dim]`.
    pub w1: nn::Linear,
    /// The down projection `[dim, hidden]`.
    pub w2: nn::Linear,
    /// The up projection `[hidden, dim]`.
    pub w3: nn::Linear,
}

impl FeedForward {
    /// `dim` -> `hidden` -> `dim` at `path`.
    pub fn new(path: nn::Path, dim: i64, hidden: i64) -> FeedForward {
        let no_bias = nn::LinearConfig {
            bias: false,
            ..Default::default()
        };
        FeedForward {
            w1: nn::linear(&path / "w1", dim, hidden, no_bias),
            w2: nn::linear(&path / "w2", hidden, dim, no_bias),
            w3: nn::linear(&path / "w3", dim, hidden, no_bias),
        }
    }
}

impl Module for FeedForward {
    fn forward(&self, x: &Tensor) -> Tensor {
        self.w2
            .forward(&(self.w1.forward(x).silu() * self.w3.forward(x)))
    }
}
