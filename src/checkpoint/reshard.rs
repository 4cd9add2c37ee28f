//! Resharding on load, DCP's `_reshard` step of `default_planner.py` (`create_read_items`
//! over overlapping chunks): each rank builds the part of a global tensor it holds from
//! whichever saved pieces overlap it, whatever world size and sharding wrote them (N ranks'
//! shards into M ranks' shards, or whole tensors).
//!
//! [`overlap`] is the arithmetic, pure over offsets and lengths (unit-tested below);
//! [`check`] checks the model against the checkpoint before anything is read; [`Staged`]
//! builds a target's values from the overlaps as the reads arrive and counts its coverage.

use std::collections::{BTreeMap, HashSet};

use tch::{Kind, Tensor};

use super::storage::{self, Pieces, TensorEntry};
use super::CheckpointError;
use super::CheckpointProblem;
use crate::state_dict::flat::Entry;

/// Where a saved piece and a rank's part overlap in one dimension: `len` values starting
/// at `dst` in the part and at `src` in the piece.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Span {
    /// The first overlapping index, counted from the part's start.
    pub dst: i64,
    /// The same index, counted from the piece's start.
    pub src: i64,
    /// How many indices overlap.
    pub len: i64,
}

/// The overlap of a rank's part (`part_offsets`, `part_size` in the global tensor) and a
/// saved piece (`piece_offsets`, `piece_size`), one [`Span`] per dimension; `None` when
/// they do not overlap, or are not of the same number of dimensions. A scalar overlaps a
/// scalar (no dimension, `Some(vec![])`).
pub(super) fn overlap(
    part_offsets: &[i64],
    part_size: &[i64],
    piece_offsets: &[i64],
    piece_size: &[i64],
) -> Option<Vec<Span>> {
    let dims = part_size.len();
    if part_offsets.len() != dims || piece_offsets.len() != dims || piece_size.len() != dims {
        return None;
    }
    (0..dims)
        .map(|d| {
            let lo = part_offsets[d].max(piece_offsets[d]);
            let hi = (part_offsets[d] + part_size[d]).min(piece_offsets[d] + piece_size[d]);
            (hi > lo).then(|| Span {
                dst: lo - part_offsets[d],
                src: lo - piece_offsets[d],
                len: hi - lo,
            })
        })
        .collect()
}

/// Checks the model against the checkpoint: every saved tensor is a target of some rank of
/// the load (`held`: this rank's targets' FQNs and the other ranks', which differ only
/// between pipeline stages), every target is saved with its global shape and dtype (from
/// the manifest alone: before any data is read).
pub(super) fn check(
    rank: usize,
    targets: &[Entry],
    held: &HashSet<String>,
    tensors: &BTreeMap<String, TensorEntry>,
) -> Result<(), CheckpointError> {
    let names: HashSet<&str> = targets.iter().map(|t| t.fqn.as_str()).collect();
    if let Some(fqn) = tensors
        .keys()
        .find(|k| !names.contains(k.as_str()) && !held.contains(k.as_str()))
    {
        return Err(CheckpointProblem::UnexpectedKey { fqn: fqn.clone() }.on(rank));
    }
    for t in targets {
        let saved = tensors
            .get(&t.fqn)
            .ok_or_else(|| CheckpointProblem::MissingKey { fqn: t.fqn.clone() }.on(rank))?;
        if saved.shape != t.global {
            return Err(CheckpointProblem::Shape {
                fqn: t.fqn.clone(),
                expected: t.global.clone(),
                found: saved.shape.clone(),
            }
            .on(rank));
        }
        let expected = storage::dtype_name(t.tensor.kind());
        if saved.dtype != expected {
            return Err(CheckpointProblem::Dtype {
                fqn: t.fqn.clone(),
                expected,
                found: saved.dtype.clone(),
            }
            .on(rank));
        }
    }
    Ok(())
}

/// Builds each of this rank's tensors from whole decoded pieces (a checkpoint of format 2,
/// read whole): (the target's tensor, its values); the targets were [`check`]ed against
/// the checkpoint first. Nothing in the model changes here.
pub(super) fn assemble(
    rank: usize,
    targets: &[Entry],
    pieces: &Pieces,
) -> Result<Vec<(Tensor, Tensor)>, CheckpointError> {
    targets
        .iter()
        .map(|t| {
            let mut staged = Staged::new(t);
            for p in pieces.get(&t.fqn).map_or(&[][..], Vec::as_slice) {
                staged.place(t, &p.offsets, &p.values);
            }
            staged.finish(rank, t)
        })
        .collect()
}

/// One target's values as a load builds them: a fresh contiguous tensor of the target's
/// shape, dtype and device, filled piece by piece as the reads arrive (each read is copied
/// in and dropped, so a load holds one read beside its staged values), and the regions
/// filled so far, from which [`Staged::finish`] counts the coverage.
pub(super) struct Staged {
    /// The values, contiguous (a read may write its bytes straight into them).
    pub values: Tensor,
    /// Each region filled, one [`Span`] per dimension, counted from the target's start.
    filled: Vec<Vec<Span>>,
}

impl Staged {
    /// Zeros of `target`'s shape, dtype and device, nothing filled yet.
    pub fn new(target: &Entry) -> Self {
        let t = &target.tensor;
        Staged {
            values: Tensor::zeros(t.size(), (t.kind(), t.device())),
            filled: Vec::new(),
        }
    }

    /// Records that the region `spans` (from [`overlap`] with the target's part) was
    /// written into [`Staged::values`] by the caller.
    pub fn record(&mut self, spans: Vec<Span>) {
        self.filled.push(spans);
    }

    /// Copies the overlap of a piece (`values` at `offsets` in the global tensor) with the
    /// target's part into place; a piece of another number of dimensions is left to the
    /// coverage check.
    pub fn place(&mut self, target: &Entry, offsets: &[i64], values: &Tensor) {
        let size = target.tensor.size();
        let Some(spans) = overlap(&target.offsets, &size, offsets, &values.size()) else {
            return;
        };
        let (mut dst, mut src) = (self.values.shallow_clone(), values.shallow_clone());
        for (d, s) in spans.iter().enumerate() {
            dst = dst.narrow(d as i64, s.dst, s.len);
            src = src.narrow(d as i64, s.src, s.len);
        }
        dst.copy_(&src);
        self.record(spans);
    }

    /// The target's tensor and its values, when the regions filled cover every value of the
    /// target's part; else [`CheckpointProblem::Incomplete`].
    pub fn finish(self, rank: usize, target: &Entry) -> Result<(Tensor, Tensor), CheckpointError> {
        let covered = covered(&target.tensor.size(), &self.filled);
        let needed = target.tensor.numel() as i64;
        if covered != needed {
            return Err(CheckpointProblem::Incomplete {
                fqn: target.fqn.clone(),
                covered,
                needed,
            }
            .on(rank));
        }
        Ok((target.tensor.shallow_clone(), self.values))
    }
}

/// How many values of a part of shape `size` the regions `filled` cover, each counted once:
/// the sum of their volumes when no two of them meet (a checkpoint's pieces never do),
/// else counted on a mask of the part (a checkpoint that holds some values twice).
fn covered(size: &[i64], filled: &[Vec<Span>]) -> i64 {
    let volume = |r: &[Span]| r.iter().map(|s| s.len).product::<i64>();
    let meet = |a: &[Span], b: &[Span]| {
        a.iter()
            .zip(b)
            .all(|(x, y)| x.dst < y.dst + y.len && y.dst < x.dst + x.len)
    };
    let disjoint = filled
        .iter()
        .enumerate()
        .all(|(i, a)| filled[i + 1..].iter().all(|b| !meet(a, b)));
    if disjoint {
        return filled.iter().map(|r| volume(r)).sum();
    }
    let mask = Tensor::zeros(size, (Kind::Bool, tch::Device::Cpu));
    for r in filled {
        let mut m = mask.shallow_clone();
        for (d, s) in r.iter().enumerate() {
            m = m.narrow(d as i64, s.dst, s.len);
        }
        let _ = m.fill_(1);
    }
    mask.sum(Kind::Int64).int64_value(&[])
}

#[cfg(test)]
mod tests {
    use super::{covered, overlap, Span};

    /// A region of the global tensor: its offsets and its size.
    type Region = (Vec<i64>, Vec<i64>);

    /// `rows` split over `world` ranks as `torch.chunk` (and tch-dist's shards) split
    /// them: `ceil(rows / world)` each, the last ones shorter or empty.
    fn chunks(rows: i64, world: i64) -> Vec<(i64, i64)> {
        let each = (rows + world - 1) / world;
        (0..world)
            .map(|r| {
                let start = (r * each).min(rows);
                (start, (start + each).min(rows) - start)
            })
            .collect()
    }

    /// Row shards of a `[rows, cols]` tensor over `world` ranks.
    fn row_shards(rows: i64, cols: i64, world: i64) -> Vec<Region> {
        chunks(rows, world)
            .into_iter()
            .map(|(start, len)| (vec![start, 0], vec![len, cols]))
            .collect()
    }

    /// Checks that `saved` pieces, through [`overlap`], give every index of `part` exactly
    /// once and from the same global index; returns how many pieces overlap it.
    fn assemble_from(part: &Region, saved: &[Region]) -> usize {
        let (offsets, size) = part;
        let total: i64 = size.iter().product();
        let mut hits = vec![0u32; total as usize];
        let mut used = 0;
        for (piece_offsets, piece_size) in saved {
            let Some(spans) = overlap(offsets, size, piece_offsets, piece_size) else {
                continue;
            };
            used += 1;
            for (d, s) in spans.iter().enumerate() {
                // The same global index on both sides, inside both.
                assert_eq!(offsets[d] + s.dst, piece_offsets[d] + s.src, "dim {d}");
                assert!(s.dst >= 0 && s.dst + s.len <= size[d], "dim {d}: {s:?}");
                assert!(
                    s.src >= 0 && s.src + s.len <= piece_size[d],
                    "dim {d}: {s:?}"
                );
            }
            // Mark every covered index of the part (row-major).
            let mut index = vec![0i64; size.len()];
            loop {
                let inside = spans
                    .iter()
                    .zip(&index)
                    .all(|(s, &i)| i >= s.dst && i < s.dst + s.len);
                if inside {
                    let flat = index.iter().zip(size).fold(0, |acc, (&i, &n)| acc * n + i);
                    hits[flat as usize] += 1;
                }
                let Some(d) = (0..size.len()).rev().find(|&d| index[d] + 1 < size[d]) else {
                    break;
                };
                index[d] += 1;
                index[d + 1..].iter_mut().for_each(|i| *i = 0);
            }
        }
        assert!(
            hits.iter().all(|&h| h == 1),
            "{part:?} from {saved:?}: {hits:?}"
        );
        used
    }

    #[test]
    fn a_split_at_2_loads_at_3() {
        let saved = row_shards(8, 3, 2);
        let parts = row_shards(8, 3, 3);
        // [0, 3) from the first piece, [3, 6) from both, [6, 8) from the second.
        let used: Vec<usize> = parts.iter().map(|p| assemble_from(p, &saved)).collect();
        assert_eq!(used, [1, 2, 1]);
        assert_eq!(
            overlap(&parts[1].0, &parts[1].1, &saved[0].0, &saved[0].1),
            Some(vec![
                Span {
                    dst: 0,
                    src: 3,
                    len: 1
                },
                Span {
                    dst: 0,
                    src: 0,
                    len: 3
                },
            ])
        );
    }

    #[test]
    fn a_split_at_2_loads_at_4() {
        let saved = row_shards(8, 3, 2);
        let used: Vec<usize> = row_shards(8, 3, 4)
            .iter()
            .map(|p| assemble_from(p, &saved))
            .collect();
        assert_eq!(used, [1, 1, 1, 1]);
    }

    #[test]
    fn a_split_at_2_loads_at_1() {
        let saved = row_shards(8, 3, 2);
        assert_eq!(assemble_from(&(vec![0, 0], vec![8, 3]), &saved), 2);
    }

    #[test]
    fn an_uneven_split_loads_at_another_world_size() {
        // 7 rows over 2 ranks (4, 3) into 3 ranks (3, 3, 1), and 5 rows over 4 ranks
        // (2, 2, 1, 0: an empty last shard) into 2.
        let used: Vec<usize> = row_shards(7, 2, 3)
            .iter()
            .map(|p| assemble_from(p, &row_shards(7, 2, 2)))
            .collect();
        assert_eq!(used, [1, 2, 1]);
        let saved: Vec<Region> = row_shards(5, 2, 4)
            .into_iter()
            .filter(|(_, size)| size[0] > 0)
            .collect();
        let used: Vec<usize> = row_shards(5, 2, 2)
            .iter()
            .map(|p| assemble_from(p, &saved))
            .collect();
        assert_eq!(used, [2, 2]);
    }

    #[test]
    fn two_dimensional_pieces_load_as_column_shards() {
        // A [4, 6] tensor saved as a 2 x 2 grid of [2, 3] blocks, loaded as three [4, 2]
        // column shards: the middle one takes a column from each block.
        let saved: Vec<Region> = [(0, 0), (0, 3), (2, 0), (2, 3)]
            .into_iter()
            .map(|(r, c)| (vec![r, c], vec![2, 3]))
            .collect();
        let used: Vec<usize> = (0..3)
            .map(|k| assemble_from(&(vec![0, 2 * k], vec![4, 2]), &saved))
            .collect();
        assert_eq!(used, [2, 4, 2]);
    }

    /// A region of a part from `(dst, len)` per dimension.
    fn region(dims: &[(i64, i64)]) -> Vec<Span> {
        dims.iter()
            .map(|&(dst, len)| Span { dst, src: 0, len })
            .collect()
    }

    #[test]
    fn coverage_counts_each_value_once() {
        // A [4, 6] part: two disjoint halves cover it; a half twice and a gap do not.
        let top = region(&[(0, 2), (0, 6)]);
        let bottom = region(&[(2, 2), (0, 6)]);
        assert_eq!(covered(&[4, 6], &[top.clone(), bottom.clone()]), 24);
        assert_eq!(covered(&[4, 6], &[top.clone(), top.clone()]), 12);
        assert_eq!(covered(&[4, 6], std::slice::from_ref(&top)), 12);
        // Overlapping regions that together cover the part: the mask counts 24, not 30.
        let middle = region(&[(1, 2), (1, 3)]);
        assert_eq!(covered(&[4, 6], &[top, bottom, middle]), 24);
        // Side by side in one dimension but apart in another: disjoint.
        let left = region(&[(0, 4), (0, 3)]);
        let right = region(&[(0, 4), (3, 3)]);
        assert_eq!(covered(&[4, 6], &[left, right]), 24);
        // A scalar is covered by its one region; nothing covers nothing.
        assert_eq!(covered(&[], &[vec![]]), 1);
        assert_eq!(covered(&[4, 6], &[]), 0);
    }

    #[test]
    fn pieces_that_do_not_fit_do_not_overlap() {
        // Side by side, another number of dimensions, an empty piece.
        assert_eq!(overlap(&[0], &[4], &[4], &[4]), None);
        assert_eq!(overlap(&[0, 0], &[4, 2], &[0], &[4]), None);
        assert_eq!(overlap(&[0], &[4], &[2], &[0]), None);
        // A scalar is one piece of itself.
        assert_eq!(overlap(&[], &[], &[], &[]), Some(vec![]));
    }
}
