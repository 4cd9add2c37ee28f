//! `torch.chunk` arithmetic and dim normalisation, written once: the chunk specs, the linear
//! sharders and the output resharding hooks all split a length and resolve a negative dim
//! with these functions.
//!
//! A length `len` split into `parts` chunks gets PyTorch's sizes: every chunk has
//! `ceil(len / parts)` entries ([`split_size`], PyTorch's `get_split_size`) except the last
//! non-empty one, which has what is left, and the chunks past the data are empty
//! ([`chunk_sizes`], `get_chunked_dim_size`). Offsets ([`chunk_offsets`]) are
//! `split * i` clamped to `len`: the one deliberate difference from PyTorch's
//! `build_metadata`, whose trailing empty chunks get offsets past the end, which
//! `torch.narrow` refuses.
//!
//! ```
//! use tch_dist_core::sharding::chunk::{chunk_offsets, chunk_sizes};
//!
//! assert_eq!(chunk_sizes(10, 4), [3, 3, 3, 1]);
//! assert_eq!(chunk_offsets(10, 4), [0, 3, 6, 9]);
//! // More parts than entries: trailing empty chunks, at offset `len`.
//! assert_eq!(chunk_sizes(2, 4), [1, 1, 0, 0]);
//! assert_eq!(chunk_offsets(2, 4), [0, 1, 2, 2]); // PyTorch: [0, 1, 2, 3]
//! ```

/// PyTorch's `get_split_size`: `ceil(len / parts)`, the size of every full chunk. Zero
/// parts give 0.
///
/// ```
/// use tch_dist_core::sharding::chunk::split_size;
/// assert_eq!(split_size(10, 4), 3);
/// assert_eq!(split_size(8, 4), 2);
/// assert_eq!(split_size(0, 3), 0);
/// ```
pub fn split_size(len: i64, parts: usize) -> i64 {
    match i64::try_from(parts) {
        Ok(0) => 0,
        Ok(p) => len / p + i64::from(len % p != 0),
        Err(_) => i64::from(len > 0), // more parts than any length: chunks of at most 1
    }
}

/// `(offset, size)` of chunk `index` of `len` entries split into `parts` chunks: the size
/// PyTorch's `get_chunked_dim_size` gives, the offset `split * index` clamped to `len`.
///
/// ```
/// use tch_dist_core::sharding::chunk::chunk_bounds;
/// assert_eq!(chunk_bounds(7, 2, 0), (0, 4));
/// assert_eq!(chunk_bounds(7, 2, 1), (4, 3));
/// assert_eq!(chunk_bounds(2, 4, 3), (2, 0));
/// ```
pub fn chunk_bounds(len: i64, parts: usize, index: usize) -> (i64, i64) {
    let split = split_size(len, parts);
    let index = i64::try_from(index).unwrap_or(i64::MAX);
    let start = split.saturating_mul(index).clamp(0, len.max(0));
    let end = split
        .saturating_mul(index.saturating_add(1))
        .clamp(0, len.max(0));
    (start, end - start)
}

/// The sizes of the `parts` chunks of `len` entries, in order (`torch.chunk`'s sizes,
/// padded with empty chunks up to `parts`). They add up to `len` (for `len >= 0` and
/// `parts >= 1`).
///
/// ```
/// use tch_dist_core::sharding::chunk::chunk_sizes;
/// assert_eq!(chunk_sizes(7, 2), [4, 3]);
/// assert_eq!(chunk_sizes(5, 4), [2, 2, 1, 0]);
/// assert!(chunk_sizes(5, 0).is_empty());
/// ```
pub fn chunk_sizes(len: i64, parts: usize) -> Vec<i64> {
    (0..parts).map(|i| chunk_bounds(len, parts, i).1).collect()
}

/// The offsets of the `parts` chunks of `len` entries, in order; an empty chunk past the
/// data starts at `len`.
///
/// ```
/// use tch_dist_core::sharding::chunk::chunk_offsets;
/// assert_eq!(chunk_offsets(7, 2), [0, 4]);
/// assert_eq!(chunk_offsets(5, 4), [0, 2, 4, 5]);
/// ```
pub fn chunk_offsets(len: i64, parts: usize) -> Vec<i64> {
    (0..parts).map(|i| chunk_bounds(len, parts, i).0).collect()
}

/// `dim` as an index into a shape of `ndim` dims, a negative dim counting from the end
/// (`-1` is the last); `None` when it is not in `-ndim..ndim`.
///
/// ```
/// use tch_dist_core::sharding::chunk::normalize_dim;
/// assert_eq!(normalize_dim(-1, 3), Some(2));
/// assert_eq!(normalize_dim(1, 3), Some(1));
/// assert_eq!(normalize_dim(3, 3), None);
/// assert_eq!(normalize_dim(-4, 3), None);
/// assert_eq!(normalize_dim(0, 0), None); // a scalar has no dim
/// ```
pub fn normalize_dim(dim: i64, ndim: usize) -> Option<usize> {
    let n = i64::try_from(ndim).ok()?;
    let d = if dim < 0 { dim.checked_add(n)? } else { dim };
    if (0..n).contains(&d) {
        usize::try_from(d).ok()
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_tile_the_length_like_torch_chunk() {
        for len in 0..20i64 {
            for parts in 1..9usize {
                let sizes = chunk_sizes(len, parts);
                let offsets = chunk_offsets(len, parts);
                assert_eq!(sizes.iter().sum::<i64>(), len, "{len} over {parts}");
                // torch.chunk: chunks of ceil(len / parts), the rest empty.
                let split = (len + parts as i64 - 1) / parts as i64;
                let mut expected_off = 0;
                for (i, (&s, &o)) in sizes.iter().zip(&offsets).enumerate() {
                    assert_eq!(s, (len - i as i64 * split).clamp(0, split));
                    assert_eq!(o, expected_off, "{len} over {parts}, chunk {i}");
                    expected_off += s;
                }
            }
        }
    }

    #[test]
    fn extreme_arguments_do_not_overflow() {
        assert_eq!(chunk_bounds(i64::MAX, 2, usize::MAX), (i64::MAX, 0));
        assert_eq!(split_size(5, usize::MAX), 1);
        assert_eq!(normalize_dim(i64::MIN, 2), None);
        assert_eq!(normalize_dim(-2, 2), Some(0));
    }
}
