//! The on-disk layout: PyTorch's distributed-checkpoint layout for safetensors (what
//! `torch.distributed.checkpoint.HuggingFaceStorageReader` reads), plus tch-dist's manifest.
//!
//! - one `shard-{rank+1:05}-model-00001-of-00001.safetensors` per rank; its `__metadata__`
//!   holds `DCP_SHARDING_INFO`, a JSON string `{fqn: {"saved_offsets": [...]}}` giving where
//!   each saved piece starts in the global tensor, and `DCP_VERSION` `1.0`, `format` `pt`;
//! - `manifest.json`, written last: every file with its length and SHA-256 (the safetensors
//!   files in `files`, each with its header's SHA-256 and its pieces' block digests,
//!   `index.rs`; the JSON sidecars `optimizer.json` and `train_state.json` in `sidecars`), every tensor with its global shape and dtype, the world size that wrote
//!   it. PyTorch's reader only lists `*.safetensors` files, so it ignores the manifest and
//!   the sidecars.

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype as StDtype, SafeTensors};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tch::{Kind, Tensor};

use super::index::{self, PieceDigests, ShardingInfo};
use super::CheckpointError;
use super::CheckpointProblem;

/// The manifest's name in a checkpoint folder.
pub const MANIFEST: &str = "manifest.json";
/// What the manifest's `format` says. Format 3 adds each file's header digest and its
/// pieces' block digests (`index.rs`), so that a load checks exactly the bytes it reads.
pub(super) const FORMAT: &str = "tch-dist checkpoint 3";
/// The format before per-piece digests: still loaded, each file read whole and checked
/// against its SHA-256. Format 1 did not checksum the sidecars: its manifests are refused
/// (not a manifest of this format) rather than trusted.
pub(super) const FORMAT_2: &str = "tch-dist checkpoint 2";

/// Rank `rank`'s file name (PyTorch's `shard-00001-model-00001-of-00001.safetensors` for
/// rank 0).
///
/// ```
/// assert_eq!(tch_dist::checkpoint::file_name(1), "shard-00002-model-00001-of-00001.safetensors");
/// ```
pub fn file_name(rank: usize) -> String {
    format!("shard-{:05}-model-00001-of-00001.safetensors", rank + 1)
}

/// `manifest.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(super) struct Manifest {
    pub format: String,
    pub world_size: usize,
    /// Safetensors file name -> its length and SHA-256 (hex).
    pub files: BTreeMap<String, FileEntry>,
    /// JSON sidecar name (`optimizer.json`, `train_state.json`) -> its length and SHA-256.
    pub sidecars: BTreeMap<String, FileEntry>,
    /// FQN -> its global shape and dtype.
    pub tensors: BTreeMap<String, TensorEntry>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(super) struct FileEntry {
    /// The file's length.
    pub bytes: u64,
    /// The whole file's SHA-256 ([`verify`] and format 2's loads check it).
    pub sha256: String,
    /// A safetensors file's header's SHA-256 (its first 8 + n bytes; format 3).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub header_sha256: Option<String>,
    /// A safetensors file's pieces' block digests, by FQN (format 3).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub pieces: BTreeMap<String, PieceDigests>,
}

impl FileEntry {
    /// The entry of a file holding `bytes` (a sidecar: checked whole).
    pub fn of(bytes: &[u8]) -> Self {
        FileEntry {
            bytes: bytes.len() as u64,
            sha256: sha256(bytes),
            header_sha256: None,
            pieces: BTreeMap::new(),
        }
    }

    /// The entry of the safetensors file `bytes` (at `path`): its length and SHA-256, its
    /// header's and its pieces' digests, computed from the whole file (the oracle of
    /// [`SafetensorsFile::write`]'s, which computes them as it writes).
    #[cfg(test)]
    pub fn of_safetensors(rank: usize, path: &Path, bytes: &[u8]) -> Result<Self, CheckpointError> {
        let (header, pieces) = index::digests(rank, path, bytes)?;
        Ok(FileEntry {
            header_sha256: Some(header),
            pieces,
            ..FileEntry::of(bytes)
        })
    }
}

/// `value` as JSON text: every JSON file of a checkpoint (the manifest, the sidecars) and
/// every file entry the ranks exchange is written through here, from its serde struct.
pub(super) fn to_json<T: Serialize + ?Sized>(
    rank: usize,
    path: &Path,
    value: &T,
) -> Result<String, CheckpointError> {
    serde_json::to_string_pretty(value).map_err(|e| {
        CheckpointProblem::Format {
            path: path.to_path_buf(),
            cause: e.to_string(),
        }
        .on(rank)
    })
}

/// The serde struct JSON text `bytes` (from the file `path`) holds.
pub(super) fn from_json<T: DeserializeOwned>(
    rank: usize,
    path: &Path,
    bytes: &[u8],
) -> Result<T, CheckpointError> {
    serde_json::from_slice(bytes).map_err(|e| {
        CheckpointProblem::Format {
            path: path.to_path_buf(),
            cause: e.to_string(),
        }
        .on(rank)
    })
}

/// Writes `value` as the JSON file `path` (fsynced) and returns its manifest entry.
pub(super) fn write_json<T: Serialize + ?Sized>(
    rank: usize,
    path: &Path,
    value: &T,
) -> Result<FileEntry, CheckpointError> {
    let text = to_json(rank, path, value)?;
    super::fs::write_durable(rank, path, text.as_bytes())?;
    Ok(FileEntry::of(text.as_bytes()))
}

/// The sidecars a checkpoint folder may hold: a file of one of these names is read only
/// when the manifest lists it, and refused when it is there unlisted.
pub(super) const SIDECARS: [&str; 2] = [super::OPTIMIZER_SIDECAR, super::TRAIN_STATE];

/// The manifest of the checkpoint folder `dir`.
pub(super) fn read_manifest(rank: usize, dir: &Path) -> Result<Manifest, CheckpointError> {
    let path = dir.join(MANIFEST);
    if !path.is_file() {
        return Err(CheckpointProblem::NotACheckpoint {
            dir: dir.to_path_buf(),
        }
        .on(rank));
    }
    let text = read(rank, &path)?;
    parse_manifest(rank, &path, &text)
}

/// The manifest the JSON text `text` (of the file `path`) holds, of format 3 or 2.
pub(super) fn parse_manifest(
    rank: usize,
    path: &Path,
    text: &[u8],
) -> Result<Manifest, CheckpointError> {
    serde_json::from_slice(text)
        .ok()
        .filter(|m: &Manifest| m.format == FORMAT || m.format == FORMAT_2)
        .ok_or_else(|| {
            CheckpointProblem::Format {
                path: path.to_path_buf(),
                cause: format!("not a manifest of this format ({FORMAT}, or {FORMAT_2})"),
            }
            .on(rank)
        })
}

/// The bytes of the file `dir/name`, checked against its manifest entry (length and
/// SHA-256).
pub(super) fn read_listed(
    rank: usize,
    dir: &Path,
    name: &str,
    entry: &FileEntry,
) -> Result<Vec<u8>, CheckpointError> {
    let file = dir.join(name);
    let corrupted = |cause: String| {
        CheckpointProblem::Corrupted {
            file: file.clone(),
            cause,
        }
        .on(rank)
    };
    let bytes = std::fs::read(&file).map_err(|e| corrupted(e.to_string()))?;
    if bytes.len() as u64 != entry.bytes {
        return Err(corrupted(format!(
            "{} bytes, the manifest says {}",
            bytes.len(),
            entry.bytes
        )));
    }
    if sha256(&bytes) != entry.sha256 {
        return Err(corrupted("its SHA-256 differs from the manifest's".into()));
    }
    Ok(bytes)
}

/// The sidecar `name` of the checkpoint folder `dir`, checked against the manifest:
/// `None` when the save wrote none; an error when the file is there but the manifest does
/// not list it (nothing unverified is read).
pub(super) fn read_sidecar(
    rank: usize,
    dir: &Path,
    manifest: &Manifest,
    name: &str,
) -> Result<Option<Vec<u8>>, CheckpointError> {
    match manifest.sidecars.get(name) {
        Some(entry) => read_listed(rank, dir, name, entry).map(Some),
        None if dir.join(name).exists() => Err(CheckpointProblem::Corrupted {
            file: dir.join(name),
            cause: "the manifest does not list it".into(),
        }
        .on(rank)),
        None => Ok(None),
    }
}

/// Checks every byte of the checkpoint folder `dir`: the manifest parses, every file and
/// sidecar it lists has its length and SHA-256, no sidecar is there unlisted. Reads the
/// whole checkpoint once, a block at a time (never a whole file in memory).
pub(super) fn verify(rank: usize, dir: &Path) -> Result<(), CheckpointError> {
    let manifest = read_manifest(rank, dir)?;
    for (name, entry) in manifest.files.iter().chain(&manifest.sidecars) {
        check_streamed(rank, &dir.join(name), entry)?;
    }
    for name in SIDECARS
        .iter()
        .filter(|n| !manifest.sidecars.contains_key(**n))
    {
        read_sidecar(rank, dir, &manifest, name)?;
    }
    Ok(())
}

/// Checks the file `file` against its manifest entry (length, SHA-256), reading it a block
/// at a time.
fn check_streamed(rank: usize, file: &Path, entry: &FileEntry) -> Result<(), CheckpointError> {
    use std::io::Read;
    let corrupted = |cause: String| {
        CheckpointProblem::Corrupted {
            file: file.to_path_buf(),
            cause,
        }
        .on(rank)
    };
    let mut f = std::fs::File::open(file).map_err(|e| corrupted(e.to_string()))?;
    let (mut hasher, mut buf, mut len) = (Sha256::new(), vec![0u8; 1 << 20], 0u64);
    loop {
        let n = f.read(&mut buf).map_err(|e| corrupted(e.to_string()))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        len += n as u64;
    }
    if len != entry.bytes {
        return Err(corrupted(format!(
            "{len} bytes, the manifest says {}",
            entry.bytes
        )));
    }
    let hex: String = hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    if hex != entry.sha256 {
        return Err(corrupted("its SHA-256 differs from the manifest's".into()));
    }
    Ok(())
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(super) struct TensorEntry {
    pub shape: Vec<i64>,
    pub dtype: String,
}

impl std::fmt::Display for TensorEntry {
    /// `[8, 4] F32`, as errors name it.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?} {}", self.shape, self.dtype)
    }
}

/// What each rank of a save reports once its file is written: the file's entry (none for
/// a rank without a file) and the global shape and dtype of every tensor it holds, which
/// the manifest's `tensors` merge (ranks hold different tensors in a pipeline).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(super) struct RankReport {
    pub file: Option<FileEntry>,
    pub tensors: BTreeMap<String, TensorEntry>,
}

/// Every saved piece, by FQN.
pub(super) type Pieces = HashMap<String, Vec<Piece>>;

/// One saved piece of a tensor: where it starts in the global tensor, and its values.
pub(super) struct Piece {
    pub offsets: Vec<i64>,
    pub values: Tensor,
}

/// safetensors' dtype for a tch kind (the kinds a checkpoint can hold).
pub(super) fn st_dtype(kind: Kind) -> Option<StDtype> {
    Some(match kind {
        Kind::Bool => StDtype::BOOL,
        Kind::Uint8 => StDtype::U8,
        Kind::Int8 => StDtype::I8,
        Kind::Int16 => StDtype::I16,
        Kind::Int => StDtype::I32,
        Kind::Int64 => StDtype::I64,
        Kind::Half => StDtype::F16,
        Kind::BFloat16 => StDtype::BF16,
        Kind::Float => StDtype::F32,
        Kind::Double => StDtype::F64,
        _ => return None,
    })
}

fn tch_kind(dtype: StDtype) -> Option<Kind> {
    Some(match dtype {
        StDtype::BOOL => Kind::Bool,
        StDtype::U8 => Kind::Uint8,
        StDtype::I8 => Kind::Int8,
        StDtype::I16 => Kind::Int16,
        StDtype::I32 => Kind::Int,
        StDtype::I64 => Kind::Int64,
        StDtype::F16 => Kind::Half,
        StDtype::BF16 => Kind::BFloat16,
        StDtype::F32 => Kind::Float,
        StDtype::F64 => Kind::Double,
        _ => return None,
    })
}

/// The tch kind of a dtype's name as the manifest writes it (`F32`).
pub(super) fn kind_of(name: &str) -> Option<Kind> {
    [
        StDtype::BOOL,
        StDtype::U8,
        StDtype::I8,
        StDtype::I16,
        StDtype::I32,
        StDtype::I64,
        StDtype::F16,
        StDtype::BF16,
        StDtype::F32,
        StDtype::F64,
    ]
    .into_iter()
    .find(|d| format!("{d:?}") == name)
    .and_then(tch_kind)
}

/// The dtype's name as the manifest and the errors write it (safetensors' names: `F32`).
pub(super) fn dtype_name(kind: Kind) -> String {
    st_dtype(kind).map_or_else(|| format!("{kind:?}"), |d| format!("{d:?}"))
}

/// The SHA-256 of `bytes`, in hex.
pub(super) fn sha256(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

/// `digest` in lowercase hex.
fn hex(digest: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(digest.len() * 2);
    for b in digest {
        out.push(DIGITS[(b >> 4) as usize] as char);
        out.push(DIGITS[(b & 15) as usize] as char);
    }
    out
}

/// A safetensors file ready to be written straight from its tensors' memory (no copy of
/// the data: DCP's `_write_item` streams each tensor too): its header in safetensors'
/// layout (8-byte length, JSON padded with spaces to 8 bytes: each tensor's dtype, shape
/// and byte range, and `__metadata__`'s `DCP_SHARDING_INFO`), its pieces ordered as
/// safetensors orders them (larger dtypes first, then by name, so that each is aligned to
/// its dtype), each contiguous on the CPU.
pub(super) struct SafetensorsFile {
    /// The header's bytes.
    header: Vec<u8>,
    /// The header as a load parses it: every piece's bytes in the file.
    parsed: index::Header,
    /// Each piece, by FQN.
    pieces: HashMap<String, Tensor>,
    /// The file's length.
    len: u64,
}

impl SafetensorsFile {
    /// The file of `tensors` (FQN, values, offsets in the global tensor) at `path`; refuses
    /// a dtype safetensors cannot hold.
    pub fn new(
        rank: usize,
        path: &Path,
        tensors: &[(String, Tensor, Vec<i64>)],
    ) -> Result<Self, CheckpointError> {
        let format = |cause: String| {
            CheckpointProblem::Format {
                path: path.to_path_buf(),
                cause,
            }
            .on(rank)
        };
        let mut order: Vec<&(String, Tensor, Vec<i64>)> = tensors.iter().collect();
        order.sort_by(|a, b| {
            let size = |t: &Tensor| t.kind().elt_size_in_bytes();
            size(&b.1).cmp(&size(&a.1)).then_with(|| a.0.cmp(&b.0))
        });
        let mut entries = serde_json::Map::new();
        let mut info = BTreeMap::new();
        let mut pieces = HashMap::new();
        let mut offset = 0u64;
        for (fqn, t, offsets) in order {
            let dtype = st_dtype(t.kind()).ok_or_else(|| {
                format(format!(
                    "`{fqn}` has a dtype safetensors cannot hold ({:?})",
                    t.kind()
                ))
            })?;
            // The tensor itself when it is on the CPU and contiguous already.
            let t = t.to_device(tch::Device::Cpu).contiguous();
            let bytes = (t.numel() * t.kind().elt_size_in_bytes()) as u64;
            entries.insert(
                fqn.clone(),
                serde_json::json!({
                    "dtype": dtype,
                    "shape": t.size(),
                    "data_offsets": [offset, offset + bytes],
                }),
            );
            offset += bytes;
            info.insert(
                fqn.clone(),
                ShardingInfo {
                    saved_offsets: offsets.clone(),
                },
            );
            pieces.insert(fqn.clone(), t);
        }
        let sharding = serde_json::to_string(&info).map_err(|e| format(e.to_string()))?;
        entries.insert(
            "__metadata__".to_string(),
            serde_json::json!({
                "DCP_SHARDING_INFO": sharding,
                "DCP_VERSION": "1.0",
                "format": "pt",
                index::MARK: FORMAT,
            }),
        );
        let mut json = serde_json::to_vec(&entries).map_err(|e| format(e.to_string()))?;
        // safetensors pads the JSON with spaces so that the data start 8-byte aligned.
        json.resize(json.len().next_multiple_of(8), b' ');
        let mut header = (json.len() as u64).to_le_bytes().to_vec();
        header.extend_from_slice(&json);
        let len = header.len() as u64 + offset;
        let parsed = index::parse(rank, path, &header, len)?;
        Ok(SafetensorsFile {
            header,
            parsed,
            pieces,
            len,
        })
    }

    /// The file's length.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Writes the file at `path` and fsyncs it, computing as the bytes go out what the
    /// manifest lists for it: its length and SHA-256, its header's SHA-256 and its pieces'
    /// block digests.
    pub fn write(&self, rank: usize, path: &Path) -> Result<FileEntry, CheckpointError> {
        let failed = || super::fs::io(rank, "writing", path);
        let mut file = std::fs::File::create(path).map_err(failed())?;
        let mut whole = Sha256::new();
        whole.update(&self.header);
        file.write_all(&self.header).map_err(failed())?;
        let mut pieces = BTreeMap::new();
        for p in &self.parsed.pieces {
            let bytes = tensor_bytes(&self.pieces[&p.fqn]);
            let (row, rows) = (p.row_bytes(), index::block_rows(p.row_bytes()));
            let mut sha = Vec::new();
            // Whole rows per block (the same blocks as a load checks); one write per block.
            let block = if row == 0 {
                bytes.len().max(1)
            } else {
                (rows * row) as usize
            };
            for chunk in bytes.chunks(block) {
                whole.update(chunk);
                if row != 0 {
                    sha.push(sha256(chunk));
                }
                file.write_all(chunk).map_err(failed())?;
            }
            pieces.insert(
                p.fqn.clone(),
                PieceDigests {
                    block_rows: rows,
                    sha256: sha,
                },
            );
        }
        file.sync_all()
            .map_err(super::fs::io(rank, "fsyncing", path))?;
        Ok(FileEntry {
            bytes: self.len,
            sha256: hex(&whole.finalize()),
            header_sha256: Some(sha256(&self.header)),
            pieces,
        })
    }
}

/// The bytes of `t`, a contiguous CPU tensor, where they lie.
fn tensor_bytes(t: &Tensor) -> &[u8] {
    let len = t.numel() * t.kind().elt_size_in_bytes();
    if len == 0 {
        return &[];
    }
    // SAFETY: `t` is contiguous on the CPU (SafetensorsFile::new made it so), so its
    // `len` bytes start at `data_ptr` and live as long as `t`, which the slice borrows;
    // nothing writes them meanwhile (the save holds its own handles on the pieces).
    unsafe { std::slice::from_raw_parts(t.data_ptr() as *const u8, len) }
}

/// The pieces of a safetensors file's tensors, by FQN: with `DCP_SHARDING_INFO`, at its
/// offsets; without (a one-file `VarStore::save`), whole tensors at offset 0.
pub(super) fn decode(
    rank: usize,
    path: &Path,
    bytes: &[u8],
) -> Result<HashMap<String, Piece>, CheckpointError> {
    let format = |cause: String| {
        CheckpointProblem::Format {
            path: path.to_path_buf(),
            cause,
        }
        .on(rank)
    };
    let (_, meta) = SafeTensors::read_metadata(bytes).map_err(|e| format(format!("{e:?}")))?;
    let info: HashMap<String, ShardingInfo> = match meta
        .metadata()
        .as_ref()
        .and_then(|m| m.get("DCP_SHARDING_INFO"))
    {
        Some(json) => {
            serde_json::from_str(json).map_err(|e| format(format!("DCP_SHARDING_INFO: {e}")))?
        }
        None => HashMap::new(),
    };
    let st = SafeTensors::deserialize(bytes).map_err(|e| format(format!("{e:?}")))?;
    let mut out = HashMap::new();
    for (fqn, view) in st.tensors() {
        let kind = tch_kind(view.dtype()).ok_or_else(|| {
            format(format!(
                "`{fqn}` has dtype {:?}, which tch cannot hold",
                view.dtype()
            ))
        })?;
        let shape: Vec<i64> = view.shape().iter().map(|&d| d as i64).collect();
        let values = Tensor::f_from_data_size(view.data(), &shape, kind)
            .map_err(|e| format(format!("`{fqn}`: {e}")))?;
        let offsets = super::index::saved_offsets(info.get(&fqn), &fqn, &shape).map_err(format)?;
        out.insert(fqn, Piece { offsets, values });
    }
    Ok(out)
}

/// Reads `path`.
pub(super) fn read(rank: usize, path: &Path) -> Result<Vec<u8>, CheckpointError> {
    std::fs::read(path).map_err(super::fs::io(rank, "reading", path))
}

/// `dir` with `suffix` added to its name: `DIR.partial`, the temporary folder a save
/// writes into before it is renamed to `DIR`, and `DIR.old` (`protocol.rs`).
pub(super) fn sibling(dir: &Path, suffix: &str) -> PathBuf {
    let mut name = dir
        .file_name()
        .map(|n| n.to_os_string())
        .unwrap_or_default();
    name.push(suffix);
    dir.with_file_name(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file written straight from its tensors holds them (read back by the safetensors
    /// crate, whatever their dtype, size or order), and its entry is what the whole file's
    /// bytes give.
    #[test]
    fn a_file_written_from_the_tensors_is_safetensors_and_its_entry_is_the_files() {
        let dir = std::env::temp_dir().join(format!("tch-dist-st-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("f.safetensors");
        let rows = Tensor::arange(3 * 20480, (Kind::Float, tch::Device::Cpu)).view([3, 20480]);
        let tensors = vec![
            ("w".to_string(), rows.shallow_clone(), vec![6, 0]),
            (
                "a.step".to_string(),
                Tensor::from_slice(&[7i64, 8]),
                vec![0],
            ),
            (
                "b".to_string(),
                Tensor::from_slice(&[1.5f32, -2.0, 3.25]).to_kind(Kind::BFloat16),
                vec![3],
            ),
            (
                "empty".to_string(),
                Tensor::zeros([0, 4], (Kind::Float, tch::Device::Cpu)),
                vec![0, 0],
            ),
            // Not contiguous: written in order.
            ("t".to_string(), rows.narrow(1, 0, 4).tr(), vec![0, 0]),
        ];
        let file = SafetensorsFile::new(0, &path, &tensors).unwrap();
        let entry = file.write(0, &path).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(bytes.len() as u64, file.len());
        assert_eq!(entry, FileEntry::of_safetensors(0, &path, &bytes).unwrap());
        assert_eq!(
            entry.pieces["w"].sha256.len(),
            3,
            "one block per 80 KiB row"
        );
        let st = SafeTensors::deserialize(&bytes).unwrap();
        for (fqn, t, _) in &tensors {
            let view = st.tensor(fqn).unwrap();
            let want = t.contiguous();
            let mut data = vec![0u8; want.numel() * want.kind().elt_size_in_bytes()];
            want.f_copy_data_u8(&mut data, want.numel()).unwrap();
            assert_eq!(view.data(), &data[..], "{fqn}");
            let shape: Vec<usize> = t.size().iter().map(|&d| d as usize).collect();
            assert_eq!(view.shape(), &shape[..], "{fqn}");
        }
        let _ = std::fs::remove_dir_all(dir);
    }
}
