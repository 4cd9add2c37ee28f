//! [`loss_parallel`]: cross-entropy over the logits of a column-parallel head, each rank
//! holding its slice of the classes (PyTorch's `loss_parallel()` context with
//! `F.cross_entropy`; torchtitan's loss under tensor parallelism).
//!
//! A language model's head is its largest activation: `[tokens, vocabulary]`. Column-parallel
//! with a local output, each rank holds `[tokens, vocabulary / tp]`, and the loss is computed
//! from those slices without gathering them:
//!
//! 1. one small all-reduce agrees on the layout: each rank's class count (its offset is the sum
//!    of the counts before it), row count, a checksum of its targets, whether it refused its
//!    input and the length of its class weights, so that a rank whose input is wrong makes
//!    every rank fail instead of reading garbage or waiting;
//! 2. the rows' maxima, all-reduced (MAX), shift the logits for a stable exponential;
//! 3. the shifted logits' sums of exponentials and the target classes' shifted logits (the
//!    rank holding a row's target class contributes it, the others zero) are summed over the
//!    ranks in one all-reduce;
//! 4. each row's loss is `ln(Σ exp) − target logit`, reduced as `F.cross_entropy` reduces it.
//!
//! Steps 2 to 4 are one custom autograd function of this rank's slice (`apply_function`),
//! which keeps one tensor of the slice's size and nothing beside it: the slice's gradient per
//! unit of the loss's, its slice of `(softmax − one_hot) · weight / divisor`, computed in the
//! forward from what this rank holds (PyTorch's keeps the slice's log-softmax). The loss
//! thus keeps `1 / tp` of what the gathered head's `cross_entropy` keeps, and the logits
//! themselves are not kept; its backward needs no collective.

use tch::{Kind, Reduction, Tensor};
use tch_dist_runtime::{
    apply_function, AutogradError, Backward, DistError, ProcessGroup, ReduceOp, Refusal,
};

use crate::OnRank;

/// `F.cross_entropy`'s arguments besides the input and the target, as [`loss_parallel`]
/// takes them (PyTorch's defaults: the mean over the rows whose target is not
/// `ignore_index`, -100, without class weights).
///
/// ```
/// use tch_dist::sharding::LossParallelOptions;
/// let opts = LossParallelOptions { reduction: tch::Reduction::Sum, ..Default::default() };
/// assert_eq!(opts.ignore_index, -100);
/// ```
#[derive(Debug)]
pub struct LossParallelOptions {
    /// `reduction`: `Mean` (the default: weighted by the class weights, over the rows not
    /// ignored), `Sum`, or `None` (one loss per row, 0 for an ignored row).
    pub reduction: Reduction,
    /// `ignore_index`: rows whose target is this value add nothing to the loss.
    pub ignore_index: i64,
    /// `weight`: one weight per class of the whole vocabulary, the same on every rank
    /// (PyTorch: replicated).
    pub weight: Option<Tensor>,
}

impl Default for LossParallelOptions {
    fn default() -> Self {
        LossParallelOptions {
            reduction: Reduction::Mean,
            ignore_index: -100,
            weight: None,
        }
    }
}

/// Why [`loss_parallel`] refused; every rank refuses together (the ranks compare their
/// inputs before they compute anything), and nothing is changed.
///
/// ```
/// use tch_dist::sharding::LossProblem;
/// let e = LossProblem::TargetsDiffer.on(1);
/// assert_eq!(
///     e.to_string(),
///     "rank 1: loss_parallel: the ranks' targets differ: every rank must pass the same targets"
/// );
/// ```
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum LossProblem {
    /// The logits are not `[rows, this rank's classes]` or the targets not `[rows]` of
    /// integers.
    #[error(
        "loss_parallel: expects logits [rows, this rank's classes] and integer targets [rows], \
         got logits {logits:?} and {kind:?} targets {targets:?}"
    )]
    Shapes {
        /// The logits' shape.
        logits: Vec<i64>,
        /// The targets' shape.
        targets: Vec<i64>,
        /// The targets' kind.
        kind: Kind,
    },
    /// A reduction `F.cross_entropy` does not have.
    #[error("loss_parallel: reduction {0:?} is not one of Mean, Sum or None")]
    Reduction(Reduction),
    /// Another rank refused its input (its own error says why).
    #[error("loss_parallel: rank {peer} refused its input")]
    PeerRefused {
        /// The lowest such rank.
        peer: usize,
    },
    /// The ranks' row counts differ.
    #[error("loss_parallel: the ranks' logits have different row counts: {0:?}")]
    RowsDiffer(Vec<i64>),
    /// The ranks' targets differ (PyTorch assumes them replicated, and a rank's own target
    /// would pick another rank's class).
    #[error("loss_parallel: the ranks' targets differ: every rank must pass the same targets")]
    TargetsDiffer,
    /// A target is neither `ignore_index` nor a class of the vocabulary.
    #[error("loss_parallel: target {target} of row {row} is out of bounds: {classes} classes")]
    TargetOutOfBounds {
        /// The row.
        row: i64,
        /// Its target.
        target: i64,
        /// The classes of all ranks together.
        classes: i64,
    },
    /// The class weights are not one per class of the whole vocabulary on every rank.
    #[error(
        "loss_parallel: the class weights must be [{classes}] on every rank; the ranks' \
         lengths: {lengths:?} (None: no weights)"
    )]
    Weight {
        /// The classes of all ranks together.
        classes: i64,
        /// Each rank's weight length (`None`: no weights; -1: not 1-D).
        lengths: Vec<Option<i64>>,
    },
}

impl LossProblem {
    /// This problem on `rank`.
    pub fn on(self, rank: usize) -> OnRank<LossProblem> {
        OnRank::new(rank, self)
    }
}

/// The errors of [`loss_parallel`]: a refusal on this rank (every rank refuses together), or
/// a failed collective.
///
/// ```
/// use tch_dist::sharding::{LossParallelError, LossProblem};
/// let e: LossParallelError = LossProblem::RowsDiffer(vec![4, 3]).on(0).into();
/// assert_eq!(e.to_string(), "rank 0: loss_parallel: the ranks' logits have different row counts: [4, 3]");
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LossParallelError {
    /// This rank's refusal.
    #[error(transparent)]
    OnRank(#[from] OnRank<LossProblem>),
    /// A collective failed (the [`DistError`] names the rank and the operation).
    #[error("loss_parallel")]
    Collective(#[source] DistError),
    /// The autograd engine failed the loss's function.
    #[error("loss_parallel")]
    Engine(#[from] AutogradError),
}

impl From<DistError> for LossParallelError {
    fn from(e: DistError) -> Self {
        LossParallelError::Collective(e)
    }
}

/// What every rank passed, as `ProcessGroup::exchange_values` gathers it before anything is
/// computed (a rank that refused its own input is named to the others there): per rank, its
/// class count, row count, class weights' length and targets' checksum.
struct Layout {
    classes: Vec<i64>,
    rows: Vec<i64>,
    weight_lengths: Vec<Option<i64>>,
    checksums: Vec<i64>,
}

impl Layout {
    /// Exchanges this rank's `refusal`, or its layout, with every rank of `group`.
    fn exchange(
        group: &ProcessGroup,
        refusal: Option<LossProblem>,
        logits: &Tensor,
        targets: &Tensor,
        weight: Option<&Tensor>,
    ) -> Result<Layout, LossParallelError> {
        let rank = group.rank();
        // The weights' length + 1; 0: none; -1: not 1-D (which matches no vocabulary).
        let weight = match weight {
            None => 0,
            Some(w) if w.dim() == 1 => w.size()[0] + 1,
            Some(_) => -1,
        };
        let values = match refusal {
            Some(_) => [0; 4],
            None => [
                logits.size()[1],
                logits.size()[0],
                weight,
                checksum(targets),
            ],
        };
        let every_rank = group
            .exchange_values("loss_parallel", refusal, &values)
            .map_err(|refusal| -> LossParallelError {
                match refusal {
                    Refusal::Own(problem) => problem.on(rank).into(),
                    Refusal::Peer { rank: peer } => {
                        LossProblem::PeerRefused { peer }.on(rank).into()
                    }
                    Refusal::Exchange(source) => LossParallelError::Collective(*source),
                    // exchange_values compares nothing, so it never refuses for a difference.
                    Refusal::Differs { setting, .. } => {
                        LossParallelError::Collective(DistError::Internal {
                            rank,
                            op: "loss_parallel",
                            what: setting,
                        })
                    }
                }
            })?;
        let field = |i: usize| every_rank.iter().map(|v| v[i]).collect::<Vec<i64>>();
        Ok(Layout {
            classes: field(0),
            rows: field(1),
            weight_lengths: field(2)
                .into_iter()
                .map(|l| (l != 0).then_some(if l < 0 { -1 } else { l - 1 }))
                .collect(),
            checksums: field(3),
        })
    }
}

/// A checksum of the targets that equal targets give on every rank; differing targets give
/// another value but for a collision.
fn checksum(targets: &Tensor) -> i64 {
    let n = targets.size()[0];
    let position = Tensor::arange(n, (Kind::Int64, targets.device())).remainder(1021) + 1;
    let t = targets.to_kind(Kind::Int64).remainder(65521) + 1;
    (t * position).sum(Kind::Int64).int64_value(&[])
}

/// Cross-entropy of logits split by class across `group`'s ranks, each passing its slice
/// `[rows, its classes]` (a column-parallel head's local output: torch.chunk's slices of the
/// vocabulary, in rank order, uneven and empty slices allowed) and the same integer targets
/// `[rows]`. Returns what `F.cross_entropy` returns on the whole logits, on every rank, with
/// its gradient flowing back into each rank's slice (PyTorch's `loss_parallel()`).
///
/// The full logits are never built: forward runs three all-reduces (the layout, the rows'
/// maxima, and the sums of exponentials with the target logits), backward none. Every rank
/// must call it, in the same order; a rank's bad input (shapes, its targets, the class
/// weights, a target out of bounds) is an error on every rank. Second derivatives are not
/// supported.
///
/// ```no_run
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # let pg = tch_dist::init_process_group(tch_dist::Backend::Gloo)?;
/// use tch_dist::sharding::{loss_parallel, LossParallelOptions};
/// // 2 ranks, a vocabulary of 7: rank 0 holds classes 0..4, rank 1 classes 4..7.
/// let classes = if pg.rank() == 0 { 4 } else { 3 };
/// let local = tch::Tensor::randn([5, classes], tch::kind::FLOAT_CPU).set_requires_grad(true);
/// let targets = tch::Tensor::from_slice(&[0i64, 6, 3, -100, 4]); // the same on every rank
/// let loss = loss_parallel(&local, &targets, &pg, &LossParallelOptions::default())?;
/// loss.backward(); // local.grad(): this rank's columns of softmax - one_hot, over 4 rows
/// # Ok(()) }
/// ```
pub fn loss_parallel(
    local_logits: &Tensor,
    targets: &Tensor,
    group: &ProcessGroup,
    opts: &LossParallelOptions,
) -> Result<Tensor, LossParallelError> {
    let rank = group.rank();
    let shapes_ok = local_logits.dim() == 2
        && targets.dim() == 1
        && local_logits.size()[0] == targets.size()[0]
        && matches!(
            targets.kind(),
            Kind::Int64 | Kind::Int | Kind::Int16 | Kind::Int8 | Kind::Uint8
        );
    let refusal = if !shapes_ok {
        Some(LossProblem::Shapes {
            logits: local_logits.size(),
            targets: targets.size(),
            kind: targets.kind(),
        })
    } else if !matches!(
        opts.reduction,
        Reduction::Mean | Reduction::Sum | Reduction::None
    ) {
        Some(LossProblem::Reduction(opts.reduction))
    } else {
        None
    };
    // 1. The layout, and every rank's verdict on its own input, before anything else.
    let agreed = Layout::exchange(group, refusal, local_logits, targets, opts.weight.as_ref())?;
    if agreed.rows.iter().any(|&r| r != agreed.rows[0]) {
        return Err(LossProblem::RowsDiffer(agreed.rows).on(rank).into());
    }
    if agreed.checksums.iter().any(|&c| c != agreed.checksums[0]) {
        return Err(LossProblem::TargetsDiffer.on(rank).into());
    }
    let classes: i64 = agreed.classes.iter().sum();
    if agreed
        .weight_lengths
        .iter()
        .any(|&l| l.is_some_and(|l| l != classes))
        || agreed
            .weight_lengths
            .iter()
            .any(|l| l.is_some() != agreed.weight_lengths[0].is_some())
    {
        return Err(LossProblem::Weight {
            classes,
            lengths: agreed.weight_lengths,
        }
        .on(rank)
        .into());
    }
    // The targets are the same on every rank now, so each finds the same bad one.
    let targets = targets.to_kind(Kind::Int64);
    let kept = targets.ne(opts.ignore_index);
    let out_of_bounds = kept.logical_and(&targets.lt(0).logical_or(&targets.ge(classes)));
    if let Some(row) = Vec::<i64>::try_from(out_of_bounds.nonzero().view([-1]))
        .ok()
        .and_then(|r| r.first().copied())
    {
        let target = targets.int64_value(&[row]);
        return Err(LossProblem::TargetOutOfBounds {
            row,
            target,
            classes,
        }
        .on(rank)
        .into());
    }
    let offset: i64 = agreed.classes[..rank].iter().sum();
    let width = agreed.classes[rank];
    // Each row's weight in the reduced loss, as F.cross_entropy weighs it (0 for an ignored
    // row), and what the reduction divides by.
    let rows = agreed.rows[0];
    let (kind, device) = (local_logits.kind(), local_logits.device());
    let row_weight = match &opts.weight {
        Some(w) => w
            .to_kind(kind)
            .index_select(0, &targets.where_self(&kept, &targets.zeros_like())),
        None => Tensor::ones([rows], (kind, device)),
    }
    .where_self(&kept, &Tensor::zeros([rows], (kind, device)));
    let divisor = match opts.reduction {
        Reduction::Sum | Reduction::None => None,
        _ => Some(row_weight.sum(kind)),
    };
    // 2-4, a custom autograd function of this rank's slice: it keeps one tensor of the
    // slice's size (the slice's gradient per unit of the loss's), and its backward needs no
    // collective.
    let local_index = &targets - offset;
    let here = kept
        .logical_and(&local_index.ge(0))
        .logical_and(&local_index.lt(width));
    let row_loss = RowLoss {
        group: group.clone(),
        width,
        rows,
        local_index: local_index.clamp(0, (width - 1).max(0)),
        here,
        row_weight,
        divisor,
        per_row: matches!(opts.reduction, Reduction::None),
    };
    let outputs =
        apply_function::<LossParallelError>(&[local_logits.shallow_clone()], &mut |inputs| {
            row_loss.forward(&inputs[0])
        })?;
    outputs.into_iter().next().ok_or_else(|| {
        DistError::Internal {
            rank,
            op: "loss_parallel",
            what: "the custom function returned no output",
        }
        .into()
    })
}

/// The loss from this rank's slice of the logits: each row's `ln(Σ exp) − target logit`
/// over every rank's classes, weighted and reduced (steps 2 to 4 of the module's docs).
struct RowLoss {
    group: ProcessGroup,
    /// This rank's classes.
    width: i64,
    rows: i64,
    /// Each row's target among this rank's classes (clamped; meaningful where `here`).
    local_index: Tensor,
    /// The rows whose target class this rank holds (and is not ignored).
    here: Tensor,
    /// Each row's weight (0 for an ignored row).
    row_weight: Tensor,
    /// What the weighted sum is divided by (`Mean`: the weights' sum).
    divisor: Option<Tensor>,
    /// `Reduction::None`: one loss per row.
    per_row: bool,
}

impl RowLoss {
    /// The forward (grad disabled): the loss and the backward.
    fn forward(&self, logits: &Tensor) -> Result<(Vec<Tensor>, Backward), LossParallelError> {
        let (kind, device) = (logits.kind(), logits.device());
        // The rows' maxima over every rank's classes (an empty slice adds nothing).
        let maxima = if self.width > 0 {
            logits.amax([1], false)
        } else {
            Tensor::full([self.rows], f64::NEG_INFINITY, (kind, device))
        };
        self.group.all_reduce(&maxima, ReduceOp::Max)?;
        // Shifted, then exponentiated in place: the slice's softmax numerators.
        let mut exp = logits - maxima.unsqueeze(1);
        let target_logit = if self.width > 0 {
            exp.gather(1, &self.local_index.unsqueeze(1), false)
                .squeeze_dim(1)
                .where_self(&self.here, &Tensor::zeros([self.rows], (kind, device)))
        } else {
            Tensor::zeros([self.rows], (kind, device))
        };
        let _ = exp.exp_();
        let sum_exp = exp.sum_dim_intlist([1].as_slice(), false, kind);
        let both = Tensor::cat(&[&sum_exp, &target_logit], 0);
        self.group.all_reduce(&both, ReduceOp::Sum)?;
        let (sum_exp, target_logit) = (
            both.narrow(0, 0, self.rows),
            both.narrow(0, self.rows, self.rows),
        );
        let weighted = (sum_exp.log() - target_logit) * &self.row_weight;
        let loss = match (&self.divisor, self.per_row) {
            (_, true) => weighted,
            (Some(d), false) => weighted.sum(kind) / d,
            (None, false) => weighted.sum(kind),
        };
        // d loss / d logit_rc = (softmax_rc − [c is r's target]) · w_r / divisor, on this
        // rank's columns: kept in the numerators' tensor, nothing else beside it.
        let _ = exp.divide_(&sum_exp.unsqueeze(1));
        if self.width > 0 {
            let minus_one = self.here.to_kind(kind).neg().unsqueeze(1);
            let _ = exp.scatter_add_(1, &self.local_index.unsqueeze(1), &minus_one);
        }
        let scale = match &self.divisor {
            Some(d) => &self.row_weight / d,
            None => self.row_weight.shallow_clone(),
        };
        let _ = exp.g_mul_(&scale.unsqueeze(1));
        let per_row = self.per_row;
        let backward: Backward = Box::new(move |grads| {
            let g = if per_row {
                grads[0].unsqueeze(1)
            } else {
                grads[0].shallow_clone()
            };
            Ok(vec![Some(&exp * g)])
        });
        Ok((vec![loss], backward))
    }
}
