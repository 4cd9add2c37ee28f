//! torchft's wire: how a quorum averages gradients when some of its members are torchft's
//! Python replica groups training with torchft's `DistributedDataParallel`.
//!
//! torchft's DDP is PyTorch's with a comm hook: each bucket's flat buffer goes through
//! `Manager.allreduce` (a SUM over the quorum's Gloo group, then a division by the
//! participants; a member that heals this step contributes zeros; a member whose step
//! failed makes no collective at all, so that the others' fail at their timeout). Its
//! buckets are never rebuilt (`find_unused_parameters=True`), so they are PyTorch's first
//! assignment: `compute_bucket_assignment_by_size` over the parameters in the module's
//! order with caps of 1 MiB then 25 MiB, reduced last bucket first. A tch-dist member
//! makes the same collectives in the same order over the same bytes.
//!
//! Nothing on that wire checks that the members train the same model: torchft sends no
//! parameter names. A tch-dist member checks what it can (every parameter of its optimizer
//! named once in [`TorchftDdp::order`]); the order itself must be the Python module's
//! `named_parameters()` order, which a `#[derive(Shardable)]` struct with the Python
//! module's fields in its order gives ([`TorchftDdp::of`]).

use tch::{Device, Tensor};
use tch_dist_core::Shardable;
use tch_dist_runtime::{ProcessGroup, ReduceOp, DEFAULT_FIRST_BUCKET_BYTES};

/// PyTorch DDP's default `bucket_cap_mb` (25), in bytes.
const DEFAULT_BUCKET_CAP_BYTES: usize = 25 * 1024 * 1024;

/// torchft's `DistributedDataParallel` wire (see [`Wire::TorchftDdp`](super::Wire)): the
/// parameters in the Python module's order, and its bucket cap.
///
/// ```
/// use tch::nn;
/// use tch_dist::Shardable;
///
/// #[derive(Debug, Shardable)]
/// struct Mlp {
///     fc1: nn::Linear,
///     fc2: nn::Linear,
/// }
/// let vs = nn::VarStore::new(tch::Device::Cpu);
/// let net = Mlp {
///     fc1: nn::linear(vs.root() / "fc1", 6, 16, Default::default()),
///     fc2: nn::linear(vs.root() / "fc2", 16, 3, Default::default()),
/// };
/// let wire = tch_dist::ft::TorchftDdp::of(&net);
/// // PyTorch's `named_parameters()` order of the same module: each Linear's weight, then bias.
/// assert_eq!(wire.order, ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]);
/// assert_eq!(wire.bucket_cap_bytes, None); // DDP's default: 1 MiB, then 25 MiB
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TorchftDdp {
    /// Every parameter's FQN, in the Python module's `named_parameters()` order.
    pub order: Vec<String>,
    /// DDP's `bucket_cap_mb` in bytes (`int(mb * 1024 * 1024)`), where the Python side gives
    /// one; `None` is DDP's default (a first bucket of 1 MiB, then 25 MiB).
    pub bucket_cap_bytes: Option<usize>,
}

impl TorchftDdp {
    /// The wire of `model`'s parameters in its walk order (the fields' order, as PyTorch's
    /// `named_parameters()` walks a module), with DDP's default buckets.
    ///
    /// ```no_run
    /// # fn demo(model: &impl tch_dist::Shardable) {
    /// let wire = tch_dist::ft::Wire::TorchftDdp(tch_dist::ft::TorchftDdp::of(model));
    /// # }
    /// ```
    pub fn of<M: Shardable + ?Sized>(model: &M) -> TorchftDdp {
        TorchftDdp {
            order: model
                .named_parameters()
                .into_iter()
                .map(|(fqn, _)| fqn)
                .collect(),
            bucket_cap_bytes: None,
        }
    }

    /// DDP's `bucket_size_limits` for torchft's DDP (`find_unused_parameters=True`).
    fn limits(&self) -> Vec<usize> {
        match self.bucket_cap_bytes {
            None => vec![DEFAULT_FIRST_BUCKET_BYTES, DEFAULT_BUCKET_CAP_BYTES],
            Some(cap) => vec![cap.max(1)],
        }
    }

    /// `params` (the optimizer's, any order) in this wire's order; an error names the
    /// first FQN that is missing from the order, unknown, or given twice.
    pub(super) fn arrange(&self, params: &[(String, Tensor)]) -> Result<Vec<Tensor>, String> {
        let by_name: std::collections::HashMap<&str, &Tensor> =
            params.iter().map(|(n, t)| (n.as_str(), t)).collect();
        let mut seen = std::collections::HashSet::with_capacity(self.order.len());
        let mut arranged = Vec::with_capacity(self.order.len());
        for fqn in &self.order {
            if !seen.insert(fqn.as_str()) {
                return Err(format!(
                    "`{fqn}` is named twice in the torchft wire's order"
                ));
            }
            let Some(p) = by_name.get(fqn.as_str()) else {
                return Err(format!(
                    "`{fqn}` of the torchft wire's order is no parameter of the optimizer"
                ));
            };
            arranged.push(p.shallow_clone());
        }
        if let Some((fqn, _)) = params
            .iter()
            .find(|(name, _)| !seen.contains(name.as_str()))
        {
            return Err(format!(
                "the optimizer's parameter `{fqn}` is missing from the torchft wire's order"
            ));
        }
        Ok(arranged)
    }

    /// The buckets in the order DDP reduces them, each its members' indices into the
    /// arranged parameters, ascending.
    fn buckets(&self, arranged: &[Tensor]) -> Vec<Vec<usize>> {
        let mut buckets =
            tch_dist_runtime::compute_bucket_assignment_by_size(arranged, &self.limits());
        buckets.reverse();
        buckets
    }
}

/// What one member's step puts on torchft's wire.
pub(super) enum Contribution {
    /// Its gradients (it was at the highest step and did not fail).
    Gradients,
    /// Zeros (it heals this step: torchft's `is_participating()` is false).
    Zeros,
}

/// The average on torchft's wire: each bucket of `arranged` flattened (a missing gradient as
/// zeros), all-reduced with SUM over `pg` in DDP's order, divided by `participants`, and
/// written back to the gradients (a missing one set). A collective that fails is returned;
/// the gradients are then no average.
pub(super) fn average(
    pg: &ProcessGroup,
    wire: &TorchftDdp,
    arranged: &[Tensor],
    contribution: Contribution,
    participants: i64,
    rank: usize,
) -> Result<(), String> {
    let buckets = wire.buckets(arranged);
    let flats: Vec<Tensor> = tch::no_grad(|| {
        buckets
            .iter()
            .map(|members| {
                let kind = arranged[members[0]].kind();
                let parts: Vec<Tensor> = members
                    .iter()
                    .map(|&i| {
                        let p = &arranged[i];
                        let g = p.grad();
                        match contribution {
                            Contribution::Gradients if g.defined() => {
                                g.to_device(Device::Cpu).to_kind(kind).reshape([-1])
                            }
                            _ => Tensor::zeros([p.numel() as i64], (kind, Device::Cpu)),
                        }
                    })
                    .collect();
                Tensor::cat(&parts, 0)
            })
            .collect()
    });
    // Launched in DDP's order (each Gloo collective takes the next tag: the members' calls
    // must pair one for one), every launched one waited for whatever failed.
    let mut launched = Vec::with_capacity(flats.len());
    let mut failure = None;
    for flat in &flats {
        match pg.all_reduce_async(flat, ReduceOp::Sum) {
            Ok(work) => launched.push(work),
            Err(e) => {
                failure = Some(e.to_string());
                break;
            }
        }
    }
    for work in launched {
        if let Err(e) = work.wait() {
            failure.get_or_insert(e.to_string());
        }
    }
    if let Some(e) = failure {
        return Err(e);
    }
    let divisor = participants.max(1) as f64;
    for (members, flat) in buckets.iter().zip(&flats) {
        let _ = flat.shallow_clone().g_div_scalar_(divisor);
        let mut offset = 0i64;
        for &i in members {
            let p = &arranged[i];
            let n = p.numel() as i64;
            let average = flat.narrow(0, offset, n).view_as(p);
            offset += n;
            let mut g = p.grad();
            if g.defined() {
                tch::no_grad(|| g.copy_(&average));
            } else {
                let average = average.to_device(p.device()).to_kind(p.kind());
                tch_dist_runtime::set_grad_for(p, Some(&average), rank, "fault tolerance")
                    .map_err(|e| format!("setting an averaged gradient: {e}"))?;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Kind;

    fn floats(n: i64) -> (String, Tensor) {
        (
            format!("p{n}"),
            Tensor::zeros([n], (Kind::Float, Device::Cpu)),
        )
    }

    #[test]
    fn ddp_reduces_the_last_parameters_bucket_first_members_ascending() {
        // 1 MiB is 262144 floats: p1 and p2 fill the first bucket, p3 opens the next.
        let params = [floats(200_000), floats(100_000), floats(5), floats(7)];
        let wire = TorchftDdp {
            order: ["p200000", "p100000", "p5", "p7"]
                .map(String::from)
                .to_vec(),
            bucket_cap_bytes: None,
        };
        let arranged = wire.arrange(&params).unwrap();
        assert_eq!(wire.buckets(&arranged), [vec![2, 3], vec![0, 1]]);
        // A cap of its own: every bucket closes at 32 bytes.
        let capped = TorchftDdp {
            bucket_cap_bytes: Some(32),
            ..wire
        };
        assert_eq!(capped.buckets(&arranged), [vec![2, 3], vec![1], vec![0]]);
    }

    #[test]
    fn an_order_that_misses_repeats_or_invents_a_parameter_is_named() {
        let params = [floats(2), floats(3)];
        let with = |order: &[&str]| TorchftDdp {
            order: order.iter().map(|s| s.to_string()).collect(),
            bucket_cap_bytes: None,
        };
        let err = |order: &[&str]| with(order).arrange(&params).err().unwrap();
        assert_eq!(
            err(&["p2"]),
            "the optimizer's parameter `p3` is missing from the torchft wire's order"
        );
        assert_eq!(
            err(&["p2", "p3", "p2"]),
            "`p2` is named twice in the torchft wire's order"
        );
        assert_eq!(
            err(&["p2", "p9", "p3"]),
            "`p9` of the torchft wire's order is no parameter of the optimizer"
        );
        let arranged = with(&["p3", "p2"]).arrange(&params).unwrap();
        assert_eq!(arranged[0].numel(), 3);
    }
}
