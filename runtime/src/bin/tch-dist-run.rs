//! `tch-dist-run`: the local launcher, a small torchrun.
//!
//! ```text
//! tch-dist-run --nproc-per-node N [--master-addr A] [--master-port P] -- CMD ARGS...
//! ```
//!
//! Starts N copies of CMD with torchrun's variables (RANK, LOCAL_RANK, WORLD_SIZE,
//! LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), prefixes each line they print with
//! `[rankR]: `, and when one rank fails, stops the others and exits with that rank's status.
//! Children die with the launcher (PR_SET_PDEATHSIG), so nothing is left behind.

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::{Duration, Instant};

const USAGE: &str = "usage: tch-dist-run --nproc-per-node N [--master-addr ADDR] [--master-port PORT] -- CMD [ARGS...]";

/// How long ranks get to exit after SIGTERM before SIGKILL.
const GRACE: Duration = Duration::from_secs(5);

struct Args {
    nproc: usize,
    master_addr: String,
    master_port: Option<u16>,
    cmd: Vec<String>,
}

fn parse_args(mut args: impl Iterator<Item = String>) -> Result<Args, String> {
    let mut nproc = None;
    let mut master_addr = "127.0.0.1".to_string();
    let mut master_port = None;
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
    Ok(Args {
        nproc,
        master_addr,
        master_port,
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
    use std::os::unix::process::ExitStatusExt;
    status
        .code()
        .unwrap_or_else(|| 128 + status.signal().unwrap_or(1))
}

static SIGNALLED: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_signal(sig: libc::c_int) {
    SIGNALLED.store(sig, Ordering::SeqCst);
}

fn signal_all(children: &mut [Option<Child>], sig: libc::c_int) {
    for c in children.iter().flatten() {
        // SAFETY: kill(2) on our own child's pid; harmless if it already exited.
        unsafe { libc::kill(c.id() as libc::pid_t, sig) };
    }
}

/// SIGTERM the running ranks, then SIGKILL whatever is left after the grace period.
fn stop_all(children: &mut [Option<Child>]) {
    signal_all(children, libc::SIGTERM);
    let deadline = Instant::now() + GRACE;
    while Instant::now() < deadline {
        for slot in children.iter_mut() {
            if let Some(c) = slot {
                if !matches!(c.try_wait(), Ok(None)) {
                    *slot = None;
                }
            }
        }
        if children.iter().all(Option::is_none) {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    for c in children.iter_mut().flatten() {
        let _ = c.kill();
        let _ = c.wait();
    }
}

fn run(args: Args) -> Result<i32, String> {
    use std::os::unix::process::CommandExt;
    let port = match args.master_port {
        Some(p) => p,
        None => free_port(&args.master_addr)?,
    };
    // SAFETY: installing async-signal-safe handlers that only store an integer.
    unsafe {
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
    }
    let mut children: Vec<Option<Child>> = Vec::new();
    let mut pumps = Vec::new();
    for rank in 0..args.nproc {
        let mut cmd = Command::new(&args.cmd[0]);
        cmd.args(&args.cmd[1..])
            .env("RANK", rank.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("GROUP_RANK", "0")
            .env("WORLD_SIZE", args.nproc.to_string())
            .env("LOCAL_WORLD_SIZE", args.nproc.to_string())
            .env("MASTER_ADDR", &args.master_addr)
            .env("MASTER_PORT", port.to_string())
            .env("TORCHELASTIC_RUN_ID", "tch-dist-run")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        // SAFETY: prctl in the forked child before exec; async-signal-safe.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
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
                children.push(Some(child));
            }
            Err(e) => {
                stop_all(&mut children);
                return Err(format!("cannot start {:?}: {e}", args.cmd[0]));
            }
        }
    }
    let mut code = 0;
    loop {
        let sig = SIGNALLED.load(Ordering::SeqCst);
        if sig != 0 {
            eprintln!("tch-dist-run: received signal {sig}, stopping all ranks");
            stop_all(&mut children);
            code = 128 + sig;
            break;
        }
        let mut failed = None;
        for (rank, slot) in children.iter_mut().enumerate() {
            if let Some(c) = slot {
                if let Ok(Some(status)) = c.try_wait() {
                    *slot = None;
                    if !status.success() {
                        failed = Some((rank, status));
                        break;
                    }
                }
            }
        }
        if let Some((rank, status)) = failed {
            eprintln!("tch-dist-run: rank {rank} failed ({status}); stopping the other ranks");
            stop_all(&mut children);
            code = exit_code(status);
            break;
        }
        if children.iter().all(Option::is_none) {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    for p in pumps {
        let _ = p.join();
    }
    Ok(code)
}

fn main() {
    let args = match parse_args(std::env::args().skip(1)) {
        Ok(a) => a,
        Err(msg) => {
            if msg.is_empty() {
                println!("{USAGE}");
                std::process::exit(0);
            }
            eprintln!("tch-dist-run: {msg}\n{USAGE}");
            std::process::exit(2);
        }
    };
    match run(args) {
        Ok(code) => std::process::exit(code),
        Err(msg) => {
            eprintln!("tch-dist-run: {msg}");
            std::process::exit(1);
        }
    }
}
