//! What a run measures beside step times: resident memory, CPU time, page faults, the
//! machine's busy time, medians and the timed window.

use super::*;

// Resident memory and malloc's bytes in use: shared with train_fsdp (examples/common).
#[path = "../common/memory.rs"]
mod memory;
pub(crate) use memory::{malloc_in_use, rss_mib};

pub(crate) fn rusage() -> libc::rusage {
    // SAFETY: getrusage fills the struct we pass; RUSAGE_SELF covers every thread.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    ru
}

/// CPU time (user + system, all threads) this process has used, in ms.
pub(crate) fn cpu_ms() -> f64 {
    let ru = rusage();
    let tv = |t: libc::timeval| t.tv_sec as f64 * 1e3 + t.tv_usec as f64 / 1e3;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// Minor page faults (fresh memory touched) so far.
pub(crate) fn page_faults() -> f64 {
    rusage().ru_minflt as f64
}

/// Busy CPU time of the whole machine so far, in ms (from /proc/stat; USER_HZ is 100): with
/// the ranks' own CPU time it tells how much other programs ran during a measurement.
pub(crate) fn machine_busy_ms() -> f64 {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let ticks: Vec<f64> = stat
        .lines()
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .skip(1)
        .filter_map(|f| f.parse().ok())
        .collect();
    // user nice system idle iowait irq softirq steal: everything but idle and iowait.
    let busy: f64 = ticks
        .iter()
        .take(8)
        .enumerate()
        .filter(|(i, _)| *i != 3 && *i != 4)
        .map(|(_, t)| t)
        .sum();
    busy * 10.0
}

pub(crate) fn median(v: &[f64]) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    }
}

/// The timed part of a run: wall time, this process's CPU time and the machine's busy time.
pub(crate) struct Window {
    pub(crate) wall_ms: f64,
    pub(crate) cpu_ms: f64,
    pub(crate) machine_busy_ms: f64,
}

impl Window {
    pub(crate) fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "wall_ms": self.wall_ms,
            "cpu_ms": self.cpu_ms,
            "machine_busy_ms": self.machine_busy_ms,
        })
    }
}

pub(crate) fn sync(device: Device) {
    if let Device::Cuda(i) = device {
        tch::Cuda::synchronize(i as i64);
    }
}

pub(crate) fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

/// The bytes of one tensor's elements.
pub(crate) fn tensor_bytes(t: &tch::Tensor) -> usize {
    t.numel() * t.kind().elt_size_in_bytes()
}

/// What this rank holds between steps, counted from the tensors: its trainable parameters'
/// bytes and their gradients'.
pub(crate) fn held_bytes(vs: &tch::nn::VarStore) -> (usize, usize) {
    let trainable = vs.trainable_variables();
    let params = trainable.iter().map(tensor_bytes).sum();
    let grads = trainable
        .iter()
        .map(|t| t.grad())
        .filter(|g| g.defined())
        .map(|g| tensor_bytes(&g))
        .sum();
    (params, grads)
}

/// The bytes this process's network namespace received and sent on `eth0` so far
/// (`/proc/net/dev`; the hosts part runs each host as a namespace whose `eth0` is its link
/// to the others); `None` without an `eth0`.
pub(crate) fn eth0_bytes() -> Option<(u64, u64)> {
    let text = std::fs::read_to_string("/proc/net/dev").ok()?;
    let line = text
        .lines()
        .find_map(|l| l.trim_start().strip_prefix("eth0:"))?;
    let f: Vec<u64> = line
        .split_whitespace()
        .filter_map(|x| x.parse().ok())
        .collect();
    Some((*f.first()?, *f.get(8)?))
}

/// `eth0`'s received and sent bytes per timed step since `start` (from [`eth0_bytes`]).
pub(crate) fn net_window(start: Option<(u64, u64)>, steps: usize) -> Option<(f64, f64)> {
    let ((rx0, tx0), (rx1, tx1)) = (start?, eth0_bytes()?);
    let per = |a: u64, b: u64| b.saturating_sub(a) as f64 / steps as f64;
    Some((per(rx0, rx1), per(tx0, tx1)))
}

/// Adds [`net_window`]'s figures to a `BENCH` record (nothing without an `eth0`).
pub(crate) fn add_net(out: &mut serde_json::Value, net: Option<(f64, f64)>) {
    if let Some((rx, tx)) = net {
        out["net_rx_bytes_per_step"] = rx.into();
        out["net_tx_bytes_per_step"] = tx.into();
    }
}

/// The always-on step check's clocks (rank 0's, measured inside the runtime): the time in
/// the check, and of it the wait for the last peer to arrive.
#[derive(Clone, Copy, Default)]
pub(crate) struct CheckClock {
    total: std::time::Duration,
    wait: std::time::Duration,
}

impl CheckClock {
    pub(crate) fn now() -> CheckClock {
        CheckClock {
            total: tch_dist::step_check_time(),
            wait: tch_dist::step_check_wait_time(),
        }
    }

    /// The `BENCH` line's fields since `self`, per step: `step_check_ms` (the whole time in
    /// the check) and `step_check_wait_ms` (of it, the wait for the last peer).
    pub(crate) fn per_step_since(self, steps: usize) -> [(&'static str, f64); 2] {
        let now = CheckClock::now();
        let per_step = |d: std::time::Duration| d.as_secs_f64() * 1e3 / steps as f64;
        [
            ("step_check_ms", per_step(now.total - self.total)),
            ("step_check_wait_ms", per_step(now.wait - self.wait)),
        ]
    }
}
