//! The steps of a rendezvous that tch-dist takes itself, so that each ends by one deadline
//! and fails with its cause: resolving MASTER_ADDR, waiting for rank 0's store to listen,
//! the run-id check, the TCPStore's worker count, the join keys that tell which ranks never
//! came, and PyTorch's optional store-based barrier.
//!
//! c10d's own loops overshoot: the TCPStore client retries a whole `timeout` long connect
//! after a back-off (two timeouts and more in all), and logs each try with a C++
//! backtrace. So the store client is only created once something listens at
//! MASTER_ADDR:MASTER_PORT, and every later step gets what is left of the deadline.
//!
//! The keys are PyTorch 2.11.0's where PyTorch has one (the TCPStore's own worker count
//! `init/`, through [`Store::check_in`]; `store_based_barrier_key:*`),
//! and tch-dist's own ones live under `tch_dist/` in the root store, outside every prefix
//! PyTorch writes, so that a PyTorch rank of the same job never sees them.

use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use crate::c10d::departures::{self, WatchStore, WATCH_SLICE};
use crate::c10d::store::Store;
use crate::error::RendezvousError;

/// The key under which the first rank that carries a run id records it (in the root store).
const RUN_ID_KEY: &str = "tch_dist/run_id";

/// PyTorch's `STORE_BASED_BARRIER_PREFIX`.
const BARRIER_KEY_PREFIX: &str = "store_based_barrier_key";

/// A rank's join key for the group named `group` (PyTorch's group name: "0" for the default
/// group), in the root store.
fn joined_key(group: &str, rank: usize) -> String {
    format!("tch_dist/joined/{group}/{rank}")
}

/// The key a PyTorch (or tch-dist) rank's Gloo backend writes for `rank` when it joins the
/// group, relative to the group's store: gloo's `connectFullMesh` sets `<rank>` under the
/// first device's prefix `0`, under the backend's `cpu/`.
fn gloo_key(rank: usize) -> String {
    format!("cpu//0/{rank}")
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
    let engine = |e: crate::error::DistError| RendezvousError::Engine {
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

/// Whether rank `rank` of the group named `name` is a tch-dist rank: it wrote its join key
/// (a PyTorch rank writes none). Reliable once the group exists: every tch-dist member wrote
/// its key before the group's backends connected.
pub(crate) fn is_tch_dist_rank(root: &Store, name: &str, rank: usize) -> bool {
    root.check(&joined_key(name, rank)).unwrap_or(false)
}

/// Whether a rank of the group named `name` of `world_size` wrote no join key: a rank that
/// is not tch-dist's (PyTorch's). Reliable once the group's backends are connected: every
/// tch-dist rank writes its join key before it starts its backends' rendezvous.
pub(crate) fn has_foreign_ranks(root: &Store, name: &str, world_size: usize) -> bool {
    (0..world_size).any(|r| !is_tch_dist_rank(root, name, r))
}

/// Records that `rank` joined the group named `name` (in the root store).
pub(crate) fn join(root: &Store, name: &str, rank: usize) -> Result<(), RendezvousError> {
    root.add(&joined_key(name, rank), 1)
        .map(|_| ())
        .map_err(|e| RendezvousError::Engine {
            cause: e.to_string(),
        })
}

/// Whether `root` already holds `rank`'s join key of the group named `name`: written by this
/// rank's previous attempt (a store that outlived a restart).
pub(crate) fn joined_before(root: &Store, name: &str, rank: usize) -> bool {
    root.check(&joined_key(name, rank)).unwrap_or(false)
}

/// PyTorch's `_store_based_barrier` (TORCH_DIST_INIT_BARRIER=1), on `store`, for the group
/// named `name` of `world_size` ranks: each adds 1 to `store_based_barrier_key:{name}`, the
/// one that makes it `world_size` sets `...:last_worker`, and every rank waits for that key
/// (by the deadline; then `NotAllCheckedIn` with the count).
pub(crate) fn store_barrier(
    store: &Store,
    name: &str,
    world_size: usize,
    deadline: Deadline,
) -> Result<(), RendezvousError> {
    let key = format!("{BARRIER_KEY_PREFIX}:{name}");
    barrier_on(
        store,
        &key,
        world_size,
        deadline,
        "the store-based barrier (TORCH_DIST_INIT_BARRIER=1)",
    )
}

/// Waits, once this rank's backends of the group named `name` are connected, until every
/// member's are, when every member is a tch-dist rank (a PyTorch rank takes no part; with
/// one, the group goes without, as PyTorch's own groups do) and Gloo connects its pairs at
/// creation (with `lazy_gloo`, c10d's `TORCH_GLOO_LAZY_INIT`, they connect at first use, so there is no race;
/// nor could the join keys be read then, as a creation then waits for no peer). Once a
/// non-lazy creation returns, every tch-dist member has joined (it writes its join key
/// before its Gloo address, which the creation waited for), so every member decides alike. Gloo's `connectFullMesh`
/// returns on a rank whose pairs are done while a peer is still connecting its other
/// pairs; were that rank to drop the group (or exit) at once, the peer would read
/// end-of-file on their pair and fail with "Connection closed by peer". One counter in
/// the group's own store (`group`), by the deadline.
pub(crate) fn all_connected(
    root: &Store,
    group: &Store,
    name: &str,
    world_size: usize,
    lazy_gloo: bool,
    deadline: Deadline,
) -> Result<(), RendezvousError> {
    if world_size < 2 || lazy_gloo || has_foreign_ranks(root, name, world_size) {
        return Ok(());
    }
    barrier_on(
        group,
        CONNECTED_KEY,
        world_size,
        deadline,
        "the check that every rank connected the group's backends",
    )
}

/// The key of [`all_connected`]'s count, in a group's own store.
const CONNECTED_KEY: &str = "tch_dist_connected";

/// Each of `world_size` ranks adds 1 to `key`, the one that makes it `world_size` sets
/// `{key}:last_worker`, and every rank waits for that key (by the deadline; then
/// `NotAllCheckedIn` with the count, naming `what`).
fn barrier_on(
    store: &Store,
    key: &str,
    world_size: usize,
    deadline: Deadline,
    what: &'static str,
) -> Result<(), RendezvousError> {
    let engine = |e: crate::error::DistError| RendezvousError::Engine {
        cause: e.to_string(),
    };
    let last = format!("{key}:last_worker");
    if store.add(key, 1).map_err(engine)? == world_size as i64 {
        store.set(&last, b"1").map_err(engine)?;
    }
    let mut pause = Duration::from_millis(1);
    loop {
        if store.check(&last).map_err(engine)? {
            return Ok(());
        }
        let left = deadline.left();
        if left.is_zero() {
            return Err(RendezvousError::NotAllCheckedIn {
                what,
                joined: store.add(key, 0).unwrap_or(-1),
                world_size,
                timeout: deadline.timeout(),
            });
        }
        std::thread::sleep(left.min(pause));
        pause = (pause * 2).min(Duration::from_millis(10));
    }
}

/// Runs `wait`, a step of a group's rendezvous that waits for the other members (the store's
/// check-in, the backends' connection), on a thread of its own, and looks every
/// [`WATCH_SLICE`] for members whose launcher reported their exit (`members`: the group's
/// global ranks, `me`: this rank's place among them): one that exited before the group was
/// made will never come, and is [`RendezvousError::Departed`] within seconds where the wait
/// would run to its deadline. An exit seen while the wait may still complete (a member that
/// joined and then exited) gets one more slice first. The thread of a wait given up on ends
/// at the wait's own deadline; its result is dropped.
pub(crate) fn watched<T: Send + 'static>(
    watch: &WatchStore,
    members: &[usize],
    me: usize,
    wait: impl FnOnce() -> T + Send + 'static,
) -> Result<T, RendezvousError> {
    let (done_tx, done) = std::sync::mpsc::channel();
    let spawned = std::thread::Builder::new()
        .name("tch-dist rendezvous".into())
        .spawn(move || {
            // The receiver is gone when the rendezvous was given up on.
            let _ = done_tx.send(wait());
        });
    if let Err(e) = spawned {
        return Err(RendezvousError::Engine {
            cause: format!("cannot start the rendezvous thread: {e}"),
        });
    }
    let mut departed: Option<(usize, String)> = None;
    loop {
        match done.recv_timeout(WATCH_SLICE) {
            Ok(result) => return Ok(result),
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                return Err(RendezvousError::Engine {
                    cause: "the rendezvous thread ended without a result".into(),
                })
            }
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
        }
        if let Some((rank, status)) = departed {
            return Err(RendezvousError::Departed { rank, status });
        }
        // A store out of reach fails the wait by itself (at its deadline).
        departed = watch
            .look(|store| {
                if !departures::any_exited(store)? {
                    return Ok(None);
                }
                for (r, &global) in members.iter().enumerate().filter(|&(r, _)| r != me) {
                    if let Some(status) = departures::exit_of(store, global)? {
                        return Ok(Some((r, status)));
                    }
                }
                Ok(None)
            })
            .unwrap_or(None);
    }
}

/// After a failed rendezvous: the ranks of the group named `name` of `world_size` that never
/// joined it (`None` when all did, or the store cannot say), with the processes of other
/// runs that came as one of them. A rank joined when it wrote its join key (a tch-dist rank)
/// or its Gloo key in the group's store `group` (any rank, PyTorch's included: a PyTorch rank
/// writes no join key).
pub(crate) fn never_joined(
    root: &Store,
    group: &Store,
    name: &str,
    world_size: usize,
    timeout: Duration,
) -> Option<RendezvousError> {
    let mut ranks = Vec::new();
    for r in 0..world_size {
        if !root.check(&joined_key(name, r)).ok()? && !group.check(&gloo_key(r)).ok()? {
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

/// SHA-1 of `data`, in hex (PyTorch names `use_local_synchronization` groups by one; it is
/// not used for security).
pub(crate) fn sha1_hex(data: &[u8]) -> String {
    let mut h: [u32; 5] = [0x67452301, 0xEFCDAB89, 0x98BADCFE, 0x10325476, 0xC3D2E1F0];
    let mut msg = data.to_vec();
    let bits = (data.len() as u64).wrapping_mul(8);
    msg.push(0x80);
    while msg.len() % 64 != 56 {
        msg.push(0);
    }
    msg.extend_from_slice(&bits.to_be_bytes());
    for chunk in msg.chunks_exact(64) {
        let mut w = [0u32; 80];
        for (i, word) in chunk.chunks_exact(4).enumerate() {
            w[i] = u32::from_be_bytes([word[0], word[1], word[2], word[3]]);
        }
        for i in 16..80 {
            w[i] = (w[i - 3] ^ w[i - 8] ^ w[i - 14] ^ w[i - 16]).rotate_left(1);
        }
        let [mut a, mut b, mut c, mut d, mut e] = h;
        for (i, wi) in w.iter().enumerate() {
            let (f, k) = match i {
                0..=19 => ((b & c) | (!b & d), 0x5A827999),
                20..=39 => (b ^ c ^ d, 0x6ED9EBA1),
                40..=59 => ((b & c) | (b & d) | (c & d), 0x8F1BBCDC),
                _ => (b ^ c ^ d, 0xCA62C1D6),
            };
            let t = a
                .rotate_left(5)
                .wrapping_add(f)
                .wrapping_add(e)
                .wrapping_add(k)
                .wrapping_add(*wi);
            e = d;
            d = c;
            c = b.rotate_left(30);
            b = a;
            a = t;
        }
        for (x, y) in h.iter_mut().zip([a, b, c, d, e]) {
            *x = x.wrapping_add(y);
        }
    }
    h.iter().map(|x| format!("{x:08x}")).collect()
}

/// PyTorch's name of a `new_group(ranks, use_local_synchronization=True)`
/// (`_hash_ranks_to_str`): SHA-1 of the sorted global ranks joined by `_`, then `_` and the
/// number of groups this process is a member of (the default group included).
pub(crate) fn hashed_group_name(sorted_ranks: &[usize], live_groups: usize) -> String {
    let ranks: Vec<String> = sorted_ranks.iter().map(usize::to_string).collect();
    sha1_hex(format!("{}_{live_groups}", ranks.join("_")).as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The names agree with Python's `hashlib.sha1` and torch 2.11's `_hash_ranks_to_str`.
    #[test]
    fn sha1_and_hashed_names() {
        assert_eq!(sha1_hex(b""), "da39a3ee5e6b4b0d3255bfef95601890afd80709");
        assert_eq!(sha1_hex(b"abc"), "a9993e364706816aba3e25717850c26c9cd0d89d");
        let long = [b'a'; 1000];
        assert_eq!(sha1_hex(&long), "291e9a6c66994949b57ba5e650361e98fc36b1ba");
        // python -c 'import hashlib; print(hashlib.sha1(b"0_1_1").hexdigest())'
        assert_eq!(
            hashed_group_name(&[0, 1], 1),
            "4a2ad14e7181d5235b64cf37fcd715cb5ce5c8e7"
        );
    }

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
