//! `tch-dist-run`: the local launcher, a small torchrun.
//!
//! ```text
//! tch-dist-run --nproc-per-node N [--master-addr A] [--master-port P] -- CMD ARGS...
//! tch-dist-run --nproc-per-node N --max-restarts M -- CMD ARGS...
//! tch-dist-run --nnodes K --node-rank R --nproc-per-node N --master-addr A --master-port P -- CMD ARGS...
//! tch-dist-run --nnodes MIN:MAX --nproc-per-node N --rdzv-backend c10d --rdzv-endpoint H:P --max-restarts M -- CMD ARGS...
//! ```
//!
//! `--max-restarts M` starts every rank again after a failure, up to M times
//! (TORCHELASTIC_RESTART_COUNT says which start it is); `--nnodes`/`--node-rank` make this
//! launcher one node of a static multi-node job (global ranks `R*N ..`). With
//! `--rdzv-backend c10d` the launchers of several hosts meet in rounds instead, and restart
//! every host's ranks together (`rendezvous/`).
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
//!   with that rank's status (128+N for signal N). It looks after every rank it starts, so
//!   a rank failing while later ranks are still being started stops the start there
//!   (`started S of N ranks; not starting the others`).
//! - When a rank exits (with any status) while the launcher is not stopping, the launcher
//!   tells the other ranks through the store rank 0 hosts at MASTER_ADDR:MASTER_PORT (c10d's
//!   TCPStore; `store.rs`): it sets `tch_dist/exited/<global rank>` to how the rank ended
//!   (`exited with status 0`, `was killed by signal 9 (SIGKILL)`) and adds 1 to
//!   `tch_dist/exited_count`, so that ranks still waiting for that rank (in a rendezvous)
//!   can fail within seconds, naming it, instead of waiting out their 30-minute timeout.
//!   A failing rank is reported before the others are stopped. Best effort: a report takes
//!   at most 500 ms and one that fails is dropped (silently when no store is there yet or
//!   any more); ranks that end once the launcher is stopping, or after a signal to it, are
//!   not reported (they were stopped, not lost).
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

mod args;
mod output;
mod rendezvous;
mod replicas;
mod store;
mod supervise;

use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::Duration;

use args::{check_capacity, parse_args, Args, HELP, USAGE};
use output::{Output, Stream};
use store::ExitReporter;
use supervise::{dies_with_launcher, first_signal, install_signal_handlers, Supervisor, TICK};

/// How long the ranks' pipes are still read once their processes are gone.
const DRAIN: Duration = Duration::from_secs(1);

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
    if let Some(groups) = args.replica_groups {
        return replicas::run(&args, groups);
    }
    let output = Output::start(args.replica_group)?;
    if let Some(rdzv) = &args.rdzv {
        // The dynamic rendezvous: each round says where this node's ranks are.
        let run_id = args
            .rdzv_id
            .clone()
            .or_else(|| std::env::var("TORCHELASTIC_RUN_ID").ok())
            .filter(|id| !id.trim().is_empty())
            .unwrap_or_else(|| format!("tch-dist-run-{}", rdzv.endpoint));
        return rendezvous::run_node(
            rdzv,
            &run_id,
            args.nproc,
            args.max_restarts,
            |start, interrupt| start_and_supervise(&args, &output, start, interrupt),
        );
    }
    let mut port = match args.master_port {
        Some(p) => p,
        None => free_port(&args.master_addr)?,
    };
    let run_id = run_id(&args, port);
    let mut restart = 0;
    loop {
        let start = Start {
            rank_base: args.node_rank * args.nproc,
            world_size: args.nnodes * args.nproc,
            group_rank: args.node_rank,
            group_world_size: args.nnodes,
            master_addr: args.master_addr.clone(),
            master_port: port,
            run_id: run_id.clone(),
            restart,
            max_restarts: args.max_restarts,
            round: None,
        };
        let (code, rank_failed) = start_and_supervise(&args, &output, &start, &mut || false)?;
        if !rank_failed || restart >= args.max_restarts || first_signal().is_some() {
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

/// One start of this node's ranks: where they sit in the world, where they meet, and which
/// start it is.
pub struct Start {
    /// The global rank of local rank 0 (ranks are contiguous per node).
    pub rank_base: usize,
    pub world_size: usize,
    /// GROUP_RANK: this node's index among the nodes.
    pub group_rank: usize,
    pub group_world_size: usize,
    pub master_addr: String,
    pub master_port: u16,
    pub run_id: String,
    /// TORCHELASTIC_RESTART_COUNT: this node's restarts so far.
    pub restart: u32,
    pub max_restarts: u32,
    /// The dynamic rendezvous' round (TCH_DIST_RDZV_ROUND), which every node agrees on.
    pub round: Option<u64>,
}

/// The command that starts local rank `local` of `start`, with torchrun's variables.
fn rank_command(args: &Args, local: usize, start: &Start) -> Command {
    let rank = start.rank_base + local;
    let mut cmd = Command::new(&args.cmd[0]);
    cmd.args(&args.cmd[1..])
        .env("RANK", rank.to_string())
        .env("LOCAL_RANK", local.to_string())
        .env("GROUP_RANK", start.group_rank.to_string())
        // One role: a role's ranks are the world's.
        .env("ROLE_RANK", rank.to_string())
        .env("WORLD_SIZE", start.world_size.to_string())
        .env("ROLE_WORLD_SIZE", start.world_size.to_string())
        .env("GROUP_WORLD_SIZE", start.group_world_size.to_string())
        .env("LOCAL_WORLD_SIZE", args.nproc.to_string())
        .env("MASTER_ADDR", &start.master_addr)
        .env("MASTER_PORT", start.master_port.to_string())
        .env("TORCHELASTIC_RUN_ID", &start.run_id)
        .env("TORCHELASTIC_RESTART_COUNT", start.restart.to_string())
        .env("TORCHELASTIC_MAX_RESTARTS", start.max_restarts.to_string())
        // Rank 0 hosts this launcher's store: no agent store here, even when the launcher
        // itself runs under torchrun.
        .env_remove("TORCHELASTIC_USE_AGENT_STORE")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        // A group of its own, led by the rank's first process (set before exec, so it
        // is in place when spawn returns).
        .process_group(0);
    match start.round {
        Some(round) => cmd.env("TCH_DIST_RDZV_ROUND", round.to_string()),
        None => cmd.env_remove("TCH_DIST_RDZV_ROUND"),
    };
    // Fault tolerance's replica group and lighthouse (`replicas.rs`); without them the
    // launcher's own environment passes through as it is.
    if let Some(g) = args.replica_group {
        cmd.env("REPLICA_GROUP_ID", g.to_string());
    }
    if let Some(url) = &args.lighthouse {
        cmd.env("TORCHFT_LIGHTHOUSE", url);
    }
    dies_with_launcher(&mut cmd);
    cmd
}

/// One start of every rank of this node, supervised until it ends: the exit status and
/// whether a rank's failure ended it. Ranks already started are watched between two starts,
/// so a failure (or a signal) stops the start at once rather than after the last rank.
/// `interrupt` is asked on every tick while the ranks run; when it says so, they are stopped
/// (not a failure: the dynamic rendezvous calls a round off).
fn start_and_supervise(
    args: &Args,
    output: &Output,
    start: &Start,
    interrupt: &mut dyn FnMut() -> bool,
) -> Result<(i32, bool), String> {
    let rank_of = |local: usize| start.rank_base + local;
    let mut ranks = Supervisor::new(ExitReporter::new(
        &start.master_addr,
        start.master_port,
        &start.run_id,
    ));
    let mut start_error = None;
    for local in 0..args.nproc {
        if ranks.observe(false, rank_of) {
            eprintln!(
                "tch-dist-run: started {local} of {} ranks; not starting the others",
                args.nproc
            );
            break;
        }
        let rank = rank_of(local);
        let started = rank_command(args, local, start)
            .spawn()
            .map_err(|e| format!("cannot start {:?}: {e}", args.cmd[0]))
            .and_then(|mut child| {
                // `child` is dropped without waiting: the supervisor reaps every child.
                ranks.add(child.id() as libc::pid_t);
                let out = child.stdout.take().map(|p| (p.into(), Stream::Stdout));
                let err = child.stderr.take().map(|p| (p.into(), Stream::Stderr));
                out.into_iter().chain(err).try_for_each(
                    |(pipe, stream): (std::os::fd::OwnedFd, _)| output.add(rank, pipe, stream),
                )
            });
        if let Err(e) = started {
            start_error = Some(e);
            ranks.stop(1);
            break;
        }
    }
    let (code, rank_failed) = ranks.run(rank_of, interrupt);
    // The ranks' processes are gone: copy what is still in their pipes, for a bounded time
    // (a process out of reach holding a pipe open would keep its end of file away forever).
    output.drain(DRAIN, TICK);
    match start_error {
        Some(e) => Err(e),
        None => Ok((code, rank_failed)),
    }
}

fn main() {
    let parsed = parse_args(std::env::args().skip(1)).and_then(|a| {
        check_capacity(a.nproc)?;
        Ok(a)
    });
    let args = match parsed {
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
        // Exit without waiting for the output thread, which may be blocked on a pipe held
        // open out of reach.
        Ok(code) => std::process::exit(code),
        Err(msg) => {
            eprintln!("tch-dist-run: {msg}");
            std::process::exit(1);
        }
    }
}
