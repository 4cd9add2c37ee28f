//! Gradients summed over the ranks: sequence parallelism's replicated parameters (a norm's
//! weight and bias) see only this rank's chunk of the sequence, so each rank's gradient is a
//! partial sum, and the whole gradient is their sum over the tensor-parallel group
//! (PyTorch: the `Partial` gradient of a `Replicate` DTensor parameter).
//!
//! [`GradientSum::register`] puts a hook on the parameter itself (libtorch's
//! `Tensor::register_hook` on a leaf): it runs when the parameter's gradient reaches its
//! accumulator, before the accumulator's own pre-hooks (fully_shard's gradient interceptor,
//! the use guards' check) and before `.grad` is written, so whatever takes the gradient next
//! takes the sum. The sum is made in place in the gradient the engine hands the hook (a
//! norm's backward makes it fresh for the parameter), on a contiguous copy when it is not
//! contiguous.

use std::sync::{Arc, Weak};

use tch::Tensor;

use crate::autograd::{add_output_grad_hook, Callback, Reply};
use crate::c10d::collectives::ReduceOp;
use crate::c10d::group::ProcessGroup;
use crate::c10d::step_check::passes::{self, Api};
use crate::error::{CollectiveSignature, DistError, Result};

/// Sums the gradients of the parameters it is [registered](GradientSum::register) on over a
/// group, for as long as it lives: the hooks hold it weakly, so dropping the last `Arc` turns
/// them into no-ops (libtorch keeps a leaf's hooks with the tensor).
///
/// ```no_run
/// # let pg = tch_dist_runtime::default_group()?;
/// use tch_dist_runtime::sharding::GradientSum;
/// let w = tch::Tensor::ones([4], tch::kind::FLOAT_CPU).set_requires_grad(true);
/// let sum = GradientSum::new(pg, |e| format!("norm.weight: {e}"));
/// sum.register(&w)?;
/// (&w * 2.0).sum(tch::Kind::Float).backward(); // w.grad() is 2 * world_size everywhere
/// drop(sum); // from here on, w's gradients are this rank's own again
/// # Ok::<(), tch_dist_runtime::DistError>(())
/// ```
pub struct GradientSum {
    group: ProcessGroup,
    failure: Box<dyn Fn(&DistError) -> String + Send + Sync>,
}

impl std::fmt::Debug for GradientSum {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GradientSum")
            .field("rank", &self.group.rank())
            .field("world_size", &self.group.world_size())
            .finish()
    }
}

impl GradientSum {
    /// A sum over `group`; a failed sum fails the backward pass with `failure(error)` (which
    /// should name the API and the parameter; the [`DistError`] names the rank).
    pub fn new(
        group: ProcessGroup,
        failure: impl Fn(&DistError) -> String + Send + Sync + 'static,
    ) -> Arc<GradientSum> {
        Arc::new(GradientSum {
            group,
            failure: Box::new(failure),
        })
    }

    /// Sums every gradient of `param` (a tensor that requires grad; a parameter) over the
    /// group before it is accumulated, while `self` lives. Every rank must register the
    /// same parameters, and each backward pass must reach them on every rank (the sum is a
    /// collective).
    pub fn register(self: &Arc<Self>, param: &Tensor) -> Result<()> {
        let ctx = Arc::new(SumContext {
            sum: Arc::downgrade(self),
        });
        add_output_grad_hook::<SumHook>(param, &ctx).map_err(|e| DistError::Collective {
            rank: self.group.rank(),
            op: "register gradient sum",
            cause: e.message,
        })
    }

    /// Sums `grad` over the group, in place, after the step check (a backward collective of
    /// tensor parallelism's).
    fn sum(&self, grad: &Tensor) -> Result<()> {
        let signature = CollectiveSignature::new(
            "all_reduce (sequence-parallel gradient)",
            grad.size(),
            grad.kind(),
        );
        passes::before_collective(&self.group, Api::TensorParallel, Some(signature))?;
        if grad.is_contiguous() {
            return self.group.all_reduce(grad, ReduceOp::Sum);
        }
        let dense = grad.contiguous();
        self.group.all_reduce(&dense, ReduceOp::Sum)?;
        let mut target = grad.shallow_clone();
        target.f_copy_(&dense).map_err(|e| DistError::Collective {
            rank: self.group.rank(),
            op: "gradient sum",
            cause: format!("the summed gradient cannot be written back: {e}"),
        })
    }
}

/// The hook's context: the sum, held weakly.
struct SumContext {
    sum: Weak<GradientSum>,
}

struct SumHook;

impl Callback for SumHook {
    type Context = SumContext;
    const PANIC: &'static str = "the gradient sum over the tensor-parallel group panicked";

    fn run(ctx: &SumContext, _index: usize, grad: Option<Tensor>) -> Reply {
        let (Some(sum), Some(grad)) = (ctx.sum.upgrade(), grad) else {
            return Ok(()); // removed, or no gradient
        };
        if !grad.defined() {
            return Ok(());
        }
        tch::no_grad(|| sum.sum(&grad)).map_err(|e| (sum.failure)(&e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::autograd::Interceptor;
    use std::sync::Mutex;
    use tch::{Device, Kind};

    /// Records the gradients an interceptor is handed.
    struct Record;

    impl Callback for Record {
        type Context = Mutex<Vec<Tensor>>;
        const PANIC: &'static str = "record";

        fn run(ctx: &Self::Context, _index: usize, grad: Option<Tensor>) -> Reply {
            if let Some(g) = grad {
                ctx.lock().unwrap().push(g.copy());
            }
            Ok(())
        }
    }

    /// The leaf's hook runs before an accumulator pre-hook (fully_shard's interceptor), also
    /// one registered before it, and sees the gradient first: what it writes in place is
    /// what the interceptor gets. (A doubling stands in for the sum, which needs ranks.)
    #[test]
    fn a_leaf_hook_runs_before_the_accumulator_pre_hooks() {
        struct Double;
        impl Callback for Double {
            type Context = ();
            const PANIC: &'static str = "double";
            fn run(_: &(), _index: usize, grad: Option<Tensor>) -> Reply {
                if let Some(g) = grad {
                    let _ = tch::no_grad(|| g.shallow_clone().f_mul_scalar_(2.0));
                }
                Ok(())
            }
        }
        let w = Tensor::ones([3], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let seen = Arc::new(Mutex::new(Vec::new()));
        let _interceptor = Interceptor::add::<Record>(&w, &seen, 0).unwrap();
        add_output_grad_hook::<Double>(&w, &Arc::new(())).unwrap();
        (&w * 3.0).sum(Kind::Float).backward();
        let seen = seen.lock().unwrap();
        assert_eq!(seen.len(), 1);
        assert_eq!(Vec::<f64>::try_from(&seen[0]).unwrap(), [6.0, 6.0, 6.0]);
        assert!(!w.grad().defined(), "the interceptor took the gradient");
    }
}
