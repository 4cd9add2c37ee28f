//! Rust ranks and PyTorch ranks in one `torch.distributed` job (torch 2.11.0, the `.venv`'s):
//! both sides run the same collectives in the same order (interop/peer.py is the PyTorch
//! side, `collectives` below the Rust side) on the default group and on subgroups made both
//! ways, and each checks every result. Every process is bounded by the launch's deadline and
//! killed at it.
//!
//! The PyTorch side needs the project's `.venv` (`make setup`), or a Python with torch 2.11.0
//! named by `TCH_DIST_PYTHON`.

use std::path::PathBuf;
use std::time::Duration;

use tch::{Kind, Tensor};
use tch_dist_runtime::testing::{describe, worker, Launch, RankOutput};
use tch_dist_runtime::{GroupOptions, Object, ProcessGroup, ReduceOp};

/// The launch's wall-clock bound (Python's start-up, a torch import, takes seconds).
const DEADLINE: Duration = Duration::from_secs(150);

fn python() -> String {
    if let Ok(p) = std::env::var("TCH_DIST_PYTHON") {
        return p;
    }
    let venv = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.venv/bin/python");
    assert!(
        venv.exists(),
        "no Python with torch: run `make setup` (the .venv) or set TCH_DIST_PYTHON"
    );
    venv.to_string_lossy().into_owned()
}

fn peer_script() -> String {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/interop/peer.py")
        .to_string_lossy()
        .into_owned()
}

fn check(what: &str, got: &Tensor, want: &[f64]) {
    let got_v: Vec<f64> = Vec::<f64>::try_from(got.to_kind(Kind::Double).reshape([-1])).unwrap();
    assert_eq!(got_v, want, "{what}");
}

fn f32s(v: &[f64]) -> Tensor {
    Tensor::from_slice(v).to_kind(Kind::Float)
}

/// peer.py's `collectives`, on `pg` (this process is `pg.rank()`).
fn collectives(pg: &ProcessGroup) {
    let w = pg.world_size();
    let me = pg.rank() as f64;
    let wf = w as f64;

    let t = f32s(&[me + 1.0, 2.0 * (me + 1.0)]);
    pg.all_reduce(&t, ReduceOp::Sum).unwrap();
    let s = wf * (wf + 1.0) / 2.0;
    check("all_reduce sum", &t, &[s, 2.0 * s]);

    let t = f32s(&[me]);
    pg.all_reduce(&t, ReduceOp::Max).unwrap();
    check("all_reduce max", &t, &[wf - 1.0]);

    let t = f32s(&[me]);
    pg.all_reduce(&t, ReduceOp::Min).unwrap();
    check("all_reduce min", &t, &[0.0]);

    let t = f32s(&[me + 1.0]);
    pg.all_reduce(&t, ReduceOp::Product).unwrap();
    check(
        "all_reduce product",
        &t,
        &[(1..=w).product::<usize>() as f64],
    );

    let t = f32s(&[me + 1.0, 4.0]);
    pg.all_reduce(&t, ReduceOp::Avg).unwrap();
    check("all_reduce avg", &t, &[(wf + 1.0) / 2.0, 4.0]);

    let t = Tensor::from_slice(&[10 * pg.rank() as i64 + 3]);
    pg.all_reduce(&t, ReduceOp::Sum).unwrap();
    check(
        "all_reduce sum int64",
        &t,
        &[(10 * w * (w - 1) / 2 + 3 * w) as f64],
    );

    let t = f32s(&[me * 10.0, 1.0]);
    pg.broadcast(&t, 1 % w).unwrap();
    check(
        "broadcast from group rank 1",
        &t,
        &[(1 % w) as f64 * 10.0, 1.0],
    );

    let outs: Vec<Tensor> = (0..w)
        .map(|_| Tensor::zeros([2], (Kind::Float, tch::Device::Cpu)))
        .collect();
    pg.all_gather(&outs, &f32s(&[me, me + 0.5])).unwrap();
    for (i, o) in outs.iter().enumerate() {
        check(
            &format!("all_gather list [{i}]"),
            o,
            &[i as f64, i as f64 + 0.5],
        );
    }

    let out = Tensor::zeros([w as i64, 2], (Kind::Float, tch::Device::Cpu));
    pg.all_gather_into_tensor(&out, &f32s(&[me, -me]).reshape([1, 2]))
        .unwrap();
    let want: Vec<f64> = (0..w).flat_map(|i| [i as f64, -(i as f64)]).collect();
    check("all_gather_into_tensor", &out, &want);

    let inp = f32s(&(0..w).map(|j| 100.0 * me + j as f64).collect::<Vec<_>>());
    let out = Tensor::zeros([1], (Kind::Float, tch::Device::Cpu));
    pg.reduce_scatter_tensor(&out, &inp, ReduceOp::Sum).unwrap();
    check(
        "reduce_scatter_tensor",
        &out,
        &[100.0 * wf * (wf - 1.0) / 2.0 + wf * me],
    );

    let inputs: Vec<Tensor> = (0..w).map(|j| f32s(&[me + 10.0 * j as f64, 1.0])).collect();
    let out = Tensor::zeros([2], (Kind::Float, tch::Device::Cpu));
    pg.reduce_scatter(&out, &inputs, ReduceOp::Sum).unwrap();
    check(
        "reduce_scatter list",
        &out,
        &[wf * (wf - 1.0) / 2.0 + 10.0 * wf * me, wf],
    );

    let inp = f32s(&(0..w).map(|j| 10.0 * me + j as f64).collect::<Vec<_>>());
    let out = Tensor::zeros([w as i64], (Kind::Float, tch::Device::Cpu));
    pg.all_to_all_single(&out, &inp).unwrap();
    let want: Vec<f64> = (0..w).map(|i| 10.0 * i as f64 + me).collect();
    check("all_to_all_single", &out, &want);

    let r = pg.rank();
    let (next, prev) = ((r + 1) % w, (r + w - 1) % w);
    let t = f32s(&[me + 0.25]);
    let got = Tensor::zeros([1], (Kind::Float, tch::Device::Cpu));
    if r == 0 {
        pg.send(&t, next, 7).unwrap();
        pg.recv(&got, prev, 7).unwrap();
    } else {
        pg.recv(&got, prev, 7).unwrap();
        pg.send(&t, next, 7).unwrap();
    }
    check("recv tag 7", &got, &[prev as f64 + 0.25]);

    pg.barrier().unwrap();
    pg.monitored_barrier(Duration::from_secs(30), true).unwrap();
}

/// peer.py's `main`, on the Rust side.
fn rust_rank(scenario: &str) {
    let pg = tch_dist_runtime::init_process_group("gloo").unwrap();
    let (rank, world) = (pg.rank(), pg.world_size());
    collectives(&pg);
    // Object collectives, str and bytes.
    let sent = vec![
        Object::from("weights-v3"),
        Object::from(&b"\x00\x01\xff"[..]),
        Object::from("x".repeat(300)),
    ];
    let mut objs = if rank == 1 {
        sent.clone()
    } else {
        vec![Object::from(""); 3]
    };
    pg.broadcast_object_list(&mut objs, 1).unwrap();
    assert_eq!(objs, sent, "broadcast_object_list");
    let object_of = |r: usize| {
        if r.is_multiple_of(2) {
            Object::from(format!("rank {r}"))
        } else {
            Object::from(vec![r as u8; r + 1])
        }
    };
    let gathered = pg.all_gather_object(&object_of(rank)).unwrap();
    assert_eq!(
        gathered,
        (0..world).map(object_of).collect::<Vec<_>>(),
        "all_gather_object"
    );
    // send_object_list / recv_object_list: rank 0 to rank 1 and back.
    if rank == 0 {
        pg.send_object_list(&[Object::from("ping"), Object::from(&b"\x07"[..])], 1)
            .unwrap();
        let mut back = vec![Object::from("")];
        pg.recv_object_list(&mut back, 1).unwrap();
        assert_eq!(back, vec![Object::from("pong 1")]);
    } else if rank == 1 {
        let mut got = vec![Object::from(""), Object::from("")];
        pg.recv_object_list(&mut got, 0).unwrap();
        assert_eq!(got, vec![Object::from("ping"), Object::from(&b"\x07"[..])]);
        pg.send_object_list(&[Object::from("pong 1")], 0).unwrap();
    }
    if scenario == "full" {
        let pair = pg
            .new_group(&[0, 1], tch_dist_runtime::Backend::Gloo)
            .unwrap();
        let ends = pg
            .new_group(&[world - 1, 0], tch_dist_runtime::Backend::Gloo)
            .unwrap();
        assert_eq!(
            pair.as_ref().map(|g| g.group_name()),
            (rank < 2).then_some("1")
        );
        if let Some(g) = &pair {
            collectives(g);
        }
        if let Some(g) = &ends {
            assert_eq!(g.global_ranks(), &[0, world - 1]);
            assert_eq!(g.group_name(), "2");
            collectives(g);
        }
        let local = if world > 2 {
            vec![1, world - 1]
        } else {
            vec![0, 1]
        };
        if local.contains(&rank) {
            let opts =
                GroupOptions::new(tch_dist_runtime::Backend::Gloo).with_local_synchronization();
            let g = pg.new_group_with(&local, &opts).unwrap().unwrap();
            assert_eq!(g.group_name().len(), 40, "a sha1");
            collectives(&g);
        }
        pg.barrier().unwrap();
    }
    tch_dist_runtime::destroy_process_group();
    println!("interop ok rank {rank}");
}

/// One mixed job: `python_ranks` are PyTorch ranks (peer.py), the others this test binary,
/// every rank with `env`.
struct Mixed {
    /// The `#[test]` function's name: the Rust ranks run it again as workers.
    test: &'static str,
    world: usize,
    python_ranks: &'static [usize],
    env: &'static [(&'static str, &'static str)],
}

impl Mixed {
    /// On one of the job's Rust ranks (a worker `Launch` started), runs `rust_side` and
    /// returns `None`; otherwise launches the job and returns the ranks' outputs and their
    /// description.
    fn launch(&self, rust_side: impl FnOnce()) -> Option<(Vec<RankOutput>, String)> {
        if worker().as_deref() == Some(self.test) {
            rust_side();
            return None;
        }
        let mut launch = Launch::new(self.test, self.world).timeout(DEADLINE);
        for &(key, value) in self.env {
            launch = launch.env(key, value);
        }
        for &r in self.python_ranks {
            launch = launch.rank_program(r, vec![python(), peer_script()]);
        }
        let out = launch.run();
        let desc = describe(&out);
        Some((out, desc))
    }

    /// [`Mixed::launch`], and every rank succeeded, printed `interop ok rank R` and met no
    /// store bind error.
    fn run(&self, rust_side: impl FnOnce()) -> Option<(Vec<RankOutput>, String)> {
        let (out, desc) = self.launch(rust_side)?;
        for o in &out {
            assert!(o.success(), "rank {} failed:\n{desc}", o.rank);
            assert!(
                o.stdout.contains(&format!("interop ok rank {}", o.rank)),
                "rank {} did not finish:\n{desc}",
                o.rank
            );
            assert!(
                !o.stderr.contains("has failed to bind"),
                "a store bind error:\n{desc}"
            );
        }
        Some((out, desc))
    }
}

fn scenario() -> String {
    std::env::var("INTEROP_SCENARIO").unwrap_or_else(|_| "full".into())
}

/// The Rust side of a scenario job: peer.py's `main` for `INTEROP_SCENARIO`.
fn scenario_rank() {
    rust_rank(&scenario())
}

#[test]
fn python_rank_0_and_rust_rank_1() {
    Mixed {
        test: "python_rank_0_and_rust_rank_1",
        world: 2,
        python_ranks: &[0],
        env: &[("INTEROP_SCENARIO", "full")],
    }
    .run(scenario_rank);
}

#[test]
fn rust_rank_0_and_python_rank_1() {
    Mixed {
        test: "rust_rank_0_and_python_rank_1",
        world: 2,
        python_ranks: &[1],
        env: &[("INTEROP_SCENARIO", "full")],
    }
    .run(scenario_rank);
}

#[test]
fn three_ranks_rust_python_rust() {
    Mixed {
        test: "three_ranks_rust_python_rust",
        world: 3,
        python_ranks: &[1],
        env: &[("INTEROP_SCENARIO", "full")],
    }
    .run(scenario_rank);
}

/// PyTorch's optional store-based barrier (TORCH_DIST_INIT_BARRIER=1) after
/// init_process_group and every new_group, with PyTorch ranks 0 and 2 around a Rust rank.
#[test]
fn three_ranks_python_rust_python_with_init_barrier() {
    Mixed {
        test: "three_ranks_python_rust_python_with_init_barrier",
        world: 3,
        python_ranks: &[0, 2],
        env: &[("TORCH_DIST_INIT_BARRIER", "1")],
    }
    .run(scenario_rank);
}

/// A Rust rank 0 that waits for a missing rank names that rank only: the PyTorch rank that
/// came (it writes no tch-dist join key) counts as joined by its Gloo key.
#[test]
fn a_missing_rank_beside_a_python_rank_is_named() {
    let job = Mixed {
        test: "a_missing_rank_beside_a_python_rank_is_named",
        world: 3,
        python_ranks: &[1],
        env: &[("TCH_DIST_TIMEOUT_SECS", "10")],
    };
    let Some((out, desc)) = job.launch(|| {
        if std::env::var("RANK").as_deref() == Ok("2") {
            return; // never joins
        }
        let err = tch_dist_runtime::init_process_group("gloo").unwrap_err();
        println!("error: {err}");
    }) else {
        return;
    };
    let line = out[0]
        .stdout
        .lines()
        .find_map(|l| l.split_once("error: ").map(|(_, e)| e.to_string()))
        .unwrap_or_else(|| panic!("rank 0 printed no error:\n{desc}"));
    assert!(
        line.ends_with("failed: rank 2 never joined within 10s"),
        "{line}\n{desc}"
    );
    // The PyTorch rank fails by its own timeout, not at the deadline.
    assert!(out[1].status.is_some() && !out[1].success(), "{desc}");
}

/// Under `torchrun --no-python` (its agent hosts the store: TORCHELASTIC_USE_AGENT_STORE=True,
/// every rank a client), a wrapper starts a PyTorch rank 0 and a Rust rank 1; no rank tries
/// to host the store (no "has failed to bind" line).
#[test]
fn under_torchrun_no_python() {
    use std::os::unix::process::CommandExt;
    const TEST: &str = "under_torchrun_no_python";
    if worker().as_deref() == Some(TEST) {
        assert_eq!(
            std::env::var("TORCHELASTIC_USE_AGENT_STORE").as_deref(),
            Ok("True")
        );
        return rust_rank("full");
    }
    let torchrun = PathBuf::from(python()).with_file_name("torchrun");
    assert!(torchrun.exists(), "no torchrun beside {}", python());
    let dir = std::env::temp_dir().join(format!("tch-dist-interop-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let wrapper = dir.join("rank.sh");
    let exe = std::env::current_exe().unwrap();
    std::fs::write(
        &wrapper,
        format!(
            "#!/bin/sh\nif [ \"$LOCAL_RANK\" = 0 ]; then exec '{}' '{}'; fi\n\
             TCH_DIST_TEST_WORKER={TEST} exec '{}' {TEST} --exact --nocapture --test-threads=1\n",
            python(),
            peer_script(),
            exe.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(
        &wrapper,
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let port = tch_dist_runtime::testing::free_port();
    let mut child = std::process::Command::new(&torchrun)
        .args([
            "--nnodes",
            "1",
            "--nproc-per-node",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            &port.to_string(),
            "--no-python",
        ])
        .arg(&wrapper)
        .env("TCH_DIST_TIMEOUT_SECS", "60")
        .env("INTEROP_SCENARIO", "full")
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .env_remove("MASTER_ADDR")
        .env_remove("MASTER_PORT")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .process_group(0)
        .spawn()
        .unwrap();
    let pid = child.id() as i32;
    let stdout = child.stdout.take().unwrap();
    let stderr = child.stderr.take().unwrap();
    let read = |mut r: Box<dyn std::io::Read + Send>| {
        std::thread::spawn(move || {
            let mut s = String::new();
            let _ = r.read_to_string(&mut s);
            s
        })
    };
    let (out, err) = (read(Box::new(stdout)), read(Box::new(stderr)));
    let deadline = std::time::Instant::now() + DEADLINE;
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break Some(s);
        }
        if std::time::Instant::now() >= deadline {
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    // Whatever happened, nothing of the job outlives the test: torchrun's process group.
    // SAFETY: kill(2) on the process group this test created; no memory is involved.
    unsafe { libc::kill(-pid, libc::SIGKILL) };
    let _ = child.wait();
    let (out, err) = (out.join().unwrap(), err.join().unwrap());
    let _ = std::fs::remove_dir_all(&dir);
    let desc = format!("stdout:\n{out}\nstderr:\n{err}");
    assert!(status.is_some_and(|s| s.success()), "{status:?}\n{desc}");
    for r in 0..2 {
        assert!(out.contains(&format!("interop ok rank {r}")), "{desc}");
    }
    assert!(!err.contains("has failed to bind"), "{desc}");
}

/// peer.py's `detail`, on the Rust side.
fn detail_rank() {
    let pg = tch_dist_runtime::init_process_group("gloo").unwrap();
    let (rank, world) = (pg.rank(), pg.world_size());
    assert_eq!(pg.debug_level(), tch_dist_runtime::DebugLevel::Detail);
    let t = f32s(&[rank as f64 + 1.0]);
    pg.all_reduce(&t, ReduceOp::Sum).unwrap();
    check("detail all_reduce", &t, &[(world * (world + 1) / 2) as f64]);
    let out = Tensor::zeros([world as i64], (Kind::Float, tch::Device::Cpu));
    pg.all_gather_into_tensor(&out, &f32s(&[rank as f64]))
        .unwrap();
    let want: Vec<f64> = (0..world).map(|i| i as f64).collect();
    check("detail all_gather_into_tensor", &out, &want);
    pg.barrier().unwrap();
    let t = f32s(&[rank as f64]);
    pg.broadcast(&t, 1).unwrap();
    check("detail broadcast", &t, &[1.0]);
    let all: Vec<usize> = (0..world).collect();
    let sub = pg
        .new_group(&all, tch_dist_runtime::Backend::Gloo)
        .unwrap()
        .unwrap();
    let t = f32s(&[rank as f64 + 1.0]);
    sub.all_reduce(&t, ReduceOp::Sum).unwrap();
    check(
        "detail subgroup all_reduce",
        &t,
        &[(world * (world + 1) / 2) as f64],
    );
    let t = f32s(&[rank as f64]);
    sub.broadcast(&t, 1).unwrap();
    check("detail subgroup broadcast", &t, &[1.0]);
    let t = Tensor::ones([4], (Kind::Float, tch::Device::Cpu));
    let err = if rank == 0 {
        pg.broadcast(&t, 0).unwrap_err()
    } else {
        pg.all_reduce(&t, ReduceOp::Sum).unwrap_err()
    };
    println!("detail mismatch: {err}");
    tch_dist_runtime::destroy_process_group();
    println!("interop ok rank {rank}");
}

/// TORCH_DISTRIBUTED_DEBUG=DETAIL on both sides: the checks of matching calls pass (a
/// broadcast included), and a mismatch (the PyTorch rank broadcasts, the Rust rank
/// all-reduces) is an error on both sides, not a hang.
#[test]
fn detail_on_both_sides() {
    let job = Mixed {
        test: "detail_on_both_sides",
        world: 2,
        python_ranks: &[0],
        env: &[
            ("TORCH_DISTRIBUTED_DEBUG", "DETAIL"),
            ("TCH_DIST_TIMEOUT_SECS", "20"),
            ("INTEROP_SCENARIO", "detail"),
        ],
    };
    let Some((out, desc)) = job.run(detail_rank) else {
        return;
    };
    for o in &out {
        assert!(o.stdout.contains("detail mismatch: "), "{desc}");
    }
    // The Rust rank's error is a typed desync naming its own call (the PyTorch rank shares
    // nothing beyond c10d's fingerprints); the PyTorch rank's is c10d's.
    assert!(
        out[1].stdout.contains(
            "rank 1: all_reduce: the ranks called different collectives (TCH_DIST_DEBUG=DETAIL \
             checks each one before it runs): rank 1 called all_reduce of [4] (Float) on Cpu"
        ),
        "{desc}"
    );
    assert!(
        out[0]
            .stdout
            .contains("detail mismatch: Detected mismatch between collectives on ranks"),
        "{desc}"
    );
}

/// Two Gloo devices per rank (`GLOO_SOCKET_IFNAME=lo,lo`), as PyTorch makes them: each
/// collective goes over the device its tag picks, so both sides must have as many.
#[test]
fn two_gloo_devices_per_rank() {
    Mixed {
        test: "two_gloo_devices_per_rank",
        world: 2,
        python_ranks: &[0],
        env: &[
            ("GLOO_SOCKET_IFNAME", "lo,lo"),
            ("INTEROP_SCENARIO", "default_group"),
        ],
    }
    .run(scenario_rank);
}

/// Gloo's lazy init (`TORCH_GLOO_LAZY_INIT=1` on every rank): the pairs connect at their first
/// use, on both sides alike.
#[test]
fn lazy_gloo_init_on_both_sides() {
    Mixed {
        test: "lazy_gloo_init_on_both_sides",
        world: 3,
        python_ranks: &[2],
        env: &[("TORCH_GLOO_LAZY_INIT", "1"), ("INTEROP_SCENARIO", "full")],
    }
    .run(scenario_rank);
}
