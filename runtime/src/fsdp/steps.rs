//! fully_shard's side of the step check (`step_check.rs`): which pass this process is in,
//! across every group, and the check before the first collective of each pass over each
//! process group.
//!
//! A pass begins with the outermost managed forward (a group's pre-forward while no managed
//! forward runs and no backward pass is under way), with the first hook of a backward pass,
//! or, for collectives outside both (a state dict's gathers, an explicit unshard), when a
//! forward or backward pass ends. Each group calls [`before_collective`] before it launches
//! an all-gather or a reduce-scatter; the first such call of a pass over a process group
//! runs the check there, with that group's counts of the passes that communicated over it.
//! A failed check (or one that could not complete) is kept: every later collective over
//! that process group fails with it, so no rank sends more after it.

use std::sync::{Mutex, MutexGuard};

use crate::error::{DistError, Result};
use crate::process_group::ProcessGroup;
use crate::step_check::{self, Phase, StepPosition};

/// What one process group has seen: its own counts, since the ranks of a group need not
/// have run the same passes over other groups (a pair of ranks trained first, then all).
struct GroupPasses {
    name: String,
    /// Forward and backward passes that communicated over this group.
    forwards: u64,
    backwards: u64,
    /// The pass (`Tracker::pass`) last checked over this group.
    checked: u64,
    failed: Option<DistError>,
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
}

/// A group's forward begins; the outermost one outside backward (where a forward is a
/// recomputation) begins a forward pass.
pub(crate) fn forward_begins() {
    let mut t = tracker();
    if t.depth == 0 && t.phase != Phase::Backward {
        t.begin(Phase::Forward);
    }
    t.depth += 1;
}

/// A group's forward ended; the outermost one ends the forward pass.
pub(crate) fn forward_ends() {
    let mut t = tracker();
    t.depth = t.depth.saturating_sub(1);
    if t.depth == 0 && t.phase == Phase::Forward {
        t.begin(Phase::Between);
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

/// Before a collective over `group`: the step check, once per pass and process group.
pub(crate) fn before_collective(group: &ProcessGroup) -> Result<()> {
    let mut guard = tracker();
    let t = &mut *guard;
    let i = match t.groups.iter().position(|g| g.name == group.group_name()) {
        Some(i) => i,
        None => {
            t.groups.push(GroupPasses {
                name: group.group_name().to_string(),
                forwards: 0,
                backwards: 0,
                checked: 0,
                failed: None,
            });
            t.groups.len() - 1
        }
    };
    let g = &mut t.groups[i];
    if let Some(e) = &g.failed {
        return Err(e.clone());
    }
    if g.checked == t.pass {
        return Ok(());
    }
    g.checked = t.pass;
    match t.phase {
        Phase::Forward => g.forwards += 1,
        Phase::Backward => g.backwards += 1,
        Phase::Between => {}
    }
    let me = StepPosition::now(t.phase, g.forwards, g.backwards);
    // The lock stays held: no collective of this pass may start before the check is done.
    step_check::check(group, "fully_shard", me).inspect_err(|e| g.failed = Some(e.clone()))
}
