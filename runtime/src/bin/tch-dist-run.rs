//! `tch-dist-run`: the local launcher, a small torchrun.
//!
//! ```text
//! tch-dist-run --nproc-per-node N [--master-addr A] [--master-port P] -- CMD ARGS...
//! tch-dist-run --nproc-per-node N --max-restarts M -- CMD ARGS...
//! tch-dist-run --nnodes K --node-rank R --nproc-per-node N --master-addr A --master-port P -- CMD ARGS...
//! ```
//!
//! `--max-restarts M` starts every rank again after a failure, up to M times
//! (TORCHELASTIC_RESTART_COUNT says which start it is); `--nnodes`/`--node-rank` make this
//! launcher one node of a static multi-node job (global ranks `R*N ..`).
//!
//! Starts N copies of CMD with torchrun's variables (RANK, LOCAL_RANK, WORLD_SIZE,
//! LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RUN_ID), prefixes each line they
//! print with `[rankR]: `, and when one rank fails, stops the others and exits with that
//! rank's status.
//!
//! The run id is the launcher's own TORCHELASTIC_RUN_ID when it has one (torchrun's, or a
//! job script's), else a new one (`tch-dist-run-<pid>-<time>`). Ranks that carry a run id
//! refuse to join the rendezvous of a run with another id, so a rank started with another
//! job's MASTER_PORT fails at once, naming both ids, instead of joining that job.
//!
//! # Process trees
//!
//! A rank is the whole process tree CMD starts (`sh -c "trainer; echo done"`, a data loader's
//! workers, a `sleep 30 &`), and nothing it starts outlives the launcher:
//!
//! - Each rank runs in a process group of its own (its pid is the group's id, in the
//!   launcher's session), and every signal the launcher sends goes to the whole group.
//! - The launcher is a child subreaper (`PR_SET_CHILD_SUBREAPER`): a process whose parent
//!   exits is re-parented to the launcher instead of init, so processes that left their
//!   rank's group (`setsid`, a daemon's double fork) are still among the launcher's
//!   descendants, which it finds through /proc's parent links when it stops.
//! - When a rank exits (with any status), SIGTERM goes to what is left of its group.
//! - When a rank fails (non-zero status or a signal), the launcher prints
//!   `rank R failed (...); stopping the other ranks`, stops everything as below and exits
//!   with that rank's status (128+N for signal N).
//! - On SIGTERM, SIGINT, SIGHUP or SIGQUIT (torchrun's default set), the launcher prints
//!   `received signal ...`, stops everything as below and exits with 128+N, as a shell
//!   reports a job killed by signal N (torchrun instead exits 1 with a SignalException).
//!   The ranks get SIGTERM whatever the signal was. Ranks are not in the terminal's
//!   foreground group, so Ctrl-C reaches them only through the launcher (and Ctrl-Z stops
//!   only the launcher).
//! - Stopping, also after every rank succeeded: SIGTERM to every rank's group and to every
//!   other live descendant of the launcher; 5 s later (at once on a further signal), SIGKILL
//!   to whatever is left. Background processes a successful rank left running are killed too.
//! - The launcher exits once its descendants are gone (it gives up on any that survive
//!   SIGKILL for 1 s, e.g. in uninterruptible sleep). It then copies what is left in the
//!   ranks' pipes for at most 1 s, without waiting for an end of file that a process out of
//!   its reach could hold off.
//!
//! Not covered: SIGKILL to the launcher (each rank's first process dies with it through
//! `PR_SET_PDEATHSIG`, but that process's children are left running), and processes started
//! outside the launcher's process tree on a rank's behalf (`systemd-run`, `ssh`, a container
//! engine's daemon). Processes outside the ranks' groups are only looked for when stopping:
//! one that a rank left while other ranks still run lives until then, and one forking faster
//! than the 20 ms loop could outrun their SIGKILL (a group's members cannot: a signal to a
//! group reaches all of them at once).

use std::collections::HashSet;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

const USAGE: &str = "usage: tch-dist-run --nproc-per-node N [--nnodes K --node-rank R] [--master-addr ADDR] [--master-port PORT] [--max-restarts M] [--rdzv-id ID] -- CMD [ARGS...]";

const HELP: &str = "\
Starts N ranks of CMD with torchrun's variables and prefixes their output with [rankR]: .
Each rank runs in its own process group. When a rank fails, or the launcher gets SIGTERM,
SIGINT, SIGHUP or SIGQUIT, every rank's group gets SIGTERM (SIGKILL 5 s later) and the
launcher exits with the failed rank's status, or 128+N after signal N. Nothing a rank starts
outlives the launcher: what ranks left running (a `sleep 30 &`) is killed once all ranks have
exited, even successfully.

--max-restarts M: after a rank fails, all ranks are stopped and started again, up to M times
(TORCHELASTIC_RESTART_COUNT tells them which start they are). --nnodes K --node-rank R: this
launcher starts ranks R*N .. R*N+N-1 of K*N, with the same --master-addr and --master-port
(required) on every node. --rdzv-id ID: the run id (default: TORCHELASTIC_RUN_ID, else a new
one; with K > 1, one derived from the master's address and port, the same on every node).";

/// How long ranks get to exit after SIGTERM before SIGKILL.
const GRACE: Duration = Duration::from_secs(5);
/// How long processes get to die after SIGKILL before the launcher gives up on them.
const KILL_WAIT: Duration = Duration::from_secs(1);
/// How long the ranks' pipes are still read once their processes are gone.
const DRAIN: Duration = Duration::from_secs(1);
/// The supervision loop's period.
const TICK: Duration = Duration::from_millis(20);

struct Args {
    nproc: usize,
    nnodes: usize,
    node_rank: usize,
    master_addr: String,
    master_port: Option<u16>,
    max_restarts: u32,
    rdzv_id: Option<String>,
    cmd: Vec<String>,
}

fn parse_args(mut args: impl Iterator<Item = String>) -> Result<Args, String> {
    let mut nproc = None;
    let mut master_addr = "127.0.0.1".to_string();
    let mut master_port = None;
    let (mut nnodes, mut node_rank, mut max_restarts, mut rdzv_id) = (1, 0, 0, None);
    let mut cmd = Vec::new();
    while let Some(a) = args.next() {
        let (flag, inline) = match a.split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f.to_string(), Some(v.to_string())),
            _ => (a.clone(), None),
        };
        let mut value = |name: &str| {
            inline
                .clone()
                .or_else(|| args.next())
                .ok_or_else(|| format!("{name} needs a value"))
        };
        match flag.as_str() {
            "--nproc-per-node" | "--nproc_per_node" => {
                let v = value("--nproc-per-node")?;
                let n = v.parse::<usize>().ok().filter(|n| *n > 0);
                nproc =
                    Some(n.ok_or_else(|| {
                        format!("--nproc-per-node {v:?} is not a positive integer")
                    })?);
            }
            "--master-addr" | "--master_addr" => master_addr = value("--master-addr")?,
            "--master-port" | "--master_port" => {
                let v = value("--master-port")?;
                let p = v.parse::<u16>().ok().filter(|p| *p > 0);
                master_port =
                    Some(p.ok_or_else(|| format!("--master-port {v:?} is not a port number"))?);
            }
            "--nnodes" => {
                // torchrun's MIN:MAX form, with MIN = MAX (no elastic membership here).
                let v = value("--nnodes")?;
                let n = match v.split_once(':') {
                    Some((lo, hi)) if lo == hi => lo.parse::<usize>().ok(),
                    Some(_) => None,
                    None => v.parse::<usize>().ok(),
                };
                nnodes = n.filter(|n| *n > 0).ok_or_else(|| {
                    format!("--nnodes {v:?} is not a positive integer (or N:N; elastic ranges are not supported)")
                })?;
            }
            "--node-rank" | "--node_rank" => {
                let v = value("--node-rank")?;
                node_rank = v
                    .parse::<usize>()
                    .map_err(|_| format!("--node-rank {v:?} is not a non-negative integer"))?;
            }
            "--max-restarts" | "--max_restarts" => {
                let v = value("--max-restarts")?;
                max_restarts = v
                    .parse::<u32>()
                    .map_err(|_| format!("--max-restarts {v:?} is not a non-negative integer"))?;
            }
            "--rdzv-id" | "--rdzv_id" => {
                let v = value("--rdzv-id")?;
                if v.trim().is_empty() {
                    return Err("--rdzv-id needs a non-empty value".into());
                }
                rdzv_id = Some(v);
            }
            "-h" | "--help" => return Err(String::new()),
            "--" => {
                cmd.extend(args.by_ref());
                break;
            }
            other if other.starts_with('-') => return Err(format!("unknown option {other}")),
            _ => {
                cmd.push(a);
                cmd.extend(args.by_ref());
                break;
            }
        }
    }
    let nproc = nproc.ok_or("--nproc-per-node is required")?;
    if cmd.is_empty() {
        return Err("no command given after --".into());
    }
    if node_rank >= nnodes {
        return Err(format!(
            "--node-rank {node_rank} is not below --nnodes {nnodes}"
        ));
    }
    if nnodes > 1 && master_port.is_none() {
        return Err("--nnodes above 1 needs --master-port (the same on every node)".into());
    }
    if nnodes > 1 && max_restarts > 0 {
        // Restarting one node's ranks alone cannot meet the other nodes' running ranks:
        // that takes torchrun's elastic agents.
        return Err("--max-restarts with --nnodes above 1 is not supported (use torchrun)".into());
    }
    Ok(Args {
        nproc,
        nnodes,
        node_rank,
        master_addr,
        master_port,
        max_restarts,
        rdzv_id,
        cmd,
    })
}

/// A port that was free a moment ago, like `torchrun --standalone`.
fn free_port(addr: &str) -> Result<u16, String> {
    let host = if addr == "localhost" {
        "127.0.0.1"
    } else {
        addr
    };
    std::net::TcpListener::bind((host, 0))
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| format!("cannot find a free port on {addr}: {e}"))
}

fn pump(
    rank: usize,
    pipe: impl Read + Send + 'static,
    to_stderr: bool,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        for line in BufReader::new(pipe).split(b'\n').map_while(Result::ok) {
            let mut buf = format!("[rank{rank}]: ").into_bytes();
            buf.extend_from_slice(&line);
            buf.push(b'\n');
            // Write each line whole so ranks' lines never interleave mid-line.
            let _ = if to_stderr {
                std::io::stderr().lock().write_all(&buf)
            } else {
                std::io::stdout().lock().write_all(&buf)
            };
        }
    })
}

fn exit_code(status: ExitStatus) -> i32 {
    status
        .code()
        .unwrap_or_else(|| 128 + status.signal().unwrap_or(1))
}

/// The first signal the launcher got (0: none yet).
static FIRST_SIGNAL: AtomicI32 = AtomicI32::new(0);
/// How many signals the launcher got.
static SIGNALS: AtomicUsize = AtomicUsize::new(0);

extern "C" fn on_signal(sig: libc::c_int) {
    // Only lock-free atomics: async-signal-safe. The supervision loop polls them.
    let _ = FIRST_SIGNAL.compare_exchange(0, sig, Ordering::SeqCst, Ordering::SeqCst);
    SIGNALS.fetch_add(1, Ordering::SeqCst);
}

const HANDLED_SIGNALS: [libc::c_int; 4] =
    [libc::SIGTERM, libc::SIGINT, libc::SIGHUP, libc::SIGQUIT];

fn install_signal_handlers() -> Result<(), String> {
    for sig in HANDLED_SIGNALS {
        // SAFETY: a zeroed sigaction is valid; the handler only touches atomics. SA_RESTART
        // keeps the pumps' reads and writes from failing with EINTR.
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
                signal_name(sig),
                std::io::Error::last_os_error()
            ));
        }
    }
    Ok(())
}

fn signal_name(sig: libc::c_int) -> &'static str {
    match sig {
        libc::SIGTERM => "SIGTERM",
        libc::SIGINT => "SIGINT",
        libc::SIGHUP => "SIGHUP",
        libc::SIGQUIT => "SIGQUIT",
        libc::SIGKILL => "SIGKILL",
        _ => "signal",
    }
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
    fn new(pid: libc::pid_t) -> Rank {
        Rank {
            pid,
            status: None,
            term_sent: false,
            group_alive: true,
        }
    }

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

/// Reaps every exited child of the launcher: its ranks' first processes (recording their
/// status) and orphaned descendants re-parented to it. Returns the ranks that exited.
fn reap(ranks: &mut [Rank]) -> Vec<usize> {
    let mut exited = Vec::new();
    loop {
        let mut raw = 0;
        // SAFETY: waitpid(2) with a valid status pointer; WNOHANG never blocks.
        let pid = unsafe { libc::waitpid(-1, &mut raw, libc::WNOHANG) };
        if pid <= 0 {
            // 0: children still run; -1: none left (ECHILD), or EINTR (next tick retries).
            return exited;
        }
        if let Some(r) = ranks.iter().position(|r| r.pid == pid) {
            ranks[r].status = Some(ExitStatus::from_raw(raw));
            exited.push(r);
        }
    }
}

/// The launcher's live (not zombie) descendants as (pid, process group), from /proc.
fn descendants() -> Vec<(libc::pid_t, libc::pid_t)> {
    let mut procs = Vec::new();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
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
            procs.push((pid, ppid, pgrp));
        }
    }
    let mut found = Vec::new();
    let mut parents = vec![std::process::id() as libc::pid_t];
    while let Some(parent) = parents.pop() {
        for &(pid, ppid, pgrp) in &procs {
            if ppid == parent {
                found.push((pid, pgrp));
                parents.push(pid);
            }
        }
    }
    found
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
    fn new(code: i32) -> Stopping {
        Stopping {
            code,
            rank_failed: false,
            since: Instant::now(),
            signals: SIGNALS.load(Ordering::SeqCst),
            killing_since: None,
            termed: HashSet::new(),
        }
    }
}

/// Watches the ranks until they have all exited or one failed or a signal came, then stops
/// every process the launcher started (directly or not). Returns the exit status and
/// whether a rank's failure (not a signal to the launcher) ended the run.
fn supervise(ranks: &mut [Rank], mut stopping: Option<Stopping>) -> (i32, bool) {
    loop {
        for r in reap(ranks) {
            let status = ranks[r].status.expect("reaped");
            let leftovers = ranks[r].terminate();
            if stopping.is_some() {
                continue;
            }
            if !status.success() {
                eprintln!("tch-dist-run: rank {r} failed ({status}); stopping the other ranks");
                let mut s = Stopping::new(exit_code(status));
                s.rank_failed = true;
                stopping = Some(s);
            } else if leftovers {
                eprintln!(
                    "tch-dist-run: rank {r} exited; terminating the processes it left running \
                     in its process group"
                );
            }
        }
        if stopping.is_none() {
            let sig = FIRST_SIGNAL.load(Ordering::SeqCst);
            if sig != 0 {
                eprintln!(
                    "tch-dist-run: received signal {sig} ({}), stopping all ranks",
                    signal_name(sig)
                );
                stopping = Some(Stopping::new(128 + sig));
            } else if ranks.iter().all(|r| r.status.is_some()) {
                stopping = Some(Stopping::new(0));
            }
        }
        if let Some(s) = &mut stopping {
            if let Some(code) = stop_step(ranks, s) {
                return (code, s.rank_failed);
            }
        }
        std::thread::sleep(TICK);
    }
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

/// The run id: `--rdzv-id`, else the launcher's TORCHELASTIC_RUN_ID, else (several nodes)
/// one derived from the master's address and port, which every node's launcher derives
/// alike, else a new one.
fn run_id(args: &Args, port: u16) -> String {
    if let Some(id) = &args.rdzv_id {
        return id.clone();
    }
    match std::env::var("TORCHELASTIC_RUN_ID") {
        Ok(id) if !id.trim().is_empty() => id,
        _ if args.nnodes > 1 => format!("tch-dist-run-{}-{port}", args.master_addr),
        _ => {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default();
            format!(
                "tch-dist-run-{}-{:x}{:08x}",
                std::process::id(),
                now.as_secs(),
                now.subsec_nanos()
            )
        }
    }
}

fn run(args: Args) -> Result<i32, String> {
    install_signal_handlers()?;
    // Orphaned descendants come to the launcher instead of init, so that it can still stop
    // them. Without it (kernels before 3.4) only the ranks' groups are reached.
    // SAFETY: prctl(2) on the launcher itself.
    unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
    let mut port = match args.master_port {
        Some(p) => p,
        None => free_port(&args.master_addr)?,
    };
    let run_id = run_id(&args, port);
    let mut restart = 0;
    loop {
        let (code, rank_failed) = start_and_supervise(&args, port, &run_id, restart)?;
        if !rank_failed || restart >= args.max_restarts || FIRST_SIGNAL.load(Ordering::SeqCst) != 0
        {
            return Ok(code);
        }
        restart += 1;
        eprintln!(
            "tch-dist-run: starting the ranks again (restart {restart} of {})",
            args.max_restarts
        );
        if args.master_port.is_none() {
            // A fresh port: the last run's store may still hold the old one.
            port = free_port(&args.master_addr)?;
        }
    }
}

/// One start of every rank of this node, supervised until it ends: the exit status and
/// whether a rank's failure ended it.
fn start_and_supervise(
    args: &Args,
    port: u16,
    run_id: &str,
    restart: u32,
) -> Result<(i32, bool), String> {
    let launcher = std::process::id() as libc::pid_t;
    let world = args.nnodes * args.nproc;
    let mut ranks = Vec::new();
    let mut pumps = Vec::new();
    let mut start_error = None;
    for local in 0..args.nproc {
        if FIRST_SIGNAL.load(Ordering::SeqCst) != 0 {
            break;
        }
        let rank = args.node_rank * args.nproc + local;
        let mut cmd = Command::new(&args.cmd[0]);
        cmd.args(&args.cmd[1..])
            .env("RANK", rank.to_string())
            .env("LOCAL_RANK", local.to_string())
            .env("GROUP_RANK", args.node_rank.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("LOCAL_WORLD_SIZE", args.nproc.to_string())
            .env("MASTER_ADDR", &args.master_addr)
            .env("MASTER_PORT", port.to_string())
            .env("TORCHELASTIC_RUN_ID", run_id)
            .env("TORCHELASTIC_RESTART_COUNT", restart.to_string())
            .env("TORCHELASTIC_MAX_RESTARTS", args.max_restarts.to_string())
            // Rank 0 hosts this launcher's store: no agent store here, even when the launcher
            // itself runs under torchrun.
            .env_remove("TORCHELASTIC_USE_AGENT_STORE")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            // A group of its own, led by the rank's first process (set before exec, so it
            // is in place when spawn returns).
            .process_group(0);
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
        match cmd.spawn() {
            Ok(mut child) => {
                if let Some(out) = child.stdout.take() {
                    pumps.push(pump(rank, out, false));
                }
                if let Some(err) = child.stderr.take() {
                    pumps.push(pump(rank, err, true));
                }
                // `child` is dropped without waiting: `reap` waits for every child.
                ranks.push(Rank::new(child.id() as libc::pid_t));
            }
            Err(e) => {
                start_error = Some(format!("cannot start {:?}: {e}", args.cmd[0]));
                break;
            }
        }
    }
    let (code, rank_failed) = supervise(&mut ranks, start_error.as_ref().map(|_| Stopping::new(1)));
    // The ranks' processes are gone: copy what is still in their pipes, for a bounded time
    // (a process out of reach holding a pipe open would keep its end of file away forever).
    let deadline = Instant::now() + DRAIN;
    while !pumps.iter().all(|p| p.is_finished()) && Instant::now() < deadline {
        std::thread::sleep(TICK);
    }
    match start_error {
        Some(e) => Err(e),
        None => Ok((code, rank_failed)),
    }
}

fn main() {
    let args = match parse_args(std::env::args().skip(1)) {
        Ok(a) => a,
        Err(msg) => {
            if msg.is_empty() {
                println!("{USAGE}\n\n{HELP}");
                std::process::exit(0);
            }
            eprintln!("tch-dist-run: {msg}\n{USAGE}");
            std::process::exit(2);
        }
    };
    match run(args) {
        // Exit without waiting for pumps still blocked on a pipe held open out of reach.
        Ok(code) => std::process::exit(code),
        Err(msg) => {
            eprintln!("tch-dist-run: {msg}");
            std::process::exit(1);
        }
    }
}
