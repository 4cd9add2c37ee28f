//! Where each rank's shard of a parameter sits: `torch.chunk` along dim 0, every chunk padded
//! to the first chunk's rows (PyTorch's FSDP2 layout), and where each padded shard sits in its
//! group's flat all-gather buffer.

/// One parameter's dim-0 sharding over `world` ranks, as rank `rank` sees it.
///
/// Rank r holds rows `[r·c, min((r+1)·c, rows))` with `c = ceil(rows / world)`: uneven and
/// empty shards are allowed (seven rows over four ranks: 2, 2, 2, 1; five over four: 2, 2,
/// 1, 0), as `torch.chunk` gives them. Every shard is padded to `c` rows, so the padded
/// shards of all ranks concatenate into the full tensor followed by the padding.
///
/// ```
/// use tch_dist_runtime::fsdp::ShardLayout;
/// let l = ShardLayout::new(&[5, 3], 4, 3);
/// assert_eq!((l.chunk_rows(), l.local_rows(), l.row_offset()), (2, 0, 5));
/// assert_eq!(l.local_shape(), vec![0, 3]);
/// assert_eq!(l.padded_numel(), 6);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardLayout {
    shape: Vec<i64>,
    rows: i64,
    row_numel: i64,
    chunk_rows: i64,
    world: i64,
    rank: i64,
}

impl ShardLayout {
    /// The layout of a parameter of `shape` (a scalar counts as one row) on `rank` of `world`.
    pub fn new(shape: &[i64], world: usize, rank: usize) -> ShardLayout {
        let (rows, row_numel) = match shape.split_first() {
            Some((rows, rest)) => (*rows, rest.iter().product()),
            None => (1, 1),
        };
        let world = world.max(1) as i64;
        ShardLayout {
            shape: shape.to_vec(),
            rows,
            row_numel,
            chunk_rows: (rows + world - 1) / world,
            world,
            rank: rank as i64,
        }
    }

    /// The full (unsharded) shape.
    pub fn shape(&self) -> &[i64] {
        &self.shape
    }

    /// Rows of the full tensor (1 for a scalar).
    pub fn rows(&self) -> i64 {
        self.rows
    }

    /// Elements per row.
    pub fn row_numel(&self) -> i64 {
        self.row_numel
    }

    /// Elements of the full tensor.
    pub fn numel(&self) -> i64 {
        self.rows * self.row_numel
    }

    /// Rows of every padded shard: `ceil(rows / world)`.
    pub fn chunk_rows(&self) -> i64 {
        self.chunk_rows
    }

    /// Elements of every padded shard.
    pub fn padded_numel(&self) -> i64 {
        self.chunk_rows * self.row_numel
    }

    /// The first full row this rank holds (its offset in a distributed checkpoint; `rows`
    /// for an empty shard past the end).
    pub fn row_offset(&self) -> i64 {
        (self.rank * self.chunk_rows).min(self.rows)
    }

    /// Rows this rank holds (without padding).
    pub fn local_rows(&self) -> i64 {
        (self.rows - self.rank * self.chunk_rows).clamp(0, self.chunk_rows)
    }

    /// Elements this rank holds (without padding).
    pub fn local_numel(&self) -> i64 {
        self.local_rows() * self.row_numel
    }

    /// The shape of this rank's shard: `[local_rows, shape[1..]]` (`[local_rows]` for a
    /// scalar).
    pub fn local_shape(&self) -> Vec<i64> {
        let mut s = vec![self.local_rows()];
        s.extend(self.shape.iter().skip(1));
        s
    }

    /// Whether the padded shards hold no padding (rows divide evenly over the ranks).
    pub fn even(&self) -> bool {
        self.chunk_rows * self.world == self.rows
    }

    /// The number of ranks.
    pub fn world(&self) -> i64 {
        self.world
    }
}

#[cfg(test)]
mod tests {
    use super::ShardLayout;

    /// torch.chunk's shard sizes: every rank's rows, in order.
    fn rows(shape: &[i64], world: usize) -> Vec<i64> {
        (0..world)
            .map(|r| ShardLayout::new(shape, world, r).local_rows())
            .collect()
    }

    #[test]
    fn chunk_sizes_are_torch_chunks() {
        assert_eq!(rows(&[7, 15], 2), [4, 3]);
        assert_eq!(rows(&[7, 15], 3), [3, 3, 1]);
        assert_eq!(rows(&[16, 17], 3), [6, 6, 4]);
        assert_eq!(rows(&[5], 4), [2, 2, 1, 0]);
        assert_eq!(rows(&[2, 3], 3), [1, 1, 0]);
        assert_eq!(rows(&[], 2), [1, 0]);
        for (shape, world) in [(vec![7, 15], 3), (vec![5], 4), (vec![16, 17], 2)] {
            let total: i64 = rows(&shape, world).iter().sum();
            assert_eq!(total, shape[0]);
            let offsets: Vec<i64> = (0..world)
                .map(|r| ShardLayout::new(&shape, world, r).row_offset())
                .collect();
            let mut expected = 0;
            for (r, off) in offsets.iter().enumerate() {
                assert_eq!(*off, expected, "{shape:?} over {world}, rank {r}");
                expected += rows(&shape, world)[r];
            }
        }
    }
}
