//! `--replica-groups R`: fault tolerance's replica groups on this host (torchft's model;
//! `tch_dist::ft`). Each group is a job of its own, run by a launcher of its own: this
//! launcher starts itself once per group (`--replica-group G`, with the group's run id), so
//! each group gets what a single job gets — its own store on a free port, its supervision,
//! its restarts (`--max-restarts` per group), its process-tree cleanup — and a group that
//! fails is restarted alone while the others go on. With `--start-lighthouse MIN` it also
//! runs the job's lighthouse (`tch-dist-lighthouse`) for as long as the groups run.
//!
//! The launcher exits once every group's launcher has: with 0 when all succeeded, else with
//! the first failed group's status. A signal to it goes to every group's launcher (which
//! stops its ranks as usual) and then to the lighthouse.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::args::Args;
use crate::supervise::{dies_with_launcher, first_signal, TICK};

/// How long a started lighthouse may take to say where it listens.
const LIGHTHOUSE_START: Duration = Duration::from_secs(30);

/// `name` beside this launcher's own executable, else as found on PATH.
fn sibling(name: &str) -> PathBuf {
    std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(|dir| dir.join(name)))
        .filter(|p| p.is_file())
        .unwrap_or_else(|| PathBuf::from(name))
}

/// A child process killed (and reaped) when dropped.
struct Owned(Child);

impl Drop for Owned {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `tch-dist-lighthouse --min_replicas MIN` on `addr` and a free port; returns it
/// with its URL once it listens.
fn start_lighthouse(addr: &str, min_replicas: u64) -> Result<(Owned, String), String> {
    let program = sibling("tch-dist-lighthouse");
    let bind = if addr.contains(':') {
        format!("[{addr}]:0")
    } else {
        format!("{addr}:0")
    };
    let mut cmd = Command::new(&program);
    cmd.args(["--min_replicas", &min_replicas.to_string(), "--bind", &bind])
        .stdin(Stdio::null())
        .stdout(Stdio::piped());
    dies_with_launcher(&mut cmd);
    let mut child = cmd
        .spawn()
        .map_err(|e| format!("cannot start {}: {e}", program.display()))?;
    let stdout = child.stdout.take();
    let owned = Owned(child);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        if let Some(out) = stdout {
            let _ = BufReader::new(out).read_line(&mut line);
        }
        let _ = tx.send(line);
    });
    let line = rx
        .recv_timeout(LIGHTHOUSE_START)
        .map_err(|_| format!("{} did not start listening", program.display()))?;
    let url = line
        .trim()
        .strip_prefix("lighthouse listening on ")
        .ok_or_else(|| format!("{} did not start: {:?}", program.display(), line.trim()))?;
    // It names itself by the bound address (or the host name): ranks reach it at ours.
    let port = url.rsplit(':').next().unwrap_or_default();
    let host = if addr.contains(':') {
        format!("[{addr}]")
    } else {
        addr.to_string()
    };
    Ok((owned, format!("http://{host}:{port}")))
}

/// The command line of group `g`'s launcher.
fn group_command(
    args: &Args,
    g: usize,
    groups: usize,
    lighthouse: Option<&str>,
    run_id: &str,
) -> Command {
    let exe = std::env::current_exe().unwrap_or_else(|_| sibling("tch-dist-run"));
    let mut cmd = Command::new(exe);
    cmd.args(["--nproc-per-node", &args.nproc.to_string()])
        .args(["--master-addr", &args.master_addr])
        .args(["--max-restarts", &args.max_restarts.to_string()])
        .args(["--rdzv-id", &format!("{run_id}-replica{g}")])
        .args(["--replica-group", &g.to_string()]);
    if let Some(url) = lighthouse {
        cmd.args(["--lighthouse", url]);
    }
    cmd.arg("--").args(&args.cmd);
    cmd.env("NUM_REPLICA_GROUPS", groups.to_string())
        .stdin(Stdio::null());
    dies_with_launcher(&mut cmd);
    cmd
}

/// Runs `groups` replica groups (see the module's docs); returns the exit status.
pub fn run(args: &Args, groups: usize) -> Result<i32, String> {
    let run_id = args.rdzv_id.clone().unwrap_or_else(|| {
        std::env::var("TORCHELASTIC_RUN_ID")
            .ok()
            .filter(|id| !id.trim().is_empty())
            .unwrap_or_else(|| format!("tch-dist-run-{}", std::process::id()))
    });
    let (_lighthouse, url) = match args.start_lighthouse {
        Some(min) => {
            let (child, url) = start_lighthouse(&args.master_addr, min)?;
            eprintln!("tch-dist-run: lighthouse at {url} (min_replicas {min})");
            (Some(child), Some(url))
        }
        None => (None, args.lighthouse.clone()),
    };
    let mut running: Vec<(usize, Owned)> = Vec::with_capacity(groups);
    for g in 0..groups {
        let child = group_command(args, g, groups, url.as_deref(), &run_id)
            .spawn()
            .map_err(|e| format!("cannot start replica group {g}'s launcher: {e}"))?;
        running.push((g, Owned(child)));
    }
    let mut first_failure: Option<(usize, i32)> = None;
    let mut forwarded = false;
    let mut deadline: Option<Instant> = None;
    while !running.is_empty() {
        if let (Some(sig), false) = (first_signal(), forwarded) {
            // Every group's launcher stops its ranks as after a signal of its own.
            for (_, child) in &running {
                // SAFETY: kill(2) to a child of ours, not yet reaped.
                unsafe { libc::kill(child.0.id() as libc::pid_t, libc::SIGTERM) };
            }
            forwarded = true;
            // Their own stop takes 5 s at most, then SIGKILL; a launcher that is stuck past
            // that is killed.
            deadline = Some(Instant::now() + Duration::from_secs(10));
            first_failure.get_or_insert((usize::MAX, 128 + sig));
        }
        if deadline.is_some_and(|d| Instant::now() > d) {
            break; // the rest are killed on drop
        }
        let mut i = 0;
        while i < running.len() {
            match running[i].1 .0.try_wait() {
                Ok(Some(status)) => {
                    let (g, _) = running.remove(i);
                    let code = crate::supervise::exit_code(status);
                    if code != 0 {
                        eprintln!(
                            "tch-dist-run: replica group {g} ended with status {code}; the others go on"
                        );
                        first_failure.get_or_insert((g, code));
                    }
                }
                Ok(None) => i += 1,
                Err(e) => {
                    return Err(format!(
                        "cannot wait for replica group {}: {e}",
                        running[i].0
                    ))
                }
            }
        }
        std::thread::sleep(TICK);
    }
    Ok(first_failure.map_or(0, |(_, code)| code))
}
