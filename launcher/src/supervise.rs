//! Watching the ranks and stopping them: signals to the launcher, reaping, each rank's process
//! group, the descendants that left their groups.

use std::collections::{HashMap, HashSet};
use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;
use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crate::store::ExitReporter;

/// How long ranks get to exit after SIGTERM before SIGKILL.
pub const GRACE: Duration = Duration::from_secs(5);
/// How long processes get to die after SIGKILL before the launcher gives up on them.
const KILL_WAIT: Duration = Duration::from_secs(1);
/// The supervision loop's period.
pub const TICK: Duration = Duration::from_millis(20);

/// The exit status a shell would report for `status` (128+N for signal N).
pub fn exit_code(status: ExitStatus) -> i32 {
    status
        .code()
        .unwrap_or_else(|| 128 + status.signal().unwrap_or(1))
}

/// The first signal the launcher got (0: none yet).
static FIRST_SIGNAL: AtomicI32 = AtomicI32::new(0);
/// How many signals the launcher got.
static SIGNALS: AtomicUsize = AtomicUsize::new(0);

/// The first of [`HANDLED_SIGNALS`] the launcher got, if any.
pub fn first_signal() -> Option<libc::c_int> {
    Some(FIRST_SIGNAL.load(Ordering::SeqCst)).filter(|&s| s != 0)
}

extern "C" fn on_signal(sig: libc::c_int) {
    // Only lock-free atomics: async-signal-safe. The supervision loop polls them.
    let _ = FIRST_SIGNAL.compare_exchange(0, sig, Ordering::SeqCst, Ordering::SeqCst);
    SIGNALS.fetch_add(1, Ordering::SeqCst);
}

/// torchrun's default set of signals that stop the job.
const HANDLED_SIGNALS: [libc::c_int; 4] =
    [libc::SIGTERM, libc::SIGINT, libc::SIGHUP, libc::SIGQUIT];

/// Arms `cmd`'s process to die with this launcher (`PR_SET_PDEATHSIG` with SIGKILL, set in
/// the child before exec), and to refuse to start when the launcher died before that: what
/// the ranks, the replica groups' launchers and the lighthouse all get.
pub fn dies_with_launcher(cmd: &mut std::process::Command) {
    use std::os::unix::process::CommandExt;
    let launcher = std::process::id() as libc::pid_t;
    // SAFETY: prctl(2) and getppid(2) in the forked child before exec; both are
    // async-signal-safe, and the error is built without allocating.
    unsafe {
        cmd.pre_exec(move || {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            // The launcher died before the death signal was armed.
            if libc::getppid() != launcher {
                return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
            }
            Ok(())
        });
    }
}

/// Catches [`HANDLED_SIGNALS`]; the supervision loop acts on them.
pub fn install_signal_handlers() -> Result<(), String> {
    for sig in HANDLED_SIGNALS {
        // SAFETY: a zeroed sigaction is valid; the handler only touches atomics. SA_RESTART
        // keeps the output thread's reads and writes from failing with EINTR.
        let ok = unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_signal as *const () as libc::sighandler_t;
            sa.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut sa.sa_mask);
            libc::sigaction(sig, &sa, std::ptr::null_mut()) == 0
        };
        if !ok {
            return Err(format!(
                "cannot install a handler for {}: {}",
                signal_name(sig).unwrap_or("signal"),
                std::io::Error::last_os_error()
            ));
        }
    }
    Ok(())
}

/// The name of `sig`, for the signals a launcher sees or a rank dies of.
pub fn signal_name(sig: libc::c_int) -> Option<&'static str> {
    Some(match sig {
        libc::SIGTERM => "SIGTERM",
        libc::SIGINT => "SIGINT",
        libc::SIGHUP => "SIGHUP",
        libc::SIGQUIT => "SIGQUIT",
        libc::SIGKILL => "SIGKILL",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        libc::SIGILL => "SIGILL",
        libc::SIGTRAP => "SIGTRAP",
        libc::SIGSYS => "SIGSYS",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGALRM => "SIGALRM",
        libc::SIGUSR1 => "SIGUSR1",
        libc::SIGUSR2 => "SIGUSR2",
        libc::SIGXCPU => "SIGXCPU",
        libc::SIGXFSZ => "SIGXFSZ",
        _ => return None,
    })
}

fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

/// One rank: its first process and the process group it leads.
struct Rank {
    /// The rank's first process, which is also its process group's id.
    pid: libc::pid_t,
    /// Set once the first process has exited and been reaped.
    status: Option<ExitStatus>,
    /// Whether the group has had its SIGTERM.
    term_sent: bool,
    /// False once a signal to the group found nobody.
    group_alive: bool,
}

impl Rank {
    /// Sends `sig` to the rank's process group (0: only checks it), and returns whether
    /// anything of the rank is left to signal.
    fn signal(&mut self, sig: libc::c_int) -> bool {
        if self.group_alive {
            // SAFETY: kill(2). While any process is in the group its id cannot be reused,
            // and once the group is empty (ESRCH) it is never signalled again.
            if unsafe { libc::kill(-self.pid, sig) } == 0 || errno() != libc::ESRCH {
                return true;
            }
            self.group_alive = false;
        }
        if self.status.is_none() {
            // The first process left its group (setpgid) and still runs; it is an unreaped
            // child of the launcher, so its pid is still its own.
            // SAFETY: kill(2) on our own unreaped child.
            unsafe { libc::kill(self.pid, sig) };
            return true;
        }
        false
    }

    /// SIGTERM to the rank's group, once; returns whether anything was there to get it.
    fn terminate(&mut self) -> bool {
        if self.term_sent {
            return false;
        }
        self.term_sent = true;
        self.signal(libc::SIGTERM)
    }
}

/// The launcher is stopping everything, and will exit with `code`.
struct Stopping {
    code: i32,
    /// Whether a rank's failure started it (a restart may follow).
    rank_failed: bool,
    since: Instant,
    /// The signal count when stopping began: one more skips the grace period.
    signals: usize,
    /// When SIGKILL was first sent.
    killing_since: Option<Instant>,
    /// Processes outside the ranks' groups that got SIGTERM.
    termed: HashSet<libc::pid_t>,
}

impl Stopping {
    fn new(code: i32, rank_failed: bool) -> Stopping {
        Stopping {
            code,
            rank_failed,
            since: Instant::now(),
            signals: SIGNALS.load(Ordering::SeqCst),
            killing_since: None,
            termed: HashSet::new(),
        }
    }
}

/// The ranks of one start, from the first started on, and whether the launcher is stopping
/// them. Every step is O(1) per rank started or reaped, so that starting n ranks (with a
/// [`Supervisor::observe`] after each) takes time linear in n.
pub struct Supervisor {
    ranks: Vec<Rank>,
    /// Each rank's index in `ranks` by its first process's pid.
    by_pid: HashMap<libc::pid_t, usize>,
    stopping: Option<Stopping>,
    /// Tells the ranks still running, through their store, which ranks exited.
    exits: ExitReporter,
}

impl Supervisor {
    /// No ranks yet; their exits are reported through `exits`.
    pub fn new(exits: ExitReporter) -> Supervisor {
        Supervisor {
            ranks: Vec::new(),
            by_pid: HashMap::new(),
            stopping: None,
            exits,
        }
    }

    /// Adds the next rank, whose first process (and group leader) is `pid`.
    pub fn add(&mut self, pid: libc::pid_t) {
        self.by_pid.insert(pid, self.ranks.len());
        self.ranks.push(Rank {
            pid,
            status: None,
            term_sent: false,
            group_alive: true,
        });
    }

    /// Stops the ranks because of something other than a rank (a failed start): the launcher
    /// will exit with `code`.
    pub fn stop(&mut self, code: i32) {
        if self.stopping.is_none() {
            self.stopping = Some(Stopping::new(code, false));
        }
    }

    /// Reaps what exited and acts on it: a rank that failed, or a signal to the launcher,
    /// starts stopping; so does the end of every rank once `all_started`. `rank_of(i)` is the
    /// global rank of the i-th started rank (for messages and the store). Returns whether it
    /// is stopping.
    ///
    /// A rank that exits while the launcher is not stopping is reported to the ranks' store
    /// (before a failure starts the stop), so that ranks waiting for it fail at once. Ranks
    /// that end once stopping began, or once a signal came (stopping begins below), are
    /// not: the launcher stopped them, or the signal's sender did, and a report would only
    /// hold up the stop.
    pub fn observe(&mut self, all_started: bool, rank_of: impl Fn(usize) -> usize) -> bool {
        for i in self.reap() {
            let status = self.ranks[i].status.expect("reaped");
            let leftovers = self.ranks[i].terminate();
            if self.stopping.is_some() {
                continue;
            }
            let rank = rank_of(i);
            if first_signal().is_none() {
                self.exits.report(rank, status);
            }
            if !status.success() {
                eprintln!("tch-dist-run: rank {rank} failed ({status}); stopping the other ranks");
                self.stopping = Some(Stopping::new(exit_code(status), true));
            } else if leftovers {
                eprintln!(
                    "tch-dist-run: rank {rank} exited; terminating the processes it left running \
                     in its process group"
                );
            }
        }
        if self.stopping.is_none() && first_signal().is_none() {
            self.exits.retry();
        }
        if self.stopping.is_none() {
            if let Some(sig) = first_signal() {
                eprintln!(
                    "tch-dist-run: received signal {sig} ({}), stopping all ranks",
                    signal_name(sig).unwrap_or("signal")
                );
                self.stopping = Some(Stopping::new(128 + sig, false));
            } else if all_started && self.ranks.iter().all(|r| r.status.is_some()) {
                self.stopping = Some(Stopping::new(0, false));
            }
        }
        self.stopping.is_some()
    }

    /// Watches the started ranks (all there are) until they have all exited or one failed or a
    /// signal came or `interrupt` (asked every tick until then) said so, then stops every
    /// process the launcher started (directly or not). Returns the exit status and whether a
    /// rank's failure (not a signal to the launcher, nor the interrupt) ended the run.
    pub fn run(
        mut self,
        rank_of: impl Fn(usize) -> usize,
        interrupt: &mut dyn FnMut() -> bool,
    ) -> (i32, bool) {
        loop {
            if !self.observe(true, &rank_of) && interrupt() {
                self.stop(1);
            }
            if let Some(mut s) = self.stopping.take() {
                if let Some(code) = stop_step(&mut self.ranks, &mut s) {
                    return (code, s.rank_failed);
                }
                self.stopping = Some(s);
            }
            std::thread::sleep(TICK);
        }
    }

    /// Reaps every exited child of the launcher: its ranks' first processes (recording their
    /// status) and orphaned descendants re-parented to it. Returns the ranks that exited.
    fn reap(&mut self) -> Vec<usize> {
        let mut exited = Vec::new();
        loop {
            let mut raw = 0;
            // SAFETY: waitpid(2) with a valid status pointer; WNOHANG never blocks.
            let pid = unsafe { libc::waitpid(-1, &mut raw, libc::WNOHANG) };
            if pid <= 0 {
                // 0: children still run; -1: none left (ECHILD), or EINTR (next tick retries).
                return exited;
            }
            if let Some(&i) = self.by_pid.get(&pid) {
                self.ranks[i].status = Some(ExitStatus::from_raw(raw));
                exited.push(i);
            }
        }
    }
}

/// The launcher's live (not zombie) descendants as (pid, process group), from /proc.
fn descendants() -> Vec<(libc::pid_t, libc::pid_t)> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    // Each live process's children, with their groups.
    let mut children: HashMap<libc::pid_t, Vec<(libc::pid_t, libc::pid_t)>> = HashMap::new();
    for entry in dir.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<libc::pid_t>().ok())
        else {
            continue;
        };
        let Ok(stat) = std::fs::read(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses.
        let Some(close) = stat.iter().rposition(|&b| b == b')') else {
            continue;
        };
        let rest = String::from_utf8_lossy(&stat[close + 1..]);
        let mut fields = rest.split_whitespace();
        let state = fields.next().unwrap_or("Z");
        let ppid = fields.next().and_then(|f| f.parse::<libc::pid_t>().ok());
        let pgrp = fields.next().and_then(|f| f.parse::<libc::pid_t>().ok());
        if let (false, Some(ppid), Some(pgrp)) = (matches!(state, "Z" | "X"), ppid, pgrp) {
            children.entry(ppid).or_default().push((pid, pgrp));
        }
    }
    let mut found = Vec::new();
    let mut parents = vec![std::process::id() as libc::pid_t];
    while let Some(parent) = parents.pop() {
        for &(pid, pgrp) in children.get(&parent).map_or(&[][..], Vec::as_slice) {
            found.push((pid, pgrp));
            parents.push(pid);
        }
    }
    found
}

/// One tick of stopping: SIGTERM to everything not yet signalled, SIGKILL once the grace
/// period is over. Returns the exit status once nothing is left.
fn stop_step(ranks: &mut [Rank], s: &mut Stopping) -> Option<i32> {
    for r in ranks.iter_mut() {
        r.terminate();
    }
    // Descendants in a rank's group are reached through the group; the others left it.
    let groups: HashSet<libc::pid_t> = ranks.iter().map(|r| r.pid).collect();
    let strays: Vec<libc::pid_t> = descendants()
        .into_iter()
        .filter(|(_, pgrp)| !groups.contains(pgrp))
        .map(|(pid, _)| pid)
        .collect();
    let groups_left = ranks
        .iter_mut()
        .map(|r| r.signal(0))
        .filter(|&alive| alive)
        .count();
    if groups_left == 0 && strays.is_empty() {
        return Some(s.code);
    }
    let skip_grace = SIGNALS.load(Ordering::SeqCst) > s.signals;
    if s.killing_since.is_none() && (s.since.elapsed() >= GRACE || skip_grace) {
        eprintln!(
            "tch-dist-run: {} still running {}; sending SIGKILL",
            describe_left(groups_left, strays.len()),
            if skip_grace {
                "after a second signal".to_string()
            } else {
                format!("{} s after SIGTERM", GRACE.as_secs())
            }
        );
        s.killing_since = Some(Instant::now());
    }
    match s.killing_since {
        Some(since) => {
            if since.elapsed() >= KILL_WAIT {
                eprintln!(
                    "tch-dist-run: giving up on {}, still there {} s after SIGKILL",
                    describe_left(groups_left, strays.len()),
                    KILL_WAIT.as_secs()
                );
                return Some(s.code);
            }
            for r in ranks.iter_mut() {
                r.signal(libc::SIGKILL);
            }
            for &pid in &strays {
                // SAFETY: kill(2) on a descendant found live just now.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
        }
        None => {
            let new: Vec<libc::pid_t> = strays
                .into_iter()
                .filter(|pid| s.termed.insert(*pid))
                .collect();
            if !new.is_empty() {
                eprintln!(
                    "tch-dist-run: terminating {} process(es) that left their rank's process group",
                    new.len()
                );
            }
            for pid in new {
                // SAFETY: kill(2) on a descendant found live just now.
                unsafe { libc::kill(pid, libc::SIGTERM) };
            }
        }
    }
    None
}

fn describe_left(groups: usize, strays: usize) -> String {
    match (groups, strays) {
        (g, 0) => format!("{g} rank process group(s)"),
        (0, p) => format!("{p} process(es) outside the ranks' groups"),
        (g, p) => format!("{g} rank process group(s) and {p} other process(es)"),
    }
}
