//! Layouts that fit hosts: `train_lm` on 2 hosts x 2 ranks as HSDP (shard within a host,
//! replicate across) and as dp (across) x tp (within), each step's loss equal to the same
//! job's on one host; and `init_device_mesh`'s warning when a `tp` group would span hosts.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use super::hosts::{describe, example, launcher, without_launch_vars, Ended, Hosts, Job};
use super::{run_on_hosts, PORT};
use tch_dist::device_mesh::init_device_mesh;
use tch_dist::testing::worker;

/// The losses of rank 0's metrics file (one JSON object per step).
fn losses(metrics: &Path, text: &str) -> Vec<f64> {
    let body = std::fs::read_to_string(metrics)
        .unwrap_or_else(|e| panic!("{}: {e}; {text}", metrics.display()));
    body.lines()
        .map(|line| {
            let v: serde_json::Value = serde_json::from_str(line).expect("a metrics line");
            v["loss"].as_f64().expect("a loss")
        })
        .collect()
}

/// The `test_loss=` line of rank 0's output.
fn test_loss(stdout: &str) -> Option<&str> {
    stdout
        .lines()
        .find_map(|l| l.split_once("test_loss=").map(|(_, v)| v))
}

/// `train_lm` with `layout` for 8 steps on 2 hosts x 2 ranks (`--nnodes 2 --node-rank R`,
/// the master on host 0), and the same job on this machine's 127.0.0.1 as 4 ranks of one
/// host: every step's loss and the test loss the same (the same collectives over another
/// network), no rank warned that `tp` spans hosts.
fn train_lm_across_hosts_equals_one_host(name: &str, layout: &[&str]) {
    let exe = example("train_lm");
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("a scratch folder");
    let args = |metrics: &str| -> Vec<String> {
        let metrics = dir.join(metrics).to_string_lossy().into_owned();
        (layout.iter().copied())
            .chain(["--epochs", "1", "--max-steps", "8", "--metrics"])
            .map(String::from)
            .chain([metrics])
            .collect()
    };
    let mut one_host = Command::new(launcher());
    without_launch_vars(&mut one_host)
        .args(["--nproc-per-node", "4", "--"])
        .arg(&exe)
        .args(args("one_host.jsonl"))
        .env("OMP_NUM_THREADS", "1");
    let hosts = Hosts::new(2);
    let jobs: Vec<Job> = (0..2)
        .map(|node| {
            let mut cmd = hosts.command(node, launcher());
            without_launch_vars(&mut cmd)
                .args(["--nnodes", "2", "--node-rank", &node.to_string()])
                .args(["--nproc-per-node", "2", "--master-addr", &hosts.addr(0)])
                .args(["--master-port", PORT, "--"])
                .arg(&exe)
                .args(args("hosts.jsonl"))
                .env("OMP_NUM_THREADS", "1");
            Job::start(node, cmd)
        })
        .chain([Job::start(9, one_host)])
        .collect();
    let ended = Job::wait_all(jobs, Duration::from_secs(180));
    let text = describe(&ended);
    assert!(ended.iter().all(Ended::success), "{text}");
    let (across, alone) = (
        losses(&dir.join("hosts.jsonl"), &text),
        losses(&dir.join("one_host.jsonl"), &text),
    );
    assert_eq!(across.len(), 8, "{text}");
    for (step, (a, b)) in across.iter().zip(&alone).enumerate() {
        assert!(
            (a - b).abs() <= 1e-6,
            "step {}: loss {a} across hosts, {b} on one host; {text}",
            step + 1
        );
    }
    assert!(across[7] < across[0], "no learning: {across:?}; {text}");
    assert_eq!(
        test_loss(&ended[0].stdout),
        test_loss(&ended[2].stdout),
        "{text}"
    );
    assert!(test_loss(&ended[0].stdout).is_some(), "{text}");
    for e in &ended {
        assert!(!e.stderr.contains("tch-dist: warning"), "{text}");
    }
}

/// HSDP (`--dp-replicate 2 --dp-shard 2`): each parameter sharded over a host's 2 ranks,
/// the hosts' gradients all-reduced across.
#[test]
fn train_lm_as_hsdp_on_two_hosts_equals_one_host() {
    train_lm_across_hosts_equals_one_host(
        "hosts_layouts_hsdp",
        &["--dp-replicate", "2", "--dp-shard", "2", "--tp", "1"],
    );
}

/// FSDP x TP (`--dp 2 --tp 2`, mesh `["dp", "tp"]`): each tp group a host's 2 ranks, dp
/// across the hosts.
#[test]
fn train_lm_as_dp_x_tp_on_two_hosts_equals_one_host() {
    train_lm_across_hosts_equals_one_host("hosts_layouts_dp_tp", &["--dp", "2", "--tp", "2"]);
}

/// `init_device_mesh` on 2 hosts x 2 ranks: `["tp", "dp"]` puts ranks 0 and 2 (hosts 0
/// and 1) in one tp group, and rank 0 warns once, naming the group, the hosts and the fix;
/// `["dp", "tp"]` keeps tp within each host and says nothing. Both meshes are made.
#[test]
fn a_tp_dim_across_hosts_is_warned_about() {
    const NAME: &str = "layouts::a_tp_dim_across_hosts_is_warned_about";
    if worker().is_some() {
        let across = init_device_mesh("cpu", &[2, 2], &["tp", "dp"]).expect("tp across hosts");
        let within = init_device_mesh("cpu", &[2, 2], &["dp", "tp"]).expect("tp within hosts");
        println!(
            "tp groups {:?} then {:?}",
            across.get_group("tp").map(|g| g.rank()),
            within.get_group("tp").map(|g| g.rank())
        );
        tch_dist::destroy_process_group();
        return;
    }
    let hosts = Hosts::new(2);
    let ended = run_on_hosts(&hosts, 2, NAME, Duration::from_secs(60));
    let text = describe(&ended);
    assert!(ended.iter().all(Ended::success), "{text}");
    let warning = "[rank0]: tch-dist: warning: init_device_mesh: the `tp` dim's group of ranks \
                   [0, 2] spans hosts 0, 1 (LOCAL_WORLD_SIZE=2 ranks per host): its \
                   collectives, in every layer's forward and backward, would cross the \
                   network; make `tp` the last dim of the mesh, with a size that divides 2";
    assert_eq!(ended[0].stderr.matches(warning).count(), 1, "{text}");
    assert!(!ended[1].stderr.contains("tch-dist: warning"), "{text}");
}
