//! What a rank reads on load, from the files' headers alone: for each of its targets (its
//! part of a global tensor), the saved pieces that overlap it and the dim-0 rows of each to
//! read, as one contiguous byte range (DCP's `create_default_local_load_plan` and
//! `create_read_items_for_chunk_list` in `default_planner.py` / `reshard.py`, which plan
//! the same overlaps but read each whole tensor in PyTorch's safetensors reader).
//!
//! A piece's rows are contiguous bytes, so the rows that overlap a target are one range:
//! exactly the rank's bytes when the tensor is sharded on dim 0 (fully_shard, colwise),
//! the overlapping rows whole when it is sharded on another dim (rowwise: the rank reads
//! the other ranks' columns of those rows too). With digests the range is widened to whole
//! digest blocks, so that what is read can be checked. Pure arithmetic, unit-tested below.

use std::collections::HashMap;

use super::index::PieceHeader;
use super::reshard::overlap;

/// A region of a global tensor a rank needs: a target's FQN, offsets and local shape.
#[derive(Debug, Clone, Copy)]
pub(super) struct Want<'a> {
    /// The FQN.
    pub fqn: &'a str,
    /// Where the part starts in the global tensor.
    pub offsets: &'a [i64],
    /// The part's shape.
    pub size: &'a [i64],
}

/// One read: rows `rows` of piece `piece` of file `file`, at bytes `bytes` of that file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Read {
    /// The file's index in the list given to [`plan`].
    pub file: usize,
    /// The piece's index in that file's header.
    pub piece: usize,
    /// The piece's dim-0 rows read, `[first, end)` (`0..1` for a scalar).
    pub rows: (i64, i64),
    /// Their bytes in the file, `[start, end)`.
    pub bytes: (u64, u64),
}

/// The reads that give every region in `wants` from the pieces of `files` (each file's
/// header pieces, with the rows per digest block when the reads must be checked: the rows
/// read are then widened to whole blocks). A region no piece overlaps gets no read (the
/// coverage check reports it).
pub(super) fn plan(wants: &[Want<'_>], files: &[Vec<(PieceHeader, Option<u64>)>]) -> Vec<Read> {
    let mut by_fqn: HashMap<&str, Vec<(usize, usize)>> = HashMap::new();
    for (f, pieces) in files.iter().enumerate() {
        for (p, (piece, _)) in pieces.iter().enumerate() {
            by_fqn.entry(piece.fqn.as_str()).or_default().push((f, p));
        }
    }
    let mut out = Vec::new();
    for want in wants {
        for &(f, p) in by_fqn.get(want.fqn).map_or(&[][..], Vec::as_slice) {
            let (piece, block) = &files[f][p];
            let Some(spans) = overlap(want.offsets, want.size, &piece.offsets, &piece.shape) else {
                continue;
            };
            let (mut first, mut end) = match spans.first() {
                Some(s) => (s.src, s.src + s.len),
                None => (0, 1),
            };
            if let Some(b) = block.map(|b| b as i64) {
                first = first / b * b;
                end = ((end + b - 1) / b * b).min(piece.rows());
            }
            let row = piece.row_bytes();
            out.push(Read {
                file: f,
                piece: p,
                rows: (first, end),
                bytes: (
                    piece.start + first as u64 * row,
                    piece.start + end as u64 * row,
                ),
            });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A piece of `fqn` at `offsets` of `shape`, f32, its bytes from `start`.
    fn piece(fqn: &str, offsets: &[i64], shape: &[i64], start: u64) -> PieceHeader {
        let numel: i64 = shape.iter().product();
        PieceHeader {
            fqn: fqn.into(),
            dtype: "F32".into(),
            shape: shape.to_vec(),
            offsets: offsets.to_vec(),
            start,
            end: start + 4 * numel as u64,
        }
    }

    fn want<'a>(fqn: &'a str, offsets: &'a [i64], size: &'a [i64]) -> Want<'a> {
        Want { fqn, offsets, size }
    }

    /// A [8, 3] tensor saved at 2 ranks (4 rows each, one file each, bytes from 100).
    fn saved_at_2(block: Option<u64>) -> Vec<Vec<(PieceHeader, Option<u64>)>> {
        vec![
            vec![(piece("w", &[0, 0], &[4, 3], 100), block)],
            vec![(piece("w", &[4, 0], &[4, 3], 100), block)],
        ]
    }

    #[test]
    fn a_rank_at_4_reads_its_rows_of_one_piece() {
        let files = saved_at_2(None);
        // Rank 1 of 4: rows 2..4, the second half of the first piece: 2 rows of 12 bytes.
        let reads = plan(&[want("w", &[2, 0], &[2, 3])], &files);
        assert_eq!(
            reads,
            [Read {
                file: 0,
                piece: 0,
                rows: (2, 4),
                bytes: (124, 148)
            }]
        );
        // Every rank of 4 reads 24 bytes: the checkpoint's 96 once in all.
        let total: u64 = (0..4)
            .flat_map(|r| plan(&[want("w", &[2 * r, 0], &[2, 3])], &files))
            .map(|r| r.bytes.1 - r.bytes.0)
            .sum();
        assert_eq!(total, 96);
    }

    #[test]
    fn a_rank_at_3_reads_rows_of_two_pieces() {
        // Rank 1 of 3 (rows 3..6): the first piece's last row, the second's first two.
        let reads = plan(&[want("w", &[3, 0], &[3, 3])], &saved_at_2(None));
        let rows: Vec<_> = reads.iter().map(|r| (r.file, r.rows, r.bytes)).collect();
        assert_eq!(rows, [(0, (3, 4), (136, 148)), (1, (0, 2), (100, 124))]);
    }

    #[test]
    fn digest_blocks_widen_the_rows_read() {
        // Blocks of 3 rows: rows 2..4 of a 4-row piece are read as 0..4 (two blocks), rows
        // 0..2 as 0..3.
        let files = saved_at_2(Some(3));
        let reads = plan(&[want("w", &[2, 0], &[2, 3])], &files);
        assert_eq!((reads[0].rows, reads[0].bytes), ((0, 4), (100, 148)));
        let reads = plan(&[want("w", &[4, 0], &[2, 3])], &files);
        assert_eq!((reads[0].rows, reads[0].bytes), ((0, 3), (100, 136)));
    }

    #[test]
    fn a_column_shard_reads_the_overlapping_rows_whole() {
        // A [2, 8] tensor saved as two [2, 4] column pieces; a rank needing columns 2..4
        // reads both rows of the first piece (its rows hold the other columns too).
        let files = vec![vec![
            (piece("w", &[0, 0], &[2, 4], 0), None),
            (piece("w", &[0, 4], &[2, 4], 32), None),
        ]];
        let reads = plan(&[want("w", &[0, 2], &[2, 2])], &files);
        assert_eq!(
            reads,
            [Read {
                file: 0,
                piece: 0,
                rows: (0, 2),
                bytes: (0, 32)
            }]
        );
    }

    #[test]
    fn scalars_other_tensors_and_missing_pieces() {
        let files = vec![vec![
            (piece("step", &[], &[], 0), Some(1)),
            (piece("w", &[0], &[4], 4), Some(16384)),
        ]];
        let reads = plan(&[want("step", &[], &[]), want("b", &[0], &[2])], &files);
        // The scalar is one row; `b` has no piece (left to the coverage check); `w` is not
        // wanted, so not read.
        assert_eq!(
            reads,
            [Read {
                file: 0,
                piece: 0,
                rows: (0, 1),
                bytes: (0, 4)
            }]
        );
        // A 1-D piece: its block of 16384 rows is the whole piece.
        let reads = plan(&[want("w", &[1], &[1])], &files);
        assert_eq!((reads[0].rows, reads[0].bytes), ((0, 4), (4, 20)));
    }
}
