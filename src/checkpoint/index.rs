//! A safetensors file's index: its header (8-byte length, then JSON: each tensor's dtype,
//! shape and byte range, and `__metadata__`'s `DCP_SHARDING_INFO`) parsed without reading
//! the data, and the per-piece digests the manifest keeps so that a load can check exactly
//! the bytes it reads. `_hf_storage.py`'s `_get_safetensors_file_metadata` reads the same
//! header (PyTorch keeps no digest).
//!
//! A piece's digests are SHA-256s of blocks of whole dim-0 rows, [`DIGEST_BLOCK_BYTES`] or
//! less each (one row when a row is larger): a rank that needs rows `a..b` of a piece reads
//! the blocks that hold them (at most one block more at each end) and checks each.

use std::collections::HashMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::storage;
use super::CheckpointError;
use super::CheckpointProblem;

/// The most bytes one digest of a piece covers (whole dim-0 rows; a row larger than this
/// is a block of its own). The trade-off: a load reads at most one block more than it needs
/// at each end of each range it reads (so that it can check what it read), and the manifest
/// holds one SHA-256 (64 characters) per block: 0.1% of the checkpoint at 64 KiB.
///
/// ```
/// // A [4096, 1024] f32 weight (4 KiB rows) has one digest per 16 rows.
/// assert_eq!(tch_dist::checkpoint::DIGEST_BLOCK_BYTES / (1024 * 4), 16);
/// ```
pub const DIGEST_BLOCK_BYTES: u64 = 64 * 1024;

/// The largest header this reader accepts (safetensors' own limit).
const MAX_HEADER: u64 = 100_000_000;

/// One tensor of a safetensors file, as its header says.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct PieceHeader {
    /// The FQN.
    pub fqn: String,
    /// safetensors' dtype name (`F32`).
    pub dtype: String,
    /// The piece's shape.
    pub shape: Vec<i64>,
    /// Where it starts in the global tensor (`DCP_SHARDING_INFO`; zeros without).
    pub offsets: Vec<i64>,
    /// Its bytes in the file, `[start, end)`, counted from the file's start.
    pub start: u64,
    /// See `start`.
    pub end: u64,
}

impl PieceHeader {
    /// Its dim-0 rows (a scalar is one row).
    pub fn rows(&self) -> i64 {
        self.shape.first().copied().unwrap_or(1)
    }

    /// The bytes of one dim-0 row.
    pub fn row_bytes(&self) -> u64 {
        match self.rows() {
            0 => 0,
            rows => (self.end - self.start) / rows as u64,
        }
    }
}

/// The `__metadata__` key a tch-dist save adds to every file it writes (the manifest's
/// format as its value; PyTorch's reader ignores it): a folder of such files without a
/// manifest is an interrupted tch-dist save, never loaded, where one without them is
/// PyTorch's own output.
pub(super) const MARK: &str = "TCH_DIST_FORMAT";

/// A safetensors file's header.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Header {
    /// The header's own length: 8 + the JSON's; the data start there.
    pub len: u64,
    /// Whether a tch-dist save wrote it ([`MARK`] in `__metadata__`).
    pub tch_dist: bool,
    /// Every tensor of the file, in the order of their bytes.
    pub pieces: Vec<PieceHeader>,
}

/// A piece's digests in the manifest: blocks of `block_rows` dim-0 rows (the last one
/// shorter), each block's SHA-256.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct PieceDigests {
    /// Rows per block.
    pub block_rows: u64,
    /// Each block's SHA-256 (hex), first rows first.
    pub sha256: Vec<String>,
}

/// The rows per digest block of a piece whose rows are `row_bytes` each.
pub(super) fn block_rows(row_bytes: u64) -> u64 {
    (DIGEST_BLOCK_BYTES / row_bytes.max(1)).max(1)
}

/// The header's length (8 + the JSON's) from a file's first 8 bytes, checked against the
/// file's length.
pub(super) fn header_len(
    rank: usize,
    path: &Path,
    first: [u8; 8],
    file_len: u64,
) -> Result<u64, CheckpointError> {
    let n = u64::from_le_bytes(first);
    if n > MAX_HEADER || n.saturating_add(8) > file_len {
        return Err(CheckpointProblem::Format {
            path: path.to_path_buf(),
            cause: format!("a safetensors header of {n} bytes in a file of {file_len}"),
        }
        .on(rank));
    }
    Ok(n + 8)
}

/// A tensor's entry in the header's JSON.
#[derive(Deserialize)]
struct Entry {
    dtype: String,
    shape: Vec<u64>,
    data_offsets: (u64, u64),
}

/// `DCP_SHARDING_INFO`'s value per FQN.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(super) struct ShardingInfo {
    pub saved_offsets: Vec<i64>,
}

/// Where a saved piece `fqn` of `shape` starts in its global tensor: its
/// `DCP_SHARDING_INFO` entry's `saved_offsets`, or the origin for a piece without one (a
/// whole tensor); offsets of another rank than the shape are the error's text.
pub(super) fn saved_offsets(
    info: Option<&ShardingInfo>,
    fqn: &str,
    shape: &[i64],
) -> Result<Vec<i64>, String> {
    match info {
        Some(i) if i.saved_offsets.len() == shape.len() => Ok(i.saved_offsets.clone()),
        Some(i) => Err(format!(
            "`{fqn}`: saved_offsets {:?} do not fit its shape {shape:?}",
            i.saved_offsets
        )),
        None => Ok(vec![0; shape.len()]),
    }
}

/// Parses `bytes`, a file's first [`Header::len`] bytes, of a file of `file_len` bytes:
/// every tensor's dtype (one tch holds), shape, offsets in the global tensor and bytes,
/// which must lie in the file and fit the shape.
pub(super) fn parse(
    rank: usize,
    path: &Path,
    bytes: &[u8],
    file_len: u64,
) -> Result<Header, CheckpointError> {
    let format = |cause: String| {
        CheckpointProblem::Format {
            path: path.to_path_buf(),
            cause,
        }
        .on(rank)
    };
    let first: [u8; 8] = bytes
        .get(..8)
        .and_then(|b| b.try_into().ok())
        .ok_or_else(|| format("shorter than a safetensors header".into()))?;
    let len = header_len(rank, path, first, file_len)?;
    let json = bytes
        .get(8..len as usize)
        .ok_or_else(|| format("shorter than its safetensors header".into()))?;
    let mut map: HashMap<String, serde_json::Value> =
        serde_json::from_slice(json).map_err(|e| format(format!("its header: {e}")))?;
    let meta: Option<HashMap<String, String>> = map
        .remove("__metadata__")
        .map(serde_json::from_value)
        .transpose()
        .map_err(|e| format(format!("its __metadata__: {e}")))?;
    let info: HashMap<String, ShardingInfo> =
        match meta.as_ref().and_then(|m| m.get("DCP_SHARDING_INFO")) {
            Some(json) => {
                serde_json::from_str(json).map_err(|e| format(format!("DCP_SHARDING_INFO: {e}")))?
            }
            None => HashMap::new(),
        };
    let data = file_len - len;
    let mut entries = map
        .into_iter()
        .map(|(fqn, value)| {
            serde_json::from_value::<Entry>(value)
                .map(|e| (fqn.clone(), e))
                .map_err(|e| format(format!("`{fqn}`: {e}")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    // In the order of their bytes: the first bad one is the one named.
    entries.sort_by(|a, b| (a.1.data_offsets, &a.0).cmp(&(b.1.data_offsets, &b.0)));
    let mut pieces = Vec::with_capacity(entries.len());
    for (fqn, e) in entries {
        let kind = storage::kind_of(&e.dtype).ok_or_else(|| {
            format(format!(
                "`{fqn}` has dtype {}, which tch cannot hold",
                e.dtype
            ))
        })?;
        let (lo, hi) = e.data_offsets;
        let numel = e
            .shape
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .and_then(|n| n.checked_mul(kind.elt_size_in_bytes() as u64));
        if lo > hi || hi > data || numel != Some(hi - lo) {
            return Err(format(format!(
                "`{fqn}`: bytes {lo}..{hi} of {data} do not hold a {} tensor of shape {:?}",
                e.dtype, e.shape
            )));
        }
        let shape: Vec<i64> = e.shape.iter().map(|&d| d as i64).collect();
        let offsets = saved_offsets(info.get(&fqn), &fqn, &shape).map_err(format)?;
        pieces.push(PieceHeader {
            fqn,
            dtype: e.dtype,
            shape,
            offsets,
            start: len + lo,
            end: len + hi,
        });
    }
    let tch_dist = meta.as_ref().is_some_and(|m| m.contains_key(MARK));
    Ok(Header {
        len,
        tch_dist,
        pieces,
    })
}

/// The digests of every piece of the safetensors file `bytes` (the whole file, as a save
/// encoded it), and its header's SHA-256: what the manifest lists for it (the oracle of
/// the save's, computed as it writes).
#[cfg(test)]
pub(super) fn digests(
    rank: usize,
    path: &Path,
    bytes: &[u8],
) -> Result<(String, std::collections::BTreeMap<String, PieceDigests>), CheckpointError> {
    let header = parse(rank, path, bytes, bytes.len() as u64)?;
    let mut out = std::collections::BTreeMap::new();
    for p in &header.pieces {
        let row = p.row_bytes();
        let rows = block_rows(row);
        let data = &bytes[p.start as usize..p.end as usize];
        let sha = if row == 0 {
            Vec::new()
        } else {
            data.chunks((rows * row) as usize)
                .map(storage::sha256)
                .collect()
        };
        out.insert(
            p.fqn.clone(),
            PieceDigests {
                block_rows: rows,
                sha256: sha,
            },
        );
    }
    Ok((storage::sha256(&bytes[..header.len as usize]), out))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;
    use storage::sha256;

    /// A tensor to write: FQN, shape, f32 values, saved offsets.
    type Written<'a> = (&'a str, Vec<usize>, Vec<f32>, Vec<i64>);

    /// A safetensors file of `tensors`, with sharding info.
    fn file(tensors: &[Written<'_>]) -> Vec<u8> {
        use safetensors::tensor::{Dtype, TensorView};
        let data: Vec<Vec<u8>> = tensors
            .iter()
            .map(|(_, _, v, _)| v.iter().flat_map(|x| x.to_le_bytes()).collect())
            .collect();
        let views: Vec<(String, TensorView)> = tensors
            .iter()
            .zip(&data)
            .map(|((n, s, _, _), d)| {
                (
                    n.to_string(),
                    TensorView::new(Dtype::F32, s.clone(), d).unwrap(),
                )
            })
            .collect();
        let info: BTreeMap<&str, ShardingInfo> = tensors
            .iter()
            .map(|(n, _, _, o)| {
                (
                    *n,
                    ShardingInfo {
                        saved_offsets: o.clone(),
                    },
                )
            })
            .collect();
        let meta = HashMap::from([(
            "DCP_SHARDING_INFO".to_string(),
            serde_json::to_string(&info).unwrap(),
        )]);
        safetensors::tensor::serialize(views, &Some(meta)).unwrap()
    }

    #[test]
    fn a_header_is_parsed_without_the_data() {
        let bytes = file(&[
            ("w", vec![3, 2], vec![1., 2., 3., 4., 5., 6.], vec![4, 0]),
            ("b", vec![3], vec![7., 8., 9.], vec![4]),
        ]);
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) + 8;
        // Only the header's bytes, and the file's length.
        let h = parse(0, Path::new("f"), &bytes[..n as usize], bytes.len() as u64).unwrap();
        assert_eq!(h.len, n);
        let w = h.pieces.iter().find(|p| p.fqn == "w").unwrap();
        assert_eq!(
            (w.shape.clone(), w.offsets.clone()),
            (vec![3, 2], vec![4, 0])
        );
        assert_eq!((w.rows(), w.row_bytes()), (3, 8));
        let values: Vec<f32> = bytes[w.start as usize..w.end as usize]
            .chunks(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(values, [1., 2., 3., 4., 5., 6.]);
        // A file shorter than its header says is refused.
        let err = parse(0, Path::new("f"), &bytes[..n as usize], n - 1).unwrap_err();
        assert!(err.to_string().contains("a safetensors header of"), "{err}");
        let err = parse(0, Path::new("f"), &bytes[..n as usize], n + 4).unwrap_err();
        // safetensors writes `b` first (by name): its bytes are already past the end.
        assert_eq!(
            err.to_string(),
            "rank 0: checkpoint: f: `b`: bytes 0..12 of 4 do not hold a F32 tensor of shape [3]"
        );
    }

    #[test]
    fn digests_cover_blocks_of_whole_rows() {
        // 40 KiB rows: one row a block; 4-byte rows: 16384 rows a block.
        assert_eq!(block_rows(40 * 1024), 1);
        assert_eq!(block_rows(4), 16384);
        assert_eq!(block_rows(0), DIGEST_BLOCK_BYTES);
        let rows: Vec<f32> = (0..3 * 20480).map(|i| i as f32).collect();
        let bytes = file(&[("w", vec![3, 20480], rows, vec![0, 0])]);
        let (_, d) = digests(0, Path::new("f"), &bytes).unwrap();
        let h = parse(0, Path::new("f"), &bytes, bytes.len() as u64).unwrap();
        let w = &h.pieces[0];
        assert_eq!(d["w"].block_rows, 1);
        assert_eq!(d["w"].sha256.len(), 3);
        let row1 =
            &bytes[(w.start + w.row_bytes()) as usize..(w.start + 2 * w.row_bytes()) as usize];
        assert_eq!(d["w"].sha256[1], sha256(row1));
    }
}
