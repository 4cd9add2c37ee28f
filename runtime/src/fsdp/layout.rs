//! Where each rank's shard of a parameter sits: `torch.chunk` along dim 0 (or another dim
//! that the ranks divide evenly), every chunk padded to the first chunk's rows (PyTorch's
//! FSDP2 layout). The chunk arithmetic itself is core's (`tch_dist_core::sharding::chunk`,
//! shared with tensor parallelism's chunk specs); this file adds the padding and the copies
//! in and out of the collectives' rank-major buffers.

use tch::Tensor;
use tch_dist_core::sharding::chunk::{chunk_bounds, split_size};

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
    /// The sharded dimension (0 unless `shard_placement_fn` chose another).
    dim: usize,
    rows: i64,
    row_numel: i64,
    chunk_rows: i64,
    world: i64,
    rank: i64,
}

impl ShardLayout {
    /// The layout of a parameter of `shape` (a scalar counts as one row) on `rank` of `world`.
    pub fn new(shape: &[i64], world: usize, rank: usize) -> ShardLayout {
        Self::along(shape, 0, world, rank)
    }

    /// The same, sharded along `dim` (a "row" is then a slice at one index of `dim`); `dim`
    /// must be a dimension of `shape` (or 0).
    pub fn along(shape: &[i64], dim: usize, world: usize, rank: usize) -> ShardLayout {
        let dim = if dim < shape.len() { dim } else { 0 };
        let (rows, row_numel) = match shape.get(dim) {
            Some(rows) => (*rows, shape.iter().product::<i64>() / (*rows).max(1)),
            None => (1, 1),
        };
        let row_numel = if rows == 0 {
            shape
                .iter()
                .enumerate()
                .filter(|(i, _)| *i != dim)
                .map(|(_, s)| *s)
                .product()
        } else {
            row_numel
        };
        let world = world.max(1);
        ShardLayout {
            shape: shape.to_vec(),
            dim,
            rows,
            row_numel,
            chunk_rows: split_size(rows, world),
            world: world as i64,
            rank: rank as i64,
        }
    }

    /// The full (unsharded) shape.
    pub fn shape(&self) -> &[i64] {
        &self.shape
    }

    /// The sharded dimension.
    pub fn dim(&self) -> usize {
        self.dim
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
        self.bounds().0
    }

    /// Rows this rank holds (without padding).
    pub fn local_rows(&self) -> i64 {
        self.bounds().1
    }

    /// This rank's `(first row, rows)`: `torch.chunk`'s chunk `rank` of `world`.
    fn bounds(&self) -> (i64, i64) {
        chunk_bounds(self.rows, self.world as usize, self.rank as usize)
    }

    /// Elements this rank holds (without padding).
    pub fn local_numel(&self) -> i64 {
        self.local_rows() * self.row_numel
    }

    /// The shape of this rank's shard: the full shape with `local_rows` along the sharded
    /// dimension (`[local_rows]` for a scalar).
    pub fn local_shape(&self) -> Vec<i64> {
        if self.shape.is_empty() {
            return vec![self.local_rows()];
        }
        let mut s = self.shape.clone();
        s[self.dim] = self.local_rows();
        s
    }

    /// Where this rank's shard starts in the full tensor, per dimension.
    pub fn offsets(&self) -> Vec<i64> {
        let mut o = vec![0; self.shape.len().max(1)];
        o[self.dim] = self.row_offset();
        o
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

/// Moving tensors between the full shape and the rank-major layout of the collectives
/// (`[world, padded_numel]`: rank r's padded shard in row r). Called under `no_grad`.
impl ShardLayout {
    /// The full shape with the sharded dimension split into `[world, chunk_rows]` (even
    /// layouts only).
    fn split_shape(&self) -> Vec<i64> {
        let mut s = self.shape[..self.dim].to_vec();
        s.push(self.world);
        s.push(self.chunk_rows);
        s.extend(&self.shape[self.dim + 1..]);
        s
    }

    /// `[world, local_shape...]` with every rank's shard as if full-sized (even layouts).
    fn rank_major_shape(&self) -> Vec<i64> {
        let mut s = vec![self.world];
        let mut local = self.shape.clone();
        local[self.dim] = self.chunk_rows;
        s.extend(local);
        s
    }

    /// The permutation taking the split shape to rank-major order (rank axis first).
    fn rank_axis_front(&self) -> Vec<i64> {
        let n = self.shape.len() as i64 + 1;
        let d = self.dim as i64;
        std::iter::once(d)
            .chain((0..n).filter(|&i| i != d))
            .collect()
    }

    /// The inverse permutation of [`rank_axis_front`](Self::rank_axis_front).
    fn rank_axis_back(&self) -> Vec<i64> {
        let n = self.shape.len() as i64 + 1;
        let d = self.dim as i64;
        (1..=d).chain(std::iter::once(0)).chain(d + 1..n).collect()
    }

    /// This rank's rows of `full` (a view).
    pub fn local_of(&self, full: &Tensor) -> Tensor {
        if self.shape.is_empty() {
            return full
                .reshape([1])
                .narrow(0, self.row_offset(), self.local_rows());
        }
        full.narrow(self.dim as i64, self.row_offset(), self.local_rows())
    }

    /// Writes the full tensor `dst` from `rows` (`[world, padded_numel]`, rank-major).
    pub fn copy_from_rank_major(&self, dst: &Tensor, rows: &Tensor) {
        if self.dim == 0 && self.even() {
            dst.view([self.world, self.padded_numel()]).copy_(rows);
        } else if self.dim == 0 {
            dst.view([self.numel()])
                .copy_(&rows.reshape([-1]).narrow(0, 0, self.numel()));
        } else {
            let src = rows
                .view(self.rank_major_shape().as_slice())
                .permute(self.rank_axis_back());
            dst.view(self.split_shape().as_slice()).copy_(&src);
        }
    }

    /// Writes `dst` (`[world, padded_numel]`, rank-major; padding left as it is) from the full
    /// tensor `full`.
    pub fn copy_to_rank_major(&self, dst: &Tensor, full: &Tensor) {
        if self.dim == 0 && self.even() {
            dst.shallow_clone()
                .copy_(&full.reshape([self.world, self.padded_numel()]));
        } else if self.dim == 0 {
            // The first `numel` elements of the rank-major buffer, row by row.
            let flat = full.reshape([-1]);
            let mut done = 0;
            for r in 0..self.world {
                let n = (self.numel() - done).clamp(0, self.padded_numel());
                if n == 0 {
                    break;
                }
                dst.get(r).narrow(0, 0, n).copy_(&flat.narrow(0, done, n));
                done += n;
            }
        } else {
            let src = full
                .reshape(self.split_shape().as_slice())
                .permute(self.rank_axis_front());
            dst.view(self.rank_major_shape().as_slice()).copy_(&src);
        }
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
    fn other_dims() {
        let l = ShardLayout::along(&[3, 8], 1, 2, 1);
        assert_eq!((l.rows(), l.row_numel(), l.chunk_rows()), (8, 3, 4));
        assert_eq!(l.local_shape(), vec![3, 4]);
        assert_eq!(l.offsets(), vec![0, 4]);
        assert!(l.even());
        assert_eq!(ShardLayout::new(&[5, 2], 2, 1).offsets(), vec![3, 0]);
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
