//! Running ranks as real processes, for tests (the analogue of PyTorch's
//! `MultiProcessTestCase`).
//!
//! A multi-process test re-executes its own test binary once per rank, filtered to itself,
//! with torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR=127.0.0.1, a free
//! MASTER_PORT) plus `TCH_DIST_TEST_WORKER` naming the test. In the parent the test spawns
//! and supervises; in a child it runs the body as one rank.
//!
//! ```no_run
//! #[test]
//! fn all_reduce_sums() {
//!     tch_dist_runtime::testing::run_ranks("all_reduce_sums", 2, |pg| {
//!         let t = tch::Tensor::from_slice(&[pg.rank() as f32 + 1.0]);
//!         pg.all_reduce(&t, tch_dist_runtime::ReduceOp::Sum).unwrap();
//!         assert_eq!(t.double_value(&[0]), 3.0);
//!     });
//! }
//! ```

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::c10d::group::{Backend, ProcessGroup};

/// The variable that marks a child process as a rank of the named test.
pub const WORKER_ENV: &str = "TCH_DIST_TEST_WORKER";

/// Default wall-clock limit for a whole multi-process test.
pub const DEFAULT_TEST_TIMEOUT: Duration = Duration::from_secs(120);

/// Default timeout of the process groups that test ranks create (seconds, as text).
const DEFAULT_GROUP_TIMEOUT_SECS: &str = "60";

/// What one rank did.
///
/// ```no_run
/// let outputs = tch_dist_runtime::testing::Launch::new("tests::two_ranks", 2).run();
/// for o in &outputs {
///     println!("rank {}: {:?}\n{}", o.rank, o.status, o.stderr);
/// }
/// ```
#[derive(Debug)]
pub struct RankOutput {
    /// The rank.
    pub rank: usize,
    /// How it ended; `None` when it was killed at the deadline.
    pub status: Option<ExitStatus>,
    /// Everything it printed on stdout.
    pub stdout: String,
    /// Everything it printed on stderr.
    pub stderr: String,
}

impl RankOutput {
    /// Whether the rank exited with status 0.
    ///
    /// ```no_run
    /// use tch_dist_runtime::testing::{describe, Launch};
    /// let outputs = Launch::new("tests::two_ranks", 2).run();
    /// assert!(outputs.iter().all(|o| o.success()), "{}", describe(&outputs));
    /// ```
    pub fn success(&self) -> bool {
        self.status.is_some_and(|s| s.success())
    }
}

/// Formats every rank's output for a failure message.
///
/// ```no_run
/// use tch_dist_runtime::testing::{describe, Launch};
/// let outputs = Launch::new("tests::two_ranks", 2).run();
/// eprintln!("{}", describe(&outputs)); // each rank's status, stdout and stderr
/// ```
pub fn describe(outputs: &[RankOutput]) -> String {
    let mut s = String::new();
    for o in outputs {
        s.push_str(&format!(
            "--- rank {} ({}) ---\nstdout:\n{}\nstderr:\n{}\n",
            o.rank,
            o.status
                .map_or("killed at the deadline".to_string(), |st| st.to_string()),
            o.stdout,
            o.stderr
        ));
    }
    s
}

/// A TCP port that was free a moment ago, for a test job's MASTER_PORT.
///
/// Taken from just below the kernel's ephemeral range (`ip_local_port_range`), never from
/// it: between this call and rank 0's store binding the port, an ephemeral port can be
/// handed to anything that binds port 0 or connects — another test's Gloo pairs open
/// dozens — and then the job fails with "address in use" or, worse, its ranks meet
/// another job's store. Ports below the range are only ever taken by name. A process-wide
/// record keeps concurrent tests of one binary from drawing the same port; a start that
/// depends on the process id and the clock keeps separate binaries apart. Falls back to a
/// kernel-chosen port when every candidate is taken.
///
/// ```no_run
/// // A rank process of this test's own job, on a port no other test of it takes.
/// let port = tch_dist_runtime::testing::free_port();
/// let mut rank = std::process::Command::new("my-rank");
/// rank.env("MASTER_ADDR", "127.0.0.1").env("MASTER_PORT", port.to_string());
/// ```
pub fn free_port() -> u16 {
    use std::collections::HashSet;
    use std::sync::Mutex;
    static HANDED_OUT: Mutex<Option<HashSet<u16>>> = Mutex::new(None);

    let (low, high) = ports_below_ephemeral();
    let span = u32::from(high - low);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    // A multiplicative hash spreads neighbouring process ids and instants over the span.
    let seed = (std::process::id() ^ nanos).wrapping_mul(2_654_435_761);
    let mut handed_out = HANDED_OUT.lock().unwrap_or_else(|e| e.into_inner());
    let handed_out = handed_out.get_or_insert_with(HashSet::new);
    for step in 0..span {
        let port = low + ((seed.wrapping_add(step)) % span) as u16;
        if handed_out.contains(&port) {
            continue;
        }
        // The store binds every interface; a port free there is free on 127.0.0.1 too.
        if std::net::TcpListener::bind(("0.0.0.0", port)).is_ok() {
            handed_out.insert(port);
            return port;
        }
    }
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("binding 127.0.0.1:0 to find a free port")
}

/// The ports `free_port` draws from: up to 8192 just below the ephemeral range, never
/// under 10000 (well-known and registered services live there).
fn ports_below_ephemeral() -> (u16, u16) {
    let ephemeral_low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    let high = ephemeral_low.max(10_001);
    let low = high.saturating_sub(8192).max(10_000);
    (low, high)
}

/// The test this process is a rank of, if it is a child.
///
/// ```no_run
/// match tch_dist_runtime::testing::worker() {
///     Some(test) => println!("a rank of {test}"),
///     None => println!("the parent, which spawns the ranks"),
/// }
/// ```
pub fn worker() -> Option<String> {
    std::env::var(WORKER_ENV).ok()
}

/// How to start the ranks of a test.
///
/// ```
/// use tch_dist_runtime::testing::Launch;
/// let launch = Launch::new("tests::two_ranks", 2).env("RUST_BACKTRACE", "1");
/// assert_eq!(launch.world_size, 2);
/// ```
#[derive(Debug, Clone)]
pub struct Launch {
    /// The test's exact name (its path in the test binary).
    pub test: String,
    /// Number of ranks.
    pub world_size: usize,
    /// Wall-clock limit for all ranks together.
    pub timeout: Duration,
    /// Extra variables for every rank (after the defaults, so they override them).
    pub env: Vec<(String, String)>,
    /// Per-rank extra variables.
    pub rank_env: Vec<Vec<(String, String)>>,
    /// Describe the ranks with Slurm's variables (SLURM_PROCID, ...) instead of torchrun's.
    pub slurm: bool,
    /// Per rank, another program to start instead of the test binary (its argv), with the
    /// same variables: a PyTorch rank of a mixed job, say.
    pub programs: Vec<Option<Vec<String>>>,
}

impl Launch {
    /// `world_size` ranks of `test` with the default limits.
    ///
    /// ```
    /// let launch = tch_dist_runtime::testing::Launch::new("tests::four_ranks", 4);
    /// assert_eq!(launch.timeout, tch_dist_runtime::testing::DEFAULT_TEST_TIMEOUT);
    /// ```
    pub fn new(test: &str, world_size: usize) -> Self {
        Self {
            test: test.to_string(),
            world_size,
            timeout: DEFAULT_TEST_TIMEOUT,
            env: Vec::new(),
            rank_env: vec![Vec::new(); world_size],
            slurm: false,
            programs: vec![None; world_size],
        }
    }

    /// Starts `rank` as `argv` (a program and its arguments) instead of the test binary,
    /// with the same variables.
    ///
    /// ```no_run
    /// use tch_dist_runtime::testing::Launch;
    /// let python = vec!["python3".to_string(), "peer.py".to_string()];
    /// let out = Launch::new("mixed_job", 2).rank_program(0, python).run();
    /// ```
    pub fn rank_program(mut self, rank: usize, argv: Vec<String>) -> Self {
        if let Some(p) = self.programs.get_mut(rank) {
            *p = Some(argv);
        }
        self
    }

    /// Adds a variable for every rank.
    ///
    /// ```
    /// use tch_dist_runtime::testing::Launch;
    /// let launch = Launch::new("tests::two_ranks", 2).env("RUST_BACKTRACE", "1");
    /// ```
    pub fn env(mut self, key: &str, value: impl Into<String>) -> Self {
        self.env.push((key.to_string(), value.into()));
        self
    }

    /// Adds a variable for one rank.
    ///
    /// ```
    /// use tch_dist_runtime::testing::Launch;
    /// let launch = Launch::new("tests::two_ranks", 2).rank_env(1, "CUDA_VISIBLE_DEVICES", "1");
    /// ```
    pub fn rank_env(mut self, rank: usize, key: &str, value: impl Into<String>) -> Self {
        if let Some(vars) = self.rank_env.get_mut(rank) {
            vars.push((key.to_string(), value.into()));
        }
        self
    }

    /// Describes the ranks with Slurm's variables instead of torchrun's.
    ///
    /// ```
    /// use tch_dist_runtime::testing::Launch;
    /// let launch = Launch::new("tests::under_slurm", 2).slurm(); // SLURM_PROCID, ...
    /// assert!(launch.slurm);
    /// ```
    pub fn slurm(mut self) -> Self {
        self.slurm = true;
        self
    }

    /// Sets the wall-clock limit.
    ///
    /// ```
    /// use tch_dist_runtime::testing::Launch;
    /// let launch = Launch::new("tests::slow", 2).timeout(std::time::Duration::from_secs(300));
    /// ```
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Starts the ranks, waits for all of them (killing every one at the deadline) and
    /// returns what each did.
    ///
    /// ```no_run
    /// use tch_dist_runtime::testing::Launch;
    /// let outputs = Launch::new("tests::two_ranks", 2).run(); // one per rank, in rank order
    /// assert!(outputs.iter().all(|o| o.success()));
    /// ```
    pub fn run(&self) -> Vec<RankOutput> {
        let exe = std::env::current_exe().expect("the test binary's path");
        let port = free_port().to_string();
        let world = self.world_size.to_string();
        let mut children: Vec<(Child, JoinHandle<String>, JoinHandle<String>)> = Vec::new();
        for rank in 0..self.world_size {
            let mut cmd = match self.programs.get(rank).cloned().flatten() {
                Some(argv) if !argv.is_empty() => {
                    let mut cmd = Command::new(&argv[0]);
                    cmd.args(&argv[1..]);
                    cmd
                }
                _ => {
                    let mut cmd = Command::new(&exe);
                    cmd.args([
                        self.test.as_str(),
                        "--exact",
                        "--nocapture",
                        "--test-threads=1",
                    ]);
                    cmd
                }
            };
            cmd.env(WORKER_ENV, &self.test)
                .env("MASTER_PORT", &port)
                .env("TCH_DIST_TIMEOUT_SECS", DEFAULT_GROUP_TIMEOUT_SECS);
            for var in [
                "RANK",
                "LOCAL_RANK",
                "WORLD_SIZE",
                "LOCAL_WORLD_SIZE",
                "MASTER_ADDR",
            ] {
                cmd.env_remove(var);
            }
            if self.slurm {
                cmd.env("SLURM_PROCID", rank.to_string())
                    .env("SLURM_LOCALID", rank.to_string())
                    .env("SLURM_NTASKS", &world)
                    .env("SLURM_NNODES", "1");
            } else {
                cmd.env("RANK", rank.to_string())
                    .env("LOCAL_RANK", rank.to_string())
                    .env("WORLD_SIZE", &world)
                    .env("LOCAL_WORLD_SIZE", &world)
                    .env("MASTER_ADDR", "127.0.0.1");
            }
            cmd.envs(self.env.iter().map(|(k, v)| (k, v)))
                .envs(
                    self.rank_env
                        .get(rank)
                        .into_iter()
                        .flatten()
                        .map(|(k, v)| (k, v)),
                )
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            let mut child = cmd.spawn().expect("spawning a test rank");
            let out = drain(child.stdout.take());
            let err = drain(child.stderr.take());
            children.push((child, out, err));
        }
        let deadline = Instant::now() + self.timeout;
        let mut statuses: Vec<Option<ExitStatus>> = vec![None; children.len()];
        loop {
            for (i, (child, _, _)) in children.iter_mut().enumerate() {
                if statuses[i].is_none() {
                    statuses[i] = child.try_wait().ok().flatten();
                }
            }
            if statuses.iter().all(Option::is_some) || Instant::now() >= deadline {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        children
            .into_iter()
            .enumerate()
            .map(|(rank, (mut child, out, err))| {
                if statuses[rank].is_none() {
                    let _ = child.kill();
                    let _ = child.wait();
                }
                RankOutput {
                    rank,
                    status: statuses[rank],
                    stdout: out.join().unwrap_or_default(),
                    stderr: err.join().unwrap_or_default(),
                }
            })
            .collect()
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

/// What a rank prints once its body has run, so that the parent can tell a rank that ran
/// the test from one whose filter matched nothing (a `test` name that is not the test's
/// exact path runs zero tests in the child, which passes).
const RAN_MARKER: &str = "tch-dist-test: rank body finished:";

/// Runs `body` as every rank of a `world_size`-process Gloo group (also made the default
/// process group, and destroyed once the body returns).
///
/// In the parent (a normal `cargo test` run) this spawns the ranks and panics, with every
/// rank's output, unless all of them run the body and pass within [`DEFAULT_TEST_TIMEOUT`].
/// `test` must be the test's exact name; a child that ran no test fails the parent.
///
/// ```no_run
/// #[test]
/// fn world_of_two() {
///     tch_dist_runtime::testing::run_ranks("world_of_two", 2, |pg| {
///         assert_eq!(pg.world_size(), 2);
///     });
/// }
/// ```
pub fn run_ranks(test: &str, world_size: usize, body: impl FnOnce(ProcessGroup)) {
    run_ranks_with(&Launch::new(test, world_size), Backend::Gloo, body)
}

/// [`run_ranks`] with explicit launch settings and backend.
///
/// ```no_run
/// use tch_dist_runtime::testing::{run_ranks_with, Launch};
/// #[test]
/// fn under_slurm() {
///     let launch = Launch::new("under_slurm", 2).slurm();
///     run_ranks_with(&launch, tch_dist_runtime::Backend::Gloo, |pg| {
///         assert_eq!(pg.world_size(), 2);
///     });
/// }
/// ```
pub fn run_ranks_with(launch: &Launch, backend: Backend, body: impl FnOnce(ProcessGroup)) {
    match worker() {
        Some(w) if w == launch.test => {
            // The default group, as a program started by torchrun would create it.
            let pg = crate::init_process_group(backend)
                .unwrap_or_else(|e| panic!("creating the test's process group: {e}"));
            let rank = pg.rank();
            body(pg);
            // As every program should before it exits: the default group's backends are shut
            // down even where the body kept clones of it (a test binary ends with the
            // process's exit, which runs no destructor of the default group).
            crate::destroy_process_group();
            println!("{RAN_MARKER} {} {rank}", launch.test);
        }
        Some(_) => {}
        None => {
            let outputs = launch.run();
            if !outputs.iter().all(RankOutput::success) {
                panic!("a rank of {} failed:\n{}", launch.test, describe(&outputs));
            }
            let marker = |rank: usize| format!("{RAN_MARKER} {} {rank}", launch.test);
            if let Some(o) = outputs
                .iter()
                .find(|o| !o.stdout.lines().any(|l| l.ends_with(&marker(o.rank))))
            {
                panic!(
                    "rank {} of {} ran no test body: is {:?} the test's exact path (as \
                     `cargo test -- --exact` names it)?\n{}",
                    o.rank,
                    launch.test,
                    launch.test,
                    describe(&outputs)
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Ports come from below the ephemeral range and are never handed out twice.
    #[test]
    fn free_ports_are_distinct_and_below_the_ephemeral_range() {
        let (low, high) = ports_below_ephemeral();
        let ports: Vec<u16> = (0..200).map(|_| free_port()).collect();
        assert!(ports.iter().all(|p| (low..high).contains(p)), "{ports:?}");
        let distinct: std::collections::HashSet<_> = ports.iter().collect();
        assert_eq!(distinct.len(), ports.len());
    }
}
