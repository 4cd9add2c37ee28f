//! Gradients multiplied by a factor: expert parallelism's experts take the tokens of every
//! rank of their group, so each rank's gradient of its experts is a sum over the ranks'
//! losses; divided by the ranks, it is the gradient of their mean, as data parallelism over
//! the same ranks averages every other parameter's (torchtitan's gradient divide factor).
//!
//! [`GradientScale::register`] puts a hook on the parameter itself, as
//! [`GradientSum`](super::GradientSum) does: it runs when the parameter's gradient reaches
//! its accumulator, before fully_shard's gradient interceptor and before `.grad` is
//! written, and scales the gradient the engine hands it in place. Nothing is added to the
//! forward.

use std::sync::{Arc, Weak};

use tch::Tensor;

use crate::autograd::{add_output_grad_hook, Callback, Reply};
use crate::error::{DistError, Result};

/// Multiplies the gradients of the parameters it is [registered](GradientScale::register)
/// on by `factor`, for as long as it lives: the hooks hold it weakly, so dropping the last
/// `Arc` turns them into no-ops.
///
/// ```
/// use tch_dist_runtime::sharding::GradientScale;
/// let w = tch::Tensor::ones([4], tch::kind::FLOAT_CPU).set_requires_grad(true);
/// let half = GradientScale::new(0.5);
/// half.register(&w, 0)?;
/// (&w * 2.0).sum(tch::Kind::Float).backward();
/// assert_eq!(Vec::<f32>::try_from(&w.grad()).unwrap(), [1.0; 4]);
/// # Ok::<(), tch_dist_runtime::DistError>(())
/// ```
#[derive(Debug)]
pub struct GradientScale {
    factor: f64,
}

impl GradientScale {
    /// A scale by `factor`.
    pub fn new(factor: f64) -> Arc<GradientScale> {
        Arc::new(GradientScale { factor })
    }

    /// Scales every gradient of `param` (a tensor that requires grad; a parameter) before it
    /// is accumulated, while `self` lives; `rank` names this rank in a failure.
    pub fn register(self: &Arc<Self>, param: &Tensor, rank: usize) -> Result<()> {
        let ctx = Arc::new(ScaleContext {
            scale: Arc::downgrade(self),
        });
        add_output_grad_hook::<ScaleHook>(param, &ctx).map_err(|e| DistError::Collective {
            rank,
            op: "register gradient scale",
            cause: e.message,
        })
    }
}

/// The hook's context: the scale, held weakly.
struct ScaleContext {
    scale: Weak<GradientScale>,
}

struct ScaleHook;

impl Callback for ScaleHook {
    type Context = ScaleContext;
    const PANIC: &'static str = "the gradient scale of expert parallelism panicked";

    fn run(ctx: &ScaleContext, _index: usize, grad: Option<Tensor>) -> Reply {
        let (Some(scale), Some(mut grad)) = (ctx.scale.upgrade(), grad) else {
            return Ok(()); // removed, or no gradient
        };
        if !grad.defined() {
            return Ok(());
        }
        tch::no_grad(|| grad.f_mul_scalar_(scale.factor))
            .map(|_| ())
            .map_err(|e| format!("the gradient could not be scaled: {e}"))
    }
}
