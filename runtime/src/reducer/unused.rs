//! Parameters without a gradient: `find_unused_parameters` counts them as zero at the end of
//! backward and all-reduces a used-map so that parameters unused on every rank keep their
//! `.grad`; `static_graph` does that once and reuses the first pass's answer (PyTorch's
//! `search_unused_parameters` and `static_graph_`).

use tch::Tensor;

use crate::c10d::collectives::ReduceOp;
use crate::error::{DistError, Result};
use crate::reducer::buckets::Layout;
use crate::reducer::pass::Pass;
use crate::reducer::ReducerInner;

/// What the first pass of a static graph saw: which parameters got a gradient on some
/// rank, and which on this rank.
pub(crate) struct StaticGraphUse {
    pub global: Vec<bool>,
    pub local: Vec<bool>,
}

/// `static_graph` after its first pass, within a pass: parameter `i` got no gradient on
/// this rank in the first pass, so it counted as zero at this pass's first hook and its
/// bucket does not wait for it.
pub(crate) fn presumed_unused(static_graph: Option<&StaticGraphUse>, i: usize) -> bool {
    static_graph.is_some_and(|s| !s.local[i])
}

/// `skip_all_reduce_unused_params`: bucket `b` is not communicated in this pass, every one
/// of its parameters having got no gradient on any rank in the previous synchronised pass
/// (`skip_unused[i]`; `None` before the first pass, or without the option).
pub(crate) fn skips_bucket(layout: &Layout, b: usize, skip_unused: Option<&[bool]>) -> bool {
    skip_unused.is_some_and(|skip| layout.buckets[b].params.iter().all(|&i| skip[i]))
}

/// Parameters without a gradient in this pass count as zero: a copied member's slice is
/// zeroed (an in-place member is reduced from a zero buffer when launched) and its bucket
/// stops waiting for it.
pub(crate) fn count_as_zero(layout: &Layout, pass: &mut Pass, params: &[usize]) {
    tch::no_grad(|| {
        for &i in params.iter().filter(|&&i| !layout.params[i].in_place) {
            let _ = layout.view(i).shallow_clone().zero_();
        }
    });
    for &i in params {
        pass.pending[layout.params[i].bucket] -= 1;
    }
}

/// At the first hook of a pass of a static graph: the parameters this rank did not use in
/// the first pass count as zero now (PyTorch's reducer marks them ready when backward
/// starts), so that buckets holding them launch during backward.
pub(crate) fn presume_static_unused(
    layout: &Layout,
    pass: &mut Pass,
    static_graph: Option<&StaticGraphUse>,
) {
    let unused: Vec<usize> = (0..layout.params.len())
        .filter(|&i| presumed_unused(static_graph, i))
        .collect();
    count_as_zero(layout, pass, &unused);
}

impl ReducerInner {
    /// Which parameters got a gradient on some rank: every rank, after all its buckets (so
    /// that the collectives line up even where another rank used a parameter this one did
    /// not), all-reduces its ready map with MAX.
    pub(crate) fn all_reduce_used_map(&self, ready: &[bool]) -> Result<Vec<bool>> {
        let used = Tensor::from_slice(&ready.iter().map(|&r| r as i32).collect::<Vec<_>>());
        self.group.all_reduce(&used, ReduceOp::Max)?;
        let used = Vec::<i32>::try_from(&used).map_err(|e| DistError::Collective {
            rank: self.rank(),
            op: self.opts.api,
            cause: format!("reading the used-parameter map: {e}"),
        })?;
        Ok(used.iter().map(|&u| u != 0).collect())
    }
}
