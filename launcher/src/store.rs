//! Telling the job's ranks that one of them exited, through the c10d TCPStore that rank 0
//! hosts at MASTER_ADDR:MASTER_PORT: a minimal blocking client of the store's wire protocol,
//! and the launcher's only network client.
//!
//! Ranks still waiting for a rank that exited (in a rendezvous, a barrier) would otherwise
//! wait out their store timeout (30 minutes by default); with the launcher's report they can
//! fail within seconds, naming the rank. The launcher writes
//!
//! - `tch_dist/exited/<global rank>`: how the rank ended ([`describe_exit`]), and
//! - `tch_dist/exited_count`: one more per report (an ADD, so the launchers of several nodes
//!   count together).
//!
//! The protocol, as torch 2.11 speaks it (`TCPStore.cpp`, `TCPStoreLibUvBackend.cpp`,
//! `TCPStoreBackend.hpp`; the libuv server, torch's default, and the legacy one take the
//! same bytes; checked against both):
//!
//! - A request is one byte of `QueryType` (VALIDATE 0, SET 1, ADD 4, PING 13, ...) followed
//!   by its arguments, all little-endian (torch sends them in native byte order).
//! - Right after connecting, the client sends VALIDATE and the u32 magic 0x3C85F7CE; there
//!   is no reply.
//! - A key or a value is a u64 length followed by its bytes.
//! - SET is a key and a value, with no reply; ADD is a key and an i64 delta, and the reply is
//!   the key's new value as an i64.
//! - PyTorch's client puts "/" in front of every key it sends (its `keyPrefix_`), so the
//!   public key `tch_dist/exited/3` travels as `/tch_dist/exited/3`. The ranks read through
//!   PyTorch's client, so this one sends the prefixed form.
//!
//! Everything here is bounded by one deadline (resolving the address included) and every
//! failure is an error value: nothing that comes from the network can panic.

use std::io::{self, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream, ToSocketAddrs};
use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::supervise::signal_name;

/// The key that holds how global rank `rank` ended, as the ranks read it.
pub fn exited_key(rank: usize) -> String {
    format!("tch_dist/exited/{rank}")
}

/// The key that counts the exits reported to the store, as the ranks read it.
pub const EXITED_COUNT_KEY: &str = "tch_dist/exited_count";

/// Where the ranks' rendezvous keeps the run id of the job that owns the store (the first
/// rank to check in claims it): a launcher given another job's MASTER_PORT must not tell
/// that job's ranks that one of them exited.
pub const RUN_ID_KEY: &str = "tch_dist/run_id";

/// The longest value read back from a store (a run id is short): a peer that is not a store
/// cannot make the launcher allocate what it claims.
const MAX_VALUE_BYTES: u64 = 64 * 1024;

/// How long one report may take: short, since the supervision loop waits for it.
const REPORT_TIMEOUT: Duration = Duration::from_millis(500);

/// `QueryType::VALIDATE` (TCPStoreBackend.hpp).
const VALIDATE: u8 = 0;
/// `QueryType::SET`.
const SET: u8 = 1;
/// `QueryType::GET`.
const GET: u8 = 3;
/// `QueryType::ADD`.
const ADD: u8 = 4;
/// `QueryType::CHECK`.
const CHECK: u8 = 5;
/// `CheckResponseType::READY`: every key asked about exists.
const READY: u8 = 0;
/// `validationMagicNumber`: the server drops a client that validates with anything else.
const VALIDATION_MAGIC: u32 = 0x3C85_F7CE;
/// What PyTorch's client puts in front of every key (`TCPStore::keyPrefix_`).
const KEY_PREFIX: &str = "/";

/// How a reaped rank's first process ended, as the store's `tch_dist/exited/<rank>` says it:
/// `exited with status 1`, `was killed by signal 9 (SIGKILL)`.
pub fn describe_exit(status: ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exited with status {code}"),
        (None, Some(sig)) => match signal_name(sig) {
            Some(name) => format!("was killed by signal {sig} ({name})"),
            None => format!("was killed by signal {sig}"),
        },
        // Only a stopped or continued process has neither, and waitpid without WUNTRACED or
        // WCONTINUED reports neither.
        (None, None) => format!("ended ({status})"),
    }
}

/// Writes to the store at `addr:port` that global rank `global_rank` ended as `what`: SETs
/// `tch_dist/exited/<global_rank>` to `what`, then ADDs 1 to `tch_dist/exited_count`, and
/// returns the count's new value. The ADD's reply also proves that the SET, sent before it
/// on the same connection, arrived. A store that another run claimed (its
/// `tch_dist/run_id` is not `run_id`: the launcher was given another job's port) is left
/// alone: `Ok(None)`. One that no run claimed yet (rank 0 has not checked in: the very exits
/// worth reporting) is written to.
///
/// `addr` is a host name or an IP address, as MASTER_ADDR is for the ranks. Everything,
/// resolving the name included, ends within about `timeout`; a late step fails with
/// [`io::ErrorKind::TimedOut`]. Errors keep the kind of the failure (a store not listening
/// is [`io::ErrorKind::ConnectionRefused`]) with a message that says which step failed.
pub fn report_exit(
    addr: &str,
    port: u16,
    run_id: &str,
    global_rank: usize,
    what: &str,
    timeout: Duration,
) -> io::Result<Option<i64>> {
    let mut store = StoreClient::connect(addr, port, Instant::now() + timeout)?;
    if store.check(RUN_ID_KEY)? && store.get(RUN_ID_KEY)? != run_id.as_bytes() {
        return Ok(None);
    }
    store.set(&exited_key(global_rank), what.as_bytes())?;
    store.add(EXITED_COUNT_KEY, 1).map(Some)
}

/// Reports the exits of one start's ranks to the store at MASTER_ADDR:MASTER_PORT, best
/// effort: a report that fails is dropped, since the ranks then wait out their own timeout
/// as they would without the launcher's help, and the launcher's job (stopping the ranks)
/// must not wait for the store.
pub struct ExitReporter {
    addr: String,
    port: u16,
    /// The ranks' TORCHELASTIC_RUN_ID.
    run_id: String,
    /// Set once a report timed out: the store's host does not answer, and every further
    /// report would hold up the supervision loop for the whole timeout again.
    unreachable: bool,
    /// Exits the store refused, as (global rank, how it ended): a rank that exits before rank
    /// 0 opened the store is exactly the one the others will wait for, so its report is
    /// tried again ([`retry`](Self::retry)) until the store takes it.
    pending: Vec<(usize, String)>,
    /// When the pending reports were last tried.
    last_retry: Option<Instant>,
}

/// How often refused reports are tried again.
const RETRY_PERIOD: Duration = Duration::from_millis(250);

impl ExitReporter {
    /// Reports to the store that rank 0 hosts at `addr:port` (MASTER_ADDR, MASTER_PORT) for
    /// the run `run_id` (the ranks' TORCHELASTIC_RUN_ID).
    pub fn new(addr: &str, port: u16, run_id: &str) -> ExitReporter {
        ExitReporter {
            addr: addr.to_string(),
            port,
            run_id: run_id.to_string(),
            unreachable: false,
            pending: Vec::new(),
            last_retry: None,
        }
    }

    /// Tries the refused reports again, at most every 250 ms (the supervision loop calls it
    /// on every tick while the ranks run).
    pub fn retry(&mut self) {
        if self.pending.is_empty() || self.last_retry.is_some_and(|t| t.elapsed() < RETRY_PERIOD) {
            return;
        }
        self.last_retry = Some(Instant::now());
        for (rank, what) in std::mem::take(&mut self.pending) {
            self.send(rank, what);
        }
    }

    /// Reports that global rank `rank` ended with `status`, within about 500 ms. A store
    /// that is not there (not up yet, or gone with rank 0) is expected and passes silently;
    /// other failures are noted on stderr.
    pub fn report(&mut self, rank: usize, status: ExitStatus) {
        self.send(rank, describe_exit(status));
    }

    /// One try of one report; a refused one is kept for [`retry`](Self::retry).
    fn send(&mut self, rank: usize, what: String) {
        if self.unreachable {
            return;
        }
        let reported = report_exit(
            &self.addr,
            self.port,
            &self.run_id,
            rank,
            &what,
            REPORT_TIMEOUT,
        );
        let Err(e) = reported else {
            return;
        };
        // Refused: rank 0 has not opened the store yet (tried again later) or has exited (then
        // tried in vain until the launcher stops); reset, broken pipe or end of file: it
        // exited during the report. Both are the ordinary start and end of a job, not worth
        // a line.
        if e.kind() == io::ErrorKind::ConnectionRefused {
            self.pending.push((rank, what));
            return;
        }
        let store_gone = matches!(
            e.kind(),
            io::ErrorKind::ConnectionReset
                | io::ErrorKind::BrokenPipe
                | io::ErrorKind::UnexpectedEof
        );
        if !store_gone {
            eprintln!(
                "tch-dist-run: could not tell the ranks through the store at {}:{} that rank \
                 {rank} {what}: {e}",
                self.addr, self.port
            );
        }
        if e.kind() == io::ErrorKind::TimedOut {
            eprintln!("tch-dist-run: not reporting further exits of this start to the store");
            self.unreachable = true;
        }
    }
}

/// One connection to a TCPStore, validated, with every step bounded by `deadline`.
struct StoreClient {
    stream: TcpStream,
    deadline: Instant,
}

impl StoreClient {
    /// Connects to the first address of `addr:port` that accepts, and validates.
    fn connect(addr: &str, port: u16, deadline: Instant) -> io::Result<StoreClient> {
        let mut last_error = None;
        for socket_addr in resolve(addr, port, deadline)? {
            let attempt = remaining(deadline, "connecting")
                .and_then(|left| TcpStream::connect_timeout(&socket_addr, left));
            match attempt {
                Ok(stream) => {
                    let mut client = StoreClient { stream, deadline };
                    // A request and its reply are one small write and one small read each:
                    // do not let Nagle's algorithm hold the request back.
                    client
                        .stream
                        .set_nodelay(true)
                        .map_err(|e| context(e, "TCP_NODELAY"))?;
                    let mut validate = vec![VALIDATE];
                    validate.extend_from_slice(&VALIDATION_MAGIC.to_le_bytes());
                    client.send(&validate, "validating")?;
                    return Ok(client);
                }
                Err(e) => last_error = Some(context(e, &format!("connecting to {socket_addr}"))),
            }
        }
        Err(last_error.unwrap_or_else(|| {
            io::Error::new(io::ErrorKind::NotFound, format!("{addr} has no address"))
        }))
    }

    /// SET `key` (public form, without the prefix) to `value`; the server sends no reply.
    fn set(&mut self, key: &str, value: &[u8]) -> io::Result<()> {
        let mut request = vec![SET];
        push_key(&mut request, key);
        push_bytes(&mut request, value);
        self.send(&request, &format!("setting {key}"))
    }

    /// CHECK whether `key` (public form) exists, without waiting for it.
    fn check(&mut self, key: &str) -> io::Result<bool> {
        let mut request = vec![CHECK];
        request.extend_from_slice(&1u64.to_le_bytes());
        push_key(&mut request, key);
        let doing = format!("checking {key}");
        self.send(&request, &doing)?;
        let mut reply = [0u8; 1];
        self.receive(&mut reply, &doing)?;
        Ok(reply[0] == READY)
    }

    /// GET `key` (public form), which must exist (the server waits for a missing one).
    fn get(&mut self, key: &str) -> io::Result<Vec<u8>> {
        let mut request = vec![GET];
        push_key(&mut request, key);
        let doing = format!("getting {key}");
        self.send(&request, &doing)?;
        let mut len = [0u8; 8];
        self.receive(&mut len, &doing)?;
        let len = u64::from_le_bytes(len);
        if len > MAX_VALUE_BYTES {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{doing}: a value of {len} bytes is not a run id"),
            ));
        }
        let mut value = vec![0u8; len as usize];
        self.receive(&mut value, &doing)?;
        Ok(value)
    }

    /// Reads exactly `buf.len()` bytes of a reply before the deadline.
    fn receive(&mut self, buf: &mut [u8], doing: &str) -> io::Result<()> {
        remaining(self.deadline, doing)
            .and_then(|left| self.stream.set_read_timeout(Some(left)))
            .and_then(|()| self.stream.read_exact(buf))
            .map_err(|e| context(e, &format!("{doing}: reading the reply")))
    }

    /// ADD `delta` to `key` (public form); returns the key's new value.
    fn add(&mut self, key: &str, delta: i64) -> io::Result<i64> {
        let mut request = vec![ADD];
        push_key(&mut request, key);
        request.extend_from_slice(&delta.to_le_bytes());
        let doing = format!("adding to {key}");
        self.send(&request, &doing)?;
        let mut reply = [0u8; 8];
        self.receive(&mut reply, &doing)?;
        Ok(i64::from_le_bytes(reply))
    }

    /// Writes one whole request before the deadline.
    fn send(&mut self, request: &[u8], doing: &str) -> io::Result<()> {
        remaining(self.deadline, doing)
            .and_then(|left| self.stream.set_write_timeout(Some(left)))
            .and_then(|()| self.stream.write_all(request))
            .map_err(|e| context(e, doing))
    }
}

/// `key` as PyTorch's client sends it: prefixed, as a length and bytes.
fn push_key(request: &mut Vec<u8>, key: &str) {
    push_bytes(request, format!("{KEY_PREFIX}{key}").as_bytes());
}

/// A u64 length, then the bytes.
fn push_bytes(request: &mut Vec<u8>, bytes: &[u8]) {
    request.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
    request.extend_from_slice(bytes);
}

/// `addr:port`'s socket addresses, by the deadline. A name is looked up (getaddrinfo, as the
/// ranks' client does) on a thread of its own, since the lookup itself cannot be given a
/// timeout: one that hangs (a DNS server that does not answer) is left behind, and the
/// report fails at the deadline.
pub(crate) fn resolve(addr: &str, port: u16, deadline: Instant) -> io::Result<Vec<SocketAddr>> {
    if let Ok(ip) = addr.parse::<IpAddr>() {
        return Ok(vec![SocketAddr::new(ip, port)]);
    }
    let (found_tx, found_rx) = mpsc::channel();
    let host = addr.to_string();
    std::thread::Builder::new()
        .name("store address lookup".into())
        .spawn(move || {
            let found = (host.as_str(), port)
                .to_socket_addrs()
                .map(|addrs| addrs.collect::<Vec<_>>());
            // The receiver is gone when the lookup outlived the deadline.
            let _ = found_tx.send(found);
        })
        .map_err(|e| context(e, "starting the address lookup"))?;
    let looking_up = format!("looking up {addr}");
    let left = remaining(deadline, &looking_up)?;
    match found_rx.recv_timeout(left) {
        Ok(found) => found.map_err(|e| context(e, &looking_up)),
        Err(_) => Err(timed_out(&looking_up)),
    }
}

/// The time left until `deadline`, or a TimedOut error naming what was being done (a zero
/// timeout would mean "none" to the socket calls, or be refused by them).
fn remaining(deadline: Instant, doing: &str) -> io::Result<Duration> {
    Some(deadline.saturating_duration_since(Instant::now()))
        .filter(|left| !left.is_zero())
        .ok_or_else(|| timed_out(doing))
}

fn timed_out(doing: &str) -> io::Error {
    io::Error::new(io::ErrorKind::TimedOut, format!("{doing}: timed out"))
}

/// `e` with what was being done in front, keeping its kind. A socket timeout reads as
/// WouldBlock (EAGAIN) on Linux; it is reported as the timeout it is.
fn context(e: io::Error, doing: &str) -> io::Error {
    let kind = match e.kind() {
        io::ErrorKind::WouldBlock => io::ErrorKind::TimedOut,
        kind => kind,
    };
    io::Error::new(kind, format!("{doing}: {e}"))
}

#[cfg(test)]
#[path = "../tests/common/tcp_store.rs"]
#[allow(dead_code)] // shared with tests/launcher.rs, which uses the rest
mod tcp_store;

#[cfg(test)]
mod tests {
    use super::tcp_store::TcpStoreServer;
    use super::*;

    /// What the launcher writes is what PyTorch's client reads: the value under the public
    /// key, and a counter that every report adds one to.
    #[test]
    fn reports_reach_a_real_tcp_store() {
        let mut server = TcpStoreServer::start();
        let timeout = Duration::from_secs(10);
        // No run claimed the store yet: the report is written.
        let count = report_exit(
            "127.0.0.1",
            server.port(),
            RUN,
            3,
            "exited with status 0",
            timeout,
        )
        .expect("the first report");
        assert_eq!(count, Some(1));
        assert_eq!(server.get("tch_dist/exited/3"), "exited with status 0");
        assert_eq!(server.count("tch_dist/exited_count"), 1);

        // Claimed by this run, and a host name, resolved like the ranks resolve MASTER_ADDR.
        server.set(RUN_ID_KEY, RUN);
        let what = "was killed by signal 9 (SIGKILL)";
        let count = report_exit("localhost", server.port(), RUN, 5, what, timeout)
            .expect("the second report");
        assert_eq!(count, Some(2));
        assert_eq!(server.get("tch_dist/exited/5"), what);
        assert_eq!(server.count("tch_dist/exited_count"), 2);
        assert_eq!(server.get("tch_dist/exited/3"), "exited with status 0");
        assert_eq!(server.get("tch_dist/exited/4"), "<missing>");
    }

    /// The run id the ranks get (`TORCHELASTIC_RUN_ID`), in these tests.
    const RUN: &str = "tch-dist-run-test";

    /// A rank that exits before rank 0 opened the store (the one the others will wait for):
    /// its refused report is tried again until the store takes it.
    #[test]
    fn a_report_refused_before_the_store_opens_is_tried_again() {
        let port = std::net::TcpListener::bind(("127.0.0.1", 0))
            .and_then(|listener| listener.local_addr())
            .expect("a free port")
            .port();
        let mut reporter = ExitReporter::new("127.0.0.1", port, RUN);
        reporter.report(1, ExitStatus::from_raw(0));
        assert_eq!(reporter.pending, [(1, "exited with status 0".to_string())]);
        let mut server = TcpStoreServer::start_at(port);
        let deadline = Instant::now() + Duration::from_secs(20);
        while !reporter.pending.is_empty() && Instant::now() < deadline {
            std::thread::sleep(RETRY_PERIOD);
            reporter.retry();
        }
        assert!(
            reporter.pending.is_empty(),
            "still pending: {:?}",
            reporter.pending
        );
        assert_eq!(server.get("tch_dist/exited/1"), "exited with status 0");
        assert_eq!(server.count("tch_dist/exited_count"), 1);
    }

    /// A store another run claimed (the launcher was given that job's port): nothing is
    /// written, and no error either.
    #[test]
    fn a_store_of_another_run_is_left_alone() {
        let mut server = TcpStoreServer::start();
        server.set(RUN_ID_KEY, "another-job");
        let reported = report_exit(
            "127.0.0.1",
            server.port(),
            RUN,
            2,
            "exited with status 0",
            Duration::from_secs(10),
        )
        .expect("a report that writes nothing");
        assert_eq!(reported, None);
        assert_eq!(server.get("tch_dist/exited/2"), "<missing>");
        assert_eq!(server.count("tch_dist/exited_count"), 0);
    }

    /// Nothing listening: an error, at once (refused), not a panic or a wait.
    #[test]
    fn a_report_to_a_closed_port_fails_quickly() {
        // A port that was free a moment ago and is closed again.
        let port = std::net::TcpListener::bind(("127.0.0.1", 0))
            .and_then(|listener| listener.local_addr())
            .expect("a free port")
            .port();
        let start = Instant::now();
        let result = report_exit(
            "127.0.0.1",
            port,
            RUN,
            0,
            "exited with status 1",
            REPORT_TIMEOUT,
        );
        let took = start.elapsed();
        let e = result.expect_err("nothing listens");
        assert_eq!(e.kind(), io::ErrorKind::ConnectionRefused, "{e}");
        assert!(e.to_string().contains("connecting to 127.0.0.1:"), "{e}");
        assert!(took < Duration::from_secs(2), "took {took:?}");
    }

    /// A peer that accepts but never answers the ADD: the report ends at its deadline.
    #[test]
    fn a_silent_peer_times_the_report_out() {
        let listener = std::net::TcpListener::bind(("127.0.0.1", 0)).expect("a listener");
        let port = listener.local_addr().expect("its address").port();
        let start = Instant::now();
        let result = report_exit(
            "127.0.0.1",
            port,
            RUN,
            0,
            "exited with status 1",
            REPORT_TIMEOUT,
        );
        let took = start.elapsed();
        let e = result.expect_err("no reply comes");
        assert_eq!(e.kind(), io::ErrorKind::TimedOut, "{e}");
        assert!(e.to_string().contains("checking tch_dist/run_id"), "{e}");
        assert!(
            took >= REPORT_TIMEOUT / 2 && took < Duration::from_secs(2),
            "took {took:?}"
        );
        drop(listener);
    }

    /// The bytes on the wire, exactly (what the real store accepts, above); and a peer that
    /// hangs up instead of answering is an error, not a panic.
    #[test]
    fn a_report_is_validate_set_add_with_prefixed_keys() {
        let listener = std::net::TcpListener::bind(("127.0.0.1", 0)).expect("a listener");
        let port = listener.local_addr().expect("its address").port();
        let peer = std::thread::spawn(move || {
            let (mut conn, _) = listener.accept().expect("the report's connection");
            conn.set_read_timeout(Some(Duration::from_secs(10)))
                .expect("a read timeout");
            // VALIDATE and the CHECK of the run id, answered NOT_READY (unclaimed).
            let mut request = vec![0u8; 5 + 33];
            conn.read_exact(&mut request)
                .expect("the validation and the check");
            conn.write_all(&[1]).expect("the check's reply");
            let mut rest = vec![0u8; 94];
            conn.read_exact(&mut rest).expect("the SET and the ADD");
            request.extend_from_slice(&rest);
            // Then hang up without the ADD's reply.
            request
        });
        let e = report_exit(
            "127.0.0.1",
            port,
            RUN,
            7,
            "exited with status 2",
            Duration::from_secs(10),
        )
        .expect_err("no reply comes");
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof, "{e}");
        let request = peer.join().expect("the peer thread");

        let mut expected = vec![0u8]; // VALIDATE
        expected.extend_from_slice(&0x3C85_F7CEu32.to_le_bytes());
        expected.push(5); // CHECK, one key
        expected.extend_from_slice(&1u64.to_le_bytes());
        expected.extend_from_slice(&16u64.to_le_bytes());
        expected.extend_from_slice(b"/tch_dist/run_id");
        expected.push(1); // SET
        expected.extend_from_slice(&18u64.to_le_bytes());
        expected.extend_from_slice(b"/tch_dist/exited/7");
        expected.extend_from_slice(&20u64.to_le_bytes());
        expected.extend_from_slice(b"exited with status 2");
        expected.push(4); // ADD
        expected.extend_from_slice(&22u64.to_le_bytes());
        expected.extend_from_slice(b"/tch_dist/exited_count");
        expected.extend_from_slice(&1i64.to_le_bytes());
        assert_eq!(request, expected);
    }

    #[test]
    fn exits_are_described_by_status_or_signal() {
        assert_eq!(
            describe_exit(ExitStatus::from_raw(0)),
            "exited with status 0"
        );
        assert_eq!(
            describe_exit(ExitStatus::from_raw(3 << 8)),
            "exited with status 3"
        );
        assert_eq!(
            describe_exit(ExitStatus::from_raw(libc::SIGKILL)),
            "was killed by signal 9 (SIGKILL)"
        );
        // With the core-dump bit set.
        assert_eq!(
            describe_exit(ExitStatus::from_raw(libc::SIGSEGV | 0x80)),
            "was killed by signal 11 (SIGSEGV)"
        );
        assert_eq!(
            describe_exit(ExitStatus::from_raw(libc::SIGRTMIN() + 1)),
            format!("was killed by signal {}", libc::SIGRTMIN() + 1)
        );
    }
}
