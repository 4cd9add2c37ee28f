//! Chrome traces of what each rank runs when: `TCH_DIST_TRACE=DIR`.
//!
//! With the variable set, every process writes `DIR/trace-rank{RANK}.json` (RANK from the
//! launch environment, else `trace-pid{PID}.json`): a Chrome trace in the JSON array format,
//! which Perfetto (ui.perfetto.dev) and `chrome://tracing` open, as they open
//! `torch.profiler`'s traces. Timestamps are microseconds of the rank's own wall clock, so
//! ranks on one machine line up; ranks on several machines line up as well as their clocks.
//!
//! What is recorded (each family of APIs records its own work through [`span`],
//! [`complete`] and [`collective`]):
//! - the forward of each hooked module (`forward <FQN or type>`, category `forward`);
//! - backward work the engines see: replicate's pass from its first gradient to the end of
//!   backward, each fully_shard group's backward (category `backward`);
//! - every collective from its launch to the return of its wait, as an async event per
//!   operation (category `collective`: `all_reduce`, `all_gather_into_tensor`,
//!   `reduce_scatter_tensor`, ...), and the wait itself on the waiting thread (`wait <op>`);
//! - optimizer steps of `tch_dist::optim` (category `optimizer`);
//! - each action of a pipeline schedule under PyTorch's name for it (`1F0`: stage 1's
//!   forward of microbatch 0; `B`, `I`, `W` for a whole, input and weight backward;
//!   category `forward` or `backward`), a split backward's `weight pass N` inside it, and
//!   each wait for a received activation or gradient (`wait activation 0 from stage 0`,
//!   category `wait`) inside the action that needed it.
//!
//! The file is valid JSON after every flush: events are buffered in memory and written about
//! once a second, when a buffer of 64 KiB fills, at [`flush`], and (from the runtime) at
//! process exit and `destroy_process_group`. Without the variable, each call costs one
//! relaxed atomic load.
//!
//! ```
//! use tch_dist_core::trace;
//! // Off unless TCH_DIST_TRACE names a folder: nothing is written, nothing is timed.
//! let _forward = trace::span("forward fc1", "forward");
//! trace::flush();
//! ```

use std::borrow::Cow;
use std::cell::Cell;
use std::fmt::Write as _;
use std::fs::File;
use std::io::{Seek, SeekFrom, Write};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

/// The variable naming the folder traces are written to.
pub const TRACE_ENV: &str = "TCH_DIST_TRACE";

/// Buffered bytes that trigger a write.
const FLUSH_BYTES: usize = 64 * 1024;

/// Not yet decided (0), on (1), off (2).
static STATE: AtomicU8 = AtomicU8::new(0);
static TRACER: OnceLock<Mutex<Tracer>> = OnceLock::new();
static NEXT_ID: AtomicU64 = AtomicU64::new(1);
static NEXT_THREAD: AtomicU64 = AtomicU64::new(1);

thread_local! {
    /// This thread's lane in the trace (1 for the first thread that records, and so on).
    static THREAD: Cell<u64> = const { Cell::new(0) };
}

/// Whether traces are being written (`TCH_DIST_TRACE` names a folder that could be opened).
///
/// ```
/// use tch_dist_core::trace;
/// // An event's arguments are worth formatting only when they are written.
/// if trace::enabled() {
///     println!("tracing into {:?}", std::env::var_os(trace::TRACE_ENV));
/// }
/// ```
pub fn enabled() -> bool {
    match STATE.load(Ordering::Relaxed) {
        1 => true,
        2 => false,
        _ => start(),
    }
}

/// Decides once whether to trace, opening the file if so.
fn start() -> bool {
    let tracer = TRACER.get_or_init(|| Mutex::new(Tracer::open()));
    let on = lock(tracer).file.is_some();
    STATE.store(if on { 1 } else { 2 }, Ordering::Relaxed);
    on
}

/// Microseconds on this rank's wall clock: the timestamps of every event.
///
/// ```
/// let start = tch_dist_core::trace::now_us();
/// assert!(tch_dist_core::trace::now_us() >= start);
/// ```
pub fn now_us() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64() * 1e6)
}

/// A new id for an async event (a collective in flight), unique in this process.
///
/// ```
/// use tch_dist_core::trace;
/// let (a, b) = (trace::next_id(), trace::next_id());
/// assert_ne!(a, b);
/// ```
pub fn next_id() -> u64 {
    NEXT_ID.fetch_add(1, Ordering::Relaxed)
}

/// A span on the calling thread, recorded when dropped; `None` (and nothing timed) when
/// tracing is off.
///
/// ```
/// use tch_dist_core::trace;
/// {
///     let _step = trace::span("step", "optimizer");
///     // ... the work being timed ...
/// } // recorded here, when tracing is on
/// ```
#[must_use = "the span ends when this is dropped"]
pub fn span(name: impl Into<Cow<'static, str>>, category: &'static str) -> Option<Span> {
    enabled().then(|| Span {
        name: name.into(),
        category,
        start: now_us(),
    })
}

/// A span that [`span`] started; recorded as a complete event when dropped.
///
/// ```
/// let span: Option<tch_dist_core::trace::Span> = tch_dist_core::trace::span("step", "optimizer");
/// drop(span); // recorded now, when tracing is on
/// ```
#[derive(Debug)]
pub struct Span {
    name: Cow<'static, str>,
    category: &'static str,
    start: f64,
}

impl Drop for Span {
    fn drop(&mut self) {
        complete(&self.name, self.category, self.start, now_us(), &[]);
    }
}

/// Records a complete event on the calling thread, from `start` to `end` (from [`now_us`]),
/// with `args` shown beside it.
///
/// ```
/// use tch_dist_core::trace;
/// let start = trace::now_us();
/// // ... the work ...
/// trace::complete("load batch", "data", start, trace::now_us(), &[("rows", "64".into())]);
/// ```
pub fn complete(name: &str, category: &str, start: f64, end: f64, args: &[(&str, String)]) {
    if !enabled() {
        return;
    }
    let mut e = event_head(name, category, "X", start);
    let _ = write!(e, ",\"dur\":{:.3}", (end - start).max(0.0));
    push_args(&mut e, args);
    e.push('}');
    record(e);
}

/// Records an operation in flight from `start` to `end` (a collective from its launch to the
/// return of its wait) as an async event pair with id `id` (from [`next_id`]), which the
/// viewers draw on a track of its own beside the calling thread's.
///
/// ```
/// use tch_dist_core::trace;
/// let (id, start) = (trace::next_id(), trace::now_us());
/// // ... launch the operation, then wait for it ...
/// trace::collective("all_reduce", id, start, trace::now_us(), &[("bytes", "4096".into())]);
/// ```
pub fn collective(name: &str, id: u64, start: f64, end: f64, args: &[(&str, String)]) {
    if !enabled() {
        return;
    }
    let mut b = event_head(name, "collective", "b", start);
    let _ = write!(b, ",\"id\":{id}");
    push_args(&mut b, args);
    b.push('}');
    let mut e = event_head(name, "collective", "e", end.max(start));
    let _ = write!(e, ",\"id\":{id}}}");
    record(b);
    record(e);
}

/// Writes what is buffered, so that the file holds every event recorded so far.
///
/// ```
/// tch_dist_core::trace::flush(); // the file now holds every event recorded so far
/// ```
pub fn flush() {
    if STATE.load(Ordering::Relaxed) != 1 {
        return;
    }
    if let Some(t) = TRACER.get() {
        lock(t).write_out();
    }
}

fn event_head(name: &str, category: &str, phase: &str, ts: f64) -> String {
    let mut e = String::with_capacity(160);
    e.push_str("{\"name\":");
    push_json_string(&mut e, name);
    e.push_str(",\"cat\":");
    push_json_string(&mut e, category);
    let _ = write!(
        e,
        ",\"ph\":\"{phase}\",\"ts\":{ts:.3},\"pid\":{},\"tid\":{}",
        pid_label(),
        thread_lane()
    );
    e
}

fn push_args(e: &mut String, args: &[(&str, String)]) {
    if args.is_empty() {
        return;
    }
    e.push_str(",\"args\":{");
    for (i, (k, v)) in args.iter().enumerate() {
        if i > 0 {
            e.push(',');
        }
        push_json_string(e, k);
        e.push(':');
        push_json_string(e, v);
    }
    e.push('}');
}

fn push_json_string(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// The trace's process id: the rank where the launch environment names one, so that each
/// rank is one process in the viewer.
fn pid_label() -> u64 {
    static PID: OnceLock<u64> = OnceLock::new();
    *PID.get_or_init(|| rank_from_env().unwrap_or(u64::from(std::process::id())))
}

fn rank_from_env() -> Option<u64> {
    ["RANK", "SLURM_PROCID"]
        .iter()
        .find_map(|v| std::env::var(v).ok()?.trim().parse().ok())
}

fn thread_lane() -> u64 {
    THREAD.with(|t| {
        if t.get() == 0 {
            t.set(NEXT_THREAD.fetch_add(1, Ordering::Relaxed));
        }
        t.get()
    })
}

fn record(event: String) {
    if let Some(t) = TRACER.get() {
        lock(t).push(event);
    }
}

fn lock(t: &Mutex<Tracer>) -> MutexGuard<'_, Tracer> {
    // A panic while recording leaves only a partial buffer behind: keep tracing.
    t.lock().unwrap_or_else(|p| p.into_inner())
}

/// The open trace file and what is not written yet.
struct Tracer {
    file: Option<File>,
    /// Bytes of the file before its closing `\n]\n`, where the next events go.
    body_len: u64,
    /// Events written so far (the first one follows `[` without a comma).
    written: u64,
    pending: Vec<String>,
    pending_bytes: usize,
    last_write: Instant,
}

impl Tracer {
    fn open() -> Tracer {
        let mut t = Tracer {
            file: None,
            body_len: 0,
            written: 0,
            pending: Vec::new(),
            pending_bytes: 0,
            last_write: Instant::now(),
        };
        let Some(dir) = std::env::var_os(TRACE_ENV).filter(|d| !d.is_empty()) else {
            return t;
        };
        let dir = PathBuf::from(dir);
        let name = match rank_from_env() {
            Some(r) => format!("trace-rank{r}.json"),
            None => format!("trace-pid{}.json", std::process::id()),
        };
        let path = dir.join(name);
        let opened = std::fs::create_dir_all(&dir)
            .and_then(|()| File::create(&path))
            .and_then(|mut f| f.write_all(b"[\n]\n").map(|()| f));
        match opened {
            Ok(f) => {
                t.file = Some(f);
                // After "[\n": the next events go there, before the closing "]\n".
                t.body_len = 2;
                let rank = pid_label();
                t.pending.push(format!(
                    "{{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":{rank},\"args\":{{\"name\":\"rank {rank}\"}}}}"
                ));
            }
            // The run goes on untraced; the one line says why there is no trace.
            Err(e) => eprintln!(
                "tch-dist: {TRACE_ENV}: cannot write {}: {e}",
                path.display()
            ),
        }
        t
    }

    fn push(&mut self, event: String) {
        self.pending_bytes += event.len() + 2;
        self.pending.push(event);
        if self.pending_bytes >= FLUSH_BYTES || self.last_write.elapsed().as_secs() >= 1 {
            self.write_out();
        }
    }

    /// Appends the pending events before the closing bracket, which is written again after
    /// them: the file is valid JSON after every write.
    fn write_out(&mut self) {
        self.last_write = Instant::now();
        let Some(file) = self.file.as_mut() else {
            return;
        };
        if self.pending.is_empty() {
            return;
        }
        let mut chunk = String::with_capacity(self.pending_bytes + 8);
        for e in self.pending.drain(..) {
            if self.written > 0 {
                chunk.push_str(",\n");
            }
            chunk.push_str(&e);
            self.written += 1;
        }
        self.pending_bytes = 0;
        let body = chunk.len() as u64;
        chunk.push_str("\n]\n");
        let wrote = file
            .seek(SeekFrom::Start(self.body_len))
            .and_then(|_| file.write_all(chunk.as_bytes()))
            .and_then(|()| file.flush());
        match wrote {
            Ok(()) => self.body_len += body,
            Err(e) => {
                eprintln!("tch-dist: {TRACE_ENV}: writing the trace failed: {e}; tracing stops");
                self.file = None;
                STATE.store(2, Ordering::Relaxed);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strings_are_escaped_as_json() {
        let mut s = String::new();
        push_json_string(&mut s, "a\"b\\c\nd\u{1}");
        assert_eq!(s, r#""a\"b\\c\nd\u0001""#);
    }
}
