//! Hosts on one machine, for the multi-host tier: each host a network namespace with its own
//! `eth0` at `10.77.0.(i+1)/24`, the hosts joined by a bridge in a namespace of their own
//! (the switch), the subnet existing only inside those namespaces. A [`Hosts`] removes its
//! namespaces (killing whatever still runs in them) when dropped, a failing test's too, and
//! sweeps away those a killed test run left behind. [`Job`] starts a process on a host and
//! collects its output, bounded in time. Root only (CI and `make test` run as root);
//! ../shared/MULTIHOST.md has the commands and the facts, docs/design/tests-and-benchmarks.md
//! ("The multi-host tier") how to add a case.

#![allow(dead_code)] // each includer uses part of it

pub use crate::build::{example, launcher};

use std::io::{BufRead, BufReader, Read};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The hosts' subnet, private to their namespaces (every set of hosts has its own switch,
/// so sets running at once do not meet).
const SUBNET: &str = "10.77.0";

/// The names' prefix: `td<pid>x<n>` (the pid tells a sweep whose namespaces these are).
const PREFIX: &str = "td";

/// Runs `ip` with `args`, panicking with its output when it fails.
fn ip(args: &[&str]) {
    let out = Command::new("ip")
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("running `ip {}`: {e}", args.join(" ")));
    assert!(
        out.status.success(),
        "`ip {}` failed: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The namespaces `ip netns list` shows.
fn namespaces() -> Vec<String> {
    let out = Command::new("ip").args(["netns", "list"]).output();
    let text = out.map(|o| o.stdout).unwrap_or_default();
    String::from_utf8_lossy(&text)
        .lines()
        .filter_map(|l| l.split_whitespace().next().map(str::to_string))
        .collect()
}

/// Where a signal goes, for [`send`]: never a number that kill(2) reads as "every process".
#[derive(Debug, Clone, Copy)]
enum To {
    Process(u32),
    /// The process group this process leads.
    GroupOf(u32),
}

/// Sends `sig` through kill(2) itself, not the `kill` program: procps' `kill -9 -PGID`
/// takes `-PGID` for an option and signals pid -1, every process of the machine (the test
/// run, its shell, CI's runner). Pids 0 and 1 (our own group, init) are never signalled.
fn send(to: To, sig: libc::c_int) {
    let target = match to {
        To::Process(pid) | To::GroupOf(pid) if pid <= 1 => return,
        To::Process(pid) => pid as libc::pid_t,
        To::GroupOf(pid) => -(pid as libc::pid_t),
    };
    // SAFETY: kill(2) with a target that is one process or one group, never 0 or -1.
    unsafe { libc::kill(target, sig) };
}

/// The processes in namespace `ns` (`ip netns pids`).
fn pids_in(ns: &str) -> Vec<u32> {
    let out = Command::new("ip").args(["netns", "pids", ns]).output();
    let text = out.map(|o| o.stdout).unwrap_or_default();
    String::from_utf8_lossy(&text)
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect()
}

/// Kills what runs in namespace `ns` and removes it (and its /etc/netns folder).
fn remove_namespace(ns: &str) {
    for pid in pids_in(ns) {
        send(To::Process(pid), libc::SIGKILL);
    }
    let _ = Command::new("ip").args(["netns", "del", ns]).status();
    let _ = std::fs::remove_dir_all(Path::new("/etc/netns").join(ns));
}

/// Removes the namespaces of test processes that no longer run (a run killed before its
/// guards could): `td<pid>x<n>...` whose pid is gone.
fn sweep() {
    for ns in namespaces() {
        let Some(rest) = ns.strip_prefix(PREFIX) else {
            continue;
        };
        let Some((pid, _)) = rest.split_once('x') else {
            continue;
        };
        if pid.parse::<u32>().is_ok() && !Path::new("/proc").join(pid).exists() {
            remove_namespace(&ns);
        }
    }
}

/// A host's link state, for [`Hosts::link`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Link {
    /// Connected.
    Up,
    /// Cut: the host's peers hear nothing more from it, not even a reset.
    Down,
}

/// `count` hosts on one switch; removed when dropped.
pub struct Hosts {
    prefix: String,
    count: usize,
}

impl Hosts {
    /// Makes `count` hosts (at most 9): namespaces `<prefix>h<i>` with `lo` up and `eth0` at
    /// [`addr`](Self::addr)`(i)`, each joined by a veth pair to the bridge of `<prefix>sw`.
    pub fn new(count: usize) -> Hosts {
        assert!((1..=9).contains(&count), "1 to 9 hosts");
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        static SWEPT: OnceLock<()> = OnceLock::new();
        SWEPT.get_or_init(sweep);
        let prefix = format!(
            "{PREFIX}{}x{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        // The guard exists before the first namespace: a failure half-way removes the rest.
        let hosts = Hosts { prefix, count };
        let sw = hosts.switch();
        ip(&["netns", "add", &sw]);
        ip(&["-n", &sw, "link", "add", "br0", "type", "bridge"]);
        ip(&["-n", &sw, "link", "set", "br0", "up"]);
        for i in 0..count {
            let ns = hosts.name(i);
            let (veth, port) = (
                format!("{}v{i}", hosts.prefix),
                format!("{}p{i}", hosts.prefix),
            );
            assert!(veth.len() <= 15, "interface name {veth} is too long");
            ip(&["netns", "add", &ns]);
            ip(&["link", "add", &veth, "type", "veth", "peer", "name", &port]);
            ip(&["link", "set", &veth, "netns", &ns]);
            ip(&["link", "set", &port, "netns", &sw]);
            ip(&["-n", &ns, "link", "set", &veth, "name", "eth0"]);
            ip(&[
                "-n",
                &ns,
                "addr",
                "add",
                &format!("{}/24", hosts.addr(i)),
                "dev",
                "eth0",
            ]);
            ip(&["-n", &ns, "link", "set", "eth0", "up"]);
            ip(&["-n", &ns, "link", "set", "lo", "up"]);
            ip(&["-n", &sw, "link", "set", &port, "master", "br0"]);
            ip(&["-n", &sw, "link", "set", &port, "up"]);
        }
        hosts
    }

    /// Host `i`'s namespace.
    pub fn name(&self, i: usize) -> String {
        format!("{}h{i}", self.prefix)
    }

    /// How many hosts there are.
    pub fn count(&self) -> usize {
        self.count
    }

    fn switch(&self) -> String {
        format!("{}sw", self.prefix)
    }

    /// Host `i`'s address on the subnet.
    pub fn addr(&self, i: usize) -> String {
        format!("{SUBNET}.{}", i + 1)
    }

    /// `program` to run on host `i` (`ip netns exec`, which execs it: the child is the
    /// program itself).
    pub fn command(&self, i: usize, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.name(i)]).arg(program);
        cmd
    }

    /// Puts host `i`'s link down (a cut cable: its peers hear nothing more) or up again.
    pub fn link(&self, i: usize, state: Link) {
        let state = match state {
            Link::Up => "up",
            Link::Down => "down",
        };
        ip(&["-n", &self.name(i), "link", "set", "eth0", state]);
    }

    /// Stops every process of host `i` (SIGSTOP): a frozen host, whose sockets stay open
    /// and silent.
    pub fn freeze(&self, i: usize) {
        self.signal(i, libc::SIGSTOP);
    }

    /// Lets host `i`'s processes run again (SIGCONT).
    pub fn thaw(&self, i: usize) {
        self.signal(i, libc::SIGCONT);
    }

    /// Host `i` lost for good: every process of it (its launcher and ranks) SIGKILLed.
    pub fn kill(&self, i: usize) {
        self.signal(i, libc::SIGKILL);
    }

    fn signal(&self, i: usize, sig: libc::c_int) {
        for pid in pids_in(&self.name(i)) {
            send(To::Process(pid), sig);
        }
    }

    /// Host `i`'s `/etc/hosts` (`ip netns exec` mounts `/etc/netns/<ns>/hosts` over it):
    /// `127.0.1.1 <hostname>` gives the classic Debian failure, the hostname resolving to
    /// loopback.
    pub fn hosts_file(&self, i: usize, contents: &str) {
        let dir = Path::new("/etc/netns").join(self.name(i));
        std::fs::create_dir_all(&dir).expect("creating /etc/netns/<ns>");
        std::fs::write(dir.join("hosts"), contents).expect("writing /etc/netns/<ns>/hosts");
    }

    /// The bytes host `i`'s `eth0` received and sent (`/proc/net/dev` inside its namespace).
    pub fn eth0_bytes(&self, i: usize) -> (u64, u64) {
        let out = self.command(i, "cat").arg("/proc/net/dev").output();
        let text = String::from_utf8_lossy(&out.map(|o| o.stdout).unwrap_or_default()).into_owned();
        let line = text
            .lines()
            .find_map(|l| l.trim_start().strip_prefix("eth0:"))
            .unwrap_or_else(|| panic!("no eth0 in host {i}'s /proc/net/dev:\n{text}"))
            .to_string();
        let fields: Vec<u64> = line
            .split_whitespace()
            .filter_map(|f| f.parse().ok())
            .collect();
        (fields[0], fields[8])
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        for i in 0..self.count {
            remove_namespace(&self.name(i));
        }
        remove_namespace(&self.switch());
    }
}

/// The launch variables a job must not inherit from the test's own environment (a test run
/// under a launcher, or as another test's rank): each job's launcher, or the job's command
/// line, sets its own.
pub const INHERITED_LAUNCH_VARS: &[&str] = &[
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GLOO_SOCKET_IFNAME",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TCH_DIST_RDZV_ROUND",
    "TCH_DIST_DEBUG",
    "TCH_DIST_TEST_WORKER",
    "TCH_DIST_TEST_KILL_AT_STEP",
];

/// `cmd` without [`INHERITED_LAUNCH_VARS`]; call it before setting any of them.
pub fn without_launch_vars(cmd: &mut Command) -> &mut Command {
    for var in INHERITED_LAUNCH_VARS {
        cmd.env_remove(var);
    }
    cmd
}

/// A process started on a host, its output collected as it runs.
pub struct Job {
    /// Which host it runs on.
    pub host: usize,
    child: Child,
    stdout: Option<JoinHandle<String>>,
    stderr: Option<JoinHandle<String>>,
}

/// How a [`Job`] ended.
#[derive(Debug)]
pub struct Ended {
    /// The host it ran on.
    pub host: usize,
    /// Its exit status; `None` when it was killed at the deadline.
    pub status: Option<ExitStatus>,
    /// When it ended, from the start of [`Job::wait_all`].
    pub after: Duration,
    /// Everything it printed on stdout.
    pub stdout: String,
    /// Everything it printed on stderr.
    pub stderr: String,
}

impl Ended {
    /// Whether it exited with status 0.
    pub fn success(&self) -> bool {
        self.status.is_some_and(|s| s.success())
    }
}

/// Every job's output, for a failure message.
pub fn describe(ended: &[Ended]) -> String {
    ended
        .iter()
        .map(|e| {
            format!(
                "--- host {} ({:?} after {:.1?}) stdout:\n{}--- stderr:\n{}",
                e.host, e.status, e.after, e.stdout, e.stderr
            )
        })
        .collect()
}

impl Job {
    /// Starts `cmd` (from [`Hosts::command`]) as host `host`'s job, in a process group of
    /// its own (so that the deadline's kill reaches what it started).
    pub fn start(host: usize, mut cmd: Command) -> Job {
        cmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0);
        let mut child = cmd.spawn().expect("starting a host's job");
        let stdout = Some(drain(child.stdout.take()));
        let stderr = Some(drain(child.stderr.take()));
        Job {
            host,
            child,
            stdout,
            stderr,
        }
    }

    /// Waits for every job until `timeout`, killing those still running then; returns how
    /// each ended, in `jobs`' order.
    pub fn wait_all(jobs: Vec<Job>, timeout: Duration) -> Vec<Ended> {
        Job::wait_until(jobs, timeout, |ended| ended.iter().all(Option::is_some))
    }

    /// Waits until job `i` has ended (at most `timeout`), then kills the others still
    /// running: for a test that judges one host while another is frozen (which would never
    /// end by itself).
    pub fn wait_for(jobs: Vec<Job>, i: usize, timeout: Duration) -> Vec<Ended> {
        Job::wait_until(jobs, timeout, |ended| ended[i].is_some())
    }

    fn wait_until(
        jobs: Vec<Job>,
        timeout: Duration,
        done: impl Fn(&[Option<(ExitStatus, Duration)>]) -> bool,
    ) -> Vec<Ended> {
        let start = Instant::now();
        let mut ended: Vec<Option<(ExitStatus, Duration)>> = vec![None; jobs.len()];
        let mut jobs = jobs;
        while !done(&ended) && start.elapsed() < timeout {
            for (job, end) in jobs.iter_mut().zip(ended.iter_mut()) {
                if end.is_none() {
                    *end = job
                        .child
                        .try_wait()
                        .ok()
                        .flatten()
                        .map(|s| (s, start.elapsed()));
                }
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        jobs.into_iter()
            .zip(ended)
            .map(|(mut job, end)| {
                if end.is_none() {
                    job.kill();
                }
                Ended {
                    host: job.host,
                    status: end.map(|(s, _)| s),
                    after: end.map_or(start.elapsed(), |(_, d)| d),
                    stdout: job
                        .stdout
                        .take()
                        .and_then(|h| h.join().ok())
                        .unwrap_or_default(),
                    stderr: job
                        .stderr
                        .take()
                        .and_then(|h| h.join().ok())
                        .unwrap_or_default(),
                }
            })
            .collect()
    }

    fn kill(&mut self) {
        // The whole process group: the launcher and the ranks it started.
        send(To::GroupOf(self.child.id()), libc::SIGKILL);
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            self.kill();
        }
    }
}

fn drain(pipe: Option<impl Read + Send + 'static>) -> JoinHandle<String> {
    std::thread::spawn(move || {
        let mut s = String::new();
        if let Some(p) = pipe {
            for line in BufReader::new(p).lines().map_while(Result::ok) {
                s.push_str(&line);
                s.push('\n');
            }
        }
        s
    })
}
