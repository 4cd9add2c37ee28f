//! Expert parallelism as a sharder (torchtitan's `ExpertParallel` style with its
//! `AllToAllTokenDispatcher`): grouped experts' 3-D weights split along the experts over the
//! group, and every call's rows sent to the rank holding their expert and back, through
//! [`functional::all_to_all_single_known`], whose backward sends the gradients back the
//! same way.
//!
//! The experts are called with two inputs, as torchtitan's `GroupedExperts.forward(x,
//! num_tokens_per_expert)`: the rows grouped by global expert and the count of rows per
//! expert ([`MoE`](crate::nn::moe::MoE) calls them so). The input hook exchanges the counts
//! (with one flag per rank, so that a rank whose counts do not describe its rows is refused
//! on every rank before any row moves), then the rows, and regroups them by local expert;
//! the output hook puts the results back in the order they came and returns them to their
//! ranks.

use std::sync::Arc;

use tch::{Kind, Tensor};
use tch_dist_core::hooks::{
    register_fallible_forward_hook_n, register_fallible_forward_pre_hook_n, ForwardError,
};
use tch_dist_core::path::join_fqn;
use tch_dist_core::Shardable;
use tch_dist_runtime::fsdp::tensor_identity;
use tch_dist_runtime::sharding::{functional, GradientScale};
use tch_dist_runtime::{DistError, ProcessGroup};

use super::error::{ForwardProblem, HookSite, ShardError, SharderError};
use super::output::OutputLayout;
use super::sharder::{
    first_submodule, hook_error, refused, set_local, shard_along, PerCall, ShardedModule, Sharder,
};
use crate::state_dict::managed::{register, Layer, ManagingApi, Registration, ShardHolder};
use crate::state_dict::{MeshDimPlacement, Placement};

/// The sharder of [`ExpertParallel`](super::ExpertParallel) and
/// [`ExpertTensorParallel`](super::ExpertTensorParallel): a grouped-experts module's `w1`,
/// `w2`, `w3` split along dim 0 (the experts) over the group, `experts / ranks` each in
/// rank order, with the hooks that send the rows to their experts and back; with a
/// tensor-parallel group, each expert's hidden width split over it as well (`w1`, `w3`
/// along dim 1, `w2` along dim 2: column- then row-parallel), the rows copied to its ranks
/// and the results summed over them.
///
/// ```
/// use tch_dist::sharding::{ExpertSharder, Sharder};
/// assert_eq!(ExpertSharder::default().name(), "expert_parallel");
/// assert!(ExpertSharder::default().trained_on_every_rank());
/// ```
#[derive(Debug, Clone, Default)]
pub struct ExpertSharder {
    /// The group over which each expert's hidden width is split (expert x tensor
    /// parallelism), if any.
    pub tensor_parallel: Option<ProcessGroup>,
}

/// Which dim of `w1`, `w2`, `w3` holds the hidden width.
const HIDDEN_DIMS: [usize; 3] = [1, 2, 1];

/// The three weights of grouped experts, or why the module is not grouped experts.
fn grouped_experts(module: &dyn Shardable) -> Result<[Tensor; 3], SharderError> {
    let kind = module.type_name();
    let not = |found: String| SharderError::NotGroupedExperts { kind, found };
    if let Some(child) = first_submodule(module) {
        return Err(not(format!("a submodule `{child}`")));
    }
    let (mut w1, mut w2, mut w3) = (None, None, None);
    for (name, t) in module.named_parameters() {
        let slot = match name.as_str() {
            "w1" => &mut w1,
            "w2" => &mut w2,
            "w3" => &mut w3,
            _ => return Err(not(format!("a parameter `{name}`"))),
        };
        *slot = Some(t.shallow_clone());
    }
    let (Some(w1), Some(w2), Some(w3)) = (w1, w2, w3) else {
        return Err(not("not all of `w1`, `w2` and `w3`".into()));
    };
    let (s1, s2, s3) = (w1.size(), w2.size(), w3.size());
    let alike = s1.len() == 3 && s1 == s3 && s2 == [s1[0], s1[2], s1[1]];
    if !alike {
        return Err(not(format!("`w1` {s1:?}, `w2` {s2:?} and `w3` {s3:?}")));
    }
    Ok([w1, w2, w3])
}

impl Sharder for ExpertSharder {
    fn name(&self) -> String {
        match &self.tensor_parallel {
            None => "expert_parallel".into(),
            Some(tp) => format!("expert_tensor_parallel(tp={})", tp.world_size()),
        }
    }

    fn check(
        &self,
        _fqn: &str,
        module: &dyn Shardable,
        group: &ProcessGroup,
    ) -> Result<(), SharderError> {
        let [w1, _, _] = grouped_experts(module)?;
        let (experts, ranks) = (w1.size()[0], group.world_size());
        if experts % ranks as i64 != 0 {
            return Err(SharderError::ExpertsNotDivisible { experts, ranks });
        }
        if let Some(tp) = &self.tensor_parallel {
            let (hidden, ranks) = (w1.size()[1], tp.world_size());
            if hidden % ranks as i64 != 0 {
                return Err(SharderError::ExpertWidthNotDivisible { hidden, ranks });
            }
        }
        Ok(())
    }

    fn trained_on_every_rank(&self) -> bool {
        true
    }

    /// The experts' weights are not fenced: their own forward refuses the global counts a
    /// call without these hooks would pass ([`GroupedExperts::f_forward_grouped`](crate::nn::moe::GroupedExperts::f_forward_grouped)
    /// takes one count per expert it holds), and a fence on them would break `fully_shard`
    /// of the same experts (the views of their unsharded weights that the forward saves).
    fn needs_hooks(&self) -> bool {
        false
    }

    fn shard(
        &self,
        fqn: &str,
        module: &dyn Shardable,
        src_rank: usize,
        group: &ProcessGroup,
    ) -> Result<ShardedModule, ShardError> {
        let weights =
            grouped_experts(module).map_err(|source| refused(group, fqn, self.name(), source))?;
        let experts = weights[0].size()[0];
        // Expert x tensor parallelism: every tp rank first takes tp rank 0's values, then
        // keeps its slice of each expert's hidden width (a level of the placement record
        // of its own, over tp, that the split over the experts then divides).
        let tensor_parallel = match &self.tensor_parallel {
            Some(tp) => Some(split_hidden(fqn, &weights, tp, group)?),
            None => None,
        };
        let mut params = Vec::new();
        // The experts' gradients gather every rank's rows: divided by the ranks, they are
        // the gradients of the mean of the ranks' losses, as data parallelism over these
        // ranks averages every other parameter's (a hook on each weight: nothing in the
        // forward).
        let mean_over_ranks = GradientScale::new(1.0 / group.world_size() as f64);
        for (name, w) in ["w1", "w2", "w3"].into_iter().zip(&weights) {
            params.push((
                name.to_string(),
                shard_along(fqn, name, w, 0, src_rank, group)?,
            ));
            if w.requires_grad() {
                mean_over_ranks
                    .register(w, group.rank())
                    .map_err(|e| ShardError::dist(group, &join_fqn(fqn, name), e))?;
            }
        }
        let dispatcher = Arc::new(Dispatcher {
            group: group.clone(),
            fqn: fqn.to_string(),
            experts,
            local: experts / group.world_size() as i64,
            tensor_parallel: self.tensor_parallel.clone(),
            pending: PerCall::default(),
            _weights: std::sync::Mutex::new(weights),
            _hidden_split: tensor_parallel,
            _mean_over_ranks: mean_over_ranks,
        });
        let unhookable = |source| ShardError::unhookable(group, fqn, source);
        let d = Arc::clone(&dispatcher);
        let pre = register_fallible_forward_pre_hook_n(module, move |_m, inputs| {
            d.dispatch(inputs).map(Some)
        })
        .map_err(unhookable)?;
        let post = register_fallible_forward_hook_n(module, move |_m, _inputs, outputs| {
            dispatcher.combine(outputs).map(|out| Some(vec![out]))
        })
        .map_err(unhookable)?;
        Ok(ShardedModule {
            params,
            output: OutputLayout::Replicated,
            hooks: vec![pre, post],
        })
    }
}

/// What the output hook needs of its call's dispatch.
struct Dispatched {
    /// The received rows' positions before they were grouped by local expert.
    inverse: Tensor,
    /// Rows this rank sent to each rank.
    to_rank: Vec<i64>,
    /// Rows each rank sent this rank.
    from_rank: Vec<i64>,
}

/// One expert-parallel module's exchanges.
struct Dispatcher {
    group: ProcessGroup,
    fqn: String,
    /// The experts over every rank.
    experts: i64,
    /// This rank's: `experts / ranks`.
    local: i64,
    /// The group each expert's hidden width is split over, if any.
    tensor_parallel: Option<ProcessGroup>,
    pending: PerCall<Dispatched>,
    /// The experts' weights, held as long as the hooks: the registry of managed parameters
    /// knows them by their tensor objects, which no other tensor may take meanwhile.
    _weights: std::sync::Mutex<[Tensor; 3]>,
    /// The hidden width's split in the registry of managed parameters, as long as the hooks.
    _hidden_split: Option<Registration>,
    /// The experts' gradients divided by the ranks, as long as the hooks.
    _mean_over_ranks: Arc<GradientScale>,
}

impl Dispatcher {
    fn error(&self, problem: ForwardProblem) -> ForwardError {
        hook_error(&self.group, &self.fqn, HookSite::ExpertParallel, problem)
    }

    /// The rows per expert of `rows` as given, if they describe them: one non-negative
    /// count per expert, adding up to the rows.
    fn own_counts(&self, rows: &Tensor, counts: &Tensor) -> Result<Vec<i64>, ForwardProblem> {
        let n_rows = rows.size().first().copied().unwrap_or(0);
        let integral = matches!(
            counts.kind(),
            Kind::Int64 | Kind::Int | Kind::Int16 | Kind::Int8 | Kind::Uint8
        );
        let values = integral
            .then(|| Vec::<i64>::try_from(counts.reshape([-1]).to_kind(Kind::Int64)).ok())
            .flatten()
            .unwrap_or_default();
        let sum: i64 = values.iter().sum();
        let fits = integral
            && rows.dim() >= 1
            && values.len() as i64 == self.experts
            && values.iter().all(|&c| c >= 0)
            && sum == n_rows;
        if fits {
            Ok(values)
        } else {
            Err(ForwardProblem::DispatchCounts {
                counts: counts.numel() as i64,
                sum,
                rows: n_rows,
                experts: self.experts,
            })
        }
    }

    /// The input hook: `[rows grouped by global expert, rows per expert]` becomes `[the
    /// rows of this rank's experts from every rank, grouped by local expert, rows per local
    /// expert]`.
    fn dispatch(&self, inputs: &[Tensor]) -> Result<Vec<Tensor>, ForwardError> {
        let [rows, counts] = inputs else {
            let got = inputs.len();
            return Err(self.error(ForwardProblem::ExpertInputs { got }));
        };
        let ranks = self.group.world_size();
        let local = self.local as usize;
        let own = self.own_counts(rows, counts);
        // To each rank: my counts for its experts and a flag (1: my counts are wrong, and
        // nothing more is exchanged), so that every rank learns every rank's verdict.
        let mut message = Vec::with_capacity(ranks * (local + 1));
        for r in 0..ranks {
            match &own {
                Ok(c) => message.extend_from_slice(&c[r * local..(r + 1) * local]),
                Err(_) => message.extend(std::iter::repeat_n(0, local)),
            }
            message.push(i64::from(own.is_err()));
        }
        let mine = Tensor::from_slice(&message);
        let theirs = mine.empty_like();
        let collective = |e| self.error(ForwardProblem::collective(e));
        self.group
            .all_to_all_single(&theirs, &mine)
            .map_err(collective)?;
        let own = own.map_err(|p| self.error(p))?;
        let theirs = Vec::<i64>::try_from(&theirs).unwrap_or_default();
        let per_rank: Vec<&[i64]> = theirs.chunks(local + 1).collect();
        if let Some(rank) = (0..ranks).find(|&r| per_rank.get(r).is_none_or(|c| c[local] != 0)) {
            return Err(self.error(ForwardProblem::PeerDispatchCounts { rank }));
        }
        // Each rank's counts for my experts, source-major.
        let theirs: Vec<&[i64]> = per_rank.iter().map(|c| &c[..local]).collect();
        let to_rank: Vec<i64> = own.chunks(local).map(|c| c.iter().sum()).collect();
        let from_rank: Vec<i64> = theirs.iter().map(|c| c.iter().sum()).collect();
        let received = functional::all_to_all_single_known(rows, &to_rank, &from_rank, &self.group)
            .map_err(collective)?;
        // Source-major to expert-major, so that each local expert's rows are contiguous.
        let mut source_start = vec![0i64; ranks];
        for s in 1..ranks {
            source_start[s] = source_start[s - 1] + from_rank[s - 1];
        }
        let mut order = Vec::with_capacity(from_rank.iter().sum::<i64>() as usize);
        let mut per_expert = vec![0i64; local];
        for (e, n) in per_expert.iter_mut().enumerate() {
            for s in 0..ranks {
                let before: i64 = theirs[s][..e].iter().sum();
                let count = theirs[s][e];
                order.extend(source_start[s] + before..source_start[s] + before + count);
                *n += count;
            }
        }
        let order = Tensor::from_slice(&order).to_device(rows.device());
        self.pending.push(Dispatched {
            inverse: order.argsort(0, false),
            to_rank,
            from_rank,
        });
        let mut grouped = received.index_select(0, &order);
        if let Some(tp) = &self.tensor_parallel {
            // Every tp rank computes its slice of each expert's hidden width from the same
            // rows: the rows' gradient is the sum of the slices'.
            grouped = functional::copy_to_ranks(&grouped, tp).map_err(collective)?;
        }
        Ok(vec![grouped, Tensor::from_slice(&per_expert)])
    }

    /// The output hook: the experts' results back in the order the rows came, and back to
    /// their ranks.
    fn combine(&self, outputs: &[Tensor]) -> Result<Tensor, ForwardError> {
        let [out] = outputs else {
            let got = outputs.len();
            return Err(self.error(ForwardProblem::Outputs { got }));
        };
        let Some(call) = self.pending.pop() else {
            return Err(self.error(ForwardProblem::CombineWithoutDispatch));
        };
        let collective = |e| self.error(ForwardProblem::collective(e));
        // Each tp rank's results are partial sums over its slice of the hidden width.
        let out = match &self.tensor_parallel {
            Some(tp) => functional::all_reduce(out, tp).map_err(collective)?,
            None => out.shallow_clone(),
        };
        let out = out.index_select(0, &call.inverse);
        functional::all_to_all_single_known(&out, &call.from_rank, &call.to_rank, &self.group)
            .map_err(collective)
    }
}

/// Expert x tensor parallelism's first step: `weights` take tp rank 0's values, then each
/// keeps this tp rank's slice of the hidden width, in place; entered in the registry of
/// managed parameters as split over `tp` (as tensor parallelism's pieces are).
fn split_hidden(
    fqn: &str,
    weights: &[Tensor; 3],
    tp: &ProcessGroup,
    group: &ProcessGroup,
) -> Result<Registration, ShardError> {
    let (rank, ranks) = (tp.rank() as i64, tp.world_size() as i64);
    let holder: Arc<dyn ShardHolder> = Arc::new(HiddenHolder { tp: tp.clone() });
    let mut entries = Vec::new();
    for (index, ((name, w), dim)) in ["w1", "w2", "w3"]
        .into_iter()
        .zip(weights)
        .zip(HIDDEN_DIMS)
        .enumerate()
    {
        tp.broadcast(w, 0)
            .map_err(|e| ShardError::dist(group, &join_fqn(fqn, name), e))?;
        let whole = w.size();
        let width = whole[dim] / ranks;
        let mine = tch::no_grad(|| w.narrow(dim as i64, rank * width, width).contiguous());
        set_local(w, &mine);
        let mut offsets = vec![0; whole.len()];
        offsets[dim] = rank * width;
        let layer = Layer {
            dims: vec![MeshDimPlacement {
                placement: Placement::Shard(dim),
                group: tp.clone(),
            }],
            whole,
            offsets,
            local: w.size(),
            blocks: 1,
            holder: Arc::clone(&holder),
            index,
        };
        entries.push((tensor_identity(w), join_fqn(fqn, name), Some(layer)));
    }
    Ok(register(
        ManagingApi::ShardModule,
        tp.global_ranks(),
        entries,
    ))
}

/// Gathers an expert weight's hidden width from every tp rank's slice (equal slices).
struct HiddenHolder {
    tp: ProcessGroup,
}

impl ShardHolder for HiddenHolder {
    fn gather(&self, index: usize, piece: &Tensor) -> Result<Tensor, DistError> {
        let dim = HIDDEN_DIMS[index % 3] as i64;
        // Gathered along dim 0 with the hidden dim moved there, then moved back.
        let front = piece.movedim(dim, 0).contiguous();
        let mut shape = front.size();
        shape[0] *= self.tp.world_size() as i64;
        let whole = Tensor::zeros(shape, (piece.kind(), piece.device()));
        self.tp.all_gather_into_tensor(&whole, &front)?;
        Ok(whole.movedim(0, dim))
    }

    /// The weights always hold this rank's slices.
    fn reshard(&self) -> Result<(), DistError> {
        Ok(())
    }
}
