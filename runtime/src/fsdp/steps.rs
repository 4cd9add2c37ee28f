//! fully_shard's side of the step check (`step_check.rs`): which pass this process is in,
//! across every group, and the check before the first collective of each pass over each
//! process group.
//!
//! A pass begins with the outermost managed forward (a group's pre-forward while no managed
//! forward runs and no backward pass is under way), with the first hook of a backward pass,
//! or, for collectives outside both (a state dict's gathers, an explicit unshard), when a
//! forward or backward pass ends. Each group calls [`before_collective`] before it launches
//! an all-gather or a reduce-scatter; the first such call of a pass over a process group
//! runs the check there. A failed check (or one that could not complete) is kept: every
//! later collective of every group fails with it, so no rank sends more after it.

use std::sync::{Mutex, MutexGuard};

use crate::error::{DistError, Result};
use crate::process_group::ProcessGroup;
use crate::step_check::{self, Phase};

struct Tracker {
    phase: Phase,
    forwards: u64,
    backwards: u64,
    /// Managed forwards running (nested calls).
    depth: usize,
    /// The process groups (by name) checked in the current pass.
    checked: Vec<String>,
    failed: Option<DistError>,
}

static TRACKER: Mutex<Tracker> = Mutex::new(Tracker {
    phase: Phase::Between,
    forwards: 0,
    backwards: 0,
    depth: 0,
    checked: Vec::new(),
    failed: None,
});

fn tracker() -> MutexGuard<'static, Tracker> {
    TRACKER.lock().unwrap_or_else(|e| e.into_inner())
}

impl Tracker {
    fn begin(&mut self, phase: Phase) {
        self.phase = phase;
        self.checked.clear();
    }
}

/// A group's forward begins; the outermost one outside backward (where a forward is a
/// recomputation) begins a step.
pub(crate) fn forward_begins() {
    let mut t = tracker();
    if t.depth == 0 && t.phase != Phase::Backward {
        t.forwards += 1;
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

/// The first hook of a backward pass ran.
pub(crate) fn backward_begins() {
    let mut t = tracker();
    t.backwards += 1;
    t.depth = 0;
    t.begin(Phase::Backward);
}

/// The backward pass ended (its end-of-backward callback finished every group).
pub(crate) fn backward_ends() {
    tracker().begin(Phase::Between);
}

/// Before a collective over `group`: the step check, once per pass and process group.
pub(crate) fn before_collective(group: &ProcessGroup) -> Result<()> {
    let mut t = tracker();
    if let Some(e) = &t.failed {
        return Err(e.clone());
    }
    if t.checked.iter().any(|name| name == group.group_name()) {
        return Ok(());
    }
    let me = step_check::StepPosition::now(t.phase, t.forwards, t.backwards);
    // The lock stays held: no collective of this pass may start before the check is done.
    match step_check::check(group, "fully_shard", me) {
        Ok(()) => {
            t.checked.push(group.group_name().to_string());
            Ok(())
        }
        Err(e) => {
            t.failed = Some(e.clone());
            Err(e)
        }
    }
}
