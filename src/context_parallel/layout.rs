//! [`SeqLayout`]: which positions of a sequence each rank holds, and the permutations
//! between the whole sequence's order and the ranks' concatenated chunks (PyTorch's
//! `_HeadTailLoadBalancer`).

use tch::Tensor;

/// How a sequence is split over the ranks of a context-parallel group.
///
/// ```
/// use tch_dist::context_parallel::SeqLayout;
/// // 8 positions over 2 ranks, head-tail: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
/// assert_eq!(SeqLayout::HeadTail.positions(8, 2, 0), [0, 1, 6, 7]);
/// assert_eq!(SeqLayout::HeadTail.positions(8, 2, 1), [2, 3, 4, 5]);
/// assert_eq!(SeqLayout::Contiguous.positions(8, 2, 1), [4, 5, 6, 7]);
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum SeqLayout {
    /// Rank `r` holds the `r`-th of `ranks` equal chunks. Causal ring attention is correct
    /// but uneven: the last rank attends to every earlier block, the first to none.
    #[default]
    Contiguous,
    /// Head-tail load balancing (PyTorch's default for `context_parallel`): the sequence in
    /// `2·ranks` chunks, rank `r` holding chunks `r` and `2·ranks − 1 − r`, so that every rank
    /// does the same causal work.
    HeadTail,
}

impl SeqLayout {
    /// What the whole sequence's length must divide by: `ranks`, or `2·ranks` head-tail.
    ///
    /// ```
    /// assert_eq!(tch_dist::context_parallel::SeqLayout::HeadTail.divisor(3), 6);
    /// ```
    pub fn divisor(self, ranks: usize) -> i64 {
        match self {
            SeqLayout::Contiguous => ranks as i64,
            SeqLayout::HeadTail => 2 * ranks as i64,
        }
    }

    /// The positions (of `seq_len`, which [`divisor`](Self::divisor) divides) that `rank`
    /// holds, in the order it holds them.
    ///
    /// ```
    /// use tch_dist::context_parallel::SeqLayout;
    /// assert_eq!(SeqLayout::HeadTail.positions(12, 3, 2), [4, 5, 6, 7]);
    /// ```
    pub fn positions(self, seq_len: i64, ranks: usize, rank: usize) -> Vec<i64> {
        let (r, n) = (rank as i64, ranks as i64);
        match self {
            SeqLayout::Contiguous => {
                let chunk = seq_len / n;
                (r * chunk..(r + 1) * chunk).collect()
            }
            SeqLayout::HeadTail => {
                let chunk = seq_len / (2 * n);
                let tail = 2 * n - 1 - r;
                (r * chunk..(r + 1) * chunk)
                    .chain(tail * chunk..(tail + 1) * chunk)
                    .collect()
            }
        }
    }

    /// Every rank's positions, concatenated in rank order (PyTorch's rearrange indices):
    /// `whole.index_select(dim, &order)` is the ranks' chunks one after the other.
    ///
    /// ```
    /// use tch_dist::context_parallel::SeqLayout;
    /// let order = SeqLayout::HeadTail.order(4, 2);
    /// assert_eq!(Vec::<i64>::try_from(&order).unwrap(), [0, 3, 1, 2]);
    /// ```
    pub fn order(self, seq_len: i64, ranks: usize) -> Tensor {
        let all: Vec<i64> = (0..ranks)
            .flat_map(|rank| self.positions(seq_len, ranks, rank))
            .collect();
        Tensor::from_slice(&all)
    }

    /// The inverse of [`order`](Self::order) (PyTorch's restore indices): the ranks'
    /// concatenated chunks `.index_select(dim, &restore)` are the whole sequence in order.
    ///
    /// ```
    /// use tch_dist::context_parallel::SeqLayout;
    /// let restore = SeqLayout::HeadTail.restore_order(4, 2);
    /// assert_eq!(Vec::<i64>::try_from(&restore).unwrap(), [0, 2, 3, 1]);
    /// ```
    pub fn restore_order(self, seq_len: i64, ranks: usize) -> Tensor {
        self.order(seq_len, ranks).argsort(0, false)
    }

    /// This rank's part of `whole` along `dim` (a copy; `dim` already checked).
    pub(crate) fn shard(self, whole: &Tensor, dim: i64, ranks: usize, rank: usize) -> Tensor {
        let len = whole.size()[dim as usize];
        let index = Tensor::from_slice(&self.positions(len, ranks, rank)).to_device(whole.device());
        whole.index_select(dim, &index)
    }

    /// A number for the ranks' agreement.
    pub(crate) fn code(self) -> i64 {
        match self {
            SeqLayout::Contiguous => 0,
            SeqLayout::HeadTail => 1,
        }
    }
}
