//! Restarts across hosts (`--rdzv-backend c10d`): every host runs `tch-dist-run --nnodes K
//! --max-restarts M --rdzv-backend c10d --rdzv-endpoint 10.77.0.1:29400`, host 0's launcher
//! hosts the rendezvous (the endpoint is its eth0's address). A failure on any host restarts
//! every host's ranks in the next round; a host lost for good is left behind once its
//! keep-alives stop; a host out of restarts closes the rendezvous and every launcher exits
//! non-zero naming it; each round's workers meet in a store of their own. The keep-alive is
//! shortened to 1 s (dead after 3) and the last call to 2 s, with torchrun's `--rdzv-conf`
//! keys, so that each case takes seconds.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use super::hosts::{describe, example, launcher, without_launch_vars, Ended, Hosts, Job, Link};
use tch::Tensor;
use tch_dist::testing::{worker, WORKER_ENV};
use tch_dist::{init_process_group, Backend, ReduceOp};

/// The rendezvous' port on host 0.
const PORT: &str = "29400";

/// torchrun's `--rdzv-conf` keys: keep-alives every second, a node dead after 3 missed, a
/// 2 s last call, and a join timeout that a test's bound ends first.
const CONF: &str =
    "keep_alive_interval=1,keep_alive_max_attempt=3,last_call_timeout=2,join_timeout=90";

/// `tch-dist-run` on host `node` in the dynamic rendezvous at host 0, with `--nnodes nnodes`,
/// `nproc` ranks and `restarts` restarts; the caller adds the command. Every host sets
/// `GLOO_SOCKET_IFNAME=eth0` (the interface is not what these tests are about), and
/// `HOST_INDEX` tells a shell rank which host it is on.
fn c10d(hosts: &Hosts, node: usize, nnodes: &str, nproc: usize, restarts: u32) -> Command {
    let mut cmd = hosts.command(node, launcher());
    without_launch_vars(&mut cmd)
        .args(["--nnodes", nnodes, "--nproc-per-node", &nproc.to_string()])
        .args(["--rdzv-backend", "c10d", "--rdzv-conf", CONF])
        .args(["--rdzv-endpoint", &format!("{}:{PORT}", hosts.addr(0))])
        .args(["--max-restarts", &restarts.to_string(), "--"])
        .env("GLOO_SOCKET_IFNAME", "eth0")
        .env("OMP_NUM_THREADS", "1")
        .env("TCH_DIST_TIMEOUT_SECS", "20")
        .env("HOST_INDEX", node.to_string());
    cmd
}

/// A shell rank: `sh -c script`.
fn sh(mut cmd: Command, script: &str) -> Command {
    cmd.args(["sh", "-c", script]);
    cmd
}

/// A fresh folder under the target's scratch space (every host sees it: shared storage).
fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("a scratch folder");
    dir
}

/// Waits (at most `limit`) until `ready()`; false if it never was.
fn wait_until(limit: Duration, ready: impl Fn() -> bool) -> bool {
    let end = Instant::now() + limit;
    while Instant::now() < end {
        if ready() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    ready()
}

/// The lines of `text` that contain `needle`.
fn lines_with<'a>(text: &'a str, needle: &str) -> Vec<&'a str> {
    text.lines().filter(|l| l.contains(needle)).collect()
}

/// The shell rank of the loss tests: says where it is, marks that it runs in a world of
/// `$WORLD_SIZE` ranks, and waits for the test's `lost` mark; then a world of 2 (the round
/// after the loss) ends well, and a world of 3 waits to be stopped.
fn loss_script(dir: &Path) -> String {
    let dir = dir.display();
    format!(
        "echo \"host=$HOST_INDEX round=$TCH_DIST_RDZV_ROUND world=$WORLD_SIZE \
         count=$TORCHELASTIC_RESTART_COUNT\"; touch {dir}/host$HOST_INDEX-world$WORLD_SIZE; \
         while [ ! -e {dir}/lost ]; do sleep 0.1; done; \
         if [ \"$WORLD_SIZE\" = 2 ]; then exit 0; fi; sleep 60"
    )
}

/// The loss tests: 3 hosts, `--nnodes 2:3`, one rank each; once all three run in one world,
/// `lose` takes host 2 away; hosts 0 and 1 must go on in a world of 2 without spending a
/// restart (their ranks did not fail: the rendezvous dropped host 2 when its keep-alives
/// stopped, and called their round off). Returns how each host ended and how long after
/// the loss hosts 0 and 1 took to end.
fn three_hosts_lose_one(name: &str, lose: impl FnOnce(&Hosts)) -> (Vec<Ended>, Duration) {
    let dir = scratch(name);
    let hosts = Hosts::new(3);
    let script = loss_script(&dir);
    let mut jobs: Vec<Job> = (0..3)
        .map(|i| Job::start(i, sh(c10d(&hosts, i, "2:3", 1, 1), &script)))
        .collect();
    let all_three = wait_until(Duration::from_secs(60), || {
        (0..3).all(|i| dir.join(format!("host{i}-world3")).exists())
    });
    let lost = jobs.pop().expect("host 2's job");
    if !all_three {
        let ended = Job::wait_all(jobs, Duration::ZERO);
        panic!(
            "the three hosts never ran in one world:\n{}",
            describe(&ended)
        );
    }
    lose(&hosts);
    std::fs::write(dir.join("lost"), "").expect("the lost mark");
    let at = Instant::now();
    let ended = Job::wait_all(jobs, Duration::from_secs(60));
    let took = at.elapsed();
    let mut all = ended;
    all.extend(Job::wait_all(vec![lost], Duration::from_secs(20)));
    (all, took)
}

/// Hosts 0 and 1 went on without host 2: a later round of world 2, their ranks at restart
/// count 0, host 2 named as the node that stopped answering.
fn check_went_on(ended: &[Ended]) {
    for e in &ended[..2] {
        assert!(e.success(), "host {}: {}", e.host, describe(ended));
        let world2 = lines_with(&e.stdout, "world=2");
        assert_eq!(world2.len(), 1, "host {}: {}", e.host, describe(ended));
        assert!(world2[0].contains("count=0"), "{}", describe(ended));
        assert!(
            e.stderr.contains("node 2 (10.77.0.3, pid")
                && e.stderr
                    .contains("stopped answering (no keep-alive for 3 s)"),
            "host {}: {}",
            e.host,
            describe(ended)
        );
    }
}

/// Host 2 SIGKILLed with its ranks (a machine that died): hosts 0 and 1 meet again without it
/// once its keep-alives stop (3 s here, 15 s by default), after the last call (2 s), and
/// finish in a world of 2.
#[test]
fn three_hosts_go_on_without_a_killed_host() {
    let (ended, took) = three_hosts_lose_one("hosts_restarts_killed", |hosts| hosts.kill(2));
    check_went_on(&ended);
    assert!(
        took < Duration::from_secs(20),
        "took {took:?}: {}",
        describe(&ended)
    );
    eprintln!("hosts 0 and 1 finished {took:.1?} after host 2 was killed");
}

/// Host 2's link cut (it hears nothing, and sends nothing): the same for hosts 0 and 1, and
/// host 2's launcher, which cannot reach the rendezvous either, stops its ranks once its
/// own keep-alives go unanswered and exits 1, saying so.
#[test]
fn three_hosts_go_on_without_a_cut_off_host() {
    let (ended, took) =
        three_hosts_lose_one("hosts_restarts_cut", |hosts| hosts.link(2, Link::Down));
    check_went_on(&ended);
    let cut = &ended[2];
    assert_eq!(
        cut.status.and_then(|s| s.code()),
        Some(1),
        "{}",
        describe(&ended)
    );
    assert!(
        cut.stderr.contains("lost the rendezvous for"),
        "{}",
        describe(&ended)
    );
    eprintln!("hosts 0 and 1 finished {took:.1?} after host 2's link went down");
}

/// A host whose rank fails in every round: its first failure restarts all three hosts in
/// round 1 (hosts 0 and 2 without spending a restart: their ranks did not fail), its second
/// spends its last restart, and it closes the rendezvous: every launcher exits non-zero,
/// hosts 0 and 2 naming host 1 as the node that ran out.
#[test]
fn a_host_out_of_restarts_ends_every_host() {
    let hosts = Hosts::new(3);
    let script = "echo \"host=$HOST_INDEX round=$TCH_DIST_RDZV_ROUND \
                  count=$TORCHELASTIC_RESTART_COUNT\"; \
                  if [ \"$HOST_INDEX\" = 1 ]; then sleep 1; exit 3; fi; sleep 60";
    let start = Instant::now();
    let jobs = (0..3)
        .map(|i| Job::start(i, sh(c10d(&hosts, i, "3", 1, 1), script)))
        .collect();
    let ended = Job::wait_all(jobs, Duration::from_secs(60));
    let took = start.elapsed();
    let text = describe(&ended);
    assert_eq!(ended[1].status.and_then(|s| s.code()), Some(3), "{text}");
    assert!(
        ended[1]
            .stderr
            .contains("has used its 1 restart(s) and its ranks failed with exit status 3; closing the rendezvous"),
        "{text}"
    );
    for i in [0, 2] {
        let e = &ended[i];
        assert_eq!(e.status.and_then(|s| s.code()), Some(1), "{text}");
        assert!(
            e.stderr
                .contains("the rendezvous was closed in round 1 by node 1 (10.77.0.2, pid")
                && e.stderr.contains(
                    "which ran out of restarts (1 used; its ranks failed with exit status 3)"
                ),
            "host {i}: {text}"
        );
        // Round 1 came without a restart of its own.
        assert!(
            e.stdout.contains(&format!("host={i} round=1 count=0")),
            "host {i}: {text}"
        );
    }
    assert!(ended[1].stdout.contains("host=1 round=1 count=1"), "{text}");
    eprintln!("every launcher ended {took:.1?} after the start");
}

/// Per-round isolation, with real ranks: in round 0, rank 0 leaves keys in the workers'
/// store that would end a later round at once if it met them (a stale exit report of rank 1,
/// and a marker), and rank 1 (host 1) fails; in round 1 the ranks meet in a store of their
/// own, on another port, where neither key is, and sum.
#[test]
fn each_round_meets_in_a_store_of_its_own() {
    const NAME: &str = "restarts::each_round_meets_in_a_store_of_its_own";
    if worker().is_some() {
        return isolation_rank();
    }
    let hosts = Hosts::new(2);
    let exe = std::env::current_exe().expect("the test binary");
    let jobs = (0..2)
        .map(|i| {
            let mut cmd = c10d(&hosts, i, "2", 1, 1);
            cmd.arg(&exe)
                .args([NAME, "--exact", "--nocapture", "--test-threads=1"])
                .env(WORKER_ENV, NAME);
            Job::start(i, cmd)
        })
        .collect();
    let ended = Job::wait_all(jobs, Duration::from_secs(90));
    let text = describe(&ended);
    assert!(ended.iter().all(Ended::success), "{text}");
    let port = |round: u64| -> String {
        let prefix = format!("round {round} rank 0 port ");
        let line = ended[0]
            .stdout
            .lines()
            .find_map(|l| l.split_once(&prefix).map(|(_, rest)| rest.to_string()))
            .unwrap_or_else(|| panic!("no round {round} line: {text}"));
        let (port, stale) = line.split_once(' ').expect("port and stale");
        assert_eq!(stale, "stale=0", "round {round}: {text}");
        port.to_string()
    };
    assert_ne!(port(0), port(1), "{text}");
    for (rank, e) in ended.iter().enumerate() {
        let sum = format!("round 1 rank {rank} sum=3");
        assert!(e.stdout.contains(&sum), "{text}");
    }
}

/// A rank of [`each_round_meets_in_a_store_of_its_own`].
fn isolation_rank() {
    let round: u64 = std::env::var("TCH_DIST_RDZV_ROUND")
        .expect("the round")
        .parse()
        .expect("a round");
    let port = std::env::var("MASTER_PORT").expect("MASTER_PORT");
    let pg = init_process_group(Backend::Gloo).expect("init_process_group");
    let store = pg.store();
    let stale = store
        .add("tch_dist_test/stale", 0)
        .expect("reading the marker");
    println!("round {round} rank {} port {port} stale={stale}", pg.rank());
    if round == 0 {
        pg.barrier().expect("barrier");
        if pg.rank() == 1 {
            // Host 1's rank fails: host 1 spends its restart, host 0 restarts for it.
            std::process::exit(3);
        }
        store.add("tch_dist_test/stale", 1).expect("the marker");
        store
            .set(
                "tch_dist/exited/1",
                b"exited with status 9 (a report of round 0)",
            )
            .expect("a stale exit report");
        store.add("tch_dist/exited_count", 1).expect("its count");
        // Not in a collective: its launcher stops it for the next round.
        std::thread::sleep(Duration::from_secs(60));
        std::process::exit(4);
    }
    let t = Tensor::from_slice(&[pg.rank() as f32 + 1.0]);
    pg.all_reduce(&t, ReduceOp::Sum).expect("all_reduce");
    println!(
        "round {round} rank {} sum={}",
        pg.rank(),
        t.double_value(&[0])
    );
    tch_dist::destroy_process_group();
}

/// A run of an example killed on one host and restarted on every host.
struct Resumed {
    ended: Vec<Ended>,
    /// `run/` (the killed run's folder) and `reference/` (the uninterrupted run's).
    dir: PathBuf,
    kill_at: u64,
    /// The step of the last checkpoint before the kill, where the run resumed.
    last: u64,
    took: Duration,
}

/// the example `crash_build` (a crash build: tests/resume/) on 2 hosts x `nproc` ranks (`--nnodes 2 --max-restarts 1`) with
/// `args(folder)`, checkpoints every `every` steps in a folder both hosts see, the last rank
/// of host 1 SIGKILLing itself after a step picked at random in `every+1 ..= steps-1`; and
/// beside it, on this machine outside the namespaces, the uninterrupted run of the same
/// world. Checks that both succeeded, that both hosts restarted in round 1 (and no later
/// round), and that rank 0 resumed from the last checkpoint before the kill.
fn kill_and_resume(
    name: &str,
    crash_build: &str,
    nproc: usize,
    (steps, every): (u64, u64),
    args: impl Fn(&Path) -> Vec<String>,
) -> Resumed {
    let exe = example(crash_build);
    let dir = scratch(name);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .subsec_nanos() as u64;
    let kill_at = every + 1 + nanos % (steps - every - 1);
    let victim = 2 * nproc - 1;
    let mut reference = Command::new(launcher());
    without_launch_vars(&mut reference)
        .args(["--nproc-per-node", &(2 * nproc).to_string(), "--"])
        .arg(&exe)
        .args(args(&dir.join("reference")))
        .env("OMP_NUM_THREADS", "1")
        .env("TCH_DIST_TIMEOUT_SECS", "60");
    let reference = Job::start(9, reference);
    let hosts = Hosts::new(2);
    let start = Instant::now();
    let jobs: Vec<Job> = (0..2)
        .map(|i| {
            let mut cmd = c10d(&hosts, i, "2", nproc, 1);
            cmd.arg(&exe)
                .args(args(&dir.join("run")))
                // Two runs share the machine's two cores: room for a slow start.
                .env("TCH_DIST_TIMEOUT_SECS", "60")
                .env("TCH_DIST_TEST_KILL_AT_STEP", kill_at.to_string())
                .env("TCH_DIST_TEST_KILL_RANK", victim.to_string());
            Job::start(i, cmd)
        })
        .chain([reference])
        .collect();
    let ended = Job::wait_all(jobs, Duration::from_secs(170));
    let took = start.elapsed();
    let text = format!("killed after step {kill_at}:\n{}", describe(&ended));
    assert!(ended.iter().all(Ended::success), "{text}");
    assert!(
        ended[1].stderr.contains(&format!("rank {victim} failed")),
        "{text}"
    );
    // Both hosts ran round 1 as the same two nodes, in the same order.
    for (i, e) in ended[..2].iter().enumerate() {
        let round1 = format!("round 1: node {i} of 2 (10.77.0.{}, pid", i + 1);
        assert!(e.stderr.contains(&round1), "{text}");
        assert!(!e.stderr.contains("round 2:"), "{text}");
    }
    let last = (kill_at - 1) / every * every;
    let resumed = format!(
        "resumed from {} at step {last}",
        dir.join("run/ckpt")
            .join(format!("step-{last:08}"))
            .display()
    );
    assert!(
        ended[0].stdout.contains(&resumed),
        "no `{resumed}` in {text}"
    );
    Resumed {
        ended,
        dir,
        kill_at,
        last,
        took,
    }
}

/// The tensors of the safetensors file `path`, by name.
fn tensors(path: &Path) -> std::collections::BTreeMap<String, Tensor> {
    Tensor::read_safetensors(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .into_iter()
        .collect()
}

/// Every tensor of `ours` within 1e-6 of `theirs`'s, the same names in both.
fn assert_close(ours: &Path, theirs: &Path, text: &str) {
    let (ours, theirs) = (tensors(ours), tensors(theirs));
    assert_eq!(
        ours.keys().collect::<Vec<_>>(),
        theirs.keys().collect::<Vec<_>>()
    );
    for (name, t) in &theirs {
        let diff = (&ours[name] - t).abs().max().double_value(&[]);
        assert!(
            diff <= 1e-6,
            "`{name}` is {diff} from the uninterrupted run; {text}"
        );
    }
}

/// train_ddp on 2 hosts x 2 ranks, `--nnodes 2 --max-restarts 1`, checkpoints every 5 of 20
/// steps in a folder both hosts see; rank 3 (host 1) SIGKILLs itself after a step picked at
/// random. Every host's ranks restart in round 1, resume from the last checkpoint before the
/// kill, and end at the parameters of an uninterrupted run of 4 ranks (within 1e-6).
#[test]
fn train_ddp_on_two_hosts_restarts_every_host_and_resumes() {
    let r = kill_and_resume("hosts_restarts_ddp", "train_ddp_crash", 2, (20, 5), |dir| {
        let s = |p: PathBuf| p.to_string_lossy().into_owned();
        [
            "--epochs",
            "2",
            "--max-steps",
            "20",
            "--checkpoint-every",
            "5",
        ]
        .map(String::from)
        .into_iter()
        .chain(["--checkpoint-dir".into(), s(dir.join("ckpt"))])
        .chain(["--checkpoint".into(), s(dir.join("final.safetensors"))])
        .collect()
    });
    let text = describe(&r.ended);
    assert!(r.ended[0].stdout.contains("trained to step 20"), "{text}");
    assert_close(
        &r.dir.join("run/final.safetensors"),
        &r.dir.join("reference/final.safetensors"),
        &text,
    );
    eprintln!(
        "killed after step {}, resumed at step {}; {:.1?} in all",
        r.kill_at, r.last, r.took
    );
}

/// train_fsdp (fully_shard, AdamW) on 2 hosts x 1 rank, the same way: rank 1 killed after a
/// random step of 12, checkpoints every 3; both ranks resume their shards of the model and of
/// AdamW's state, and the last checkpoint's shards equal the uninterrupted run's.
#[test]
fn train_fsdp_on_two_hosts_restarts_every_host_and_resumes() {
    let r = kill_and_resume(
        "hosts_restarts_fsdp",
        "train_fsdp_crash",
        1,
        (12, 3),
        |dir| {
            [
                "--epochs",
                "1",
                "--max-steps",
                "12",
                "--checkpoint-every",
                "3",
            ]
            .map(String::from)
            .into_iter()
            .chain([
                "--checkpoint-dir".into(),
                dir.join("ckpt").to_string_lossy().into_owned(),
            ])
            .collect()
        },
    );
    let text = describe(&r.ended);
    for shard in 1..=2 {
        let file = format!("ckpt/step-00000012/shard-{shard:05}-model-00001-of-00001.safetensors");
        assert_close(
            &r.dir.join("run").join(&file),
            &r.dir.join("reference").join(&file),
            &text,
        );
    }
    eprintln!(
        "killed after step {}, resumed at step {}; {:.1?} in all",
        r.kill_at, r.last, r.took
    );
}

/// The same command line, `tch-dist-run ... --` or `torchrun ... --no-python`, with the
/// `--rdzv-conf` keys and `--local-addr` torchrun needs here (its host detection compares the
/// endpoint with the hostname's addresses, which the namespaces share: `is_host=1` on host 0;
/// `--local-addr`, or it would publish the shared hostname): host 1's rank fails on its first
/// start, and under both launchers both hosts restart and finish, host 0 without spending a
/// restart (its count stays 0), host 1 with one.
#[test]
fn the_same_command_lines_run_under_torchrun() {
    let hosts = Hosts::new(2);
    let torchrun = Path::new(env!("CARGO_MANIFEST_DIR")).join(".venv/bin/torchrun");
    for (program, separator) in [(launcher().to_path_buf(), "--"), (torchrun, "--no-python")] {
        // Host 0's rank waits in its first start only (its restart count stays 0: a mark).
        let dir = scratch("hosts_restarts_torchrun");
        let script = format!(
            "echo \"host=$HOST_INDEX rank=$RANK/$WORLD_SIZE count=$TORCHELASTIC_RESTART_COUNT\"; \
             if [ \"$HOST_INDEX\" = 1 ] && [ \"$TORCHELASTIC_RESTART_COUNT\" = 0 ]; then \
             sleep 1; exit 3; fi; \
             if [ \"$HOST_INDEX\" = 0 ] && [ ! -e {0}/waited ]; then touch {0}/waited; sleep 30; fi",
            dir.display()
        );
        let start = Instant::now();
        let jobs = (0..2)
            .map(|i| {
                let conf = if i == 0 {
                    format!("{CONF},is_host=1")
                } else {
                    CONF.to_string()
                };
                let mut cmd = hosts.command(i, &program);
                without_launch_vars(&mut cmd)
                    .args([
                        "--nnodes",
                        "2",
                        "--nproc-per-node",
                        "1",
                        "--max-restarts",
                        "1",
                    ])
                    .args(["--rdzv-backend", "c10d", "--rdzv-conf", &conf])
                    .args(["--rdzv-endpoint", &format!("{}:{PORT}", hosts.addr(0))])
                    .args([
                        "--local-addr",
                        &hosts.addr(i),
                        separator,
                        "sh",
                        "-c",
                        &script,
                    ])
                    .env("HOST_INDEX", i.to_string())
                    .env("GLOO_SOCKET_IFNAME", "eth0");
                Job::start(i, cmd)
            })
            .collect();
        let ended = Job::wait_all(jobs, Duration::from_secs(90));
        let text = format!("{}:\n{}", program.display(), describe(&ended));
        assert!(ended.iter().all(Ended::success), "{text}");
        let out: String = ended.iter().map(|e| e.stdout.as_str()).collect();
        for line in [
            "host=0 rank=0/2 count=0",
            "host=1 rank=1/2 count=0",
            "host=1 rank=1/2 count=1",
        ] {
            assert!(out.contains(line), "no `{line}` in {text}");
        }
        assert_eq!(out.matches("host=0 rank=0/2 count=0").count(), 2, "{text}");
        eprintln!("{}: {:.1?}", program.display(), start.elapsed());
    }
}
