//! A load's reads: the manifest and each file's header first ([`Reader::open`]), then only
//! the byte ranges the read plan (`read_plan.rs`) names for this rank's targets, each read
//! with a positioned read straight into the target's staged values (whole rows of them) or
//! into one buffer of the rows read, whose overlap is copied into place, and checked
//! against the manifest's block digests ([`Reader::fetch`]); counted in [`LoadStats`].
//! `_hf_storage.py`'s `HuggingFaceStorageReader.read_data` is the counterpart (it reads
//! every tensor whole).
//!
//! A format-2 checkpoint (no piece digests) is read as before: every file whole, checked
//! against its SHA-256. A one-file `VarStore::save`, and a folder PyTorch's
//! `HuggingFaceStorageWriter` wrote (no manifest, no tch-dist mark in its files), are read
//! by the plan and checked against nothing (they carry no checksum).

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use tch::{Kind, Tensor};

use super::index::{self, Header, PieceDigests, PieceHeader};
use super::read_plan::{self, Want};
use super::reshard::{self, Span, Staged};
use super::storage::{self, Manifest, Pieces, TensorEntry, MANIFEST};
use super::CheckpointError;
use super::CheckpointProblem;
use crate::state_dict::flat::Entry;

/// What one rank's load read: every byte it read from the checkpoint (the manifest, each
/// file's header, the slices of its tensors, and for a checkpoint of format 2 every file
/// whole) and how many safetensors files it opened. Returned by
/// [`load`](super::load()); a rank's `bytes_read` is about its share of
/// the checkpoint (see the [module docs](super) for what it reads beyond).
///
/// ```
/// let stats = tch_dist::checkpoint::LoadStats::default();
/// assert_eq!((stats.bytes_read, stats.files_opened), (0, 0));
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LoadStats {
    /// Bytes read from the checkpoint's files by this rank.
    pub bytes_read: u64,
    /// Safetensors files this rank opened (each one's header is read).
    pub files_opened: usize,
}

/// One rank's reads of one load, counted.
pub(super) struct Reader {
    rank: usize,
    /// What it read so far.
    pub stats: LoadStats,
}

/// A checkpoint opened for a load: the manifest and every file's header read, nothing else
/// (or, for format 2, every file read and checked).
pub(super) struct Opened {
    /// The manifest (none for a one-file `VarStore::save`).
    pub manifest: Option<Manifest>,
    /// Every tensor's global shape and dtype.
    pub tensors: BTreeMap<String, TensorEntry>,
    source: Source,
}

enum Source {
    /// Format 2: every piece, decoded from files read whole and checked.
    Whole(Pieces),
    /// Format 3 or a one-file `VarStore::save`: the files, their headers read.
    Indexed(Vec<IndexedFile>),
}

struct IndexedFile {
    path: PathBuf,
    file: File,
    /// Each piece of the header, with its rows per digest block (`None`: not checked).
    pieces: Vec<(PieceHeader, Option<u64>)>,
    /// The manifest's digests of its pieces (none without a manifest).
    digests: Option<BTreeMap<String, PieceDigests>>,
}

impl Reader {
    pub(super) fn new(rank: usize) -> Self {
        Reader {
            rank,
            stats: LoadStats::default(),
        }
    }

    /// The rank it reads for.
    pub(super) fn rank(&self) -> usize {
        self.rank
    }

    fn corrupted(&self, file: &Path) -> impl Fn(String) -> CheckpointError + use<> {
        let (rank, file) = (self.rank, file.to_path_buf());
        move |cause| {
            CheckpointProblem::Corrupted {
                file: file.clone(),
                cause,
            }
            .on(rank)
        }
    }

    /// `len` bytes of `file` (at `path`) from `start`, counted.
    fn read_at(
        &mut self,
        file: &File,
        path: &Path,
        start: u64,
        len: u64,
    ) -> Result<Vec<u8>, CheckpointError> {
        let mut buf = vec![0u8; len as usize];
        self.read_into(file, path, start, &mut buf)?;
        Ok(buf)
    }

    /// Fills `buf` with the bytes of `file` (at `path`) from `start`, counted.
    fn read_into(
        &mut self,
        file: &File,
        path: &Path,
        start: u64,
        buf: &mut [u8],
    ) -> Result<(), CheckpointError> {
        file.read_exact_at(buf, start)
            .map_err(super::fs::io(self.rank, "reading", path))?;
        self.stats.bytes_read += buf.len() as u64;
        Ok(())
    }

    /// Opens the file `path` and reads its header; `entry` (the manifest's) when the file
    /// must match it: its length, its header's SHA-256.
    fn open_file(
        &mut self,
        path: &Path,
        entry: Option<&storage::FileEntry>,
    ) -> Result<(File, Header), CheckpointError> {
        let corrupted = self.corrupted(path);
        let file = match entry {
            Some(_) => File::open(path).map_err(|e| corrupted(e.to_string()))?,
            None => File::open(path).map_err(super::fs::io(self.rank, "reading", path))?,
        };
        self.stats.files_opened += 1;
        let len = file
            .metadata()
            .map_err(super::fs::io(self.rank, "reading", path))?
            .len();
        if let Some(e) = entry.filter(|e| e.bytes != len) {
            return Err(corrupted(format!(
                "{len} bytes, the manifest says {}",
                e.bytes
            )));
        }
        let first = self.read_at(&file, path, 0, 8.min(len))?;
        let first: [u8; 8] = first.try_into().map_err(|_| {
            CheckpointProblem::Format {
                path: path.to_path_buf(),
                cause: "shorter than a safetensors header".into(),
            }
            .on(self.rank)
        })?;
        let n = index::header_len(self.rank, path, first, len)?;
        let mut bytes = first.to_vec();
        bytes.extend(self.read_at(&file, path, 8, n - 8)?);
        if let Some(e) = entry
            && e.header_sha256.as_deref() != Some(storage::sha256(&bytes).as_str())
        {
            return Err(corrupted(
                "its header's SHA-256 differs from the manifest's".into(),
            ));
        }
        let header = index::parse(self.rank, path, &bytes, len)?;
        Ok((file, header))
    }

    /// Opens the checkpoint `path` (a folder, or a one-file `VarStore::save`): reads the
    /// manifest and every file's header (format 3), or every file whole (format 2).
    pub(super) fn open(&mut self, path: &Path) -> Result<Opened, CheckpointError> {
        if path.is_file() {
            // One safetensors file of whole tensors (`VarStore::save`): no checksum.
            let (file, header) = self.open_file(path, None)?;
            let tensors = header
                .pieces
                .iter()
                .map(|p| {
                    let entry = TensorEntry {
                        shape: p.shape.clone(),
                        dtype: p.dtype.clone(),
                    };
                    (p.fqn.clone(), entry)
                })
                .collect();
            let pieces = header.pieces.into_iter().map(|p| (p, None)).collect();
            let file = IndexedFile {
                path: path.to_path_buf(),
                file,
                pieces,
                digests: None,
            };
            return Ok(Opened {
                manifest: None,
                tensors,
                source: Source::Indexed(vec![file]),
            });
        }
        let manifest_path = path.join(MANIFEST);
        if !manifest_path.is_file() {
            return self.open_pytorch(path);
        }
        let text = storage::read(self.rank, &manifest_path)?;
        self.stats.bytes_read += text.len() as u64;
        let manifest = storage::parse_manifest(self.rank, &manifest_path, &text)?;
        let source = if manifest.format == storage::FORMAT_2 {
            let mut pieces: Pieces = HashMap::new();
            for (name, entry) in &manifest.files {
                let bytes = storage::read_listed(self.rank, path, name, entry)?;
                self.stats.files_opened += 1;
                self.stats.bytes_read += bytes.len() as u64;
                for (fqn, p) in storage::decode(self.rank, &path.join(name), &bytes)? {
                    pieces.entry(fqn).or_default().push(p);
                }
            }
            Source::Whole(pieces)
        } else {
            let mut files = Vec::new();
            for (name, entry) in &manifest.files {
                let file_path = path.join(name);
                let (file, header) = self.open_file(&file_path, Some(entry))?;
                let corrupted = self.corrupted(&file_path);
                let mut pieces = Vec::new();
                for p in header.pieces {
                    let d = entry.pieces.get(&p.fqn).ok_or_else(|| {
                        corrupted(format!("the manifest has no digests of `{}`", p.fqn))
                    })?;
                    let blocks = match p.row_bytes() {
                        0 => 0,
                        _ => (p.rows() as u64).div_ceil(d.block_rows.max(1)),
                    };
                    if d.block_rows == 0 || d.sha256.len() as u64 != blocks {
                        return Err(corrupted(format!(
                            "the manifest's digests of `{}` do not fit its {} rows",
                            p.fqn,
                            p.rows()
                        )));
                    }
                    pieces.push((p, Some(d.block_rows)));
                }
                files.push(IndexedFile {
                    path: file_path,
                    file,
                    pieces,
                    digests: Some(entry.pieces.clone()),
                });
            }
            Source::Indexed(files)
        };
        Ok(Opened {
            tensors: manifest.tensors.clone(),
            manifest: Some(manifest),
            source,
        })
    }

    /// Opens the folder `dir` without a manifest as PyTorch's `HuggingFaceStorageWriter`
    /// output (its `*.safetensors` files, each tensor's global shape the pieces' extent,
    /// as `HuggingFaceStorageReader.read_metadata` computes it): nothing to check it against.
    /// Refused as an interrupted tch-dist save ([`NotACheckpoint`](CheckpointProblem::NotACheckpoint))
    /// when it is a save's temporary folder (`DIR.partial`, `DIR.old`), holds no
    /// safetensors file, or any of its files was written by tch-dist (`index::MARK`).
    fn open_pytorch(&mut self, dir: &Path) -> Result<Opened, CheckpointError> {
        let rank = self.rank;
        let not_a_checkpoint = || {
            CheckpointProblem::NotACheckpoint {
                dir: dir.to_path_buf(),
            }
            .on(rank)
        };
        let temporary = dir
            .file_name()
            .is_some_and(|n| super::fs::is_temporary(&n.to_string_lossy()));
        if temporary || !dir.is_dir() {
            return Err(not_a_checkpoint());
        }
        let mut names: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(super::fs::io(self.rank, "listing", dir))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.is_file() && p.extension().is_some_and(|e| e == "safetensors"))
            .collect();
        names.sort();
        if names.is_empty() {
            return Err(not_a_checkpoint());
        }
        let mut files = Vec::new();
        let mut tensors: BTreeMap<String, TensorEntry> = BTreeMap::new();
        for path in names {
            let (file, header) = self.open_file(&path, None)?;
            if header.tch_dist {
                return Err(not_a_checkpoint());
            }
            for p in &header.pieces {
                let entry = tensors.entry(p.fqn.clone()).or_insert_with(|| TensorEntry {
                    shape: vec![0; p.shape.len()],
                    dtype: p.dtype.clone(),
                });
                if entry.dtype != p.dtype || entry.shape.len() != p.shape.len() {
                    return Err(CheckpointProblem::Format {
                        path: path.clone(),
                        cause: format!(
                            "`{}` is {} {:?} here, {} of {} dimensions in another file",
                            p.fqn,
                            p.dtype,
                            p.shape,
                            entry.dtype,
                            entry.shape.len()
                        ),
                    }
                    .on(self.rank));
                }
                for (g, (o, n)) in entry.shape.iter_mut().zip(p.offsets.iter().zip(&p.shape)) {
                    *g = (*g).max(o + n);
                }
            }
            let pieces = header.pieces.into_iter().map(|p| (p, None)).collect();
            files.push(IndexedFile {
                path,
                file,
                pieces,
                digests: None,
            });
        }
        Ok(Opened {
            manifest: None,
            tensors,
            source: Source::Indexed(files),
        })
    }

    /// [`Reader::fetch`] of `targets` once they were checked against the whole checkpoint
    /// (a striped load reads only some of the model's targets).
    pub(super) fn read(
        &mut self,
        opened: &Opened,
        targets: &[Entry],
        tensors: &BTreeMap<String, TensorEntry>,
    ) -> Result<Vec<(Tensor, Tensor)>, CheckpointError> {
        let files = match &opened.source {
            Source::Whole(pieces) => return reshard::assemble(self.rank, targets, pieces),
            Source::Indexed(files) => files,
        };
        let sizes: Vec<Vec<i64>> = targets.iter().map(|t| t.tensor.size()).collect();
        let wants: Vec<Want<'_>> = targets
            .iter()
            .zip(&sizes)
            .map(|(t, size)| Want {
                fqn: &t.fqn,
                offsets: &t.offsets,
                size,
            })
            .collect();
        let headers: Vec<Vec<(PieceHeader, Option<u64>)>> =
            files.iter().map(|f| f.pieces.clone()).collect();
        let by_fqn: HashMap<&str, usize> = targets
            .iter()
            .enumerate()
            .map(|(i, t)| (t.fqn.as_str(), i))
            .collect();
        // Every target's values are allocated once and filled as the reads arrive, each read
        // dropped once copied in (or read straight into them): a load holds this rank's
        // staged values and one read, not every read beside the values.
        let mut staged: Vec<Staged> = targets.iter().map(Staged::new).collect();
        for read in read_plan::plan(&wants, &headers) {
            let f = &files[read.file];
            let (piece, block) = &f.pieces[read.piece];
            let Some(&i) = by_fqn.get(piece.fqn.as_str()) else {
                continue;
            };
            let kind = self.kind_of(f, piece, tensors)?;
            // The rows read, as a piece at its place in the global tensor.
            let (mut offsets, mut shape) = (piece.offsets.clone(), piece.shape.clone());
            if let (Some(o), Some(n)) = (offsets.first_mut(), shape.first_mut()) {
                *o += read.rows.0;
                *n = read.rows.1 - read.rows.0;
            }
            let (start, end) = read.bytes;
            let numel: i64 = shape.iter().product();
            if end - start != numel as u64 * kind.elt_size_in_bytes() as u64 {
                return Err(self.format(f)(format!(
                    "`{}`: rows {}..{} are {} bytes, not {numel} values of {}",
                    piece.fqn,
                    read.rows.0,
                    read.rows.1,
                    end - start,
                    piece.dtype
                )));
            }
            let (t, s) = (&targets[i], &mut staged[i]);
            let size = t.tensor.size();
            let Some(spans) = reshard::overlap(&t.offsets, &size, &offsets, &shape) else {
                continue;
            };
            let check = |reader: &Self, bytes: &[u8]| match (block, &f.digests) {
                (Some(b), Some(digests)) => {
                    reader.check_blocks(f, piece, *b, &digests[&piece.fqn], read.rows, bytes)
                }
                _ => Ok(()),
            };
            if let Some(at) = contiguous_rows(&s.values, kind, &spans, &shape) {
                // The rows read are exactly whole rows of the staged values: read them into
                // place, no copy.
                let len = (end - start) as usize;
                // SAFETY: `s.values` is a contiguous CPU tensor this load allocated and
                // alone holds; `at + len` is within it (`contiguous_rows`: whole rows of
                // it, `len` their bytes, checked above), and nothing else reads or writes
                // it while the slice lives.
                let into = unsafe {
                    std::slice::from_raw_parts_mut((s.values.data_ptr() as *mut u8).add(at), len)
                };
                self.read_into(&f.file, &f.path, start, into)?;
                check(self, into)?;
                s.record(spans);
            } else {
                // Fresh aligned memory of the piece's dtype, read, checked, its overlap
                // copied into place and dropped.
                let rows = Tensor::empty(shape.as_slice(), (kind, tch::Device::Cpu));
                let len = (end - start) as usize;
                // SAFETY: `rows` is a contiguous CPU tensor of exactly `len` bytes (checked
                // above), just allocated and held only here.
                let into =
                    unsafe { std::slice::from_raw_parts_mut(rows.data_ptr() as *mut u8, len) };
                self.read_into(&f.file, &f.path, start, into)?;
                check(self, into)?;
                s.place(t, &offsets, &rows);
            }
        }
        staged
            .into_iter()
            .zip(targets)
            .map(|(s, t)| s.finish(self.rank, t))
            .collect()
    }

    /// Checks `bytes`, rows `rows` of `piece` (whole blocks of `block` rows), against the
    /// manifest's digests.
    fn check_blocks(
        &self,
        f: &IndexedFile,
        piece: &PieceHeader,
        block: u64,
        digests: &PieceDigests,
        rows: (i64, i64),
        bytes: &[u8],
    ) -> Result<(), CheckpointError> {
        let (first, end) = (rows.0 as u64, rows.1 as u64);
        let row = piece.row_bytes();
        let mut lo = first;
        while lo < end {
            let hi = ((lo / block + 1) * block).min(end);
            let slice = &bytes[((lo - first) * row) as usize..((hi - first) * row) as usize];
            if storage::sha256(slice) != digests.sha256[(lo / block) as usize] {
                return Err(self.corrupted(&f.path)(format!(
                    "`{}`'s rows {lo}..{hi} differ from the manifest's SHA-256",
                    piece.fqn
                )));
            }
            lo = hi;
        }
        Ok(())
    }

    /// The dtype of `piece`, which must be the one the checkpoint lists for its tensor.
    fn kind_of(
        &self,
        f: &IndexedFile,
        piece: &PieceHeader,
        tensors: &BTreeMap<String, TensorEntry>,
    ) -> Result<Kind, CheckpointError> {
        let format = self.format(f);
        let listed = tensors.get(&piece.fqn).map(|t| t.dtype.as_str());
        if listed.is_some_and(|d| d != piece.dtype) {
            return Err(format(format!(
                "`{}` is {} here but {} in the manifest",
                piece.fqn,
                piece.dtype,
                listed.unwrap_or_default()
            )));
        }
        storage::kind_of(&piece.dtype)
            .ok_or_else(|| format(format!("`{}`: dtype {}", piece.fqn, piece.dtype)))
    }

    fn format(&self, f: &IndexedFile) -> impl Fn(String) -> CheckpointError + use<> {
        let (rank, path) = (self.rank, f.path.clone());
        move |cause| {
            CheckpointProblem::Format {
                path: path.clone(),
                cause,
            }
            .on(rank)
        }
    }
}

/// Where in `values` (a contiguous tensor) the region `spans` starts, in bytes, when it is
/// whole rows of it that are all of the rows read (a piece of shape `read`): then the bytes
/// read are exactly those of the region and can be read into place. `None` on another
/// device or of another dtype than the piece's (`kind`), or when the read holds more (rows
/// widened to digest blocks, other ranks' columns) or the region is not whole rows.
fn contiguous_rows(values: &Tensor, kind: Kind, spans: &[Span], read: &[i64]) -> Option<usize> {
    // The caller writes the read's bytes at the offset returned: only sound in memory of
    // the piece's own dtype, whatever the checks before this one established.
    if values.device() != tch::Device::Cpu || !values.is_contiguous() || values.kind() != kind {
        return None;
    }
    let size = values.size();
    let Some((first, rest)) = spans.split_first() else {
        // A scalar: the one value.
        return Some(0);
    };
    let whole_rows = rest
        .iter()
        .zip(&size[1..])
        .zip(&read[1..])
        .all(|((s, &n), &r)| s.dst == 0 && s.src == 0 && s.len == n && n == r);
    (whole_rows && first.src == 0 && first.len == read[0]).then(|| {
        let row: i64 = size[1..].iter().product();
        (first.dst * row) as usize * values.kind().elt_size_in_bytes()
    })
}
