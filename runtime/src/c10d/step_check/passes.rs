//! Which pass this process is in, for the APIs whose collectives run inside the model's own
//! forward and backward (fully_shard's gathers and reduce-scatters, tensor parallelism's
//! differentiable collectives), and the step check before the first collective of each pass
//! over each process group.
//!
//! A pass begins with the outermost managed forward (a fully_shard group's pre-forward, a
//! tensor-parallel module's hooked call, while no managed forward runs and no backward pass
//! is under way), with the first hook of a backward pass (fully_shard's pre-backward hook,
//! the first tensor-parallel collective of a backward), or, for collectives outside both (a
//! state dict's gathers, an explicit unshard), when a forward or backward pass ends. Each API
//! calls [`before_collective`] before it launches a collective; the first such call of a
//! pass over a process group runs the check there, with that group's counts of the passes
//! that communicated over it and, for tensor parallelism, what the pass will run (the
//! collectives its forward recorded for this backward, and the first collective's tensor).
//! A failed check (or one that could not complete) is kept: every later collective over that
//! process group fails with it, so no rank sends more after it.
//!
//! A forward that runs during a backward pass is a recomputation (activation checkpointing):
//! it belongs to the backward pass, and what it records is not counted for the next one.

use std::collections::BTreeMap;
use std::sync::{Mutex, MutexGuard};

use tch::Tensor;

use crate::autograd::{self, Callback, Reply};
use crate::c10d::group::ProcessGroup;
use crate::error::{CollectiveSignature, DistError, PassProgram, Phase, Result, StepPosition};
use crate::ffi;

/// What one process group has seen: its own counts, since the ranks of a group need not
/// have run the same passes over other groups (a pair of ranks trained first, then all).
struct GroupPasses {
    name: String,
    /// Forward and backward passes that communicated over this group.
    forwards: u64,
    backwards: u64,
    /// The pass (`Tracker::pass`) last counted for this group: the first use of the group in
    /// a pass counts it, collective or not (a tensor-parallel backward may communicate
    /// nothing, and a rank that skipped it must still differ in its counts).
    counted: u64,
    /// The pass last checked over this group.
    checked: u64,
    /// Tensor-parallel collectives recorded for a backward since the last backward pass
    /// began over this group.
    recorded: u64,
    /// The settings noted for this group ([`note_setting`]), by owner and name.
    settings: BTreeMap<(u64, &'static str), i64>,
    failed: Option<DistError>,
}

impl GroupPasses {
    /// FNV-1a over the noted settings in key order: equal settings give equal fingerprints
    /// on every rank; 0 while none was noted.
    fn settings_fingerprint(&self) -> u64 {
        if self.settings.is_empty() {
            return 0;
        }
        use std::hash::Hasher;
        let mut h = crate::Fingerprint::default();
        for ((owner, name), value) in &self.settings {
            h.write(&owner.to_le_bytes());
            h.write(name.as_bytes());
            h.write(&value.to_le_bytes());
        }
        h.finish()
    }
}

struct Tracker {
    phase: Phase,
    /// Numbers the passes of this process (each `begin` a new one).
    pass: u64,
    /// Managed forwards running (nested calls).
    depth: usize,
    groups: Vec<GroupPasses>,
}

static TRACKER: Mutex<Tracker> = Mutex::new(Tracker {
    phase: Phase::Between,
    // A new group's `checked` (0) is no pass: its first collective is checked.
    pass: 1,
    depth: 0,
    groups: Vec::new(),
});

fn tracker() -> MutexGuard<'static, Tracker> {
    TRACKER.lock().unwrap_or_else(|e| e.into_inner())
}

impl Tracker {
    fn begin(&mut self, phase: Phase) {
        self.phase = phase;
        self.pass += 1;
    }

    /// `group`'s record, made at its first use.
    fn group(&mut self, group: &ProcessGroup) -> &mut GroupPasses {
        let i = match self
            .groups
            .iter()
            .position(|g| g.name == group.group_name())
        {
            Some(i) => i,
            None => {
                self.groups.push(GroupPasses {
                    name: group.group_name().to_string(),
                    forwards: 0,
                    backwards: 0,
                    counted: 0,
                    checked: 0,
                    recorded: 0,
                    settings: BTreeMap::new(),
                    failed: None,
                });
                self.groups.len() - 1
            }
        };
        &mut self.groups[i]
    }

    /// For an API whose backward passes begin inside libtorch's backward (a node, a hook, a
    /// recomputation): while no backward pass is under way here, one begins, and ends with
    /// the engine's pass.
    fn enter_backward(&mut self, group: &ProcessGroup, api: Api) -> Result<()> {
        if api != Api::TensorParallel || self.phase == Phase::Backward || !engine_in_backward() {
            return Ok(());
        }
        let op = api.op();
        // SAFETY: inside a running backward pass (the engine says so); the context is a
        // static, alive for the whole process.
        unsafe { autograd::queue_end_of_backward::<EndOfBackward>(&END_OF_BACKWARD) }.map_err(
            |e| DistError::Collective {
                rank: group.rank(),
                op,
                cause: e.message,
            },
        )?;
        self.depth = 0;
        self.begin(Phase::Backward);
        Ok(())
    }

    /// `group`'s record with this pass counted (once per pass), or its kept failure.
    fn count(&mut self, group: &ProcessGroup, api: Api) -> Result<&mut GroupPasses> {
        self.enter_backward(group, api)?;
        let (phase, pass) = (self.phase, self.pass);
        let g = self.group(group);
        if let Some(e) = &g.failed {
            return Err(e.clone());
        }
        if g.counted != pass {
            g.counted = pass;
            match phase {
                Phase::Forward => g.forwards += 1,
                Phase::Backward => g.backwards += 1,
                Phase::Between => {}
            }
        }
        Ok(g)
    }
}

/// The APIs whose collectives run inside the model's passes, as the step check names them
/// and as their backward passes begin.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Api {
    /// fully_shard: its pre-backward hook begins a backward pass and its end-of-backward
    /// callback ends it.
    FullyShard,
    /// Tensor parallelism: its first operation inside libtorch's backward begins one, ended
    /// with the engine's pass.
    TensorParallel,
}

impl Api {
    /// The name the step check's errors give.
    pub(crate) fn op(self) -> &'static str {
        match self {
            Api::FullyShard => "fully_shard",
            Api::TensorParallel => "tensor parallelism",
        }
    }
}

/// Whether libtorch's engine runs a backward pass on this thread.
fn engine_in_backward() -> bool {
    // SAFETY: a query of this thread's state, without arguments.
    unsafe { ffi::tdr_in_backward() }
}

/// A managed forward begins (a fully_shard group's, a tensor-parallel module's hooked call);
/// the outermost one outside backward (where a forward is a recomputation) begins a forward
/// pass. Pair it with [`forward_ends`]; a call that fails or unwinds before its end is ended
/// when the outermost hooked call on its thread ends.
///
/// ```
/// tch_dist_runtime::managed_forward_begins();
/// // ... the module's forward, whose collectives the step check covers as one pass ...
/// tch_dist_runtime::managed_forward_ends();
/// ```
pub fn forward_begins() {
    let mut t = tracker();
    if t.depth == 0 && t.phase != Phase::Backward && !engine_in_backward() {
        t.begin(Phase::Forward);
    }
    t.depth += 1;
}

/// A managed forward ended ([`forward_begins`]); the outermost one ends the forward pass.
pub fn forward_ends() {
    let mut t = tracker();
    t.depth = t.depth.saturating_sub(1);
    if t.depth == 0 && t.phase == Phase::Forward {
        t.begin(Phase::Between);
    }
}

/// The outermost hooked call on this thread ended, also by failing or unwinding (when the
/// managed forwards inside it never reached their end): no managed forward runs any more.
pub(crate) fn outermost_call_ended() {
    let mut t = tracker();
    if t.depth != 0 && t.phase != Phase::Backward {
        t.depth = 0;
        if t.phase == Phase::Forward {
            t.begin(Phase::Between);
        }
    }
}

/// The first hook of a root's backward pass ran. Several roots (fully_shard calls with no
/// common enclosing call) each begin it in one backward: the first begins the pass.
pub(crate) fn backward_begins() {
    let mut t = tracker();
    t.depth = 0;
    if t.phase != Phase::Backward {
        t.begin(Phase::Backward);
    }
}

/// A root's backward pass ended (its end-of-backward callback finished its groups); the
/// callbacks of other roots in the same backward run after it, in the new phase, alike on
/// every rank.
pub(crate) fn backward_ends() {
    tracker().begin(Phase::Between);
}

/// A tensor-parallel forward over `group` recorded a collective its backward will run
/// (outside a recomputation): the next backward pass's header counts it.
pub(crate) fn note_recorded(group: &ProcessGroup) {
    let mut t = tracker();
    if t.phase != Phase::Backward && !engine_in_backward() {
        t.group(group).recorded += 1;
    }
}

/// Notes a setting of `owner` (a number a managed module's group, or a root's context for
/// a setting its groups share, takes in creation order) that changes what `group`'s passes send or compute without changing
/// their collectives' sizes, so that the step check before the next pass over `group`
/// compares it across the ranks: a rank that set it alone (or to another value) fails that
/// check on every rank, before the pass sends anything, rather than computing other numbers
/// (a gradient divide factor) or sending mismatched collectives (a gather skipped).
pub(crate) fn note_setting(group: &ProcessGroup, owner: u64, name: &'static str, value: i64) {
    tracker().group(group).settings.insert((owner, name), value);
}

/// Forgets the settings `owner` noted for `group` (its module was dropped: another built
/// later starts from the defaults).
pub(crate) fn forget_settings(group: &ProcessGroup, owner: u64) {
    tracker()
        .group(group)
        .settings
        .retain(|(o, _), _| *o != owner);
}

/// Forgets every setting noted for `group`: a model is being built over it (its groups'
/// settings start from the defaults; the instance table keeps a dropped model's groups
/// alive, so a model built after another whose settings differed across ranks would
/// otherwise inherit that difference).
pub(crate) fn forget_all_settings(group: &ProcessGroup) {
    tracker().group(group).settings.clear();
}

/// An operation of `api` over `group` that communicates nothing (a tensor-parallel copy or
/// split, the backward of an all-reduce): this pass is counted for the group, or the
/// group's kept failure returned.
pub(crate) fn note_pass(group: &ProcessGroup, api: Api) -> Result<()> {
    tracker().count(group, api).map(|_| ())
}

/// Before a collective of `api` over `group`: the step check, once per pass and process
/// group. `first` is the collective's signature, compared when it is the pass's first.
/// Inside libtorch's backward (a tensor-parallel collective's backward, a recomputation's
/// forward, a gradient hook) the collective belongs to the backward pass, which begins here
/// if no other API began it.
pub(crate) fn before_collective(
    group: &ProcessGroup,
    api: Api,
    first: Option<CollectiveSignature>,
) -> Result<()> {
    let mut guard = tracker();
    let t = &mut *guard;
    let (phase, pass) = {
        t.count(group, api)?;
        (t.phase, t.pass)
    };
    let g = t.group(group);
    if g.checked == pass {
        return Ok(());
    }
    g.checked = pass;
    let recorded = match phase {
        Phase::Backward => std::mem::take(&mut g.recorded),
        Phase::Forward | Phase::Between => 0,
    };
    let me = StepPosition::now(phase, g.forwards, g.backwards);
    let program = PassProgram {
        recorded,
        first,
        settings: g.settings_fingerprint(),
    };
    // The lock stays held: no collective of this pass may start before the check is done.
    super::check(group, api.op(), me, program).inspect_err(|e| g.failed = Some(e.clone()))
}

/// The end of a backward pass that a tensor-parallel collective began.
struct EndOfBackward;

/// [`EndOfBackward`]'s context: nothing but an address.
static END_OF_BACKWARD: () = ();

impl Callback for EndOfBackward {
    type Context = ();
    const PANIC: &'static str = "tensor parallelism: internal panic at the end of backward";

    fn run(_ctx: &(), _index: usize, _grad: Option<Tensor>) -> Reply {
        backward_ends();
        Ok(())
    }
}
