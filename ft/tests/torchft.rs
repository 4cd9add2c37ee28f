//! tch-dist's lighthouse, managers and clients against PyTorch's torchft (the `torchft` 0.2.0
//! wheel in the project's venv, which `make setup` installs): both ways round, one shared
//! quorum of a tch-dist replica group and a torchft one. Every peer process is killed when
//! its test ends, and every call has a deadline.

use std::io::{BufRead, BufReader};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::thread;
use std::time::Duration;

use serde_json::Value;
use tch_dist_ft::{
    LighthouseClient, LighthouseOptions, LighthouseServer, ManagerClient, ManagerOptions,
    ManagerQuorumRequest, ManagerQuorumResponse, ManagerServer, QuorumMember,
};

const T: Duration = Duration::from_secs(20);
const PEER: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/torchft_peer.py");
const PYTHON: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../.venv/bin/python");

/// A torchft peer process, killed on drop (also when the test fails).
struct Peer {
    child: Child,
    stdin: Option<ChildStdin>,
}

impl Peer {
    fn start(args: &[&str]) -> (Peer, BufReader<std::process::ChildStdout>) {
        let mut child = Command::new(PYTHON)
            .arg(PEER)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            // torchft's INFO log of every quorum; the peer reports its errors on stdout.
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("{PYTHON} {PEER}: {e} (make setup installs the venv)"));
        let stdout = BufReader::new(child.stdout.take().expect("piped"));
        let stdin = child.stdin.take();
        (Peer { child, stdin }, stdout)
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        drop(self.stdin.take());
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One line of the peer's output, within 90 s (a watchdog kills the peer otherwise).
fn line_within(peer: &mut Peer, out: &mut BufReader<std::process::ChildStdout>) -> String {
    let pid = peer.child.id();
    let (done, watch) = std::sync::mpsc::channel::<()>();
    let watchdog = thread::spawn(move || {
        if watch.recv_timeout(Duration::from_secs(90)).is_err() {
            let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
        }
    });
    let mut line = String::new();
    let read = out.read_line(&mut line);
    let _ = done.send(());
    let _ = watchdog.join();
    read.expect("reading the peer");
    assert!(!line.is_empty(), "the torchft peer ended without output");
    line
}

fn manager(replica_id: &str, lighthouse: &str, store: &str) -> ManagerServer {
    manager_of(replica_id, lighthouse, store, 1)
}

/// What `tch_dist::ft::Manager` runs: a manager that shares quorums with tch-dist groups
/// only.
fn training_manager(replica_id: &str, lighthouse: &str) -> ManagerServer {
    ManagerServer::start(ManagerOptions {
        members: tch_dist_ft::QuorumMembers::TchDistOnly,
        ..manager_options(replica_id, lighthouse, "127.0.0.1:3333", 1)
    })
    .expect("a manager")
}

/// A manager of a group of `world_size` ranks.
fn manager_of(replica_id: &str, lighthouse: &str, store: &str, world_size: u64) -> ManagerServer {
    ManagerServer::start(manager_options(replica_id, lighthouse, store, world_size))
        .expect("a manager")
}

/// These tests' manager settings.
fn manager_options(
    replica_id: &str,
    lighthouse: &str,
    store: &str,
    world_size: u64,
) -> ManagerOptions {
    ManagerOptions {
        replica_id: replica_id.into(),
        lighthouse_addr: lighthouse.into(),
        hostname: "127.0.0.1".into(),
        bind: "127.0.0.1:0".into(),
        store_addr: store.into(),
        world_size,
        heartbeat_interval: Duration::from_millis(100),
        connect_timeout: Duration::from_secs(10),
        quorum_retries: 0,
        members: Default::default(),
    }
}

/// Each client's quorum for (step, commit_failures), asked at once.
fn quorums(
    clients: &[&ManagerClient],
    step: i64,
    commit_failures: i64,
) -> Vec<ManagerQuorumResponse> {
    thread::scope(|s| {
        let asked: Vec<_> = clients
            .iter()
            .map(|c| {
                s.spawn(move || {
                    c.quorum(
                        ManagerQuorumRequest {
                            group_rank: 0,
                            step,
                            checkpoint_metadata: format!("step {step}"),
                            init_sync: true,
                            commit_failures,
                            ..Default::default()
                        },
                        T,
                    )
                })
            })
            .collect();
        asked
            .into_iter()
            .map(|h| h.join().expect("no panic").expect("a quorum"))
            .collect()
    })
}

/// A tch-dist lighthouse on 127.0.0.1 (any port) with torchft's defaults otherwise.
fn lighthouse_on_loopback(min_replicas: u64) -> LighthouseServer {
    LighthouseServer::start(LighthouseOptions {
        bind: "127.0.0.1:0".into(),
        ..LighthouseOptions::new(min_replicas)
    })
    .expect("a lighthouse")
}

#[test]
fn tch_dist_groups_form_quorums_at_torchfts_lighthouse() {
    let (mut peer, mut out) = Peer::start(&["lighthouse", "2", "100"]);
    let line = line_within(&mut peer, &mut out);
    let port = line.trim().strip_prefix("port ").expect("`port N`");
    let lighthouse = format!("http://127.0.0.1:{port}");

    let heartbeat = LighthouseClient::connect(&lighthouse, T).expect("connect");
    heartbeat
        .heartbeat("replica_9:probe", T)
        .expect("torchft's lighthouse takes a heartbeat");

    let m0 = manager("replica_0:rs", &lighthouse, "127.0.0.1:1000");
    let m1 = manager("replica_1:rs", &lighthouse, "127.0.0.1:1001");
    let c0 = ManagerClient::connect(&m0.address(), T).expect("connect");
    let c1 = ManagerClient::connect(&m1.address(), T).expect("connect");

    // Step 0 with init_sync: replica_1 heals from replica_0, both meet at replica_0's store.
    let first = quorums(&[&c0, &c1], 0, 0);
    assert_eq!(first[0].quorum_id, first[1].quorum_id);
    assert_eq!(first[0].replica_ids, ["replica_0:rs", "replica_1:rs"]);
    assert_eq!((first[0].replica_rank, first[1].replica_rank), (0, 1));
    assert_eq!(first[0].replica_world_size, 2);
    assert!(!first[0].heal);
    assert_eq!(first[0].recover_dst_replica_ranks, [1]);
    assert!(first[1].heal);
    assert_eq!(first[1].recover_src_manager_address, m0.address());
    assert_eq!(first[1].store_address, "127.0.0.1:1000");
    assert_eq!(c1.checkpoint_metadata(0, T).expect("kept"), "step 0");
    for c in [&c0, &c1] {
        assert!(c.should_commit(0, 0, true, T).expect("a vote"));
    }

    // Step 1, the same members: torchft's fast quorum under the same id, nobody heals.
    let second = quorums(&[&c0, &c1], 1, 0);
    assert_eq!(second[0].quorum_id, first[0].quorum_id);
    assert!(second.iter().all(|r| !r.heal && r.max_world_size == 2));

    // A reported commit failure: a new quorum id, so the groups rebuild their process group.
    let third = quorums(&[&c0, &c1], 1, 1);
    assert_eq!(third[0].quorum_id, first[0].quorum_id + 1);
    assert_eq!(third[1].commit_failures, 1);
}

#[test]
fn a_torchft_group_and_a_tch_dist_group_share_a_tch_dist_lighthouse() {
    let lighthouse = LighthouseServer::start(LighthouseOptions {
        bind: "127.0.0.1:0".into(),
        join_timeout: Duration::from_millis(100),
        ..LighthouseOptions::new(2)
    })
    .expect("a lighthouse");
    let ours = manager("replica_1:rs", &lighthouse.address(), "127.0.0.1:2222");
    // torchft's ManagerClient drives both groups' rank 0: its requests carry its deadline
    // header the way ours do, and its manager asks our lighthouse.
    let (mut peer, mut out) = Peer::start(&["groups", &lighthouse.address(), &ours.address()]);
    let line = line_within(&mut peer, &mut out);
    let got: Value = serde_json::from_str(&line).expect("one JSON object");
    assert_eq!(got["errors"], serde_json::json!([]), "{got}");
    let (py, rs) = (&got["py"], &got["rs"]);
    assert_eq!(py["quorum_id"], rs["quorum_id"]);
    assert_eq!(
        py["replica_ids"],
        serde_json::json!(["replica_0:py", "replica_1:rs"])
    );
    assert_eq!(
        (py["replica_rank"].as_i64(), rs["replica_rank"].as_i64()),
        (Some(0), Some(1))
    );
    assert_eq!(py["heal"], false);
    assert_eq!(py["recover_dst_replica_ranks"], serde_json::json!([1]));
    assert_eq!(rs["heal"], true);
    assert_eq!(rs["recover_src_manager_address"], got["py_manager"]);
    assert_eq!(rs["recover_src_replica_rank"], 0);
    for r in [py, rs] {
        assert_eq!(r["store_address"], "127.0.0.1:1111");
        assert_eq!(r["max_world_size"], 2);
    }
    assert_eq!(got["py_commit"], true);
    assert_eq!(got["rs_commit"], true);
    assert_eq!(got["rs_metadata"], "rs-meta");
}

#[test]
fn a_manager_refuses_a_rank_outside_its_group_and_a_call_without_deadline_errs_fast() {
    let lighthouse = lighthouse_on_loopback(1);
    let m = manager("replica_0:rs", &lighthouse.address(), "127.0.0.1:3333");
    let c = ManagerClient::connect(&m.address(), T).expect("connect");
    let err = c
        .quorum(
            ManagerQuorumRequest {
                group_rank: 1,
                ..Default::default()
            },
            T,
        )
        .expect_err("group rank 1 of a group of one");
    assert_eq!(
        err.to_string(),
        format!(
            "manager quorum at {}: the peer answered InvalidArgument",
            m.address()
        )
    );
    assert_eq!(
        std::error::Error::source(&err).map(|s| s.to_string()),
        Some("group rank 1 is not in 0..1 (the manager of replica_0:rs)".to_string())
    );
    // A group of three whose rank 1 never asks (it made no manager, say): rank 0 and 2 are
    // told which rank is missing before their deadline, not left to time out.
    let trio = manager_of("replica_1:rs", &lighthouse.address(), "127.0.0.1:3333", 3);
    let c = ManagerClient::connect(&trio.address(), T).expect("connect");
    let errs: Vec<_> = thread::scope(|s| {
        let asked: Vec<_> = [0, 2]
            .map(|group_rank| {
                let c = &c;
                s.spawn(move || {
                    c.quorum(
                        ManagerQuorumRequest {
                            group_rank,
                            step: 7,
                            ..Default::default()
                        },
                        Duration::from_millis(500),
                    )
                    .expect_err("rank 1 never asks")
                })
            })
            .into_iter()
            .collect();
        asked
            .into_iter()
            .map(|h| h.join().expect("no panic"))
            .collect()
    });
    for err in errs {
        assert_eq!(
            err.kind(),
            &tch_dist_ft::FtErrorKind::Rpc(tch_dist_ft::RpcCode::FailedPrecondition),
            "{err}"
        );
        assert_eq!(
            std::error::Error::source(&err).map(|s| s.to_string()),
            Some(
                "group ranks [1] of replica_1:rs did not ask for the quorum of step 7 within \
                 500ms (every rank of a replica group makes a manager and begins each step \
                 with start_quorum)"
                    .to_string()
            )
        );
    }
    // A lighthouse that never forms the quorum (min_replicas 2 of one group): the deadline.
    let lonely = lighthouse_on_loopback(2);
    let client = LighthouseClient::connect(&lonely.address(), T).expect("connect");
    let start = std::time::Instant::now();
    let err = client
        .quorum(
            QuorumMember {
                replica_id: "replica_0:rs".into(),
                world_size: 1,
                ..Default::default()
            },
            Duration::from_millis(10),
        )
        .expect_err("no quorum of one");
    assert!(
        start.elapsed() < Duration::from_secs(1),
        "{:?}",
        start.elapsed()
    );
    assert_eq!(
        err.kind(),
        &tch_dist_ft::FtErrorKind::TimedOut(Duration::from_millis(10))
    );
}

/// `method path` over HTTP/1.1 at `address` (`http://host:port`): the status code and the
/// body.
fn http(address: &str, method: &str, path: &str) -> (u16, String) {
    use std::io::{Read, Write};
    let host = address.trim_start_matches("http://");
    let mut stream = std::net::TcpStream::connect(host).expect("the lighthouse's port");
    stream.set_read_timeout(Some(T)).expect("a timeout");
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: {host}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    )
    .expect("a request");
    let mut response = String::new();
    stream.read_to_string(&mut response).expect("a response");
    let code = response
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no status line: {response}"));
    let body = response
        .split_once("\r\n\r\n")
        .map_or("", |(_, b)| b)
        .to_string();
    (code, body)
}

#[test]
fn the_dashboard_shows_a_torchft_group_asking_and_its_kill_button_ends_it() {
    let lighthouse = lighthouse_on_loopback(2);
    let address = lighthouse.address();
    let (code, page) = http(&address, "GET", "/status");
    assert_eq!(code, 200, "{page}");
    assert!(page.contains("<p>min_replicas 2, join timeout 60s, heartbeat timeout 5s</p>"));
    assert!(
        page.contains("<h2>Last quorum</h2>\n<p>none yet</p>"),
        "{page}"
    );
    // A torchft group (the wheel's manager) asks for a quorum of one, which min_replicas 2
    // never forms: the page lists it among the groups asking.
    let (mut peer, mut out) = Peer::start(&["asking", &address]);
    assert_eq!(line_within(&mut peer, &mut out).trim(), "asking");
    let deadline = std::time::Instant::now() + T;
    let page = loop {
        let (_, page) = http(&address, "GET", "/");
        if page.contains("<tr><td>replica_0:py</td><td>5</td><td>1</td>") {
            break page;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "never listed:\n{page}"
        );
        thread::sleep(Duration::from_millis(50));
    };
    assert!(
        page.contains("<p>waiting: 1 groups ask for a quorum, min_replicas is 2</p>"),
        "{page}"
    );
    assert!(page.contains("<tr><td>replica_0:py</td><td>"), "{page}");
    // No such group: nothing is asked of anyone.
    let (code, body) = http(&address, "POST", "/replica/replica_9:rs/kill");
    assert_eq!(
        (code, body.as_str()),
        (
            404,
            "no replica group replica_9:rs is asking for a quorum or in the last one"
        )
    );
    // The kill button: torchft's manager ends its process.
    let (code, body) = http(&address, "POST", "/replica/replica_0:py/kill");
    assert_eq!(code, 200, "{body}");
    assert!(
        body.starts_with("asked replica group replica_0:py (its manager at http://127.0.0.1:"),
        "{body}"
    );
    let deadline = std::time::Instant::now() + T;
    let status = loop {
        if let Some(status) = peer.child.try_wait().expect("the peer's status") {
            break status;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the peer survived its kill"
        );
        thread::sleep(Duration::from_millis(20));
    };
    assert!(!status.success(), "{status:?}");
}

#[test]
fn a_training_manager_refuses_a_quorum_with_a_torchft_group_naming_it() {
    let lighthouse = lighthouse_on_loopback(2);
    let address = lighthouse.address();
    let m = training_manager("replica_1:rs", &address);
    let c = ManagerClient::connect(&m.address(), T).expect("connect");
    // A torchft group asks too: the lighthouse forms a quorum of both (the control plane is
    // torchft's), and the tch-dist group, which would average with it, refuses it.
    let (mut peer, mut out) = Peer::start(&["asking", &address]);
    assert_eq!(line_within(&mut peer, &mut out).trim(), "asking");
    let err = c
        .quorum(
            ManagerQuorumRequest {
                group_rank: 0,
                step: 5,
                ..Default::default()
            },
            T,
        )
        .expect_err("a quorum with a torchft group");
    assert_eq!(
        err.kind(),
        &tch_dist_ft::FtErrorKind::Rpc(tch_dist_ft::RpcCode::FailedPrecondition),
        "{err}"
    );
    let why = std::error::Error::source(&err)
        .map(|s| s.to_string())
        .unwrap_or_default();
    assert!(
        why.starts_with("replica group replica_0:py of quorum ")
            && why.ends_with(
                " is no tch-dist group (a torchft group, say): it shares the lighthouse, but \
                 cannot average with tch-dist's groups (their cross-group collectives differ)"
            ),
        "{why}"
    );
}
