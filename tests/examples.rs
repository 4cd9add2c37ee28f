//! The examples end cleanly: a dead peer ends a training example with one line and exit
//! status 1, not a panic; `train_ddp --resume` refuses a checkpoint that does not fit the
//! model, naming every key that differs, before training; `train_fsdp` trains to a sensible
//! accuracy at 2 ranks in bounded time; `train_lm` (FSDP x TP at 4 ranks) learns, writes its
//! metrics and a checkpoint PyTorch loads, and refuses a mesh that is not the world.
//!
//! The examples are run as the programs users run (built here with `cargo build
//! --example`, a no-op when they are up to date), their ranks started directly with
//! torchrun's variables, so that no launcher stops rank 0 before it reports.

use std::io::{BufRead, BufReader};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use tch::{Kind, Tensor};
use tch_dist::testing::free_port;

#[path = "common/python.rs"]
mod python;

/// The example binaries, built once per test binary in its own profile.
fn example(name: &str) -> PathBuf {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    let dir = BUILT.get_or_init(|| {
        // target/<profile>/deps/examples-HASH -> target/<profile>
        let exe = std::env::current_exe().unwrap();
        let profile_dir = exe.parent().unwrap().parent().unwrap().to_path_buf();
        let mut cmd = Command::new(env!("CARGO"));
        cmd.args(["build", "--quiet", "--manifest-path"])
            .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml"))
            .args(["--example", "train_ddp", "--example", "tensor_parallel"])
            .args(["--example", "train_fsdp", "--example", "train_lm"])
            .args(["--example", "weight_sync_worker"]);
        if profile_dir.ends_with("release") {
            cmd.arg("--release");
        }
        let status = cmd.status().expect("running cargo build --example");
        assert!(status.success(), "cargo build --example failed");
        profile_dir.join("examples")
    });
    dir.join(name)
}

/// A fresh directory for one test's files.
fn temp_dir(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tch-dist-{test}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Rank `rank` of `world` of an example, with its output piped.
fn start_rank(exe: &Path, rank: usize, world: usize, port: u16, args: &[&str]) -> Child {
    Command::new(exe)
        .args(args)
        .env("RANK", rank.to_string())
        .env("LOCAL_RANK", rank.to_string())
        .env("WORLD_SIZE", world.to_string())
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .env("TCH_DIST_TIMEOUT_SECS", "20")
        .env_remove("TORCHELASTIC_RUN_ID")
        .env_remove("TCH_DIST_DEBUG")
        .env_remove("TORCH_DISTRIBUTED_DEBUG")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting an example")
}

/// `train_lm` with `extra` in one process for 9 steps of `batch` sequences, its metrics
/// written to `metrics`; returns its stdout once it succeeded.
fn train_lm_in_one_process(extra: &[&str], batch: &str, metrics: &Path) -> String {
    let mut args = extra.to_vec();
    let metrics = metrics.to_str().unwrap();
    args.extend([
        "--dp",
        "1",
        "--tp",
        "1",
        "--max-steps",
        "9",
        "--local-batch-size",
        batch,
        "--metrics",
        metrics,
    ]);
    let (status, out, err) = finish(
        start_rank(&example("train_lm"), 0, 1, free_port(), &args),
        Duration::from_secs(240),
    );
    assert!(status.success(), "{out}\n{err}");
    out
}

/// Waits (bounded) for `child`, killing it at the deadline; returns (status, stdout, stderr).
fn finish(mut child: Child, limit: Duration) -> (std::process::ExitStatus, String, String) {
    let deadline = Instant::now() + limit;
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!(
                "still running after {limit:?}:\n{}\n{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    (
        out.status,
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Starts 2 ranks of `name`, waits until rank 0 prints a line containing `started`, lets
/// it train `train_for`, SIGKILLs rank 1 and returns rank 0's end and how long after the
/// kill it came.
fn kill_rank_1(
    name: &str,
    args: &[&str],
    started: &str,
    train_for: Duration,
) -> (std::process::ExitStatus, String, Duration) {
    let exe = example(name);
    let port = free_port();
    let mut rank0 = start_rank(&exe, 0, 2, port, args);
    let mut rank1 = start_rank(&exe, 1, 2, port, args);
    // Rank 0's stdout, line by line, until the marker.
    let stdout = rank0.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let line = rx
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            .unwrap_or_else(|_| {
                let _ = rank0.kill();
                let _ = rank1.kill();
                panic!("rank 0 of {name} did not print {started:?}");
            });
        if line.contains(started) {
            break;
        }
    }
    std::thread::sleep(train_for);
    rank1.kill().unwrap();
    let killed = Instant::now();
    let status1 = rank1.wait().unwrap();
    assert_eq!(status1.signal(), Some(libc::SIGKILL));
    let (status, _, stderr) = finish(rank0, Duration::from_secs(60));
    (status, stderr, killed.elapsed())
}

#[test]
fn a_dead_peer_ends_train_ddp_with_one_line() {
    let dir = temp_dir("dead-peer-ddp");
    let ck = dir.join("ck.safetensors");
    let (status, stderr, _) = kill_rank_1(
        "train_ddp",
        &["--epochs", "100000", "--checkpoint", ck.to_str().unwrap()],
        "training on 2 ranks",
        Duration::from_secs(1),
    );
    assert_eq!(status.code(), Some(1), "{status:?}\n{stderr}");
    // Rank 0 notices where it waits: a bucket's all-reduce, or the backward pass's step
    // check (its header exchange: an all-to-all in the first two steps, then shared memory,
    // where the peer's pid is gone and the check's op is named).
    assert!(
        [
            "error: rank 0: all_reduce failed: rank 1 closed the connection\n",
            "error: rank 0: all_to_all failed: rank 1 closed the connection\n",
            "error: rank 0: replicate failed: rank 1 closed the connection\n",
        ]
        .contains(&stderr.as_str()),
        "{stderr}"
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_dead_peer_ends_tensor_parallel_with_one_line() {
    let (status, stderr, _) = kill_rank_1(
        "tensor_parallel",
        &["--epochs", "100000"],
        "parameters (blocks.0.fc1.weight",
        Duration::from_secs(1),
    );
    assert_eq!(status.code(), Some(1), "{status:?}\n{stderr}");
    // Where rank 0 was decides the failing collective (a sharded layer's forward hook, or
    // its backward); either way one line, no panic.
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(stderr.starts_with("error: "), "{stderr}");
    // Gloo words a lost peer as a reset or as a close, depending on whether rank 0 was
    // reading or writing when the kernel noticed (both seen here).
    assert!(
        [
            "Connection reset by peer",
            "Connection closed by peer",
            "closed the connection"
        ]
        .iter()
        .any(|m| stderr.contains(m)),
        "{stderr}"
    );
}

#[test]
fn a_dead_peer_ends_train_fsdp_with_one_line() {
    let (status, stderr, ended_after) = kill_rank_1(
        "train_fsdp",
        &["--epochs", "100000"],
        "training on 2 ranks",
        Duration::from_secs(1),
    );
    assert_eq!(status.code(), Some(1), "{status:?}\n{stderr}");
    // Where rank 0 was decides the failing collective (a group's all-gather in forward or
    // backward, or its gradients' reduce-scatter); either way one line, no panic.
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(stderr.starts_with("error: "), "{stderr}");
    assert!(stderr.contains("rank 0: "), "{stderr}");
    // Noticed when the connection closes, not after the group's timeout (20 s here), and
    // said so (a reduce-scatter's failure once read as a timeout).
    assert!(
        stderr.contains("closed the connection") || stderr.contains("Connection reset by peer"),
        "{stderr}"
    );
    assert!(!stderr.contains("timed out"), "{stderr}");
    // fully_shard's typed error, naming the module by its FQN (the root's hook, or a
    // block's), in forward or backward alike.
    assert!(stderr.contains("fully_shard: the hook of "), "{stderr}");
    assert!(
        ended_after < Duration::from_secs(15),
        "rank 0 ended {ended_after:?} after rank 1 died:\n{stderr}"
    );
}

/// `train_fsdp` at 2 ranks with `args`, to its end: rank 0's output (every rank must succeed).
fn train_fsdp_at_2(args: &[&str]) -> String {
    let exe = example("train_fsdp");
    let port = free_port();
    let ranks: Vec<Child> = (0..2).map(|r| start_rank(&exe, r, 2, port, args)).collect();
    let ends: Vec<_> = ranks
        .into_iter()
        .map(|c| finish(c, Duration::from_secs(180)))
        .collect();
    for (r, (status, out, err)) in ends.iter().enumerate() {
        assert!(status.success(), "rank {r}:\n{out}\n{err}");
    }
    ends[0].1.clone()
}

/// The `test_accuracy=` figure of a run's output.
fn test_accuracy(out: &str) -> f64 {
    out.lines()
        .find_map(|l| l.strip_prefix("test_accuracy="))
        .unwrap_or_else(|| panic!("no test_accuracy= line:\n{out}"))
        .trim()
        .parse()
        .unwrap()
}

#[test]
fn train_fsdp_reaches_090_test_accuracy_at_2_ranks() {
    let out = train_fsdp_at_2(&[]);
    let acc = test_accuracy(&out);
    assert!(acc > 0.9, "test_accuracy={acc}:\n{out}");
    assert!(
        out.contains("3 fully_shard groups"),
        "per-block groups and the root:\n{out}"
    );
}

/// `--pp 2`: the model as two pipeline stages (Schedule1F1B), one rank each, trains as well;
/// its checkpoint (each stage its part, under the whole model's names) verifies.
#[test]
fn train_fsdp_as_a_2_stage_pipeline_reaches_090_test_accuracy() {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("train_fsdp_pp");
    let _ = std::fs::remove_dir_all(&dir);
    let ckpt = dir.to_str().unwrap();
    let out = train_fsdp_at_2(&[
        "--pp",
        "2",
        "--checkpoint-dir",
        ckpt,
        "--checkpoint-every",
        "330",
    ]);
    let acc = test_accuracy(&out);
    assert!(acc > 0.9, "test_accuracy={acc}:\n{out}");
    assert!(
        out.contains("pipeline: 2 stages x 1 data-parallel ranks, Schedule1F1B"),
        "{out}"
    );
    let manifest = std::fs::read_to_string(dir.join("step-00000330/manifest.json")).unwrap();
    for fqn in [
        "\"patch.weight\"",
        "\"blocks.0.",
        "\"blocks.1.",
        "\"head.weight\"",
    ] {
        assert!(
            manifest.contains(fqn),
            "{fqn} in the pipeline's checkpoint:\n{manifest}"
        );
    }
}

/// `--activation-checkpointing`: each block's forward keeps only its input, so what a forward
/// leaves for backward drops (the model trains either way).
#[test]
fn train_fsdp_with_activation_checkpointing_keeps_less_for_backward() {
    let kept = |extra: &[&str]| -> f64 {
        let mut args = vec!["--epochs", "1", "--batch-size", "256"];
        args.extend_from_slice(extra);
        let out = &train_fsdp_at_2(&args);
        assert!(out.contains("test_accuracy="), "{out}");
        out.lines()
            .find_map(|l| l.split("forward kept at most ").nth(1))
            .and_then(|rest| rest.split(' ').next()?.parse().ok())
            .unwrap_or_else(|| panic!("no memory line:\n{out}"))
    };
    let (without, with) = (kept(&[]), kept(&["--activation-checkpointing"]));
    assert!(
        with < 0.6 * without,
        "kept {with} MB with checkpointing, {without} MB without"
    );
}

/// The model's variables: fc1 64->128, fc2 128->10.
fn net_tensors(kind: Kind) -> Vec<(String, Tensor)> {
    [
        ("fc1.weight", vec![128, 64]),
        ("fc1.bias", vec![128]),
        ("fc2.weight", vec![10, 128]),
        ("fc2.bias", vec![10]),
    ]
    .into_iter()
    .map(|(k, shape)| {
        (
            k.to_string(),
            Tensor::zeros(shape, (kind, tch::Device::Cpu)),
        )
    })
    .collect()
}

fn write(path: &Path, tensors: &[(String, Tensor)]) {
    let named: Vec<(&str, &Tensor)> = tensors.iter().map(|(k, t)| (k.as_str(), t)).collect();
    Tensor::write_safetensors(&named, path).unwrap();
}

/// `train_ddp` at world size 1 with `args`: (exit status, stdout, stderr).
fn train_ddp_alone(args: &[&str]) -> (std::process::ExitStatus, String, String) {
    let child = start_rank(&example("train_ddp"), 0, 1, free_port(), args);
    finish(child, Duration::from_secs(120))
}

#[test]
fn resume_checks_dtype_shape_and_keys_first() {
    let dir = temp_dir("resume");
    let resume = |path: &Path| {
        train_ddp_alone(&[
            "--resume",
            "--epochs",
            "1",
            "--checkpoint",
            path.to_str().unwrap(),
        ])
    };

    // float64 where the model is float32: every key is named.
    let doubles = dir.join("doubles.safetensors");
    write(&doubles, &net_tensors(Kind::Double));
    let (status, stdout, stderr) = resume(&doubles);
    assert_eq!(status.code(), Some(1), "{stdout}\n{stderr}");
    assert_eq!(
        stderr,
        format!(
            "error: --resume: {} does not fit the model: `fc1.bias` has dtype Double in the \
             checkpoint but Float in the model; `fc1.weight` has dtype Double in the checkpoint \
             but Float in the model; `fc2.bias` has dtype Double in the checkpoint but Float in \
             the model; `fc2.weight` has dtype Double in the checkpoint but Float in the model\n",
            doubles.display()
        )
    );
    assert!(
        !stdout.contains("training on"),
        "refused before training: {stdout}"
    );

    // A wrong shape, a missing key and an extra one.
    let mut tensors = net_tensors(Kind::Float);
    tensors.retain(|(k, _)| k != "fc2.weight");
    tensors[2].1 = Tensor::zeros([7], (Kind::Float, tch::Device::Cpu)); // fc2.bias
    tensors.push((
        "fc3.weight".into(),
        Tensor::zeros([1], (Kind::Float, tch::Device::Cpu)),
    ));
    let mixed = dir.join("mixed.safetensors");
    write(&mixed, &tensors);
    let (status, stdout, stderr) = resume(&mixed);
    assert_eq!(status.code(), Some(1), "{stdout}\n{stderr}");
    assert_eq!(
        stderr,
        format!(
            "error: --resume: {} does not fit the model: `fc2.bias` has shape [7] in the \
             checkpoint but [10] in the model; `fc2.weight` is missing from the checkpoint; \
             `fc3.weight` is in the checkpoint but not in the model\n",
            mixed.display()
        )
    );

    // A checkpoint the example wrote itself resumes.
    let own = dir.join("own.safetensors");
    let (status, stdout, stderr) =
        train_ddp_alone(&["--epochs", "1", "--checkpoint", own.to_str().unwrap()]);
    assert!(status.success(), "{stdout}\n{stderr}");
    let (status, stdout, stderr) = resume(&own);
    assert!(status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("test_accuracy="), "{stdout}");
    let _ = std::fs::remove_dir_all(dir);
}

/// `--verify DIR` checks every byte of a checkpoint the example wrote, in one process: a
/// complete one is `verified`, one with a changed byte in a tensor no load at this world
/// size would read is still found, naming the file.
#[test]
fn verify_flag_checks_every_byte_of_a_checkpoint() {
    let dir = temp_dir("verify");
    let ckpt = dir.join("ckpt");
    let (status, stdout, stderr) = train_ddp_alone(&[
        "--max-steps",
        "2",
        "--checkpoint-every",
        "2",
        "--checkpoint-dir",
        ckpt.to_str().unwrap(),
        "--checkpoint",
        dir.join("final.safetensors").to_str().unwrap(),
    ]);
    assert!(status.success(), "{stdout}\n{stderr}");
    let step = ckpt.join("step-00000002");
    let verify = || train_ddp_alone(&["--verify", step.to_str().unwrap()]);
    let (status, stdout, stderr) = verify();
    assert!(status.success(), "{stdout}\n{stderr}");
    assert_eq!(
        stdout,
        format!(
            "verified {}: every file matches its manifest\n",
            step.display()
        )
    );

    // The last byte of the rank's tensor file: the end of its last tensor's data.
    let file = step.join(tch_dist::checkpoint::file_name(0));
    let mut bytes = std::fs::read(&file).expect("the rank's file");
    *bytes.last_mut().unwrap() ^= 0x40;
    std::fs::write(&file, bytes).unwrap();
    let (status, stdout, stderr) = verify();
    assert_eq!(status.code(), Some(1), "{stdout}\n{stderr}");
    assert!(
        stderr.starts_with("error: ") && stderr.contains(&file.display().to_string()),
        "names the damaged file: {stderr}"
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// examples/weight_sync end to end: the PyTorch trainer (rank 0, the `.venv`'s torch) and two
/// tch-dist workers; the trainer checks every step's actions against its own.
#[test]
fn weight_sync_pytorch_trainer_and_rust_workers() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let python = root.join(".venv/bin/python");
    assert!(python.exists(), "no .venv: run `make setup`");
    let trainer = root.join("examples/weight_sync/trainer.py");
    let worker = example("weight_sync_worker");
    let port = free_port();
    let t = trainer.to_string_lossy().into_owned();
    let rank0 = start_rank(&python, 0, 3, port, &[t.as_str()]);
    let workers: Vec<Child> = (1..3)
        .map(|r| start_rank(&worker, r, 3, port, &[]))
        .collect();
    let (status, stdout, stderr) = finish(rank0, Duration::from_secs(120));
    let ends: Vec<_> = workers
        .into_iter()
        .map(|w| finish(w, Duration::from_secs(30)))
        .collect();
    // The trainer's own verdict decides, not its exit status: it prints the line once every
    // step's check passed, and an abort in the interpreter's Gloo teardown after that (seen
    // once in another test's PyTorch rank) says nothing about the result.
    assert!(
        stdout.contains("weights in sync on 2 workers after 5 steps"),
        "trainer ({status}):\n{stdout}\n{stderr}\nworkers: {ends:?}"
    );
    for (r, (status, out, err)) in ends.iter().enumerate() {
        assert!(status.success(), "worker {}:\n{out}\n{err}", r + 1);
        assert!(out.contains("sent actions back"), "{out}");
    }
}

/// Runs 2 ranks of `name` with `TCH_DIST_TRACE` and returns each rank's trace events; the
/// traces go to a folder of the calling `test`'s own (tests run at once, several with the
/// same example).
fn traced_run(test: &str, name: &str, args: &[&str]) -> Vec<Vec<serde_json::Value>> {
    let dir = temp_dir(test);
    let traces = dir.join("traces");
    let exe = example(name);
    let port = free_port();
    let ranks: Vec<Child> = (0..2)
        .map(|r| {
            let mut cmd = Command::new(&exe);
            cmd.args(args)
                .env("RANK", r.to_string())
                .env("LOCAL_RANK", r.to_string())
                .env("WORLD_SIZE", "2")
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env("TCH_DIST_TIMEOUT_SECS", "60")
                .env("TCH_DIST_TRACE", &traces)
                .env_remove("TORCHELASTIC_RUN_ID")
                .env_remove("TCH_DIST_DEBUG")
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            cmd.spawn().expect("starting an example")
        })
        .collect();
    for (r, child) in ranks.into_iter().enumerate() {
        let (status, out, err) = finish(child, Duration::from_secs(180));
        assert!(status.success(), "{name} rank {r}:\n{out}\n{err}");
    }
    let events = (0..2)
        .map(|r| {
            let path = traces.join(format!("trace-rank{r}.json"));
            let text = std::fs::read_to_string(&path)
                .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            let v: serde_json::Value = serde_json::from_str(&text)
                .unwrap_or_else(|e| panic!("{} is not JSON: {e}", path.display()));
            v.as_array().expect("a JSON array of events").clone()
        })
        .collect();
    let _ = std::fs::remove_dir_all(dir);
    events
}

/// A traced event's name, phase, start and end (µs; an async event's end is its `e`).
#[derive(Debug, Clone)]
struct TraceSpan {
    name: String,
    start: f64,
    end: f64,
}

/// The complete events (`X`) and the async pairs (`b`/`e`, by id) of one rank's trace.
fn spans(events: &[serde_json::Value]) -> (Vec<TraceSpan>, Vec<TraceSpan>) {
    let field = |e: &serde_json::Value, k: &str| e.get(k).and_then(|v| v.as_f64());
    let name = |e: &serde_json::Value| e["name"].as_str().unwrap_or("").to_string();
    let mut complete = Vec::new();
    let mut begun = std::collections::HashMap::new();
    let mut collectives = Vec::new();
    for e in events {
        let (Some(ts), Some(ph)) = (field(e, "ts"), e["ph"].as_str()) else {
            continue; // metadata
        };
        match ph {
            "X" => complete.push(TraceSpan {
                name: name(e),
                start: ts,
                end: ts + field(e, "dur").expect("an X event has a duration"),
            }),
            "b" => {
                begun.insert(e["id"].as_u64().expect("an id"), (name(e), ts));
            }
            "e" => {
                let (n, start) = begun
                    .remove(&e["id"].as_u64().unwrap())
                    .expect("b before e");
                collectives.push(TraceSpan {
                    name: n,
                    start,
                    end: ts,
                });
            }
            other => panic!("unexpected phase {other}"),
        }
    }
    assert!(begun.is_empty(), "collectives never ended: {begun:?}");
    (complete, collectives)
}

#[test]
fn trace_of_train_ddp_shows_all_reduces_overlapping_backward() {
    let dir = temp_dir("trace-ddp-ck");
    let ck = dir.join("ck.safetensors");
    let args = ["--epochs", "1", "--checkpoint", ck.to_str().unwrap()];
    for (rank, events) in traced_run("trace-ddp", "train_ddp", &args)
        .iter()
        .enumerate()
    {
        let (complete, collectives) = spans(events);
        let backward: Vec<&TraceSpan> = complete
            .iter()
            .filter(|s| s.name == "backward (replicate)")
            .collect();
        assert!(
            backward.len() > 10,
            "rank {rank}: {} backward passes",
            backward.len()
        );
        let all_reduces: Vec<&TraceSpan> = collectives
            .iter()
            .filter(|c| c.name == "all_reduce")
            .collect();
        // Overlap: every pass launched a bucket's all-reduce while backward still ran.
        for b in &backward {
            assert!(
                all_reduces
                    .iter()
                    .any(|a| a.start >= b.start && a.start < b.end),
                "rank {rank}: no all_reduce launched inside the backward pass at {}",
                b.start
            );
        }
        assert!(complete.iter().any(|s| s.name.starts_with("forward ")));
        assert!(
            complete.iter().any(|s| s.name == "SGD"),
            "rank {rank}: no optimizer step"
        );
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn trace_of_train_fsdp_shows_each_gather_before_its_forward() {
    for (rank, events) in traced_run("trace-fsdp", "train_fsdp", &["--epochs", "1"])
        .iter()
        .enumerate()
    {
        let (complete, collectives) = spans(events);
        let gathers: Vec<&TraceSpan> = collectives
            .iter()
            .filter(|c| c.name == "all_gather_into_tensor")
            .collect();
        let blocks: Vec<&TraceSpan> = complete
            .iter()
            .filter(|s| s.name == "forward Block")
            .collect();
        assert!(
            blocks.len() > 10,
            "rank {rank}: {} block forwards",
            blocks.len()
        );
        // Each block's forward runs on gathered parameters: a gather launched and waited
        // for before it began, since the block's previous forward.
        let mut previous = f64::MIN;
        for b in &blocks {
            assert!(
                gathers
                    .iter()
                    .any(|g| g.start > previous && g.start < b.start && g.end <= b.start),
                "rank {rank}: no all_gather finished before the block forward at {}",
                b.start
            );
            previous = previous.max(b.start);
        }
        assert!(
            collectives
                .iter()
                .any(|c| c.name == "reduce_scatter_tensor"),
            "rank {rank}: no reduce-scatter"
        );
    }
}

/// `--pp 2`: each rank's trace names its pipeline actions as PyTorch does (`0F3`: stage 0's
/// forward of microbatch 3), in Schedule1F1B's order, and a receive's wait inside the action
/// that needed it: stage 1 waits for each activation inside its forward, stage 0 for each
/// gradient inside its backward.
#[test]
fn trace_of_a_pipelined_train_fsdp_names_each_action_in_1f1b_order() {
    let traces = traced_run("trace-pp", "train_fsdp", &["--epochs", "1", "--pp", "2"]);
    for (stage, events) in traces.iter().enumerate() {
        let (complete, _) = spans(events);
        let actions: Vec<&TraceSpan> = complete
            .iter()
            .filter(|s| {
                let b = s.name.as_bytes();
                b.len() == 3 && b[0] == b'0' + stage as u8 && matches!(b[1], b'F' | b'B')
            })
            .collect();
        assert!(
            actions.len() > 40,
            "stage {stage}: {} actions",
            actions.len()
        );
        // The first step: 1F1B's order for 2 stages and 4 microbatches (order.rs).
        let first: Vec<&str> = actions.iter().take(8).map(|s| s.name.as_str()).collect();
        let expected = if stage == 0 {
            ["0F0", "0F1", "0B0", "0F2", "0B1", "0F3", "0B2", "0B3"]
        } else {
            ["1F0", "1B0", "1F1", "1B1", "1F2", "1B2", "1F3", "1B3"]
        };
        assert_eq!(first, expected, "stage {stage}'s first step");
        let (wait, inside) = if stage == 0 {
            ("wait gradient 0 from stage 1", "0B0")
        } else {
            ("wait activation 0 from stage 0", "1F0")
        };
        let w = complete
            .iter()
            .find(|s| s.name == wait)
            .unwrap_or_else(|| panic!("stage {stage}: no {wait:?} span"));
        let a = actions.iter().find(|s| s.name == inside).unwrap();
        assert!(
            a.start <= w.start && w.end <= a.end,
            "stage {stage}: {wait:?} ({:.0}..{:.0} µs) outside {inside} ({:.0}..{:.0})",
            w.start,
            w.end,
            a.start,
            a.end
        );
    }
}

/// `train_lm` at 4 ranks with `args`, every rank to its end: (exit status, stdout, stderr)
/// per rank.
fn train_lm_at_4(args: &[&str]) -> Vec<(std::process::ExitStatus, String, String)> {
    let exe = example("train_lm");
    let port = free_port();
    let ranks: Vec<Child> = (0..4).map(|r| start_rank(&exe, r, 4, port, args)).collect();
    ranks
        .into_iter()
        .map(|c| finish(c, Duration::from_secs(240)))
        .collect()
}

/// The `NAME=value` figure of a run's output.
fn figure(out: &str, name: &str) -> f64 {
    out.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix('='))
        .unwrap_or_else(|| panic!("no {name}= line:\n{out}"))
        .trim()
        .parse()
        .unwrap_or_else(|e| panic!("{name}=: {e}\n{out}"))
}

/// The Llama-style model as dp 2 x tp 2 (vocab-parallel embedding, Megatron attention and
/// SwiGLU, fully_shard per layer over dp) for one epoch (19 steps): the test loss falls
/// well below the uniform guess (ln 93 = 4.53; about 2.8 here), rank 0's metrics file has
/// one JSON object per step with every field, and PyTorch's `dcp.load` reads the 2-D
/// checkpoint into a plain PyTorch Llama whose test loss is the example's (1e-3): the
/// weights and the model agree.
#[test]
fn train_lm_at_dp2_tp2_learns_and_pytorch_loads_its_checkpoint() {
    let dir = temp_dir("train-lm");
    let metrics = dir.join("metrics.jsonl");
    let ckpt = dir.join("ckpt");
    let ends = train_lm_at_4(&[
        "--epochs",
        "1",
        "--metrics",
        metrics.to_str().unwrap(),
        "--checkpoint-dir",
        ckpt.to_str().unwrap(),
    ]);
    for (r, (status, out, err)) in ends.iter().enumerate() {
        assert!(status.success(), "rank {r}:\n{out}\n{err}");
    }
    let out = &ends[0].1;
    assert!(
        out.contains("dp 2 x tp 2 (4 ranks)") && out.contains("19 steps per epoch, 19 in all"),
        "{out}"
    );
    assert!(out.contains("epoch 1 loss="), "{out}");
    for r in 0..4 {
        assert!(
            out.contains(&format!("  rank {r} (dp {}, tp {}): loss=", r / 2, r % 2)),
            "rank {r}'s figures:\n{out}"
        );
    }
    let test_loss = figure(out, "test_loss");
    let uniform = 93f64.ln();
    assert!(
        test_loss < 3.5,
        "test_loss={test_loss} (uniform guess {uniform:.4}):\n{out}"
    );

    let text = std::fs::read_to_string(&metrics).expect("rank 0's metrics file");
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l:?}: {e}")))
        .collect();
    assert_eq!(lines.len(), 19, "{text}");
    for (i, m) in lines.iter().enumerate() {
        assert_eq!(m["step"].as_u64(), Some(i as u64 + 1), "{m}");
        assert_eq!(m["epoch"].as_u64(), Some(1), "{m}");
        for field in ["loss", "tokens_per_s", "peak_mem_mib"] {
            let v = m[field]
                .as_f64()
                .unwrap_or_else(|| panic!("{field} in {m}"));
            assert!(v.is_finite() && v > 0.0, "{field} in {m}");
        }
    }
    // The first step starts near the uniform guess (a freshly initialized model).
    let first = lines[0]["loss"].as_f64().unwrap();
    assert!(
        (first - uniform).abs() < 1.0,
        "the first step's loss {first}"
    );

    let saved = out
        .lines()
        .find_map(|l| l.strip_prefix("saved checkpoint "))
        .unwrap_or_else(|| panic!("no checkpoint line:\n{out}"));
    assert_eq!(Path::new(saved), ckpt.join("step-00000019"));
    // Each rank holds 2-D pieces no other rank holds: all four write.
    for r in 0..4 {
        assert!(
            Path::new(saved)
                .join(tch_dist::checkpoint::file_name(r))
                .exists(),
            "rank {r}'s file"
        );
    }
    pytorch_agrees(Path::new(saved), test_loss, None);
    let _ = std::fs::remove_dir_all(dir);
}

/// PyTorch's `dcp.load` of train_lm's checkpoint `saved` into a plain PyTorch Llama
/// (tests/examples/pytorch_load_lm.py, one process), whose test loss must be `test_loss`
/// (1e-3); with `hf`, train_lm's `--hf-checkpoint` file loaded into a model of HF's names
/// too, whose test loss must be the same (1e-4).
fn pytorch_agrees(saved: &Path, test_loss: f64, hf: Option<&Path>) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut cmd = python::clean(python::python().join("python"));
    cmd.arg(root.join("tests/examples/pytorch_load_lm.py"))
        .arg(saved)
        .arg(root.join("data/lm_text.txt"))
        .arg(test_loss.to_string())
        .env("OMP_NUM_THREADS", "1");
    if let Some(hf) = hf {
        cmd.arg("--hf").arg(hf);
    }
    let py = python::bounded(cmd);
    let stdout = String::from_utf8_lossy(&py.stdout);
    assert!(
        stdout.lines().last() == Some("ok"),
        "PyTorch's load and test loss ({}):\n{stdout}\n{}",
        py.status,
        String::from_utf8_lossy(&py.stderr)
    );
}

/// `--dp 3 --tp 2` at 4 ranks: every rank refuses with one line naming the mismatch and exit
/// status 2, before any collective could leave a rank waiting; a flag that does not parse
/// is refused the same way, before the process group.
#[test]
fn train_lm_refuses_a_mesh_that_is_not_the_world() {
    for (r, (status, out, err)) in train_lm_at_4(&["--dp", "3", "--tp", "2"])
        .iter()
        .enumerate()
    {
        assert_eq!(status.code(), Some(2), "rank {r}:\n{out}\n{err}");
        assert_eq!(
            err,
            "error: --dp 3 x --tp 2 is 6 ranks, but this job has 4 (WORLD_SIZE); pick --dp \
             and --tp whose product is 4\n",
            "rank {r}"
        );
        assert!(!out.contains("training"), "rank {r}: {out}");
    }
    let alone = start_rank(&example("train_lm"), 0, 1, free_port(), &["--tp", "two"]);
    let (status, _, err) = finish(alone, Duration::from_secs(60));
    assert_eq!(status.code(), Some(2), "{err}");
    assert_eq!(err, "error: --tp: invalid digit found in string\n");
    let args = ["--sequence-parallel", "--seq-len", "63"];
    let alone = start_rank(&example("train_lm"), 0, 1, free_port(), &args);
    let (status, _, err) = finish(alone, Duration::from_secs(60));
    assert_eq!(status.code(), Some(2), "{err}");
    assert_eq!(
        err,
        "error: --sequence-parallel splits each sequence over the 2 tp ranks: --seq-len 63 \
         must be a multiple of --tp\n"
    );
}

/// `train_lm` at 4 ranks for 10 steps with `extra` flags: rank 0's output and its metrics'
/// per-step losses.
fn train_lm_losses(name: &str, extra: &[&str]) -> (String, Vec<f64>) {
    let dir = temp_dir(name);
    let metrics = dir.join("metrics.jsonl");
    let mut args = vec!["--max-steps", "10", "--metrics", metrics.to_str().unwrap()];
    args.extend_from_slice(extra);
    let ends = train_lm_at_4(&args);
    for (r, (status, out, err)) in ends.iter().enumerate() {
        assert!(status.success(), "rank {r}:\n{out}\n{err}");
    }
    let losses = metric_losses(&metrics);
    let _ = std::fs::remove_dir_all(dir);
    (ends[0].1.clone(), losses)
}

/// `--sequence-parallel` (torchtitan's plan: SequenceParallel norms, PrepareModuleInput on
/// attention and the feed-forward, reduce-scattered row-parallel outputs, the output layer
/// gathering the sequence) only moves where the activations live: 10 steps give the plain
/// tensor-parallel run's losses (1e-4; the sums run in another order) and its test loss;
/// its checkpoint (the norms whole over tp, as without) loads into PyTorch's plain model.
/// `--loss-parallel` (the output's logits left local, `loss_parallel`) gives the same losses.
#[test]
fn train_lm_with_sequence_parallel_trains_as_without() {
    let ckpt = Path::new(env!("CARGO_TARGET_TMPDIR")).join("train_lm_sp");
    let _ = std::fs::remove_dir_all(&ckpt);
    let (plain_out, plain) = train_lm_losses("train-lm-tp", &[]);
    let (sp_out, sp) = train_lm_losses(
        "train-lm-sp",
        &[
            "--sequence-parallel",
            "--checkpoint-dir",
            ckpt.to_str().unwrap(),
        ],
    );
    assert!(
        sp_out.contains("dp 2 x tp 2 with sequence parallelism (4 ranks)"),
        "{sp_out}"
    );
    assert_eq!((plain.len(), sp.len()), (10, 10));
    for (step, (a, b)) in plain.iter().zip(&sp).enumerate() {
        assert!(
            (a - b).abs() < 1e-4,
            "step {}: loss {a} vs {b} with SP",
            step + 1
        );
    }
    let (a, b) = (
        figure(&plain_out, "test_loss"),
        figure(&sp_out, "test_loss"),
    );
    assert!((a - b).abs() < 1e-3, "test_loss {a} vs {b} with SP");
    pytorch_agrees(&ckpt.join("step-00000010"), b, None);
    // --loss-parallel: the loss from each tp rank's columns of the logits, never gathered
    // (loss_parallel): the same losses.
    let (lp_out, lp) = train_lm_losses("train-lm-lp", &["--loss-parallel"]);
    assert!(
        lp_out.contains("dp 2 x tp 2 with loss parallelism (4 ranks)"),
        "{lp_out}"
    );
    assert_eq!(lp.len(), 10);
    for (step, (a, b)) in plain.iter().zip(&lp).enumerate() {
        assert!(
            (a - b).abs() < 1e-4,
            "step {}: loss {a} vs {b} with loss parallelism",
            step + 1
        );
    }
    let c = figure(&lp_out, "test_loss");
    assert!(
        (a - c).abs() < 1e-3,
        "test_loss {a} vs {c} with loss parallelism"
    );
}

/// The per-step losses of a run's metrics file (rank 0's JSON lines).
fn metric_losses(path: &Path) -> Vec<f64> {
    std::fs::read_to_string(path)
        .expect("rank 0's metrics file")
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["loss"]
                .as_f64()
                .unwrap()
        })
        .collect()
}

/// `train_lm --moe` at 4 ranks trains as one process on the same global batches, in two
/// layouts of torchtitan's mesh `[efsdp, ep, tp]`: dp 4 with `--ep 2` (8 experts, 4 per ep
/// rank, tokens exchanged with an all-to-all, fully_shard on them over the 2 efsdp ranks that
/// hold the same ones and on the rest over all 4; 16 sequences per rank against 64 on one)
/// and dp 2 x tp 2 with `--loss-parallel` (ep = dp: fully_shard over the experts' own ranks
/// leaves them be; attention and output tensor-parallel, the experts whole on each tp rank;
/// 16 per dp rank against 32), and dp 2 x tp 2 with `--expert-tp` (torchtitan's
/// `ExpertTensorParallel`: each expert's hidden width split over tp as well): the same
/// losses for 9 steps (1e-4; an epoch's 10th is a
/// short batch, which the samplers pad differently) and test loss (1e-3), and each epoch
/// line reports the experts' load; PyTorch loads each layout's checkpoint into torchtitan's
/// MoE and its `--hf-checkpoint` file into a model of Hugging Face's names
/// (tests/examples/pytorch_load_lm.py) and computes the same test loss with each. An `--ep`
/// that does not divide `--dp` is refused.
#[test]
fn train_lm_with_moe_at_4_ranks_trains_as_one_process() {
    let dir = temp_dir("train-lm-moe");
    let layouts: [(&[&str], &str, &str); 3] = [
        (
            &["--dp", "4", "--ep", "2", "--tp", "1"],
            "64",
            "expert-parallel over ep 2, sharded over efsdp 2)",
        ),
        (
            &["--dp", "2", "--tp", "2", "--loss-parallel"],
            "32",
            "expert-parallel over ep 2) and loss parallelism",
        ),
        (
            &["--dp", "2", "--tp", "2", "--expert-tp"],
            "32",
            "expert-parallel over ep 2, each expert's width over tp 2)",
        ),
    ];
    let mut one_runs: std::collections::HashMap<&str, String> = Default::default();
    for (layout, one_batch, says) in layouts {
        let (four_m, one_m) = (
            dir.join("four.jsonl"),
            dir.join(format!("one-{one_batch}.jsonl")),
        );
        let (ckpt, hf) = (dir.join("ckpt"), dir.join("hf.safetensors"));
        let mut four_args = vec![
            "--moe",
            "--max-steps",
            "9",
            "--metrics",
            four_m.to_str().unwrap(),
            "--checkpoint-dir",
            ckpt.to_str().unwrap(),
            "--hf-checkpoint",
            hf.to_str().unwrap(),
        ];
        four_args.extend_from_slice(layout);
        let ends = train_lm_at_4(&four_args);
        for (r, (status, out, err)) in ends.iter().enumerate() {
            assert!(status.success(), "{layout:?}: rank {r}:\n{out}\n{err}");
        }
        // The one-process run of a global batch, once per batch size.
        let one_out = one_runs
            .entry(one_batch)
            .or_insert_with(|| train_lm_in_one_process(&["--moe"], one_batch, &one_m));
        let four_out = &ends[0].1;
        assert!(four_out.contains(says), "{layout:?}: {four_out}");
        assert!(four_out.contains("expert_load="), "{four_out}");
        let (four, one) = (metric_losses(&four_m), metric_losses(&one_m));
        assert_eq!((four.len(), one.len()), (9, 9));
        for (step, (a, b)) in four.iter().zip(&one).enumerate() {
            assert!(
                (a - b).abs() < 1e-4,
                "{layout:?}: step {}: loss {a} at 4 ranks vs {b} in one process",
                step + 1
            );
        }
        let (a, b) = (figure(four_out, "test_loss"), figure(one_out, "test_loss"));
        assert!(
            (a - b).abs() < 1e-3,
            "{layout:?}: test_loss {a} at 4 ranks vs {b} in one process"
        );
        // PyTorch loads the experts (gathered from their ep and efsdp pieces, or whole on
        // each tp rank) into torchtitan's MoE, and the HF file into a model of HF's names,
        // and computes the same test loss with each.
        pytorch_agrees(&ckpt.join("step-00000009"), a, Some(&hf));
        let _ = std::fs::remove_dir_all(&ckpt);
    }
    let _ = std::fs::remove_dir_all(dir);
    let alone = start_rank(
        &example("train_lm"),
        0,
        1,
        free_port(),
        &["--moe", "--dp", "4", "--ep", "3"],
    );
    let (status, _, err) = finish(alone, Duration::from_secs(60));
    assert_eq!(status.code(), Some(2), "{err}");
    assert_eq!(
        err,
        "error: --ep 3 must divide --dp 4 (expert parallelism borrows its ranks from dp)\n"
    );
}

/// `train_lm --cp` (each sequence split head-tail over the cp ranks, ring attention, the
/// RoPE tables split with the tokens, fully_shard over dp x cp) trains as one process on the
/// same global batches: dp 2 x cp 2 (16 sequences per dp rank against 32 on one), dp 1 x
/// cp 4 and dp 1 x cp 2 x tp 2 (heads over tp, 16 against 16) give the same losses for 9
/// steps (1e-4) and test loss (1e-3); a sequence length that 2·cp does not divide is
/// refused before the process group.
#[test]
fn train_lm_with_context_parallel_trains_as_one_process() {
    let dir = temp_dir("train-lm-cp");
    let mut one_runs: std::collections::HashMap<&str, String> = Default::default();
    for (dp, cp, tp, one_batch) in [
        ("2", "2", "1", "32"),
        ("1", "4", "1", "16"),
        ("1", "2", "2", "16"),
    ] {
        let four_m = dir.join("four.jsonl");
        let one_m = dir.join(format!("one-{one_batch}.jsonl"));
        let four_args = [
            "--dp",
            dp,
            "--cp",
            cp,
            "--tp",
            tp,
            "--max-steps",
            "9",
            "--metrics",
            four_m.to_str().unwrap(),
        ];
        let ends = train_lm_at_4(&four_args);
        for (r, (status, out, err)) in ends.iter().enumerate() {
            assert!(
                status.success(),
                "dp {dp} cp {cp} tp {tp}: rank {r}:\n{out}\n{err}"
            );
        }
        // One run per batch size: the two layouts of 16 sequences share it.
        let one_out = one_runs
            .entry(one_batch)
            .or_insert_with(|| train_lm_in_one_process(&[], one_batch, &one_m));
        let four_out = &ends[0].1;
        let mesh = match tp {
            "1" => format!("dp {dp} x cp {cp} (4 ranks)"),
            _ => format!("dp {dp} x cp {cp} x tp {tp} (4 ranks)"),
        };
        assert!(four_out.contains(&mesh), "{four_out}");
        let (four, one) = (metric_losses(&four_m), metric_losses(&one_m));
        assert_eq!((four.len(), one.len()), (9, 9));
        for (step, (a, b)) in four.iter().zip(&one).enumerate() {
            assert!(
                (a - b).abs() < 1e-4,
                "dp {dp} cp {cp}: step {}: loss {a} vs {b} in one process",
                step + 1
            );
        }
        let (a, b) = (figure(four_out, "test_loss"), figure(one_out, "test_loss"));
        assert!(
            (a - b).abs() < 1e-3,
            "dp {dp} cp {cp}: test_loss {a} vs {b}"
        );
    }
    let _ = std::fs::remove_dir_all(dir);
    let args = ["--cp", "2", "--tp", "1", "--dp", "1", "--seq-len", "62"];
    let alone = start_rank(&example("train_lm"), 0, 1, free_port(), &args);
    let (status, _, err) = finish(alone, Duration::from_secs(60));
    assert_eq!(status.code(), Some(2), "{err}");
    assert_eq!(
        err,
        "error: --cp 2 splits each sequence into 4 chunks (head-tail): --seq-len 62 must be a \
         multiple of 4\n"
    );
}
