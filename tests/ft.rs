//! Fault-tolerant training (`tch_dist::ft`) as torchft tests it: replica groups as separate
//! jobs (`examples/train_ft.rs`, one rank each, each with its own store), a fault injected
//! at a chosen (group, step). The oracle: every group ends with the same parameters and
//! momentum, equal to a run without the fault (data keyed by step and replica rank; with
//! `min_replica_size` 2 a step commits only with both groups, so the steps committed are the
//! same). The run without the fault uses torchft's own lighthouse (the `torchft` wheel), the
//! runs with one tch-dist's. The faults: a group killed (restarted by hand, and by
//! `tch-dist-run --replica-groups`), a step that fails in one group (`report_error`), a
//! group that hangs (SIGSTOP, then SIGCONT), and the lighthouse restarting. Every process is
//! killed when its test ends.

#[path = "common/build.rs"]
mod build;

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::Value;
use tch_dist::ft::{LighthouseOptions, LighthouseServer};
use tch_dist::testing::free_port;

const STEPS: &str = "12";

/// Options every group of these tests runs with: the cross-group group's timeout is 3 s (a
/// hung peer costs that much), and steps commit only with both groups.
const COMMON: [&str; 8] = [
    "--steps",
    STEPS,
    "--step-ms",
    "20",
    "--timeout-ms",
    "3000",
    "--min-replica-size",
    "2",
];

/// Output collected as it arrives, readable meanwhile.
#[derive(Clone, Default)]
struct Collected(Arc<Mutex<String>>);

impl Collected {
    fn text(&self) -> String {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

fn drain(from: impl Read + Send + 'static) -> (Collected, JoinHandle<()>) {
    let out = Collected::default();
    let filling = out.clone();
    let reader = std::thread::spawn(move || {
        for line in BufReader::new(from).lines().map_while(Result::ok) {
            let mut text = filling.0.lock().unwrap_or_else(|e| e.into_inner());
            text.push_str(&line);
            text.push('\n');
        }
    });
    (out, reader)
}

/// A process (a group's, or the launcher's), its output collected as it runs; killed on
/// drop.
struct Proc {
    child: Child,
    stdout: (Collected, Option<JoinHandle<()>>),
    stderr: (Collected, Option<JoinHandle<()>>),
}

/// How a process ended.
#[derive(Debug)]
struct Ended {
    status: Option<ExitStatus>,
    stdout: String,
    stderr: String,
}

impl Ended {
    fn success(&self) -> bool {
        self.status.is_some_and(|s| s.success())
    }
}

/// The deadline of a test whose processes run for at most `secs`, taken once the binaries
/// they run are built (a build under the whole suite's load can take a minute of its own).
fn deadline_after_builds(secs: u64) -> Instant {
    build::launcher();
    build::lighthouse();
    build::example("train_ft");
    Instant::now() + Duration::from_secs(secs)
}

/// `cmd` without the launch variables of the test's own environment.
fn clean(program: impl AsRef<std::ffi::OsStr>) -> Command {
    let mut cmd = Command::new(program);
    for var in [
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_RUN_ID",
        "TORCHELASTIC_RESTART_COUNT",
        "REPLICA_GROUP_ID",
        "TORCHFT_LIGHTHOUSE",
    ] {
        cmd.env_remove(var);
    }
    cmd
}

impl Proc {
    fn spawn(mut cmd: Command) -> Proc {
        cmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd.spawn().expect("starting a process");
        let (out, out_reader) = drain(child.stdout.take().expect("piped"));
        let (err, err_reader) = drain(child.stderr.take().expect("piped"));
        Proc {
            child,
            stdout: (out, Some(out_reader)),
            stderr: (err, Some(err_reader)),
        }
    }

    /// `train_ft` as replica group `name` at `lighthouse`, a job of one rank with its own
    /// store, with [`COMMON`] and `extra` options.
    fn group(name: &str, lighthouse: &str, extra: &[&str]) -> Proc {
        Proc::train_ft(name, lighthouse, &[&COMMON[..], extra].concat())
    }

    /// `train_ft` as replica group `name` at `lighthouse` (one rank, a store of its own),
    /// with `args` only.
    fn train_ft(name: &str, lighthouse: &str, args: &[&str]) -> Proc {
        let mut cmd = clean(build::example("train_ft"));
        cmd.env("RANK", "0")
            .env("WORLD_SIZE", "1")
            .env("LOCAL_RANK", "0")
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", free_port().to_string())
            .args(["--replica-id", name, "--lighthouse", lighthouse])
            .args(args);
        Proc::spawn(cmd)
    }

    /// A torchft Python replica group, `replica_{index}` (ft/tests/torchft_peer.py `train`:
    /// torchft's Manager, DistributedDataParallel and optimizer wrapper on train_ft's model).
    fn torchft(lighthouse: &str, index: &str, args: &[&str]) -> Proc {
        let mut cmd = clean(concat!(env!("CARGO_MANIFEST_DIR"), "/.venv/bin/python"));
        cmd.arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/ft/tests/torchft_peer.py"
        ))
        .args(["train", lighthouse, index])
        .args(args);
        Proc::spawn(cmd)
    }

    /// Waits until `text` is in the process's stdout (false at `deadline`).
    fn printed(&self, text: &str, deadline: Instant) -> bool {
        while Instant::now() < deadline {
            if self.stdout.0.text().contains(text) || self.stderr.0.text().contains(text) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    }

    /// Waits until the process ends, killing it at `deadline`.
    fn wait(mut self, deadline: Instant) -> Ended {
        let status = loop {
            match self.child.try_wait() {
                Ok(Some(s)) => break Some(s),
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20))
                }
                _ => {
                    let _ = self.child.kill();
                    let _ = self.child.wait();
                    break None;
                }
            }
        };
        for reader in [self.stdout.1.take(), self.stderr.1.take()]
            .into_iter()
            .flatten()
        {
            let _ = reader.join();
        }
        Ended {
            status,
            stdout: self.stdout.0.text(),
            stderr: self.stderr.0.text(),
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The `FINAL` state in `stdout` (without the group's id), or a failure naming `whole`.
fn final_state(stdout: &str, whole: &dyn std::fmt::Debug) -> Value {
    let line = stdout
        .lines()
        .find_map(|l| l.strip_prefix("FINAL "))
        .unwrap_or_else(|| panic!("no FINAL line: {whole:#?}"));
    let mut v: Value = serde_json::from_str(line).expect("FINAL json");
    v.as_object_mut().expect("an object").remove("replica_id");
    v
}

/// torchft's lighthouse from the wheel (ft/tests/torchft_peer.py), killed on drop.
struct TorchftLighthouse {
    child: Child,
    address: String,
}

impl TorchftLighthouse {
    fn start(min_replicas: u32) -> TorchftLighthouse {
        let python = concat!(env!("CARGO_MANIFEST_DIR"), "/.venv/bin/python");
        let peer = concat!(env!("CARGO_MANIFEST_DIR"), "/ft/tests/torchft_peer.py");
        let mut child = Command::new(python)
            .args([peer, "lighthouse", &min_replicas.to_string(), "200"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            // Its INFO log of every quorum.
            .stderr(Stdio::null())
            .spawn()
            .expect("the venv's python (make setup)");
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("piped"))
            .read_line(&mut line)
            .expect("the lighthouse's port");
        let port = line
            .trim()
            .strip_prefix("port ")
            .expect("`port N`")
            .to_string();
        TorchftLighthouse {
            child,
            address: format!("http://127.0.0.1:{port}"),
        }
    }
}

impl Drop for TorchftLighthouse {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A tch-dist lighthouse for these tests: a group is dead 500 ms after its last heartbeat.
fn lighthouse_at(bind: &str) -> LighthouseServer {
    LighthouseServer::start(LighthouseOptions {
        bind: bind.into(),
        heartbeat_timeout: Duration::from_millis(500),
        join_timeout: Duration::from_millis(200),
        ..LighthouseOptions::new(1)
    })
    .expect("a lighthouse")
}

/// Both groups' final states, each checked to have succeeded.
fn both_final(g0: &Ended, g1: &Ended) -> [Value; 2] {
    for e in [g0, g1] {
        assert!(e.success(), "{e:#?}");
    }
    let states = [final_state(&g0.stdout, g0), final_state(&g1.stdout, g1)];
    assert_eq!(
        states[0], states[1],
        "the two groups diverged:\n{g0:#?}\n{g1:#?}"
    );
    states
}

/// Groups 0 (seed 1, then `extra0`) and 1 (seed 2, then `extra1`) at a lighthouse of their
/// own, run to their end.
fn two_groups(deadline: Instant, extra0: &[&str], extra1: &[&str]) -> (Ended, Ended) {
    let lighthouse = lighthouse_at("127.0.0.1:0");
    let at = lighthouse.address();
    let g0 = Proc::group("replica_0", &at, &[&["--seed", "1"], extra0].concat());
    let g1 = Proc::group("replica_1", &at, &[&["--seed", "2"], extra1].concat());
    (g0.wait(deadline), g1.wait(deadline))
}

/// Group 0 (seed 1) and group 1 (seed 2), both with `extra`, at a lighthouse of their own;
/// group 1 exits at step 4 (checked) and is restarted by hand from seed 3. Both groups, run
/// to their end.
fn killed_and_restarted(deadline: Instant, extra: &[&str]) -> (Ended, Ended) {
    let lighthouse = lighthouse_at("127.0.0.1:0");
    let at = lighthouse.address();
    let g0 = Proc::group("replica_0", &at, &[&["--seed", "1"], extra].concat());
    let failed = Proc::group(
        "replica_1",
        &at,
        &[&["--seed", "2", "--exit-at", "4"], extra].concat(),
    )
    .wait(deadline);
    assert_eq!(failed.status.and_then(|s| s.code()), Some(3), "{failed:#?}");
    let restarted = Proc::group("replica_1", &at, &[&["--seed", "3"], extra].concat());
    (g0.wait(deadline), restarted.wait(deadline))
}

#[test]
fn faults_of_every_kind_end_as_the_run_without_them() {
    let deadline = deadline_after_builds(240);
    let seed = |s: &'static str| ["--seed", s];

    // Without a fault, at torchft's lighthouse: group 1 starts from other weights than group
    // 0's and takes them at step 0 (init_sync).
    let expected = {
        let torchft = TorchftLighthouse::start(2);
        let g0 = Proc::group("replica_0", &torchft.address, &seed("1"));
        let g1 = Proc::group("replica_1", &torchft.address, &seed("2"));
        let [s0, s1] = both_final(&g0.wait(deadline), &g1.wait(deadline));
        assert_eq!(s1, s0);
        s0
    };
    assert_eq!(expected["step"], 12);
    assert_eq!(
        expected["batches_committed"], 24,
        "two participants in every committed step"
    );

    // Killed: group 1 exits at step 4, before its gradients are averaged; group 0's step
    // fails and does not commit, and it waits alone (min 2) until group 1, restarted from
    // yet other weights, heals from it and the two go on.
    {
        let (g0, g1) = killed_and_restarted(deadline, &[]);
        assert_eq!(both_final(&g0, &g1), [expected.clone(), expected.clone()]);
        assert!(
            g0.stderr.contains(
                "step 4 not committed: averaging the gradients: rank 0: all_reduce failed"
            ),
            "{g0:#?}"
        );
    }

    // The same under tch-dist-run --replica-groups 2 --start-lighthouse 1: the launcher
    // restarts group 1 alone (the injected exit is at its first start only).
    {
        let mut cmd = clean(build::launcher());
        cmd.args(["--replica-groups", "2", "--start-lighthouse", "1"])
            .args(["--nproc-per-node", "1", "--max-restarts", "1", "--"])
            .arg(build::example("train_ft"))
            .args(COMMON)
            .args(["--seed", "1", "--exit-at", "4", "--exit-replica", "1"]);
        let ended = Proc::spawn(cmd).wait(deadline);
        assert!(ended.success(), "{ended:#?}");
        assert!(
            ended
                .stderr
                .contains("[replica1/rank0]: train_ft: exiting at step 4 (injected)")
                && ended
                    .stderr
                    .contains("starting the ranks again (restart 1 of 1)"),
            "{ended:#?}"
        );
        for g in ["replica0", "replica1"] {
            let prefix = format!("[{g}/rank0]: ");
            let own: Vec<&str> = ended
                .stdout
                .lines()
                .filter_map(|l| l.strip_prefix(prefix.as_str()))
                .collect();
            assert_eq!(final_state(&own.join("\n"), &ended), expected, "{g}");
        }
    }

    // A step that fails in group 1 (report_error): it commits nowhere, and group 0 learns
    // of it from the average itself, not from a timeout (the group's timeout is 30 s here).
    {
        let slow = ["--timeout-ms", "30000"];
        let start = Instant::now();
        let (g0, g1) = two_groups(deadline, &slow, &[&slow[..], &["--fail-at", "3"]].concat());
        assert_eq!(both_final(&g0, &g1), [expected.clone(), expected.clone()]);
        assert!(
            start.elapsed() < Duration::from_secs(25),
            "{:?}",
            start.elapsed()
        );
        assert!(
            g0.stderr
                .contains("step 3 not committed: 1 member(s) of quorum"),
            "{g0:#?}"
        );
        assert!(
            g1.stderr
                .contains("step 3 not committed: an injected failure"),
            "{g1:#?}"
        );
    }

    // Group 1 has no gradient for fc2.bias in any step (set to none after backward): it
    // contributes zeros there and receives the average, so both groups step it alike and
    // end equal (to each other; not to the run where group 1 used it).
    {
        let (g0, g1) = two_groups(deadline, &[], &["--drop-grad", "fc2.bias"]);
        let [s0, _] = both_final(&g0, &g1);
        assert_eq!(s0["step"], 12);
        assert_ne!(s0["params"]["fc2.bias"], expected["params"]["fc2.bias"]);
    }

    // A misuse: group 1 averages twice in step 5. The second average communicates nothing
    // and fails group 1's step, which falls one step behind and heals; no average meets
    // another step's.
    {
        let (g0, g1) = two_groups(deadline, &[], &["--average-twice-at", "5"]);
        assert_eq!(both_final(&g0, &g1), [expected.clone(), expected.clone()]);
        assert!(
            g1.stderr
                .contains("step 5 not committed: allreduce_gradients was called twice in one step"),
            "{g1:#?}"
        );
    }

    // A hung group: group 1 stops itself (SIGSTOP) at step 4 for 4 s. Group 0's step fails
    // (its average at the 3 s timeout, or its quorum leaves group 1 out once its heartbeats
    // stop), and group 0 waits alone; group 1 goes on after SIGCONT, its step fails on the
    // quorum's group that group 0 left, and the two meet again.
    {
        let lighthouse = lighthouse_at("127.0.0.1:0");
        let at = lighthouse.address();
        let g0 = Proc::group("replica_0", &at, &seed("1"));
        let g1 = Proc::group("replica_1", &at, &["--seed", "2", "--stop-at", "4"]);
        assert!(
            g1.printed("stopping at step 4", deadline),
            "group 1 never stopped"
        );
        // Longer than the group's timeout (3 s).
        std::thread::sleep(Duration::from_secs(4));
        let _ = Command::new("kill")
            .args(["-CONT", &g1.child.id().to_string()])
            .status();
        let (g0, g1) = (g0.wait(deadline), g1.wait(deadline));
        assert_eq!(both_final(&g0, &g1), [expected.clone(), expected.clone()]);
        // Whether group 0's step 4 met the hang in its average (the group's timeout) or in
        // its quorum (group 1 already dropped), it did not commit.
        assert!(g0.stderr.contains("step 4 not committed: "), "{g0:#?}");
    }

    // The lighthouse restarts (on the same address) once both groups have committed step 2:
    // the steps that meet the gap do not commit, and the groups go on with the new one.
    {
        let bind = format!("127.0.0.1:{}", free_port());
        let first = lighthouse_at(&bind);
        let at = first.address();
        let slower = ["--step-ms", "100"];
        let g0 = Proc::group("replica_0", &at, &[&seed("1")[..], &slower].concat());
        let g1 = Proc::group("replica_1", &at, &[&seed("2")[..], &slower].concat());
        assert!(g0.printed("committed step 2", deadline), "no step 2");
        drop(first);
        std::thread::sleep(Duration::from_millis(500));
        let _second = lighthouse_at(&bind);
        let (g0, g1) = (g0.wait(deadline), g1.wait(deadline));
        assert_eq!(
            both_final(&g0, &g1)[0],
            expected,
            "{}\n{}",
            g0.stderr,
            g1.stderr
        );
    }
}

#[test]
fn the_average_overlapping_backward_ends_as_the_one_after_it() {
    let deadline = deadline_after_builds(240);
    let overlap = ["--overlap"];
    let (g0, g1) = two_groups(deadline, &[], &[]);
    let [expected, _] = both_final(&g0, &g1);
    assert_eq!(expected["step"], 12);

    // Both groups send chunks during backward, or only one does: the same collectives in
    // the same order, the same result.
    for (extra0, extra1) in [(&overlap[..], &overlap[..]), (&overlap[..], &[][..])] {
        let (g0, g1) = two_groups(deadline, extra0, extra1);
        assert_eq!(both_final(&g0, &g1), [expected.clone(), expected.clone()]);
    }

    // A failure reported after backward, when the gradients' chunks have left: the flag
    // comes last, and the step commits nowhere.
    {
        let (g0, g1) = two_groups(deadline, &overlap, &["--overlap", "--fail-at", "3"]);
        assert_eq!(both_final(&g0, &g1), [expected.clone(), expected.clone()]);
        assert!(
            g0.stderr
                .contains("step 3 not committed: 1 member(s) of quorum"),
            "{g0:#?}"
        );
    }

    // The misuse of a second backward after prepare_for_backward (gradient accumulation):
    // what left was not the step's gradient, so the step fails on both groups, by name.
    {
        let (g0, g1) = two_groups(deadline, &overlap, &["--overlap", "--accumulate-at", "5"]);
        assert_eq!(both_final(&g0, &g1), [expected.clone(), expected.clone()]);
        assert!(
            g1.stderr.contains(
                "step 5 not committed: the gradient of `fc2.bias` was accumulated again after \
                 its part of the average had left: call prepare_for_backward before the step's \
                 last backward only"
            ),
            "{g1:#?}"
        );
        assert!(
            g0.stderr
                .contains("step 5 not committed: 1 member(s) of quorum"),
            "{g0:#?}"
        );
    }

    // Killed after its chunks left (group 1 exits at step 4 after backward): group 0's
    // step fails at the chunk that never comes, and the restarted group heals and goes on.
    {
        let (g0, g1) = killed_and_restarted(deadline, &overlap);
        assert_eq!(both_final(&g0, &g1), [expected.clone(), expected.clone()]);
        assert!(g0.stderr.contains("step 4 not committed: "), "{g0:#?}");
    }
}

#[test]
fn a_replica_group_with_another_model_is_named_on_every_member() {
    let deadline = deadline_after_builds(60);
    let lighthouse = LighthouseServer::start(LighthouseOptions {
        bind: "127.0.0.1:0".into(),
        ..LighthouseOptions::new(2)
    })
    .expect("a lighthouse");
    let address = lighthouse.address();
    let g0 = Proc::group("replica_0", &address, &["--hidden", "16"]);
    let g1 = Proc::group("replica_1", &address, &["--hidden", "8"]);
    let (g0, g1) = (g0.wait(deadline), g1.wait(deadline));
    for (e, other) in [(&g0, "replica_1:"), (&g1, "replica_0:")] {
        assert_eq!(e.status.and_then(|s| s.code()), Some(1), "{e:#?}");
        assert!(
            e.stderr
                .contains(&format!(", group rank 0: replica group {other}"))
                && e.stderr
                    .contains("trains another model (other parameter names, shapes or dtypes)"),
            "{e:#?}"
        );
    }
}

/// Every `FINAL` state `tch-dist-run --replica-groups 2 --nproc-per-node 2` printed, by its
/// `[replicaG/rankR]: ` prefix.
fn launched_states(ended: &Ended) -> Vec<(String, Value)> {
    assert!(ended.success(), "{ended:#?}");
    let mut states: Vec<(String, Value)> = ended
        .stdout
        .lines()
        .filter(|l| l.contains("FINAL "))
        .map(|l| {
            let (prefix, rest) = l.split_once(": ").expect("a prefixed line");
            (prefix.to_string(), final_state(rest, ended))
        })
        .collect();
    states.sort_by(|a, b| a.0.cmp(&b.0));
    states
}

/// One group's state from its two ranks' shards (`--shard`): each parameter's and momentum
/// buffer's values are rank 0's dim-0 chunk then rank 1's, flattened.
fn joined_shards(rank0: &Value, rank1: &Value) -> Value {
    let mut whole = rank0.clone();
    for part in ["params", "momentum"] {
        let theirs = rank1[part].as_object().expect("an object");
        for (name, values) in whole[part].as_object_mut().expect("an object") {
            let values = values.as_array_mut().expect("values");
            values.extend(theirs[name].as_array().expect("values").iter().cloned());
        }
    }
    whole
}

/// Whether `a` and `b` are equal but for rounding (numbers within 1e-6, relative).
fn close(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => {
            let (x, y) = (
                x.as_f64().unwrap_or(f64::NAN),
                y.as_f64().unwrap_or(f64::NAN),
            );
            (x - y).abs() <= 1e-6 * (1.0 + y.abs())
        }
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(x, y)| close(x, y))
        }
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len() && x.iter().all(|(k, v)| y.get(k).is_some_and(|w| close(v, w)))
        }
        _ => a == b,
    }
}

/// The model's parameters and momentum in a `FINAL` line (the rest differs between
/// tch-dist's and torchft's groups).
fn trained(state: &Value) -> Value {
    serde_json::json!({"params": state["params"], "momentum": state["momentum"]})
}

/// The Python reference (torchft_peer.py `reference`): one process, each phase `N:I,J`
/// N steps averaging groups I and J's batches.
fn reference(phases: &[&str]) -> Value {
    let out = Command::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.venv/bin/python"))
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/ft/tests/torchft_peer.py"
        ))
        .arg("reference")
        .args(phases)
        .output()
        .expect("the venv's python (make setup)");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    trained(&final_state(&stdout, &out))
}

/// A tch-dist group (`replica_0`, on torchft's wire) and a torchft Python group
/// (`replica_1`) at a lighthouse of their own, meeting in their first quorum: the tch-dist
/// group runs `rust_steps` steps, the Python one 6 (exiting at `python_exit_at`, or `-`).
/// Returns both, ended.
fn mixed_quorum(deadline: Instant, rust_steps: &str, python_exit_at: &str) -> (Ended, Ended) {
    let lighthouse = LighthouseServer::start(LighthouseOptions {
        bind: "127.0.0.1:0".into(),
        heartbeat_timeout: Duration::from_millis(500),
        // Long: the first quorum waits for both groups (they heartbeat before either asks).
        join_timeout: Duration::from_secs(20),
        ..LighthouseOptions::new(1)
    })
    .expect("a lighthouse");
    let at = lighthouse.address();
    let start = std::env::temp_dir().join(format!(
        "tch-dist-ft-start-{}-{}",
        std::process::id(),
        free_port()
    ));
    let start = start.to_str().expect("a UTF-8 path");
    let rust_args = [
        "--wire",
        "torchft",
        "--init-sin",
        "--no-init-sync",
        "--steps",
        rust_steps,
        "--step-ms",
        "20",
        "--timeout-ms",
        "3000",
        "--start-file",
        start,
    ];
    let rust = Proc::train_ft("replica_0", &at, &rust_args);
    let python = Proc::torchft(&at, "1", &["6", python_exit_at, "20", start]);
    for p in [&rust, &python] {
        assert!(p.printed("manager up", deadline), "a group never started");
    }
    std::fs::write(start, "").expect("the start file");
    let ended = (rust.wait(deadline), python.wait(deadline));
    let _ = std::fs::remove_file(start);
    ended
}

#[test]
fn a_tch_dist_group_trains_in_one_quorum_with_a_torchft_python_group() {
    let deadline = deadline_after_builds(150);
    // No fault: both groups average every step, as one process averaging both batches.
    let (rust, python) = mixed_quorum(deadline, "6", "-");
    for e in [&rust, &python] {
        assert!(e.success(), "{e:#?}");
    }
    let expected = reference(&["6:0,1"]);
    for e in [&rust, &python] {
        let got = trained(&final_state(&e.stdout, e));
        assert!(
            close(&got, &expected),
            "not the one-process run:\n{e:#?}\n{expected}"
        );
    }
    // The Python group dies after its backward at step 3 (its average with the tch-dist
    // group done): the tch-dist group commits that step and goes on alone.
    let (rust, python) = mixed_quorum(deadline, "6", "3");
    assert_eq!(python.status.and_then(|s| s.code()), Some(3), "{python:#?}");
    assert!(rust.success(), "{rust:#?}");
    let got = trained(&final_state(&rust.stdout, &rust));
    let expected = reference(&["4:0,1", "2:0"]);
    assert!(close(&got, &expected), "{rust:#?}\n{expected}");
    // The tch-dist group leaves after step 2 (its run ends): torchft's group goes on alone
    // from step 3. (A peer that dies inside torchft's DDP all-reduce ends the torchft group
    // itself: torchft 0.2.0's comm hook asserts on the failed work's future.)
    let (rust, python) = mixed_quorum(deadline, "3", "-");
    for e in [&rust, &python] {
        assert!(e.success(), "{e:#?}");
    }
    let got = trained(&final_state(&python.stdout, &python));
    let expected = reference(&["3:0,1", "3:1"]);
    assert!(close(&got, &expected), "{python:#?}\n{expected}");
}

#[test]
fn a_tch_dist_group_never_heals_from_a_torchft_python_group_and_names_it() {
    let deadline = deadline_after_builds(90);
    let lighthouse = lighthouse_at("127.0.0.1:0");
    let at = lighthouse.address();
    // torchft's group trains alone (commits are logged), then the tch-dist group joins at
    // step 0: behind, it would heal from the torchft group.
    let python = Proc::torchft(&at, "1", &["100000", "-", "50"]);
    assert!(
        python.printed("should_commit completed should_commit=true", deadline),
        "torchft's group never committed"
    );
    let rust = Proc::train_ft(
        "replica_0",
        &at,
        &[
            "--wire",
            "torchft",
            "--init-sin",
            "--no-init-sync",
            "--timeout-ms",
            "3000",
        ],
    )
    .wait(deadline);
    assert!(!rust.success(), "{rust:#?}");
    assert!(
        rust.stderr.contains("healing from replica_1:")
            && rust.stderr.contains(
                "it is a torchft Python group, whose state travels as pickled Python objects: \
                 healing does not cross languages"
            ),
        "{rust:#?}"
    );
}

#[test]
fn groups_of_two_ranks_lose_a_whole_group_and_end_as_the_run_without_the_loss() {
    let deadline = deadline_after_builds(360);
    // Two groups of two ranks: replicate (or fully_shard) within each group, the
    // fault-tolerant average across them (each group rank with its peers of the other group).
    let run = |extra: &[&str]| {
        let mut cmd = clean(build::launcher());
        cmd.args(["--replica-groups", "2", "--start-lighthouse", "1"])
            .args(["--nproc-per-node", "2", "--max-restarts", "1", "--"])
            .arg(build::example("train_ft"))
            .args(COMMON)
            // Each group from other weights, the ranks of a group alike: with init_sync every
            // rank of every group takes group 0's at step 0.
            .args(["--seed", "1", "--seed-per-group"])
            .args(extra);
        Proc::spawn(cmd).wait(deadline)
    };
    let without = launched_states(&run(&[]));
    let prefixes: Vec<&str> = without.iter().map(|(p, _)| p.as_str()).collect();
    assert_eq!(
        prefixes,
        [
            "[replica0/rank0]",
            "[replica0/rank1]",
            "[replica1/rank0]",
            "[replica1/rank1]"
        ]
    );
    let expected = without[0].1.clone();
    for (prefix, state) in &without {
        assert_eq!(state, &expected, "{prefix} without the loss");
    }
    // Both ranks of group 1 exit at step 4; its launcher restarts the group alone, whose
    // ranks heal, each from its peer rank of group 0.
    let loss = ["--exit-at", "4", "--exit-replica", "1"];
    let ended = run(&loss);
    assert!(
        ended
            .stderr
            .contains("[replica1/rank1]: train_ft: exiting at step 4 (injected)"),
        "{ended:#?}"
    );
    for (prefix, state) in launched_states(&ended) {
        assert_eq!(state, expected, "{prefix} with the loss");
    }
    // A step that fails on one rank of group 1 only (report_error on its rank 1): the
    // failure reaches group 0's rank 1 through its average and group 0's rank 0 through its
    // group's vote; the step commits nowhere, and nothing differs from the run without it.
    let ended = run(&["--fail-at", "3", "--exit-replica", "1", "--fail-rank", "1"]);
    assert!(
        ended
            .stderr
            .contains("[replica1/rank1]: train_ft: failing step 3 (injected)")
            && !ended
                .stderr
                .contains("[replica1/rank0]: train_ft: failing step 3 (injected)"),
        "{ended:#?}"
    );
    for g in ["replica0", "replica1"] {
        for r in ["rank0", "rank1"] {
            let prefix = format!("[{g}/{r}]: train_ft: step 3 not committed");
            assert!(ended.stderr.contains(&prefix), "{prefix}: {ended:#?}");
        }
    }
    for (prefix, state) in launched_states(&ended) {
        assert_eq!(state, expected, "{prefix} with one rank's failure");
    }
    // replicate with gradient_as_bucket_view: its reducer re-points `.grad` at its own
    // bucket every step, away from the fault-tolerant average's buffer; the average follows.
    for (prefix, state) in launched_states(&run(&["--bucket-view"])) {
        assert_eq!(state, expected, "{prefix} with gradient_as_bucket_view");
    }
    // HSDP: fully_shard within each group, each rank averaging its shards with its peer
    // rank of the other group, and healing them from it; the shards joined are the
    // replicated run's values (but for rounding: the reductions differ).
    for extra in [&["--shard"][..], &[&["--shard"][..], &loss].concat()] {
        let sharded = launched_states(&run(extra));
        assert_eq!(sharded.len(), 4, "{extra:?}");
        for group in sharded.chunks(2) {
            let whole = joined_shards(&group[0].1, &group[1].1);
            assert!(
                close(&whole, &expected),
                "{} {extra:?}:\n{whole}\n{expected}",
                group[0].0
            );
        }
    }
}

#[test]
fn two_groups_started_under_one_name_are_refused_on_every_member() {
    let deadline = deadline_after_builds(60);
    let lighthouse = LighthouseServer::start(LighthouseOptions {
        bind: "127.0.0.1:0".into(),
        ..LighthouseOptions::new(2)
    })
    .expect("a lighthouse");
    let at = lighthouse.address();
    let (a, b) = (
        Proc::group("replica_0", &at, &[]),
        Proc::group("replica_0", &at, &[]),
    );
    for e in [a.wait(deadline), b.wait(deadline)] {
        assert_eq!(e.status.and_then(|s| s.code()), Some(1), "{e:#?}");
        assert!(
            e.stderr.contains(
                ", group rank 0: two replica groups of the quorum are named replica_0 (each \
                 needs a name of its own: REPLICA_GROUP_ID)"
            ),
            "{e:#?}"
        );
    }
}

#[test]
fn a_group_rank_that_makes_no_manager_is_named_within_the_quorum_timeout() {
    let deadline = deadline_after_builds(60);
    // A group of two ranks, one of which makes no Manager (it sleeps 30 s): the other fails
    // within the quorum timeout (2 s), naming it, and the launcher ends the group.
    let run = |missing: &str| {
        let mut cmd = clean(build::launcher());
        cmd.args(["--replica-groups", "1", "--start-lighthouse", "1"])
            .args(["--nproc-per-node", "2", "--"])
            .arg(build::example("train_ft"))
            .args(["--quorum-timeout-ms", "2000", "--no-manager-rank", missing]);
        let start = Instant::now();
        let ended = Proc::spawn(cmd).wait(deadline);
        assert!(!ended.success(), "{ended:#?}");
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "{:?}",
            start.elapsed()
        );
        ended
    };
    let ended = run("1");
    assert!(
        ended
            .stderr
            .contains("[replica0/rank0]:   caused by: group ranks [1] of replica_0:")
            && ended.stderr.contains(
                " did not ask for the quorum of step 0 within 2s (every rank of a replica group \
             makes a manager and begins each step with start_quorum)"
            ),
        "{ended:#?}"
    );
    let ended = run("0");
    assert!(
        ended.stderr.contains(
            "[replica0/rank1]: train_ft: replica replica_0, group rank 1: group rank 0 made no \
             manager within 2s (every rank of a replica group makes one)"
        ),
        "{ended:#?}"
    );
}
