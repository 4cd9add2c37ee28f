//! Fault tolerance across hosts: two replica groups (`examples/train_ft.rs`, one rank each)
//! on two hosts, the lighthouse on host 0; host 1's link is cut for 5 s mid-training. The
//! steps that meet the cut do not commit (group 0's average ends at the group's 3 s
//! timeout, group 1's quorum call at its own), the lighthouse drops group 1 while it is
//! silent, and once the link is back the two meet again: both end equal to the same run
//! without the cut.

use std::time::{Duration, Instant};

use super::build;
use super::hosts::{describe, Ended, Hosts, Job, Link};

/// The lighthouse on host 0: a group is dead 500 ms after its last heartbeat.
fn lighthouse(hosts: &Hosts) -> Job {
    let mut cmd = hosts.command(0, build::lighthouse());
    cmd.args([
        "--min_replicas",
        "1",
        "--bind",
        &format!("{}:29510", hosts.addr(0)),
    ])
    .args(["--heartbeat_timeout_ms", "500", "--join_timeout_ms", "200"]);
    Job::start(0, cmd)
}

/// Replica group `g` on host `g`, its store on its own host.
fn group(hosts: &Hosts, g: usize, progress: &std::path::Path) -> Job {
    let mut cmd = hosts.command(g, build::example("train_ft"));
    super::hosts::without_launch_vars(&mut cmd)
        .env("RANK", "0")
        .env("WORLD_SIZE", "1")
        .env("LOCAL_RANK", "0")
        .env("MASTER_ADDR", hosts.addr(g))
        .env("MASTER_PORT", "29500")
        .env("OMP_NUM_THREADS", "1")
        .args(["--replica-id", &format!("replica_{g}")])
        .args(["--lighthouse", &format!("http://{}:29510", hosts.addr(0))])
        .args([
            "--steps",
            "40",
            "--step-ms",
            "100",
            "--seed",
            &(g + 1).to_string(),
        ])
        .args(["--min-replica-size", "2", "--timeout-ms", "3000"])
        .args(["--quorum-timeout-ms", "3000"])
        .arg("--progress")
        .arg(progress);
    Job::start(g, cmd)
}

/// Both groups' final states (each `FINAL` line without the group's id).
fn finals(ended: &[Ended]) -> Vec<serde_json::Value> {
    ended[1..]
        .iter()
        .map(|e| {
            assert!(e.success(), "{}", describe(ended));
            let line = e
                .stdout
                .lines()
                .find_map(|l| l.strip_prefix("FINAL "))
                .unwrap_or_else(|| panic!("no FINAL line:\n{}", describe(ended)));
            let mut v: serde_json::Value = serde_json::from_str(line).expect("json");
            v.as_object_mut().expect("an object").remove("replica_id");
            v
        })
        .collect()
}

/// Runs the two groups (and the lighthouse) on fresh hosts; `during` runs once group 1 has
/// committed 3 steps. Returns the groups' final states and group 0's stderr.
fn run(tmp: &std::path::Path, during: impl FnOnce(&Hosts)) -> (Vec<serde_json::Value>, String) {
    let hosts = Hosts::new(2);
    let progress = |g: usize| tmp.join(format!("progress{g}"));
    let _ = std::fs::remove_file(progress(1));
    let mut jobs = vec![lighthouse(&hosts)];
    std::thread::sleep(Duration::from_millis(300));
    jobs.push(group(&hosts, 0, &progress(0)));
    jobs.push(group(&hosts, 1, &progress(1)));
    let start = Instant::now();
    loop {
        let step: i64 = std::fs::read_to_string(progress(1))
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(0);
        if step >= 3 {
            break;
        }
        if start.elapsed() > Duration::from_secs(90) {
            let ended = Job::wait_all(jobs, Duration::ZERO);
            panic!("group 1 never committed 3 steps:\n{}", describe(&ended));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    during(&hosts);
    // The groups end by themselves; the lighthouse is killed once they have.
    let lighthouse = jobs.remove(0);
    let groups = Job::wait_all(jobs, Duration::from_secs(120));
    let mut ended = Job::wait_all(vec![lighthouse], Duration::ZERO);
    ended.extend(groups);
    let stderr = ended[1].stderr.clone();
    (finals(&ended), stderr)
}

#[test]
fn a_replica_group_whose_link_is_cut_rejoins_and_ends_as_without_the_cut() {
    let tmp = std::env::temp_dir().join(format!("tch-dist-ft-hosts-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).expect("a temp dir");
    let (expected, _) = run(&tmp, |_| {});
    assert_eq!(expected[0], expected[1]);
    assert_eq!(expected[0]["step"], 40);
    let (cut, stderr0) = run(&tmp, |hosts| {
        hosts.link(1, Link::Down);
        std::thread::sleep(Duration::from_secs(5));
        hosts.link(1, Link::Up);
    });
    assert!(
        stderr0.contains("not committed"),
        "no step met the cut: {stderr0}"
    );
    assert_eq!(
        cut[0], expected[0],
        "group 0 against the run without the cut"
    );
    assert_eq!(cut[1], expected[0], "group 1 against it");
    let _ = std::fs::remove_dir_all(&tmp);
}
