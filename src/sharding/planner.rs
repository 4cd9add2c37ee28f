//! [`ShardingPlanner`] and [`MegatronPlanner`].

use tch_dist_core::Shardable;

use super::plan::{PlanEntry, ShardingPlan};
use super::sharder::{ColwiseLinear, RowwiseLinear};
use super::ShardError;

/// Writes a [`ShardingPlan`] for a module (PyTorch's `ShardingPlanner`).
pub trait ShardingPlanner {
    /// The plan for `module`.
    fn build_plan(&self, module: &dyn Shardable) -> Result<ShardingPlan, ShardError>;
}

/// Megatron-LM's tensor parallelism for transformer blocks, selected by module name:
/// the attention input projections and the MLP's first layer column-parallel (their local
/// output columns handed on as they are), the attention output projection and the MLP's
/// second layer row-parallel (their partial sums all-reduced).
///
/// A pattern matches a module's last FQN component (`"fc1"`), or its whole FQN when it
/// contains a `.`; `*` matches any run of characters. Only linear layers (`weight` and an
/// optional `bias`) are planned; a fused query-key-value projection (`fused_qkv`
/// patterns) is split per query, key and value. The model's forward must compute attention
/// heads from the local width (heads per rank = local width / head size), as Megatron's do.
///
/// ```
/// use tch::nn;
/// use tch_dist::sharding::{MegatronPlanner, PlanEntry, ShardingPlanner};
/// use tch_dist::Shardable;
///
/// #[derive(Debug, Shardable)]
/// struct Mlp { fc1: nn::Linear, fc2: nn::Linear }
///
/// let vs = nn::VarStore::new(tch::Device::Cpu);
/// let mlp = Mlp {
///     fc1: nn::linear(vs.root() / "fc1", 4, 8, Default::default()),
///     fc2: nn::linear(vs.root() / "fc2", 8, 4, Default::default()),
/// };
/// let plan = MegatronPlanner::default().build_plan(&mlp).unwrap();
/// let names: Vec<_> = plan.plan.iter().map(|(k, e)| match e {
///     PlanEntry::Sharder(s) => format!("{k}: {}", s.name()),
///     PlanEntry::Spec(_) => unreachable!(),
/// }).collect();
/// assert_eq!(names, ["fc1: colwise_linear", "fc2: rowwise_linear"]);
/// assert_eq!(plan.return_local_tensor, ["fc1"]);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MegatronPlanner {
    /// Column-parallel layers (query, key, value projections; MLP up-projections).
    pub colwise: Vec<String>,
    /// Column-parallel layers whose weight stacks query, key and value.
    pub fused_qkv: Vec<String>,
    /// Row-parallel layers (attention output projection; MLP down-projection).
    pub rowwise: Vec<String>,
}

impl Default for MegatronPlanner {
    fn default() -> Self {
        let s = |v: &[&str]| v.iter().map(|p| p.to_string()).collect();
        MegatronPlanner {
            colwise: s(&[
                "q_proj",
                "k_proj",
                "v_proj",
                "query",
                "key",
                "value",
                "fc1",
                "w1",
                "w3",
                "up_proj",
                "gate_proj",
                "c_fc",
            ]),
            fused_qkv: s(&["qkv", "qkv_proj", "c_attn", "in_proj"]),
            rowwise: s(&[
                "out_proj",
                "o_proj",
                "attn_out",
                "proj",
                "fc2",
                "w2",
                "down_proj",
                "c_proj",
            ]),
        }
    }
}

/// `*`-glob match of `pattern` against `text`.
fn glob(pattern: &str, text: &str) -> bool {
    let (p, t): (Vec<char>, Vec<char>) = (pattern.chars().collect(), text.chars().collect());
    let (mut pi, mut ti) = (0, 0);
    let (mut star, mut mark) = (None, 0);
    while ti < t.len() {
        if pi < p.len() && p[pi] != '*' && p[pi] == t[ti] {
            pi += 1;
            ti += 1;
        } else if pi < p.len() && p[pi] == '*' {
            star = Some(pi);
            mark = ti;
            pi += 1;
        } else if let Some(s) = star {
            pi = s + 1;
            mark += 1;
            ti = mark;
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|&c| c == '*')
}

fn matches(patterns: &[String], fqn: &str) -> bool {
    let last = fqn.rsplit('.').next().unwrap_or(fqn);
    patterns.iter().any(|p| {
        if p.contains('.') {
            glob(p, fqn)
        } else {
            glob(p, last)
        }
    })
}

fn is_linear(module: &dyn Shardable) -> bool {
    let params = module.named_parameters();
    module.named_modules().len() == 1
        && params.iter().any(|(n, t)| n == "weight" && t.dim() == 2)
        && params.iter().all(|(n, _)| n == "weight" || n == "bias")
}

impl ShardingPlanner for MegatronPlanner {
    fn build_plan(&self, module: &dyn Shardable) -> Result<ShardingPlan, ShardError> {
        let mut plan = ShardingPlan::default();
        for (fqn, m) in module.named_modules() {
            if fqn.is_empty() || !is_linear(m) {
                continue;
            }
            let entry = if matches(&self.fused_qkv, &fqn) {
                PlanEntry::Sharder(std::sync::Arc::new(ColwiseLinear { fused: 3 }))
            } else if matches(&self.colwise, &fqn) {
                PlanEntry::Sharder(std::sync::Arc::new(ColwiseLinear::default()))
            } else if matches(&self.rowwise, &fqn) {
                PlanEntry::Sharder(std::sync::Arc::new(RowwiseLinear))
            } else {
                continue;
            };
            if let PlanEntry::Sharder(s) = &entry
                && s.name().starts_with("colwise")
            {
                plan.return_local_tensor.push(fqn.clone());
            }
            plan.plan.insert(fqn, entry);
        }
        Ok(plan)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn glob_matches_like_fnmatch_star() {
        assert!(glob("fc1", "fc1"));
        assert!(!glob("fc1", "fc10"));
        assert!(glob("*.attn.*", "blocks.0.attn.q_proj"));
        assert!(glob("blocks.*.fc1", "blocks.11.fc1"));
        assert!(!glob("blocks.*.fc1", "blocks.1.fc2"));
        assert!(glob("*", ""));
        assert!(matches(&["q_proj".into()], "blocks.0.attn.q_proj"));
        assert!(!matches(&["proj".into()], "blocks.0.attn.q_proj"));
    }
}
