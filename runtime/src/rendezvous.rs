//! The steps of a rendezvous that tch-dist takes itself, so that each ends by one deadline
//! and fails with its cause: resolving MASTER_ADDR, waiting for rank 0's store to listen,
//! the run-id check, and the join keys that tell which ranks never came.
//!
//! c10d's own loops overshoot: the TCPStore client retries a whole `timeout` long connect
//! after a back-off (two timeouts and more in all), and logs each try with a C++
//! backtrace. So the store client is only created once something listens at
//! MASTER_ADDR:MASTER_PORT, and every later step gets what is left of the deadline.

use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use crate::error::RendezvousError;
use crate::store::Store;

/// The key under which the first rank that carries a run id records it (in the root store).
const RUN_ID_KEY: &str = "tch_dist/run_id";

/// A rank's join key, in its group's store.
fn joined_key(rank: usize) -> String {
    format!("tch_dist/joined/{rank}")
}

/// Where a refused process of another run records its run id, by the rank it came as (in
/// the root store).
fn refused_key(rank: usize) -> String {
    format!("tch_dist/refused/{rank}")
}

/// One rendezvous' deadline.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Deadline {
    at: Instant,
    timeout: Duration,
}

impl Deadline {
    pub(crate) fn after(timeout: Duration) -> Deadline {
        Deadline {
            at: Instant::now() + timeout,
            timeout,
        }
    }

    /// The time left (zero once passed).
    pub(crate) fn left(&self) -> Duration {
        self.at.saturating_duration_since(Instant::now())
    }

    /// The whole timeout, for messages.
    pub(crate) fn timeout(&self) -> Duration {
        self.timeout
    }
}

/// Resolves `host:port`, waiting at most until the deadline for the resolver (it runs on a
/// thread of its own, left behind when it does not answer in time).
pub(crate) fn resolve(
    host: &str,
    port: u16,
    deadline: Deadline,
) -> Result<Vec<SocketAddr>, RendezvousError> {
    let unresolvable = |cause: String| RendezvousError::UnresolvableHost {
        host: host.to_string(),
        cause,
    };
    let (tx, rx) = std::sync::mpsc::channel();
    let query = (host.to_string(), port);
    std::thread::Builder::new()
        .name("tch-dist-resolve".into())
        .spawn(move || {
            let _ = tx.send(query.to_socket_addrs().map(Iterator::collect::<Vec<_>>));
        })
        .map_err(|e| unresolvable(format!("cannot start the resolver thread: {e}")))?;
    match rx.recv_timeout(deadline.left()) {
        Ok(Ok(addrs)) if !addrs.is_empty() => Ok(addrs),
        Ok(Ok(_)) => Err(unresolvable("the resolver returned no address".into())),
        Ok(Err(e)) => Err(unresolvable(e.to_string())),
        Err(_) => Err(unresolvable(format!(
            "the resolver did not answer within {:?}",
            deadline.timeout()
        ))),
    }
}

/// Waits until one of `addrs` accepts a TCP connection (rank 0's store listens), trying
/// every 50 ms until the deadline.
pub(crate) fn wait_for_listener(
    addrs: &[SocketAddr],
    deadline: Deadline,
) -> Result<(), RendezvousError> {
    const PAUSE: Duration = Duration::from_millis(50);
    let mut last = String::from("no attempt was made");
    loop {
        for addr in addrs {
            let left = deadline.left();
            if left.is_zero() {
                break;
            }
            match TcpStream::connect_timeout(addr, left.min(Duration::from_secs(1))) {
                Ok(_) => return Ok(()),
                Err(e) => last = e.to_string(),
            }
        }
        let left = deadline.left();
        if left.is_zero() {
            return Err(RendezvousError::NobodyListening {
                timeout: deadline.timeout(),
                cause: last,
            });
        }
        std::thread::sleep(left.min(PAUSE));
    }
}

/// The run-id check: the first rank that carries an id claims the store for its run; a rank
/// of another run is refused (and says so in the store, for the error of the rank that
/// waits for it). Ranks without an id (a PyTorch rank) are not checked.
pub(crate) fn check_run(
    root: &Store,
    rank: usize,
    run_id: Option<&str>,
) -> Result<(), RendezvousError> {
    let Some(mine) = run_id else {
        return Ok(());
    };
    let engine = |e: crate::DistError| RendezvousError::Engine {
        cause: e.to_string(),
    };
    let theirs = root
        .compare_set(RUN_ID_KEY, b"", mine.as_bytes())
        .map_err(engine)?;
    if theirs == mine.as_bytes() {
        return Ok(());
    }
    let _ = root.set(&refused_key(rank), mine.as_bytes());
    Err(RendezvousError::OtherRun {
        mine: mine.to_string(),
        theirs: String::from_utf8_lossy(&theirs).into_owned(),
    })
}

/// Records that `rank` joined the group whose store is `group`.
pub(crate) fn join(group: &Store, rank: usize) -> Result<(), RendezvousError> {
    group
        .add(&joined_key(rank), 1)
        .map(|_| ())
        .map_err(|e| RendezvousError::Engine {
            cause: e.to_string(),
        })
}

/// After a failed rendezvous: the ranks of a group of `world_size` that never joined it
/// (`None` when all did, or the store cannot say), with the processes of other runs that
/// came as one of them.
pub(crate) fn never_joined(
    root: &Store,
    group: &Store,
    world_size: usize,
    timeout: Duration,
) -> Option<RendezvousError> {
    let mut ranks = Vec::new();
    for r in 0..world_size {
        if !group.check(&joined_key(r)).ok()? {
            ranks.push(r);
        }
    }
    if ranks.is_empty() {
        return None;
    }
    let refused = ranks
        .iter()
        .filter(|&&r| root.check(&refused_key(r)).unwrap_or(false))
        .filter_map(|&r| {
            let id = root.get(&refused_key(r)).ok()?;
            Some((r, String::from_utf8_lossy(&id).into_owned()))
        })
        .collect();
    Some(RendezvousError::NeverJoined {
        ranks,
        timeout,
        refused,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unresolvable_host_fails_fast() {
        let start = Instant::now();
        let err = resolve(
            "no-such-host.invalid",
            29500,
            Deadline::after(Duration::from_secs(5)),
        )
        .unwrap_err();
        assert!(
            matches!(&err, RendezvousError::UnresolvableHost { host, .. } if host == "no-such-host.invalid"),
            "{err}"
        );
        assert!(start.elapsed() < Duration::from_secs(5));
        assert!(
            !resolve("127.0.0.1", 1, Deadline::after(Duration::from_secs(5)))
                .unwrap()
                .is_empty()
        );
    }

    #[test]
    fn waiting_for_a_listener_ends_at_the_deadline() {
        let port = crate::testing::free_port();
        let addrs = resolve("127.0.0.1", port, Deadline::after(Duration::from_secs(5))).unwrap();
        let start = Instant::now();
        let err =
            wait_for_listener(&addrs, Deadline::after(Duration::from_millis(400))).unwrap_err();
        let took = start.elapsed();
        assert!(
            took >= Duration::from_millis(400) && took < Duration::from_millis(1400),
            "{took:?}"
        );
        assert!(
            matches!(err, RendezvousError::NobodyListening { .. }),
            "{err}"
        );
        let listener = std::net::TcpListener::bind(addrs[0]).unwrap();
        wait_for_listener(&addrs, Deadline::after(Duration::from_secs(5))).unwrap();
        drop(listener);
    }
}
