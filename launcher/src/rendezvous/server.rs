//! The hosting launcher's server: a TCP listener on the endpoint's address (not every
//! interface), one request and one reply per connection, served on a thread of their own
//! (at most [`MAX_CONNECTIONS`] at once, each bounded by [`CONNECTION_LIMIT`] and
//! [`MAX_LINE`]). A stray connection, a port scanner or garbage bytes
//! get a `refused` line at most, and change nothing.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::round::{Rendezvous, Reply, Rules};
use super::wire::{self, MAX_LINE};

/// Connections served at once; more are closed at once.
pub const MAX_CONNECTIONS: usize = 64;

/// How long one connection may take to send its request and take its reply.
pub const CONNECTION_LIMIT: Duration = Duration::from_secs(5);

/// The rendezvous this launcher hosts.
pub struct Server {
    state: Arc<Mutex<Rendezvous>>,
    addr: SocketAddr,
}

/// The state, also after a panic elsewhere while it was held (none is expected: it is
/// plain data, and every step of it is total).
fn lock(m: &Mutex<Rendezvous>) -> MutexGuard<'_, Rendezvous> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Server {
    /// Serves the rendezvous of `run_id` under `rules` on `listener`, from a thread of its
    /// own that lives as long as the launcher.
    pub fn start(listener: TcpListener, rules: Rules, run_id: &str) -> Result<Server, String> {
        let addr = listener
            .local_addr()
            .map_err(|e| format!("the rendezvous listener has no address: {e}"))?;
        let state = Arc::new(Mutex::new(Rendezvous::new(rules)));
        let (shared, run_id) = (state.clone(), run_id.to_string());
        std::thread::Builder::new()
            .name("rendezvous server".into())
            .spawn(move || accept_loop(listener, shared, run_id))
            .map_err(|e| format!("cannot start the rendezvous server: {e}"))?;
        Ok(Server { state, addr })
    }

    /// Where it listens.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Waits, once the rendezvous is closed, until every node has heard of it (or died), at
    /// most `limit`, or until `stop()` says so (a signal): the other launchers learn from
    /// this one's server why the job ends. Returns whether all heard.
    pub fn linger(&self, limit: Duration, stop: impl Fn() -> bool) -> bool {
        let deadline = Instant::now() + limit;
        loop {
            let told = {
                let mut state = lock(&self.state);
                state.tick(Instant::now());
                state.closure().is_none() || state.everyone_told()
            };
            if told {
                return true;
            }
            if stop() || Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

fn accept_loop(listener: TcpListener, state: Arc<Mutex<Rendezvous>>, run_id: String) {
    let active = Arc::new(AtomicUsize::new(0));
    let run_id = Arc::new(run_id);
    for conn in listener.incoming() {
        let Ok(conn) = conn else {
            // Out of descriptors, or a connection reset before it was accepted.
            std::thread::sleep(Duration::from_millis(10));
            continue;
        };
        if active.fetch_add(1, Ordering::SeqCst) >= MAX_CONNECTIONS {
            active.fetch_sub(1, Ordering::SeqCst);
            continue;
        }
        let (state, run_id, count) = (state.clone(), run_id.clone(), active.clone());
        let spawned = std::thread::Builder::new()
            .name("rendezvous connection".into())
            .spawn(move || {
                serve(conn, &state, &run_id);
                count.fetch_sub(1, Ordering::SeqCst);
            });
        if spawned.is_err() {
            active.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

/// One connection: a request line, a reply line, closed.
fn serve(mut conn: TcpStream, state: &Mutex<Rendezvous>, run_id: &str) {
    let deadline = Instant::now() + CONNECTION_LIMIT;
    let Ok(line) = read_line(&mut conn, deadline) else {
        return;
    };
    let reply = answer(&line, state, run_id, Instant::now());
    let _ = write_all(&mut conn, wire::encode_reply(&reply).as_bytes(), deadline);
}

/// The reply to one request line.
pub fn answer(line: &str, state: &Mutex<Rendezvous>, run_id: &str, now: Instant) -> Reply {
    match wire::decode_request(line) {
        Err(e) => Reply::Refused {
            why: format!("not understood: {e}"),
        },
        Ok(e) if e.run_id != run_id => Reply::Refused {
            why: format!(
                "this rendezvous is run {run_id:?}'s, not run {:?}'s (node {})",
                e.run_id,
                e.request.node()
            ),
        },
        Ok(e) => lock(state).handle(now, e.request),
    }
}

/// Reads one line (up to and with its newline) of at most [`MAX_LINE`] bytes by `deadline`.
pub fn read_line(stream: &mut TcpStream, deadline: Instant) -> io::Result<String> {
    let mut line = Vec::with_capacity(256);
    let mut buf = [0u8; 512];
    loop {
        let left = remaining(deadline)?;
        stream.set_read_timeout(Some(left))?;
        let n = match stream.read(&mut buf) {
            Ok(0) => {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "the connection closed before a whole line",
                ))
            }
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                return Err(io::Error::new(io::ErrorKind::TimedOut, "timed out"))
            }
            Err(e) => return Err(e),
        };
        line.extend_from_slice(&buf[..n]);
        if let Some(end) = line.iter().position(|&b| b == b'\n') {
            line.truncate(end + 1);
            return String::from_utf8(line).map_err(|_| {
                io::Error::new(io::ErrorKind::InvalidData, "a line that is not UTF-8")
            });
        }
        if line.len() >= MAX_LINE {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("a line longer than {MAX_LINE} bytes"),
            ));
        }
    }
}

/// Writes `bytes` whole by `deadline`.
pub fn write_all(stream: &mut TcpStream, bytes: &[u8], deadline: Instant) -> io::Result<()> {
    stream.set_write_timeout(Some(remaining(deadline)?))?;
    stream.write_all(bytes).map_err(|e| match e.kind() {
        io::ErrorKind::WouldBlock => io::Error::new(io::ErrorKind::TimedOut, "timed out"),
        _ => e,
    })
}

/// The time left until `deadline`; a TimedOut error once none is (a zero timeout means
/// "none" to the socket calls).
pub fn remaining(deadline: Instant) -> io::Result<Duration> {
    Some(deadline.saturating_duration_since(Instant::now()))
        .filter(|d| !d.is_zero())
        .ok_or_else(|| io::Error::new(io::ErrorKind::TimedOut, "timed out"))
}

#[cfg(test)]
mod tests {
    use super::super::round::{Member, NodeId, Request};
    use super::super::wire::Envelope;
    use super::*;

    fn rules() -> Rules {
        Rules {
            min_nodes: 2,
            max_nodes: 2,
            last_call: Duration::from_secs(30),
            keep_alive_interval: Duration::from_secs(5),
            keep_alive_max_attempt: 3,
        }
    }

    fn ask(addr: SocketAddr, bytes: &[u8]) -> io::Result<String> {
        let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
        s.write_all(bytes)?;
        // Nothing more comes: a server waiting for the rest of a line sees the end at once.
        s.shutdown(std::net::Shutdown::Write)?;
        read_line(&mut s, Instant::now() + Duration::from_secs(10))
    }

    fn join(i: u32) -> Vec<u8> {
        wire::encode_request(&Envelope {
            run_id: "run".into(),
            request: Request::Join {
                id: NodeId {
                    addr: "127.0.0.1".into(),
                    pid: i,
                    token: 0,
                },
                member: Member {
                    nproc: 1,
                    ports: [1000, 1001],
                },
                nnodes: (2, 2),
            },
        })
        .into_bytes()
    }

    /// Garbage, a request of another run, a line too long, a connection that sends half a
    /// line and hangs, one that sends nothing: none changes the rendezvous, and a real join
    /// served in between (and after) is answered.
    #[test]
    fn strays_and_garbage_change_nothing() {
        let listener = TcpListener::bind("127.0.0.1:0").expect("a listener");
        let server = Server::start(listener, rules(), "run").expect("the server");
        let addr = server.addr();
        // Silent and half-line connections, held open while the rest goes on.
        let silent = TcpStream::connect(addr).expect("a silent connection");
        let mut half = TcpStream::connect(addr).expect("a half-line connection");
        half.write_all(b"tdrdzv1 jo").expect("half a line");

        let reply = ask(addr, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").expect("a reply");
        assert!(
            reply.starts_with("tdrdzv1 refused why=not%20understood"),
            "{reply}"
        );
        let reply = ask(addr, &[0xff; 100]).expect_err("no line: the connection ends");
        assert_eq!(reply.kind(), io::ErrorKind::UnexpectedEof, "{reply}");
        let other = String::from_utf8(join(1))
            .expect("text")
            .replace("run=run", "run=other");
        let reply = ask(addr, other.as_bytes()).expect("a reply");
        assert!(
            reply.contains("refused") && reply.contains("\"other\""),
            "{reply}"
        );
        let long = vec![b'a'; 3 * MAX_LINE];
        assert!(ask(addr, &long).is_err());

        let first = ask(addr, &join(1)).expect("the first join");
        assert!(
            first.starts_with("tdrdzv1 waiting round=0 present=1 "),
            "{first}"
        );
        let second = ask(addr, &join(2)).expect("the second join");
        assert!(
            second.starts_with("tdrdzv1 assigned round=0 group_rank=1 "),
            "{second}"
        );
        drop((silent, half));
    }

    /// A stuck client holds its connection's thread for at most the connection limit.
    #[test]
    fn a_silent_connection_is_dropped_at_its_limit() {
        let listener = TcpListener::bind("127.0.0.1:0").expect("a listener");
        let server = Server::start(listener, rules(), "run").expect("the server");
        let mut silent = TcpStream::connect(server.addr()).expect("a connection");
        let start = Instant::now();
        let mut buf = [0u8; 16];
        silent
            .set_read_timeout(Some(Duration::from_secs(20)))
            .expect("a timeout");
        let n = silent.read(&mut buf).unwrap_or(0);
        assert_eq!(n, 0, "no reply to nothing");
        let took = start.elapsed();
        assert!(
            took >= CONNECTION_LIMIT - Duration::from_millis(100),
            "{took:?}"
        );
        assert!(took < CONNECTION_LIMIT + Duration::from_secs(3), "{took:?}");
    }
}
