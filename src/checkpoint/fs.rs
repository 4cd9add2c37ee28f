//! The file-system moves under a checkpoint: writes that are on disk before they are relied
//! on (`fsync` of each file, of the folder before it is renamed, of the parent after), the
//! temporary folder of a save and its names, the rename or atomic swap that puts a complete
//! checkpoint in place, and removals manifest first (a half-removed checkpoint is never
//! taken for a complete one). DCP's `filesystem.py` (its writes, `fsync`, and the rename of
//! `.metadata` into place).

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use super::storage::{self, MANIFEST};
use super::CheckpointError;
use super::CheckpointProblem;

/// The suffix of the folder a save writes into (`DIR.partial`) before it is renamed into
/// place; after a replace it holds the old checkpoint until that is removed.
pub(super) const PARTIAL: &str = ".partial";
/// The suffix of the old checkpoint moved aside where the file system cannot swap two
/// folders (the fallback in [`replace`]).
pub(super) const OLD: &str = ".old";

/// Whether `name` is a save's temporary folder (`.partial`, `.old`): never a checkpoint to
/// resume from, whatever it holds.
pub(super) fn is_temporary(name: &str) -> bool {
    name.ends_with(PARTIAL) || name.ends_with(OLD)
}

/// An I/O error of `op` on `path`.
pub(super) fn io(
    rank: usize,
    op: &'static str,
    path: &Path,
) -> impl FnOnce(std::io::Error) -> CheckpointError + use<> {
    let path = path.to_path_buf();
    move |source| CheckpointProblem::Io { op, path, source }.on(rank)
}

/// Writes `bytes` to a new file `path` and fsyncs it.
pub(super) fn write_durable(rank: usize, path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
    let mut file = File::create(path).map_err(io(rank, "writing", path))?;
    file.write_all(bytes).map_err(io(rank, "writing", path))?;
    file.sync_all().map_err(io(rank, "fsyncing", path))
}

/// Fsyncs the folder `dir` (its entries: the names of the files in it).
fn sync_dir(rank: usize, dir: &Path) -> Result<(), CheckpointError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io(rank, "fsyncing", dir))
}

/// The folder `dir` is in (`.` for a bare name).
pub(super) fn parent_of(dir: &Path) -> PathBuf {
    match dir.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// Makes the empty temporary folder `tmp`, removing what an interrupted save left there.
pub(super) fn start(rank: usize, tmp: &Path) -> Result<(), CheckpointError> {
    if tmp.exists() {
        remove_checkpoint(rank, tmp)?;
    }
    std::fs::create_dir_all(tmp).map_err(io(rank, "creating", tmp))
}

/// Puts the complete folder `tmp` in place as `dir`: fsyncs `tmp`, then renames it to
/// `dir` when there is none, or swaps the two atomically (`renameat2(RENAME_EXCHANGE)`),
/// so that `dir` always names a complete checkpoint; fsyncs the parent folder. Afterwards
/// `tmp` holds the replaced checkpoint (if any), for [`finish`] to remove.
///
/// Where the file system cannot swap folders (not Linux, or `EINVAL`: some network file
/// systems), the old `dir` is renamed to `DIR.old` first: a crash between the two renames
/// leaves the old checkpoint in `DIR.old` and the new in `tmp`, and no `dir`.
pub(super) fn replace(rank: usize, tmp: &Path, dir: &Path) -> Result<(), CheckpointError> {
    sync_dir(rank, tmp)?;
    if dir.exists() {
        if !exchange(rank, tmp, dir)? {
            let old = storage::sibling(dir, OLD);
            if old.exists() {
                remove_checkpoint(rank, &old)?;
            }
            std::fs::rename(dir, &old).map_err(io(rank, "renaming", dir))?;
            std::fs::rename(tmp, dir).map_err(io(rank, "renaming", dir))?;
            std::fs::rename(&old, tmp).map_err(io(rank, "renaming", &old))?;
        }
    } else {
        std::fs::rename(tmp, dir).map_err(io(rank, "renaming", dir))?;
    }
    sync_dir(rank, &parent_of(dir))
}

/// Swaps the folders `a` and `b` atomically; `Ok(false)` where the file system cannot.
#[cfg(target_os = "linux")]
fn exchange(rank: usize, a: &Path, b: &Path) -> Result<bool, CheckpointError> {
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;
    let c = |p: &Path| {
        CString::new(p.as_os_str().as_bytes())
            .map_err(|e| io(rank, "swapping", p)(std::io::Error::from(e)))
    };
    let (ca, cb) = (c(a)?, c(b)?);
    // SAFETY: renameat2(2) with two NUL-terminated paths that outlive the call; the raw
    // syscall, as older C libraries lack the wrapper.
    let r = unsafe {
        libc::syscall(
            libc::SYS_renameat2,
            libc::AT_FDCWD,
            ca.as_ptr(),
            libc::AT_FDCWD,
            cb.as_ptr(),
            libc::RENAME_EXCHANGE,
        )
    };
    if r == 0 {
        return Ok(true);
    }
    let e = std::io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::EINVAL) | Some(libc::ENOSYS) | Some(libc::EOPNOTSUPP) => Ok(false),
        _ => Err(io(rank, "swapping", b)(e)),
    }
}

#[cfg(not(target_os = "linux"))]
fn exchange(_rank: usize, _a: &Path, _b: &Path) -> Result<bool, CheckpointError> {
    Ok(false)
}

/// Removes the replaced checkpoint that [`replace`] left in `tmp`, if any.
pub(super) fn finish(rank: usize, tmp: &Path) -> Result<(), CheckpointError> {
    if tmp.exists() {
        remove_checkpoint(rank, tmp)?;
    }
    Ok(())
}

/// Removes the checkpoint folder `dir`, its manifest first: a half-removed checkpoint is
/// never taken for a complete one.
pub(super) fn remove_checkpoint(rank: usize, dir: &Path) -> Result<(), CheckpointError> {
    let manifest = dir.join(MANIFEST);
    if manifest.exists() {
        std::fs::remove_file(&manifest).map_err(io(rank, "removing", &manifest))?;
    }
    std::fs::remove_dir_all(dir).map_err(io(rank, "removing", dir))
}
