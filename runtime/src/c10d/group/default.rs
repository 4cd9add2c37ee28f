//! The process-wide default group (PyTorch's `_world.default_pg` behind
//! `init_process_group`, `is_initialized`, `destroy_process_group`).

use std::sync::Mutex;

use crate::error::{DistError, Result};

use super::{Backend, InitOptions, ProcessGroup};

static DEFAULT_GROUP: Mutex<Option<ProcessGroup>> = Mutex::new(None);

fn default_slot() -> std::sync::MutexGuard<'static, Option<ProcessGroup>> {
    // A panic while holding this lock cannot leave the Option half-written.
    DEFAULT_GROUP.lock().unwrap_or_else(|e| e.into_inner())
}

/// Creates the default process group from the launch environment (torchrun's RANK,
/// WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT, else Slurm's) and returns it.
///
/// `backend` is a [`Backend`] or one of PyTorch's strings (`"gloo"`, `"nccl"`,
/// `"cpu:gloo,cuda:nccl"`; another string is [`DistError::UnknownBackend`]). The group is
/// PyTorch 2.11's default group, store keys and handshake included, so PyTorch ranks that call
/// `torch.distributed.init_process_group` with the same string and variables join it.
///
/// With `Backend::Nccl` the group binds CUDA device LOCAL_RANK (PyTorch's
/// `torch.cuda.set_device(local_rank)` plus `device_id`): it becomes this thread's current
/// device, NCCL's bound device and [`ProcessGroup::bound_device`]. For an explicit device,
/// eager connection or the test switches, use [`init_process_group_with`] with
/// [`InitOptions::from_env`] and its builders.
///
/// ```no_run
/// let pg = tch_dist_runtime::init_process_group(tch_dist_runtime::Backend::Gloo)?;
/// println!("rank {} of {}", pg.rank(), pg.world_size());
/// # tch_dist_runtime::destroy_process_group();
/// let pg = tch_dist_runtime::init_process_group("gloo")?; // as torch.distributed
/// # Ok::<(), tch_dist_runtime::DistError>(())
/// ```
pub fn init_process_group<B>(backend: B) -> Result<ProcessGroup>
where
    B: TryInto<Backend>,
    DistError: From<B::Error>,
{
    init_process_group_with(&InitOptions::from_env(backend.try_into()?)?)
}

/// Creates the default process group from explicit options.
pub fn init_process_group_with(opts: &InitOptions) -> Result<ProcessGroup> {
    if default_slot().is_some() {
        return Err(DistError::AlreadyInitialized);
    }
    let pg = ProcessGroup::new(opts)?;
    let mut slot = default_slot();
    if slot.is_some() {
        return Err(DistError::AlreadyInitialized);
    }
    *slot = Some(pg.clone());
    Ok(pg)
}

/// The default process group.
pub fn default_group() -> Result<ProcessGroup> {
    default_slot().clone().ok_or(DistError::NotInitialized)
}

/// Whether a default process group exists.
pub fn is_initialized() -> bool {
    default_slot().is_some()
}

/// Shuts the default group down (see [`ProcessGroup::shutdown`]: even while clones of it
/// are alive, with every subgroup created from it) and forgets it, so that
/// `init_process_group` may be called again. Call it before the process exits.
pub fn destroy_process_group() {
    let group = default_slot().take();
    if let Some(pg) = group {
        pg.shutdown();
    }
}
