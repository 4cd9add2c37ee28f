//! Changes of layout of plain local tensors over the tensor-parallel group, as DTensor's
//! `redistribute` makes them for `parallelize_module`'s styles: `Shard(d)` to `Replicate`
//! (an all-gather along `d`), `Replicate` to `Shard(d)` (this rank's even chunk), and a
//! partial sum to `Shard(d)` (a reduce-scatter). Each is a differentiable collective of
//! [`functional`] with Megatron's conjugate in backward: a replicated tensor's gradient is
//! whole on every rank (the loss is computed alike everywhere), a shard's is this rank's
//! piece of it.
//!
//! `Shard(d)` pieces are even: a whole tensor whose length along `d` the group's size does
//! not divide is refused ([`ForwardProblem::NotDivisible`]), since a rank holding a piece
//! could not tell the other ranks' sizes from its own.

use tch::Tensor;
use tch_dist_core::sharding::chunk::normalize_dim;
use tch_dist_runtime::sharding::functional;
use tch_dist_runtime::ProcessGroup;

use super::error::ForwardProblem;
use super::output::{materialize, OutputLayout};
use super::parallel::Layout;

/// One buildable change of layout (PyTorch's `redistribute` between two placements on a
/// 1-D mesh).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Redistribute {
    /// Nothing to do: the same layout, or a tensor the plan leaves alone.
    Keep,
    /// `Shard(d)` to `Replicate`: every rank's piece concatenated along `d`; backward keeps
    /// this rank's piece of the gradient.
    Gather(i64),
    /// `Replicate` to `Shard(d)`: this rank's piece along `d`; backward gathers the pieces'
    /// gradients.
    Split(i64),
}

impl Redistribute {
    /// The change from `from` to `to` (`None`: leave the tensor alone, as PyTorch does when
    /// either layout is `None`), or `None` when tch-dist does not build it (`Shard(a)` to
    /// `Shard(b)`, an all-to-all).
    pub fn new(from: Option<Layout>, to: Option<Layout>) -> Option<Redistribute> {
        match (from, to) {
            (None, _) | (_, None) | (Some(Layout::Replicate), Some(Layout::Replicate)) => {
                Some(Redistribute::Keep)
            }
            (Some(Layout::Shard(a)), Some(Layout::Shard(b))) => {
                (a == b).then_some(Redistribute::Keep)
            }
            (Some(Layout::Shard(d)), Some(Layout::Replicate)) => Some(Redistribute::Gather(d)),
            (Some(Layout::Replicate), Some(Layout::Shard(d))) => Some(Redistribute::Split(d)),
        }
    }

    /// `x` in the new layout (`None`: unchanged).
    pub fn apply(self, x: &Tensor, g: &ProcessGroup) -> Result<Option<Tensor>, ForwardProblem> {
        let collective = ForwardProblem::collective;
        match self {
            Redistribute::Keep => Ok(None),
            Redistribute::Gather(dim) => {
                let d = layout_dim(x, dim)?;
                let sizes = vec![x.size()[d]; g.world_size()];
                functional::all_gather(x, d as i64, &sizes, g)
                    .map(Some)
                    .map_err(collective)
            }
            Redistribute::Split(dim) => {
                let (d, sizes) = even_pieces(x, dim, g.world_size())?;
                functional::split(x, d, &sizes, g)
                    .map(Some)
                    .map_err(collective)
            }
        }
    }
}

/// `dim` of `x`, or the problem naming it.
fn layout_dim(x: &Tensor, dim: i64) -> Result<usize, ForwardProblem> {
    let ndim = x.dim();
    normalize_dim(dim, ndim).ok_or(ForwardProblem::LayoutDim { dim, ndim })
}

/// The dim of `x` that `Shard(dim)` splits, and its even pieces over `world` ranks.
fn even_pieces(x: &Tensor, dim: i64, world: usize) -> Result<(i64, Vec<i64>), ForwardProblem> {
    let d = layout_dim(x, dim)?;
    let len = x.size()[d];
    if len % world as i64 != 0 {
        return Err(ForwardProblem::NotDivisible { len, dim, world });
    }
    Ok((d as i64, vec![len / world as i64; world]))
}

/// A sharded module's raw output, laid out as `layout`, as this rank's even piece along
/// `dim` of the whole output, as a style's `output_layouts=Shard(dim)` asks. A partial sum (a
/// row-parallel layer's) is reduce-scattered (PyTorch's `Partial` to `Shard(dim)`); backward
/// all-gathers the pieces' gradients, undivided, since the ranks go on computing one model on
/// pieces of one sequence. A term every rank added (a row-parallel bias) is taken out of the
/// sum and this rank's piece of it added back through [`functional::copy_to_ranks`], whose
/// backward sums over the ranks: each rank's bias gradient is then the whole sequence's, as
/// the unsharded layer's. Any other layout is made whole first, then split.
pub(super) fn to_shard(
    out: &Tensor,
    layout: &OutputLayout,
    dim: i64,
    g: &ProcessGroup,
) -> Result<Tensor, ForwardProblem> {
    let collective = ForwardProblem::collective;
    let OutputLayout::Partial { replicated } = layout else {
        let whole = materialize(out, layout, g)?.unwrap_or_else(|| out.shallow_clone());
        let (d, sizes) = even_pieces(&whole, dim, g.world_size())?;
        return functional::split(&whole, d, &sizes, g).map_err(collective);
    };
    let (d, sizes) = even_pieces(out, dim, g.world_size())?;
    let Some(b) = replicated else {
        return functional::reduce_scatter(out, d, &sizes, g).map_err(collective);
    };
    let shape = out.size();
    let summed = functional::reduce_scatter(&(out - b.expand(&shape, false)), d, &sizes, g)
        .map_err(collective)?;
    let mine = functional::copy_to_ranks(b, g).map_err(collective)?;
    let offset = sizes[0] * g.rank() as i64;
    Ok(summed
        + mine
            .expand(&shape, false)
            .narrow(d, offset, sizes[g.rank()]))
}
