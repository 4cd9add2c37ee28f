//! A node's side of the wire: one connection per request to the endpoint, the request line,
//! the reply line, all by one deadline (the heartbeat timeout, 5 s by default).

use std::io;
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use super::round::{Reply, Request};
use super::server::{read_line, write_all};
use super::wire::{self, Envelope};

/// Why a request got no reply.
#[derive(Debug)]
pub enum Failure {
    /// Nobody answered in time, or the connection failed: the host may be starting, gone,
    /// or out of reach.
    Unreachable(String),
    /// Something answered that is not a rendezvous.
    Garbled(String),
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failure::Unreachable(e) | Failure::Garbled(e) => f.write_str(e),
        }
    }
}

/// The rendezvous at the endpoint, for one run.
#[derive(Clone)]
pub struct Client {
    /// The endpoint as given, for messages.
    pub endpoint: String,
    addrs: Vec<SocketAddr>,
    run_id: String,
    timeout: Duration,
}

impl Client {
    pub fn new(endpoint: &str, addrs: Vec<SocketAddr>, run_id: &str, timeout: Duration) -> Client {
        Client {
            endpoint: endpoint.to_string(),
            addrs,
            run_id: run_id.to_string(),
            timeout,
        }
    }

    /// Sends the request `build` makes from the address this host reaches the endpoint from
    /// (the connection's own), and returns the reply.
    pub fn ask(&self, build: impl FnOnce(IpAddr) -> Request) -> Result<Reply, Failure> {
        let deadline = Instant::now() + self.timeout;
        let mut stream = self.connect(deadline)?;
        let local = stream
            .local_addr()
            .map_err(|e| self.unreachable("reading the connection's own address", e))?;
        let line = wire::encode_request(&Envelope {
            run_id: self.run_id.clone(),
            request: build(local.ip()),
        });
        write_all(&mut stream, line.as_bytes(), deadline)
            .map_err(|e| self.unreachable("sending", e))?;
        let reply = read_line(&mut stream, deadline).map_err(|e| {
            if e.kind() == io::ErrorKind::InvalidData {
                Failure::Garbled(format!("the rendezvous at {}: {e}", self.endpoint))
            } else {
                self.unreachable("reading the reply", e)
            }
        })?;
        wire::decode_reply(&reply).map_err(|e| {
            Failure::Garbled(format!(
                "the rendezvous at {} answered something else: {e}",
                self.endpoint
            ))
        })
    }

    fn connect(&self, deadline: Instant) -> Result<TcpStream, Failure> {
        let mut last = None;
        for addr in &self.addrs {
            let left = super::server::remaining(deadline)
                .map_err(|e| self.unreachable("connecting", e))?;
            match TcpStream::connect_timeout(addr, left) {
                Ok(s) => {
                    let _ = s.set_nodelay(true);
                    return Ok(s);
                }
                Err(e) => last = Some(e),
            }
        }
        Err(self.unreachable(
            "connecting",
            last.unwrap_or_else(|| io::Error::new(io::ErrorKind::NotFound, "no address")),
        ))
    }

    fn unreachable(&self, doing: &str, e: io::Error) -> Failure {
        let e = if e.kind() == io::ErrorKind::WouldBlock {
            "timed out".to_string()
        } else {
            e.to_string()
        };
        Failure::Unreachable(format!("the rendezvous at {}: {doing}: {e}", self.endpoint))
    }
}
