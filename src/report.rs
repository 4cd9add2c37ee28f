//! [`report`]: an error's composed message, its own text and then each cause's.
//!
//! tch-dist's errors follow one rule (rustls's, anyhow's and eyre's): a variant's Display
//! names only its own context (the rank, the API, the module), and an error of another layer
//! inside it (the [`DistError`](crate::DistError) under a [`ShardError`](crate::sharding::ShardError),
//! the sharding spec's error under a plan entry) is reached through
//! [`source()`](std::error::Error::source), never printed twice. `report` puts the chain back
//! together; anyhow's and eyre's `{:#}` print the same text.

/// The composed message of `error`: its Display and each [`source`](std::error::Error::source)'s,
/// joined with `": "`.
///
/// ```
/// use tch_dist::sharding::{PlanProblem, ShardProblem};
/// let e = ShardProblem::Plan { fqn: "fc3.weight".into(), problem: PlanProblem::NotAParameter }.on(1);
/// assert_eq!(e.to_string(), "rank 1: shard_module: `fc3.weight`");
/// assert_eq!(tch_dist::report(&e), "rank 1: shard_module: `fc3.weight`: is not a parameter of the model");
/// ```
pub fn report(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut cause = error.source();
    while let Some(e) = cause {
        text.push_str(": ");
        text.push_str(&e.to_string());
        cause = e.source();
    }
    text
}
