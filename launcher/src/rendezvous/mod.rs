//! The dynamic rendezvous (`--rdzv-backend c10d`): the launchers of several hosts meet in
//! rounds, as torchrun's c10d rendezvous has them meet, so that a failure on any host stops
//! and restarts the ranks of every host together, a lost host is left behind, and a new one
//! can come in (`--nnodes MIN:MAX`). Rust only: torchrun keeps its state as a pickled Python
//! object in a TCPStore, which a tch-dist-run launcher does not read, so one job's launchers
//! are all tch-dist-run or all torchrun (the workers' variables are torchrun's either way).
//!
//! One launcher hosts the state (the one on whose host the endpoint's address is, or the one
//! given `--rdzv-conf is_host=1`) on a listener bound to that address; every launcher, the
//! host's own included, asks it over TCP, one request and one reply per connection. The
//! state machine (`round.rs`) is pure, so its rules are tested without sockets.
//!
//! | file | what it does | torchrun's counterpart |
//! | --- | --- | --- |
//! | `mod.rs` | [`Config`]: the endpoint, `--nnodes MIN:MAX`, `--rdzv-conf`'s timeouts, `--local-addr` | `run.py`'s rendezvous arguments, `RendezvousParameters` |
//! | `round.rs` | the rounds as a state machine: join, poll, close, leave, keep-alive expiry, the last call, ranks and the workers' store per round | `dynamic_rendezvous.py` (`_RendezvousState`, the join/exit/close ops, `_sanitize`) |
//! | `wire.rs` | the messages as lines of text, decoded without panics | `c10d_rendezvous_backend.py` (base64 of a pickle in one key) |
//! | `server.rs` | the hosting launcher's listener: bounded connections, stray bytes refused | the TCPStore server `c10d_rendezvous_backend.py` starts |
//! | `client.rs` | one request to the endpoint, by one deadline | the TCPStore client |
//! | `host.rs` | who hosts: `is_host`, else the endpoint's address among this host's interfaces | `utils.py` `_matches_machine_hostname` |
//! | `node.rs` | a launcher's life: join, wait, start the ranks, watch the round, restart or close | `agent/server/api.py` `_invoke_run`, `_restart_workers` |
//!
//! # Messages
//!
//! A request is one line `tdrdzv1 VERB run=RUN_ID addr=A pid=P token=T ...`, the reply one
//! line `tdrdzv1 KIND ...` (values percent-escaped, lines at most 4096 bytes):
//!
//! | request | fields | replies |
//! | --- | --- | --- |
//! | `join` | `nproc`, `ports=P1,P2` (free on the node's host), `nnodes=MIN:MAX` | `waiting`, `assigned`, `closed`, `refused` (another run, other node counts) |
//! | `poll` (also the keep-alive) | | `waiting round present last_call_ms`, `assigned round group_rank group_world_size rank_base world_size master_addr master_port`, `restart round why`, `closed`, `unknown` |
//! | `close` | `why=finished`, or `why=restarts restarts failure` | `done` |
//! | `leave` (a launcher stopped by a signal) | | `done` |
//!
//! `closed` carries `round`, the closing node (`addr pid token group_rank`) and its `why`.
//!
//! # Timeouts (`--rdzv-conf`, torchrun's keys and defaults)
//!
//! | key | default | what it bounds |
//! | --- | --- | --- |
//! | `join_timeout` | 600 s | from a node's join to its round's completion |
//! | `last_call_timeout` | 30 s | from MIN nodes present to the round's completion (late nodes still come in) |
//! | `close_timeout` | 30 s | how long the host stays, once closed, for the others to hear why |
//! | `heartbeat` | 5 s | one request (connect, send, reply) |
//! | `keep_alive_interval` | 5 s | a node polls at least this often (every 250 ms in fact) |
//! | `keep_alive_max_attempt` | 3 | a node silent for interval × attempts (15 s) is dropped |
//! | `is_host` | from the endpoint | whether this launcher hosts |

mod client;
mod host;
mod node;
mod round;
mod server;
mod wire;

use std::time::Duration;

pub use node::run_node;

/// torchrun's default rendezvous port.
pub const DEFAULT_PORT: u16 = 29400;

/// The dynamic rendezvous' settings, from the command line.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// `--rdzv-endpoint` as given.
    pub endpoint: String,
    /// Its host and port (29400 unless given).
    pub host: String,
    pub port: u16,
    pub min_nodes: usize,
    pub max_nodes: usize,
    pub join_timeout: Duration,
    pub last_call: Duration,
    pub close_timeout: Duration,
    pub heartbeat: Duration,
    pub keep_alive_interval: Duration,
    pub keep_alive_max_attempt: u32,
    /// `is_host` from `--rdzv-conf`; `None`: decided from the endpoint's address.
    pub is_host: Option<bool>,
    /// `--local-addr`: the address this node is known by (MASTER_ADDR when it is node 0).
    pub local_addr: Option<String>,
    /// `--rdzv-conf` keys taken but not used (torchrun's `read_timeout`, `use_libuv`, ...).
    pub ignored: Vec<String>,
}

impl Config {
    /// The settings for `--rdzv-endpoint endpoint`, `--nnodes min:max`, with torchrun's
    /// defaults.
    pub fn new(endpoint: &str, min_nodes: usize, max_nodes: usize) -> Result<Config, String> {
        let (host, port) = parse_endpoint(endpoint)?;
        Ok(Config {
            endpoint: endpoint.to_string(),
            host,
            port,
            min_nodes,
            max_nodes,
            join_timeout: Duration::from_secs(600),
            last_call: Duration::from_secs(30),
            close_timeout: Duration::from_secs(30),
            heartbeat: Duration::from_secs(5),
            keep_alive_interval: Duration::from_secs(5),
            keep_alive_max_attempt: 3,
            is_host: None,
            local_addr: None,
            ignored: Vec::new(),
        })
    }

    /// Applies `--rdzv-conf k=v,k=v` (torchrun's keys; times in whole seconds).
    pub fn apply_conf(&mut self, conf: &str) -> Result<(), String> {
        for item in conf.split(',').filter(|s| !s.trim().is_empty()) {
            let (k, v) = item
                .split_once('=')
                .map(|(k, v)| (k.trim(), v.trim()))
                .ok_or_else(|| format!("--rdzv-conf {item:?} is not key=value"))?;
            let secs = |min: u64| -> Result<Duration, String> {
                v.parse::<u64>()
                    .ok()
                    .filter(|s| *s >= min)
                    .map(Duration::from_secs)
                    .ok_or_else(|| {
                        format!("--rdzv-conf {k}={v:?} is not a whole number of seconds of at least {min}")
                    })
            };
            match k {
                "join_timeout" => self.join_timeout = secs(1)?,
                "last_call_timeout" => self.last_call = secs(0)?,
                "close_timeout" => self.close_timeout = secs(0)?,
                "heartbeat_timeout" | "heartbeat" => self.heartbeat = secs(1)?,
                "keep_alive_interval" => self.keep_alive_interval = secs(1)?,
                "keep_alive_max_attempt" => {
                    self.keep_alive_max_attempt =
                        v.parse().ok().filter(|n| *n >= 1).ok_or_else(|| {
                            format!(
                            "--rdzv-conf keep_alive_max_attempt={v:?} is not a positive integer"
                        )
                        })?
                }
                "is_host" => {
                    self.is_host = Some(match v.to_ascii_lowercase().as_str() {
                        "1" | "true" | "t" | "yes" | "y" => true,
                        "0" | "false" | "f" | "no" | "n" => false,
                        _ => return Err(format!("--rdzv-conf is_host={v:?} is not a boolean")),
                    })
                }
                _ => self.ignored.push(k.to_string()),
            }
        }
        Ok(())
    }

    /// The state machine's rules.
    pub(crate) fn rules(&self) -> round::Rules {
        round::Rules {
            min_nodes: self.min_nodes,
            max_nodes: self.max_nodes,
            last_call: self.last_call,
            keep_alive_interval: self.keep_alive_interval,
            keep_alive_max_attempt: self.keep_alive_max_attempt,
        }
    }
}

/// `HOST[:PORT]` or `[V6]:PORT` (torchrun's `parse_rendezvous_endpoint`, port 29400 unless
/// given).
pub fn parse_endpoint(endpoint: &str) -> Result<(String, u16), String> {
    let bad = || format!("--rdzv-endpoint {endpoint:?} is not HOST:PORT");
    let (host, port) = if let Some(rest) = endpoint.strip_prefix('[') {
        let (h, after) = rest.split_once(']').ok_or_else(bad)?;
        match after {
            "" => (h, None),
            p => (h, Some(p.strip_prefix(':').ok_or_else(bad)?)),
        }
    } else {
        match endpoint.rsplit_once(':') {
            // A bare IPv6 address has colons of its own.
            Some((h, _)) if h.contains(':') => (endpoint, None),
            Some((h, p)) => (h, Some(p)),
            None => (endpoint, None),
        }
    };
    if host.is_empty() || host.chars().any(char::is_whitespace) {
        return Err(bad());
    }
    let port = match port {
        None => DEFAULT_PORT,
        Some(p) => p.parse::<u16>().ok().filter(|p| *p > 0).ok_or_else(bad)?,
    };
    Ok((host.to_string(), port))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_parse_as_torchrun_parses_them() {
        let ok = |e: &str| parse_endpoint(e).expect(e);
        assert_eq!(ok("10.0.0.1:1234"), ("10.0.0.1".into(), 1234));
        assert_eq!(ok("node-a"), ("node-a".into(), 29400));
        assert_eq!(ok("[::1]:5"), ("::1".into(), 5));
        assert_eq!(ok("[fe80::1]"), ("fe80::1".into(), 29400));
        assert_eq!(ok("fe80::1"), ("fe80::1".into(), 29400));
        for bad in [
            "", ":80", "a:0", "a:b", "a:70000", "[::1", "[::1]x", "a b:1",
        ] {
            assert!(parse_endpoint(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn rdzv_conf_takes_torchruns_keys() {
        let mut c = Config::new("h:1", 1, 2).expect("a config");
        c.apply_conf(
            "join_timeout=60,last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=4,\
             is_host=True,read_timeout=60,close_timeout=0,heartbeat=3",
        )
        .expect("known keys");
        assert_eq!(c.join_timeout, Duration::from_secs(60));
        assert_eq!(c.last_call, Duration::from_secs(2));
        assert_eq!(c.rules().dead_after(), Duration::from_secs(4));
        assert_eq!(c.close_timeout, Duration::ZERO);
        assert_eq!(c.heartbeat, Duration::from_secs(3));
        assert_eq!(c.is_host, Some(true));
        assert_eq!(c.ignored, ["read_timeout"]);
        for bad in [
            "join_timeout=0",
            "keep_alive_max_attempt=0",
            "is_host=maybe",
            "x",
            "last_call_timeout=-1",
        ] {
            assert!(c.apply_conf(bad).is_err(), "{bad}");
        }
    }
}
