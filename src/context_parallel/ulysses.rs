//! [`ulysses_attention`]: attention over a sequence split across ranks, by exchanging
//! heads for sequence (DeepSpeed-Ulysses): an all-to-all gives each rank every position of
//! `heads / ranks` heads, attention runs on the whole sequence, and a second all-to-all gives
//! each rank its positions of every head back. With the head-tail layout the gathered
//! sequence is put in order before attention and back after.

use tch::Tensor;
use tch_dist_runtime::sharding::functional;
use tch_dist_runtime::ProcessGroup;

use super::{AttentionOptions, CpError, CpProblem, SeqLayout};

/// Scaled-dot-product attention of `q`, `k`, `v` `[batch, heads, local positions, head dim]`,
/// split along the sequence as `opts.layout` says, equal to the attention of the whole
/// sequence, this rank's positions of it: the heads are exchanged for the sequence with [`functional::all_to_all_single`]
/// (differentiable, so backward runs the exchanges in reverse), attention runs on every
/// position of `heads / ranks` heads, and the outputs go back. Causal attention masks by the
/// global positions.
///
/// Every rank calls it with the same shapes; heads the ranks do not divide, or inputs that
/// are not alike 4-D, are refused on every rank (ranks whose chunks differ in length fail
/// the exchange on every rank).
///
/// ```no_run
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use tch_dist::context_parallel::{ulysses_attention, AttentionOptions};
/// let pg = tch_dist::init_process_group(tch_dist::Backend::Gloo)?; // 2 ranks
/// // 4 heads, a sequence of 16 positions: 8 on each rank.
/// let q = tch::Tensor::randn([2, 4, 8, 32], tch::kind::FLOAT_CPU);
/// let (k, v) = (q.randn_like(), q.randn_like());
/// let out = ulysses_attention(&q, &k, &v, &pg, &AttentionOptions { causal: true, ..Default::default() })?;
/// assert_eq!(out.size(), [2, 4, 8, 32]); // this rank's 8 positions of every head
/// # Ok(()) }
/// ```
pub fn ulysses_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    group: &ProcessGroup,
    opts: &AttentionOptions,
) -> Result<Tensor, CpError> {
    let ranks = group.world_size() as i64;
    let rank = group.rank();
    let shape = q.size();
    if shape.len() != 4 || k.size() != shape || v.size() != shape {
        let problem = CpProblem::Shapes {
            q: shape,
            k: k.size(),
            v: v.size(),
        };
        return Err(problem.on(rank).into());
    }
    let (batch, heads, local, dim) = (shape[0], shape[1], shape[2], shape[3]);
    if heads % ranks != 0 {
        return Err(CpProblem::Heads { heads, ranks }.on(rank).into());
    }
    if opts.layout == SeqLayout::HeadTail && local % 2 != 0 {
        return Err(CpProblem::OddHeadTail { positions: local }.on(rank).into());
    }
    // The gathered sequence is the ranks' chunks in rank order: in position order for the
    // contiguous layout, permuted for head-tail.
    let permutation = match opts.layout {
        SeqLayout::Contiguous => None,
        SeqLayout::HeadTail => {
            let len = ranks * local;
            let device = q.device();
            Some((
                opts.layout
                    .restore_order(len, ranks as usize)
                    .to_device(device),
                opts.layout.order(len, ranks as usize).to_device(device),
            ))
        }
    };
    let group_heads = heads / ranks;
    let one_each = vec![1i64; ranks as usize];
    // [batch, heads, local, dim] -> one row per destination rank (its heads), then every
    // rank's positions of this rank's heads, in rank (= position) order.
    let scatter_heads = |x: &Tensor| -> Result<Tensor, CpError> {
        let rows = x
            .reshape([batch, ranks, group_heads, local, dim])
            .permute([1, 0, 2, 3, 4])
            .reshape([ranks, -1]);
        let (got, _) = functional::all_to_all_single(&rows, &one_each, group)?;
        Ok(got
            .reshape([ranks, batch, group_heads, local, dim])
            .permute([1, 2, 0, 3, 4])
            .reshape([batch, group_heads, ranks * local, dim]))
    };
    let in_order = |x: Tensor| match &permutation {
        Some((restore, _)) => x.index_select(2, restore),
        None => x,
    };
    let (q, k, v) = (
        in_order(scatter_heads(q)?),
        in_order(scatter_heads(k)?),
        in_order(scatter_heads(v)?),
    );
    let out = Tensor::scaled_dot_product_attention::<Tensor>(
        &q,
        &k,
        &v,
        None,
        0.0,
        opts.causal,
        opts.scale,
        false,
    );
    let out = match &permutation {
        Some((_, order)) => out.index_select(2, order),
        None => out,
    };
    // Back: this rank's heads at every position -> every head at this rank's positions.
    let rows = out
        .reshape([batch, group_heads, ranks, local, dim])
        .permute([2, 0, 1, 3, 4])
        .reshape([ranks, -1]);
    let (got, _) = functional::all_to_all_single(&rows, &one_each, group)?;
    Ok(got
        .reshape([ranks, batch, group_heads, local, dim])
        .permute([1, 0, 2, 3, 4])
        .reshape([batch, heads, local, dim]))
}
