//! Fault-tolerant training (`tch_dist::ft`) as torchft tests it: replica groups as separate
//! jobs (`examples/train_ft.rs`, one rank each, each with its own store), a failure injected
//! at a chosen (group, step), the failed group restarted alone. The oracle: every group ends
//! with the same parameters and momentum, equal to a run without the failure (data keyed by
//! step and replica rank; with `min_replica_size` 2 a step commits only with both groups, so
//! the steps committed are the same). The run without the failure uses torchft's own
//! lighthouse (the `torchft` wheel), the run with it tch-dist's. Every process is killed when
//! its test ends.

#[path = "common/build.rs"]
mod build;

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::Value;
use tch_dist::ft::{LighthouseOptions, LighthouseServer};
use tch_dist::testing::free_port;

const STEPS: &str = "12";

/// A replica group's process, its output collected as it runs; killed on drop.
struct Group {
    child: Child,
    stdout: Option<JoinHandle<String>>,
    stderr: Option<JoinHandle<String>>,
}

/// How a group ended.
#[derive(Debug)]
struct Ended {
    status: Option<ExitStatus>,
    stdout: String,
    stderr: String,
}

fn drain(from: impl Read + Send + 'static) -> JoinHandle<String> {
    std::thread::spawn(move || {
        let mut out = String::new();
        let _ = BufReader::new(from).read_to_string(&mut out);
        out
    })
}

impl Group {
    /// `train_ft` as replica group `name` at `lighthouse`, a job of one rank with its own
    /// store, with `extra` options.
    fn start(name: &str, lighthouse: &str, extra: &[&str]) -> Group {
        let mut cmd = Command::new(build::example("train_ft"));
        for var in [
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "LOCAL_WORLD_SIZE",
            "GROUP_RANK",
            "TORCHELASTIC_RUN_ID",
        ] {
            cmd.env_remove(var);
        }
        cmd.env("RANK", "0")
            .env("WORLD_SIZE", "1")
            .env("LOCAL_RANK", "0")
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", free_port().to_string())
            .args([
                "--replica-id",
                name,
                "--lighthouse",
                lighthouse,
                "--steps",
                STEPS,
            ])
            .args(["--step-ms", "20", "--timeout-ms", "3000"])
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd.spawn().expect("starting train_ft");
        let stdout = Some(drain(child.stdout.take().expect("piped")));
        let stderr = Some(drain(child.stderr.take().expect("piped")));
        Group {
            child,
            stdout,
            stderr,
        }
    }

    /// Waits until the group ends, killing it at `deadline`.
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
        Ended {
            status,
            stdout: self
                .stdout
                .take()
                .and_then(|h| h.join().ok())
                .unwrap_or_default(),
            stderr: self
                .stderr
                .take()
                .and_then(|h| h.join().ok())
                .unwrap_or_default(),
        }
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The group's final state (its `FINAL` line without its id), or a failure naming its output.
fn final_state(e: &Ended) -> Value {
    let line = e
        .stdout
        .lines()
        .find_map(|l| l.strip_prefix("FINAL "))
        .unwrap_or_else(|| panic!("no FINAL line: {e:#?}"));
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

#[test]
fn a_killed_replica_group_rejoins_by_healing_and_ends_as_a_run_without_the_failure() {
    let deadline = Instant::now() + Duration::from_secs(120);
    let both = ["--min-replica-size", "2"];
    let seeded = |seed: &'static str| [both[0], both[1], "--seed", seed];

    // Without the failure, at torchft's lighthouse: group 1 starts from other weights than
    // group 0's and takes them at step 0 (init_sync).
    let reference = {
        let torchft = TorchftLighthouse::start(2);
        let g0 = Group::start("replica_0", &torchft.address, &seeded("1"));
        let g1 = Group::start("replica_1", &torchft.address, &seeded("2"));
        [g0.wait(deadline), g1.wait(deadline)]
    };
    for e in &reference {
        assert!(e.status.is_some_and(|s| s.success()), "{e:#?}");
    }
    let expected = final_state(&reference[0]);
    assert_eq!(final_state(&reference[1]), expected);
    assert_eq!(expected["step"], 12);
    assert_eq!(
        expected["batches_committed"], 24,
        "two participants in every committed step"
    );

    // With it, at tch-dist's lighthouse: group 1 exits at step 4, before its gradients are
    // averaged; group 0's step fails and does not commit, and it waits alone (min 2) until
    // group 1, restarted from yet other weights, heals from it and the two go on.
    let lighthouse = LighthouseServer::start(LighthouseOptions {
        bind: "127.0.0.1:0".into(),
        heartbeat_timeout: Duration::from_millis(500),
        join_timeout: Duration::from_millis(200),
        ..LighthouseOptions::new(1)
    })
    .expect("a lighthouse");
    let address = lighthouse.address();
    let g0 = Group::start("replica_0", &address, &seeded("1"));
    let mut exiting = seeded("2").to_vec();
    exiting.extend(["--exit-at", "4"]);
    let failed = Group::start("replica_1", &address, &exiting).wait(deadline);
    assert_eq!(failed.status.and_then(|s| s.code()), Some(3), "{failed:#?}");
    let restarted = Group::start("replica_1", &address, &seeded("3"));
    let (g0, g1) = (g0.wait(deadline), restarted.wait(deadline));
    for e in [&g0, &g1] {
        assert!(e.status.is_some_and(|s| s.success()), "{e:#?}");
    }
    assert!(
        g0.stderr
            .contains("step 4 not committed: averaging the gradients: rank 0: all_reduce failed"),
        "{g0:#?}"
    );
    assert_eq!(
        final_state(&g0),
        expected,
        "group 0 against the run without the failure"
    );
    assert_eq!(final_state(&g1), expected, "the restarted group against it");

    // The same failure under tch-dist-run --replica-groups 2 --start-lighthouse 1: the
    // launcher restarts group 1 alone (the injected exit is at its first start only).
    build::lighthouse();
    let mut cmd = Command::new(build::launcher());
    for var in [
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_RUN_ID",
    ] {
        cmd.env_remove(var);
    }
    cmd.args([
        "--replica-groups",
        "2",
        "--start-lighthouse",
        "1",
        "--nproc-per-node",
        "1",
    ])
    .args(["--max-restarts", "1", "--"])
    .arg(build::example("train_ft"))
    .args([
        "--steps",
        STEPS,
        "--step-ms",
        "20",
        "--timeout-ms",
        "3000",
        "--seed",
        "1",
    ])
    .args([
        "--min-replica-size",
        "2",
        "--exit-at",
        "4",
        "--exit-replica",
        "1",
    ])
    .stdin(Stdio::null())
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    let mut child = cmd.spawn().expect("tch-dist-run");
    let stdout = child.stdout.take().map(drain);
    let stderr = child.stderr.take().map(drain);
    let ended = Group {
        child,
        stdout,
        stderr,
    }
    .wait(deadline);
    assert!(ended.status.is_some_and(|s| s.success()), "{ended:#?}");
    assert!(
        ended
            .stdout
            .contains("[replica1/rank0]: train_ft: exiting at step 4 (injected)")
            || ended
                .stderr
                .contains("[replica1/rank0]: train_ft: exiting at step 4 (injected)"),
        "{ended:#?}"
    );
    assert!(
        ended
            .stderr
            .contains("starting the ranks again (restart 1 of 1)"),
        "{ended:#?}"
    );
    for g in ["replica0", "replica1"] {
        let prefix = format!("[{g}/rank0]: ");
        let only = Ended {
            status: ended.status,
            stdout: ended
                .stdout
                .lines()
                .filter_map(|l| l.strip_prefix(prefix.as_str()))
                .collect::<Vec<_>>()
                .join("\n"),
            stderr: String::new(),
        };
        assert_eq!(
            final_state(&only),
            expected,
            "{g} under the launcher: {ended:#?}"
        );
    }
}

#[test]
fn a_replica_group_with_another_model_is_named_on_every_member() {
    let deadline = Instant::now() + Duration::from_secs(60);
    let lighthouse = LighthouseServer::start(LighthouseOptions {
        bind: "127.0.0.1:0".into(),
        ..LighthouseOptions::new(2)
    })
    .expect("a lighthouse");
    let address = lighthouse.address();
    let g0 = Group::start("replica_0", &address, &["--hidden", "16"]);
    let g1 = Group::start("replica_1", &address, &["--hidden", "8"]);
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
