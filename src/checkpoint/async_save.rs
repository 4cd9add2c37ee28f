//! [`async_save`](super::async_save()): a save that returns once this rank's tensors are staged to host memory,
//! writing, agreeing and committing in a background thread over a process group of its own
//! (DCP's `async_save` with its `DefaultStager` and `_ThreadBasedAsyncCheckpointExecutor`).
//!
//! At most one async save is in flight in a process: the next [`async_save`](super::async_save()) (or a
//! [`save`](super::save)) waits for the previous one first, so that the background group's
//! collectives run in one order on every rank and at most one staged copy is held.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;

use tch_dist_core::Shardable;
use tch_dist_runtime::{Backend, GroupOptions, ProcessGroup};

use super::CheckpointProblem;
use super::{fs, protocol, CheckpointError, Parts, SaveOptions};

/// The background thread's outcome.
type Outcome = Result<(), CheckpointError>;

/// A background write: its thread until someone joined it, then its outcome until the
/// handle takes it.
struct Job {
    thread: Mutex<Option<JoinHandle<Outcome>>>,
    outcome: Mutex<Option<Outcome>>,
    rank: usize,
    dir: PathBuf,
}

/// A lock whose holder panicked still guards consistent data here (an `Option` swapped
/// whole).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Job {
    /// Waits for the thread to end (once; later calls return at once) and keeps its outcome.
    fn join(&self) {
        let mut thread = lock(&self.thread);
        if let Some(handle) = thread.take() {
            let outcome = handle.join().unwrap_or_else(|panic| {
                let cause = panic
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "a panic".into());
                Err(CheckpointProblem::Background {
                    dir: self.dir.clone(),
                    cause,
                }
                .on(self.rank))
            });
            *lock(&self.outcome) = Some(outcome);
        }
    }

    fn is_finished(&self) -> bool {
        lock(&self.thread).as_ref().is_none_or(|h| h.is_finished())
    }
}

/// The async save in flight in this process, if any.
static IN_FLIGHT: Mutex<Option<Arc<Job>>> = Mutex::new(None);

/// Waits for the async save in flight in this process, if any (its outcome stays with its
/// [`AsyncSave`] handle).
pub(super) fn wait_in_flight() {
    let previous = lock(&IN_FLIGHT).take();
    if let Some(job) = previous {
        job.join();
    }
}

/// The background groups, one per group that async saves ran over, by the group's name and
/// global ranks: created at the first [`async_save`](super::async_save()) over it, reused afterwards.
static BACKGROUND_GROUPS: Mutex<Vec<(GroupKey, ProcessGroup)>> = Mutex::new(Vec::new());

/// A group by its name and global ranks.
type GroupKey = (String, Vec<usize>);

/// `group`'s background group: a Gloo group of the same ranks, created collectively (every
/// rank of `group` is in its first `async_save`) with local synchronization, so that other
/// ranks' `new_group` counts are not disturbed.
fn background_group(group: &ProcessGroup, dir: &Path) -> Result<ProcessGroup, CheckpointError> {
    let key = (
        group.group_name().to_string(),
        group.global_ranks().to_vec(),
    );
    let mut groups = lock(&BACKGROUND_GROUPS);
    // A shut-down group's background group went down with it (it is its child): every
    // rank sees that alike, and makes a new one alike.
    groups.retain(|(_, g)| !g.is_shut_down());
    if let Some((_, g)) = groups.iter().find(|(k, _)| *k == key) {
        return Ok(g.clone());
    }
    let ranks: Vec<usize> = (0..group.world_size()).collect();
    let opts = GroupOptions::new(Backend::Gloo).with_local_synchronization();
    let created = group
        .new_group_with(&ranks, &opts)
        .map_err(|e| {
            CheckpointProblem::Save {
                dir: dir.to_path_buf(),
                step: "creating the background group",
                source: Box::new(e),
            }
            .on(group.rank())
        })?
        // Every rank of `group` is a member of a group of all its ranks.
        .ok_or_else(|| {
            CheckpointProblem::Background {
                dir: dir.to_path_buf(),
                cause: "this rank is not in the background group of its own ranks".into(),
            }
            .on(group.rank())
        })?;
    groups.push((key, created.clone()));
    Ok(created)
}

/// An async save in progress: PyTorch's `Future` from `dcp.async_save`. [`wait`](Self::wait)
/// returns its outcome; dropping it without waiting waits too (so that no background write
/// outlives its handle unseen) and prints an error it ended in to stderr, as its outcome
/// would otherwise be lost. A process that ends while a save is in flight (its handle
/// leaked, `std::process::exit`) ends the save as a crash would: `DIR.partial` is left, and
/// [`latest`](super::latest) stays on the previous checkpoint.
///
/// ```no_run
/// # use tch::nn;
/// # use tch_dist::Shardable;
/// # #[derive(Debug, Shardable)]
/// # struct Net { fc: nn::Linear }
/// # fn demo(pg: &tch_dist::ProcessGroup, model: &Net) -> Result<(), tch_dist::checkpoint::CheckpointError> {
/// use tch_dist::checkpoint::{self, SaveOptions, State};
/// let pending = checkpoint::async_save("ckpt/step-00000100", &State::new(model), pg, &SaveOptions::default())?;
/// // ... the next steps train while the checkpoint is written ...
/// pending.wait()?;
/// # Ok(()) }
/// ```
#[must_use = "an async save's outcome is known only from wait()"]
pub struct AsyncSave {
    job: Arc<Job>,
    waited: bool,
}

impl std::fmt::Debug for AsyncSave {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AsyncSave")
            .field("rank", &self.job.rank)
            .field("dir", &self.job.dir)
            .field("finished", &self.job.is_finished())
            .finish()
    }
}

impl AsyncSave {
    /// Waits for the background write, the ranks' agreement and the commit, and returns
    /// the save's outcome: `Ok` once the checkpoint is in place as `dir` (on every rank:
    /// the last step is a collective), else the error every rank got, as
    /// [`save`](super::save) returns it.
    pub fn wait(mut self) -> Result<(), CheckpointError> {
        self.waited = true;
        self.job.join();
        lock(&self.job.outcome)
            .take()
            // Only this handle takes the outcome, once: after a join it is there.
            .unwrap_or(Ok(()))
    }

    /// Whether the background part has ended (then [`wait`](Self::wait) returns at once).
    pub fn is_finished(&self) -> bool {
        self.job.is_finished()
    }

    /// The checkpoint folder being written.
    pub fn dir(&self) -> &Path {
        &self.job.dir
    }
}

impl Drop for AsyncSave {
    fn drop(&mut self) {
        if self.waited {
            return;
        }
        self.job.join();
        if let Some(Err(e)) = lock(&self.job.outcome).take() {
            eprintln!(
                "tch-dist: an AsyncSave dropped without wait() failed: {}",
                crate::report(&e)
            );
        }
    }
}

/// Saves like [`save`](super::save), asynchronously: stages this rank's part of the state
/// to host memory (a copy: the next optimizer step may change the parameters; the
/// optimizer's settings and the train state taken now) and returns; a background thread
/// writes `DIR.partial`, agrees with the other ranks and commits, the same steps as
/// [`save`](super::save) (`protocol.rs`), over a Gloo group of `group`'s ranks of its own
/// (created at the first `async_save` over `group`: a collective of every rank), so that its
/// collectives never interleave with training's on `group`.
pub(super) fn start<M: Shardable + ?Sized>(
    dir: &Path,
    parts: &Parts<'_, M>,
    group: &ProcessGroup,
    opts: &SaveOptions,
) -> Result<AsyncSave, CheckpointError> {
    let rank = group.rank();
    // The previous async save first: one order of the background group's collectives on
    // every rank, and one staged copy at a time.
    wait_in_flight();
    let background = background_group(group, dir)?;
    let (pieces, tensors) = super::stage(dir, parts.model, parts.optimizer, group, true);
    let sidecar = parts.optimizer.map(crate::optim::sidecar::of);
    let train_state = parts.train_state.cloned();
    let (dir_owned, keep_last) = (dir.to_path_buf(), opts.keep_last);
    let thread = std::thread::Builder::new()
        .name(format!("tch-dist async_save rank {rank}"))
        .spawn(move || {
            let save = protocol::Save::new(&dir_owned, &background);
            let sidecars = protocol::Sidecars {
                train_state: train_state.as_ref(),
                optimizer: sidecar,
            };
            let outcome = save.run(pieces, tensors, sidecars, keep_last);
            // The staged copy and the file's bytes are freed by now, but glibc keeps freed
            // memory of this thread's arena mapped: give it back, or every save's thread
            // leaves its shard resident (the growth pytorch#170163 reports).
            #[cfg(all(target_os = "linux", target_env = "gnu"))]
            // SAFETY: malloc_trim(3) only returns free memory to the system.
            unsafe {
                libc::malloc_trim(0);
            }
            outcome
        })
        .map_err(fs::io(rank, "starting the writer of", dir))?;
    let job = Arc::new(Job {
        thread: Mutex::new(Some(thread)),
        outcome: Mutex::new(None),
        rank,
        dir: dir.to_path_buf(),
    });
    *lock(&IN_FLIGHT) = Some(job.clone());
    Ok(AsyncSave { job, waited: false })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A panicked background thread is an error naming the rank, the folder and the panic,
    /// kept for `wait`; a second join returns at once.
    #[test]
    fn a_panicking_background_is_an_error_of_the_handle() {
        let thread = std::thread::spawn(|| -> Outcome { panic!("boom") });
        let job = Arc::new(Job {
            thread: Mutex::new(Some(thread)),
            outcome: Mutex::new(None),
            rank: 1,
            dir: PathBuf::from("ckpt/step-00000001"),
        });
        let handle = AsyncSave {
            job: job.clone(),
            waited: false,
        };
        let err = handle.wait().unwrap_err();
        assert_eq!(
            err.to_string(),
            "rank 1: checkpoint.async_save of ckpt/step-00000001: the background write \
             failed: boom"
        );
        assert!(job.is_finished());
        job.join();
    }
}
