//! [`ShardingPlan`]: what to shard and how (PyTorch's `sharding_plan.ShardingPlan`), built
//! with typed paths or read from JSON/TOML.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use tch_dist_core::path::{ModulePath, ParamPath};
use tch_dist_core::sharding::ShardingSpec;

use super::sharder::{sharder_by_name, Sharder};

/// How one entry of [`ShardingPlan::plan`] shards its target.
#[derive(Clone)]
pub enum PlanEntry {
    /// Shard the parameter named by the key with this spec.
    Spec(ShardingSpec),
    /// Shard the whole module named by the key with this sharder.
    Sharder(Arc<dyn Sharder>),
}

impl fmt::Debug for PlanEntry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PlanEntry::Spec(s) => f.debug_tuple("Spec").field(s).finish(),
            PlanEntry::Sharder(s) => f.debug_tuple("Sharder").field(&s.name()).finish(),
        }
    }
}

impl PartialEq for PlanEntry {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (PlanEntry::Spec(a), PlanEntry::Spec(b)) => a == b,
            (PlanEntry::Sharder(a), PlanEntry::Sharder(b)) => a.name() == b.name(),
            _ => false,
        }
    }
}

/// How to shard a module across ranks (PyTorch's `ShardingPlan`):
///
/// * `plan`: parameter FQN → [`ShardingSpec`], or module FQN → [`Sharder`];
/// * `output_plan`: module FQN → the [`ShardingSpec`] its output is resharded to;
/// * `return_local_tensor`: modules whose (sharded) output is handed on as this rank's
///   local shard, to continue data-parallel.
///
/// `""` names the root module. Keys are checked against the model by
/// [`shard_module`](super::shard_module) before anything changes. Written with typed paths
/// a misspelt key does not compile:
///
/// ```
/// use tch::nn;
/// use tch_dist::sharding::{ColwiseLinear, RowwiseLinear, ShardingPlan};
/// use tch_dist::Shardable;
///
/// #[derive(Debug, Shardable)]
/// struct Mlp { fc1: nn::Linear, fc2: nn::Linear }
///
/// let plan = ShardingPlan::builder()
///     .shard_module(Mlp::path().fc1(), ColwiseLinear::default())
///     .shard_module(Mlp::path().fc2(), RowwiseLinear)
///     .build();
/// assert_eq!(plan.plan.len(), 2);
/// // The same plan as a file: sharders by name, specs as data.
/// let json = serde_json::to_string(&plan).unwrap();
/// assert_eq!(serde_json::from_str::<ShardingPlan>(&json).unwrap(), plan);
/// ```
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ShardingPlan {
    /// Parameter FQN → spec, or module FQN → sharder.
    pub plan: BTreeMap<String, PlanEntry>,
    /// Module FQN → the spec its output is resharded to.
    pub output_plan: BTreeMap<String, ShardingSpec>,
    /// Modules whose output becomes this rank's local shard.
    pub return_local_tensor: Vec<String>,
}

impl ShardingPlan {
    /// An empty plan to fill; see [`ShardingPlanBuilder`].
    pub fn builder() -> ShardingPlanBuilder {
        ShardingPlanBuilder::default()
    }
}

/// Builds a [`ShardingPlan`]. Parameter keys take `impl Into<ParamPath>` (a typed parameter
/// path or a string), module keys `impl ModulePath` (a typed module path or a string), so
/// a module where a parameter is expected, or the reverse, does not compile.
#[derive(Debug, Default)]
pub struct ShardingPlanBuilder {
    plan: ShardingPlan,
}

impl ShardingPlanBuilder {
    /// Shards the parameter `param` with `spec`.
    pub fn shard_param(
        mut self,
        param: impl Into<ParamPath>,
        spec: impl Into<ShardingSpec>,
    ) -> Self {
        self.plan
            .plan
            .insert(param.into().fqn().to_owned(), PlanEntry::Spec(spec.into()));
        self
    }

    /// Shards the module `module` with `sharder`.
    pub fn shard_module(
        mut self,
        module: impl ModulePath,
        sharder: impl Sharder + 'static,
    ) -> Self {
        self.plan.plan.insert(
            module.fqn().to_owned(),
            PlanEntry::Sharder(Arc::new(sharder)),
        );
        self
    }

    /// Reshards `module`'s output to `spec`.
    pub fn output(mut self, module: impl ModulePath, spec: impl Into<ShardingSpec>) -> Self {
        self.plan
            .output_plan
            .insert(module.fqn().to_owned(), spec.into());
        self
    }

    /// Hands `module`'s output on as this rank's local shard.
    pub fn return_local_tensor(mut self, module: impl ModulePath) -> Self {
        let fqn = module.fqn().to_owned();
        if !self.plan.return_local_tensor.contains(&fqn) {
            self.plan.return_local_tensor.push(fqn);
        }
        self
    }

    /// The plan.
    pub fn build(self) -> ShardingPlan {
        self.plan
    }
}

/// One `plan` entry in a file: `{"spec": {...}}` or `{"sharder": "colwise_linear"}`.
#[derive(Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
enum EntryFile {
    Spec(ShardingSpec),
    Sharder(String),
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct PlanFile {
    plan: BTreeMap<String, EntryFile>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    output_plan: BTreeMap<String, ShardingSpec>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    return_local_tensor: Vec<String>,
}

impl Serialize for ShardingPlan {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        PlanFile {
            plan: self
                .plan
                .iter()
                .map(|(k, e)| {
                    let e = match e {
                        PlanEntry::Spec(spec) => EntryFile::Spec(spec.clone()),
                        PlanEntry::Sharder(sh) => EntryFile::Sharder(sh.name()),
                    };
                    (k.clone(), e)
                })
                .collect(),
            output_plan: self.output_plan.clone(),
            return_local_tensor: self.return_local_tensor.clone(),
        }
        .serialize(s)
    }
}

impl<'de> Deserialize<'de> for ShardingPlan {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let file = PlanFile::deserialize(d)?;
        let mut plan = BTreeMap::new();
        for (k, e) in file.plan {
            let entry = match e {
                EntryFile::Spec(spec) => PlanEntry::Spec(spec),
                EntryFile::Sharder(name) => {
                    PlanEntry::Sharder(sharder_by_name(&name).ok_or_else(|| {
                        serde::de::Error::custom(format!(
                            "plan entry `{k}`: unknown sharder `{name}` (known: colwise_linear, \
                             colwise_linear(fused=N), rowwise_linear, colwise_embedding, \
                             rowwise_embedding, expert_parallel)"
                        ))
                    })?)
                }
            };
            plan.insert(k, entry);
        }
        Ok(ShardingPlan {
            plan,
            output_plan: file.output_plan,
            return_local_tensor: file.return_local_tensor,
        })
    }
}
