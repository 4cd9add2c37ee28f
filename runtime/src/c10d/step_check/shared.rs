//! The step check's headers through shared memory, for a group whose ranks all run on one
//! host (one kernel, one `/dev/shm`, one network and pid namespace): each rank writes its
//! header into its own slot of a mapped file and waits on a futex until every peer's slot
//! holds the same check, so a check costs a few memory writes and at most one wake-up instead
//! of a collective's round of messages through the backend's threads.
//!
//! Layout: a control block (a generation counter every publish bumps, the futex word, and a
//! count of waiters, so that a publish makes a system call only when someone sleeps), then
//! one slot per rank: its pid (for the liveness of a peer that is waited for), the count of
//! collectives it launched on the group and the last one's name ([`CallMirror`]), and
//! [`ENTRIES`] entries, used in turn by its checks. A rank reuses check `k`'s entry for
//! check `k + ENTRIES` only after finishing check `k + ENTRIES - 1`, which needs every peer's
//! header of that check; a peer that has at most `ENTRIES - 1` checks of the group in flight
//! at once (begun, not yet finished) publishes it only after it finished reading check `k`.
//! replicate's backward keeps one check in flight from its first gradient hook to its
//! first bucket, and the others none, so two would do; four leave room. A reader also
//! compares the entry's number, so an entry reused too early is waited on (and times out),
//! never read as another check.
//!
//! A peer that is missing from a check while it has launched more collectives than this rank
//! is elsewhere: it called a collective this rank has not (a barrier where this rank trains),
//! and waits there for this rank as this rank waits for its header. The wait ends naming it
//! ([`Unfinished::PeerElsewhere`]), as the backend's all-to-all meeting that collective
//! would have ended in an error, rather than at the group's timeout. (The ranks launch their
//! collectives in one order, the check's place among them included: DETAIL and the backend's
//! path hold them to it too. Point-to-point transfers are not counted: they differ by rank.)
//!
//! The file's name carries a random number rank 0 sent in the group's first header
//! (`lane.rs`); every rank maps it before the second header says so, and is unlinked once
//! the second header says every rank did (or when the group is dropped before), so nothing
//! is left in `/dev/shm` after a run (a crash between the two checks leaves one small file).

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicI64, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::LEN;

/// Entries per rank's slot, used in turn.
const ENTRIES: usize = 4;

/// How long a missing peer must stay ahead in collectives before the wait calls it elsewhere:
/// a margin for the moment between a launch and its count (each rank counts after the
/// engine took the call).
const ELSEWHERE_AFTER: Duration = Duration::from_millis(500);

/// The collectives a mirrored count names: every op a group launches but its transfers
/// (`collectives.rs`; its low byte: the index here plus 1; 0 for any other).
const NAMED_CALLS: [&str; 8] = [
    "all_reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "barrier",
];

/// The control block at the start of the file.
#[repr(C, align(64))]
struct Control {
    /// Bumped by every publish; the futex word the waiters sleep on.
    generation: AtomicU32,
    /// Ranks asleep (or about to sleep) on `generation`.
    waiters: AtomicU32,
}

/// One check's header in a rank's slot.
#[repr(C, align(64))]
struct Entry {
    /// The check this entry holds (1, 2, ...; 0: none yet), written last.
    seq: AtomicU64,
    /// When it was written (CLOCK_MONOTONIC, ns): the last peer's arrival.
    published_ns: AtomicU64,
    header: [AtomicI64; LEN],
}

/// One rank's slot.
#[repr(C, align(64))]
struct Slot {
    pid: AtomicU64,
    /// The collectives the rank launched on the group, shifted up a byte, and the last one's
    /// code in [`NAMED_CALLS`] ([`CallMirror::store`]).
    calls: AtomicU64,
    entries: [Entry; ENTRIES],
}

/// What a wait that found every header returns.
#[derive(Debug)]
pub(super) struct Arrived {
    /// Every rank's header, in rank order.
    pub(super) rows: Vec<[i64; LEN]>,
    /// When the last of them was written (CLOCK_MONOTONIC, ns).
    pub(super) last_ns: u64,
}

/// Why a wait ended without every header.
#[derive(Debug)]
pub(super) enum Unfinished {
    /// The peer's process is gone (or a zombie).
    PeerExited { peer: usize, pid: u64 },
    /// The deadline passed.
    Timeout,
    /// What the caller's watch reported (a departed member, an unreachable store).
    Watched(crate::error::DistError),
    /// The peer launched more collectives than this rank (`calls` of them, the last
    /// `last_call`, where known): it waits in one this rank never called.
    PeerElsewhere {
        peer: usize,
        calls: u64,
        last_call: Option<&'static str>,
    },
}

/// The shared mapping; unmapped when its last holder (the segment, a [`CallMirror`]) goes.
struct Mapping {
    base: NonNull<u8>,
    len: usize,
}

// SAFETY: shared memory accessed only through atomics; the pointer stays valid until `Drop`
// unmaps it.
unsafe impl Send for Mapping {}
// SAFETY: as above: every access is atomic.
unsafe impl Sync for Mapping {}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: mapped in `Segment::attach` with this length; the last holder is going.
        unsafe {
            libc::munmap(self.base.as_ptr().cast(), self.len);
        }
    }
}

/// This rank's count of collectives launched on the group, mirrored into its slot so that a
/// peer waiting for its step-check header sees where it is (kept by the group, which
/// counts its launches; [`Segment::call_mirror`]).
pub(crate) struct CallMirror {
    mapping: Arc<Mapping>,
    offset: usize,
}

impl CallMirror {
    /// Records `count` collectives launched, the last of them `op`.
    pub(crate) fn store(&self, count: u64, op: &str) {
        let code = NAMED_CALLS
            .iter()
            .position(|n| *n == op)
            .map_or(0, |i| i as u64 + 1);
        // SAFETY: `offset` is this rank's `Slot::calls` inside the mapping, which `mapping`
        // keeps alive.
        let word = unsafe {
            &*self
                .mapping
                .base
                .as_ptr()
                .add(self.offset)
                .cast::<AtomicU64>()
        };
        word.store(count << 8 | code, Ordering::Release);
    }
}

/// A mirrored word's count and last collective.
fn unpack_calls(word: u64) -> (u64, Option<&'static str>) {
    let code = (word & 0xff) as usize;
    (
        word >> 8,
        code.checked_sub(1)
            .and_then(|i| NAMED_CALLS.get(i).copied()),
    )
}

/// A mapped segment of one group.
pub(crate) struct Segment {
    mapping: Arc<Mapping>,
    world: usize,
    rank: usize,
    path: PathBuf,
    /// This rank's next check.
    next: u64,
}

impl Segment {
    fn size(world: usize) -> usize {
        std::mem::size_of::<Control>() + world * std::mem::size_of::<Slot>()
    }

    /// Opens (creating it if this rank is first) and maps the group's segment named after
    /// `nonce`, and writes this rank's pid into its slot.
    pub(super) fn attach(nonce: u64, world: usize, rank: usize) -> io::Result<Segment> {
        let path = PathBuf::from(format!("/dev/shm/tch-dist-step-check-{nonce:016x}"));
        let file: File = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(&path)?;
        let len = Self::size(world);
        // The same length on every rank: a later rank's call changes nothing.
        file.set_len(len as u64)?;
        // SAFETY: a fresh shared mapping of the whole file, checked below.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let base = NonNull::new(ptr.cast::<u8>()).ok_or_else(io::Error::last_os_error)?;
        let segment = Segment {
            mapping: Arc::new(Mapping { base, len }),
            world,
            rank,
            path,
            next: 1,
        };
        segment
            .slot(rank)
            .pid
            .store(u64::from(std::process::id()), Ordering::Release);
        Ok(segment)
    }

    /// Removes the file's name (every rank has it mapped): the memory goes with the last
    /// mapping.
    pub(super) fn unlink(&self) {
        let _ = std::fs::remove_file(&self.path);
    }

    fn control(&self) -> &Control {
        // SAFETY: the mapping starts with a Control (zeroed by the file's creation, and
        // atomics of zero are valid) and lives as long as `self`.
        unsafe { &*self.mapping.base.as_ptr().cast::<Control>() }
    }

    /// Where rank `rank`'s slot starts in the mapping.
    fn slot_offset(&self, rank: usize) -> usize {
        assert!(
            rank < self.world,
            "step check: slot {rank} of {}",
            self.world
        );
        std::mem::size_of::<Control>() + rank * std::mem::size_of::<Slot>()
    }

    fn slot(&self, rank: usize) -> &Slot {
        let offset = self.slot_offset(rank);
        // SAFETY: `rank < world` slots follow the control block inside the mapping.
        unsafe { &*self.mapping.base.as_ptr().add(offset).cast::<Slot>() }
    }

    /// The mirror of this rank's collective count into its slot.
    pub(crate) fn call_mirror(&self) -> CallMirror {
        CallMirror {
            mapping: self.mapping.clone(),
            offset: self.slot_offset(self.rank) + std::mem::offset_of!(Slot, calls),
        }
    }

    /// Writes this rank's header of its next check; returns the check's number.
    pub(super) fn publish(&mut self, header: &[i64; LEN]) -> u64 {
        let seq = self.next;
        self.next += 1;
        let entry = &self.slot(self.rank).entries[entry_index(seq)];
        for (cell, value) in entry.header.iter().zip(header) {
            cell.store(*value, Ordering::Relaxed);
        }
        entry.published_ns.store(now_ns(), Ordering::Relaxed);
        entry.seq.store(seq, Ordering::Release);
        let control = self.control();
        control.generation.fetch_add(1, Ordering::SeqCst);
        if control.waiters.load(Ordering::SeqCst) > 0 {
            futex_wake(&control.generation);
        }
        seq
    }

    /// Waits until every rank's header of check `seq` is written, or `deadline`; between
    /// sleeps it looks at the peers still missing (their pids, and their collectives
    /// against `own_calls`, this rank's count) and, every `watch_every`, asks `watch` (the
    /// group's departures watch).
    pub(super) fn wait(
        &self,
        seq: u64,
        deadline: Instant,
        watch_every: Duration,
        own_calls: impl Fn() -> u64,
        mut watch: impl FnMut() -> Option<crate::error::DistError>,
    ) -> Result<Arrived, Unfinished> {
        let control = self.control();
        let mut next_watch = Instant::now() + watch_every;
        let mut spins = 0u32;
        let mut sleeping = false;
        // Since when the missing peer has been ahead in collectives.
        let mut ahead_since: Option<Instant> = None;
        let result = loop {
            let generation = control.generation.load(Ordering::SeqCst);
            let missing = (0..self.world).find(|r| {
                self.slot(*r).entries[entry_index(seq)]
                    .seq
                    .load(Ordering::Acquire)
                    != seq
            });
            let Some(missing) = missing else {
                break Ok(self.read(seq));
            };
            // A few yields first: on a busy host the peer is often one time slice away.
            if spins < 16 {
                spins += 1;
                std::thread::yield_now();
                continue;
            }
            let now = Instant::now();
            if now >= deadline {
                break Err(Unfinished::Timeout);
            }
            let pid = self.slot(missing).pid.load(Ordering::Acquire);
            if pid != 0 && process_gone(pid) {
                break Err(Unfinished::PeerExited { peer: missing, pid });
            }
            let (calls, last_call) = unpack_calls(self.slot(missing).calls.load(Ordering::Acquire));
            if calls > own_calls() {
                let since = *ahead_since.get_or_insert(now);
                if now.duration_since(since) >= ELSEWHERE_AFTER {
                    break Err(Unfinished::PeerElsewhere {
                        peer: missing,
                        calls,
                        last_call,
                    });
                }
            } else {
                ahead_since = None;
            }
            if now >= next_watch {
                next_watch = now + watch_every;
                if let Some(e) = watch() {
                    break Err(Unfinished::Watched(e));
                }
            }
            if !sleeping {
                sleeping = true;
                control.waiters.fetch_add(1, Ordering::SeqCst);
                // Counted as a waiter before looking again: a publish from now on wakes us.
                continue;
            }
            let slice = deadline
                .saturating_duration_since(now)
                .min(Duration::from_millis(20));
            futex_wait(&control.generation, generation, slice);
        };
        if sleeping {
            control.waiters.fetch_sub(1, Ordering::SeqCst);
        }
        result
    }

    fn read(&self, seq: u64) -> Arrived {
        let mut last_ns = 0;
        let rows = (0..self.world)
            .map(|r| {
                let entry = &self.slot(r).entries[entry_index(seq)];
                last_ns = last_ns.max(entry.published_ns.load(Ordering::Relaxed));
                std::array::from_fn(|i| entry.header[i].load(Ordering::Relaxed))
            })
            .collect();
        Arrived { rows, last_ns }
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        // Normally unlinked after the second check already; a group dropped before it (a
        // failed first check, the end of the program) leaves nothing behind either. The
        // mapping goes with its last holder.
        self.unlink();
    }
}

fn entry_index(seq: u64) -> usize {
    (seq % ENTRIES as u64) as usize
}

/// CLOCK_MONOTONIC in nanoseconds: one clock for every process of the host.
pub(super) fn now_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: writes the timespec it is given.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    (ts.tv_sec as u64)
        .saturating_mul(1_000_000_000)
        .saturating_add(ts.tv_nsec as u64)
}

/// Whether the process `pid` exited: no entry in /proc, or a zombie its parent has not
/// reaped yet.
fn process_gone(pid: u64) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.trim_start().chars().next())
            .is_some_and(|state| matches!(state, 'Z' | 'X')),
    }
}

fn futex_wait(word: &AtomicU32, expected: u32, limit: Duration) {
    let ts = libc::timespec {
        tv_sec: limit.as_secs() as libc::time_t,
        tv_nsec: limit.subsec_nanos() as libc::c_long,
    };
    // SAFETY: a futex wait on a live shared word (not FUTEX_PRIVATE: other processes wake
    // it), with a relative timeout; any error (EAGAIN: it changed, EINTR) is a spurious
    // wake-up the caller's loop handles.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
            std::ptr::null::<u32>(),
            0u32,
        );
    }
}

fn futex_wake(word: &AtomicU32) {
    // SAFETY: wakes every waiter of a live shared word.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE,
            i32::MAX,
            std::ptr::null::<libc::timespec>(),
            std::ptr::null::<u32>(),
            0u32,
        );
    }
}

/// Bumped whenever what a segment's words mean changes while their sizes do not.
const LAYOUT: u32 = 2;

/// What identifies this host for the step check, or 0 where shared memory is not to be
/// used (something unreadable): the boot, the user, the network, pid and mount namespaces
/// and `/dev/shm` itself. Ranks in separate network namespaces (the multi-host test tier's
/// hosts) count as separate hosts, as real ones would be. The segment's layout is part of
/// it, so that ranks built from tch-dists of other layouts stay on the backend rather than
/// read each other's slots amiss.
pub(super) fn host_key() -> i64 {
    use std::hash::Hasher;
    use std::os::unix::fs::MetadataExt;
    let Ok(boot) = std::fs::read_to_string("/proc/sys/kernel/random/boot_id") else {
        return 0;
    };
    let mut h = crate::Fingerprint::default();
    h.write_u32(LAYOUT);
    for size in [
        std::mem::size_of::<Control>(),
        std::mem::size_of::<Slot>(),
        ENTRIES,
        LEN,
    ] {
        h.write_usize(size);
    }
    h.write(boot.trim().as_bytes());
    // SAFETY: no arguments; always succeeds.
    h.write_u32(unsafe { libc::getuid() });
    for path in [
        "/proc/self/ns/net",
        "/proc/self/ns/pid",
        "/proc/self/ns/mnt",
        "/dev/shm",
    ] {
        let Ok(meta) = std::fs::metadata(path) else {
            return 0;
        };
        h.write_u64(meta.dev());
        h.write_u64(meta.ino());
    }
    // Never 0, which means "no".
    (h.finish() | 1) as i64
}

/// A random number for a segment's name.
pub(super) fn nonce() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(now_ns());
    h.write_u32(std::process::id());
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_ranks_meet_and_a_missing_one_times_out() {
        let nonce = nonce();
        let mut a = Segment::attach(nonce, 2, 0).expect("attach 0");
        let mut b = Segment::attach(nonce, 2, 1).expect("attach 1");
        a.unlink();
        let row = |v: i64| [v; LEN];
        for seq in 1..=6u64 {
            assert_eq!(a.publish(&row(seq as i64)), seq);
            let soon = Instant::now() + Duration::from_millis(30);
            // b has not written check `seq` yet.
            assert!(matches!(
                a.wait(seq, soon, Duration::from_secs(1), || 0, || None),
                Err(Unfinished::Timeout)
            ));
            assert_eq!(b.publish(&row(10 + seq as i64)), seq);
            let far = Instant::now() + Duration::from_secs(5);
            let got = a
                .wait(seq, far, Duration::from_secs(1), || 0, || None)
                .expect("a");
            assert_eq!(got.rows, vec![row(seq as i64), row(10 + seq as i64)]);
            assert!(b
                .wait(seq, far, Duration::from_secs(1), || 0, || None)
                .is_ok());
        }
        assert!(!process_gone(u64::from(std::process::id())));
        assert!(process_gone(u64::from(u32::MAX)));
        assert_ne!(host_key(), 0);
        assert_eq!(host_key(), host_key());
    }

    #[test]
    fn a_missing_peer_ahead_in_collectives_is_elsewhere() {
        let nonce = nonce();
        let mut a = Segment::attach(nonce, 2, 0).expect("attach 0");
        let b = Segment::attach(nonce, 2, 1).expect("attach 1");
        a.unlink();
        let (a_calls, b_calls) = (a.call_mirror(), b.call_mirror());
        a_calls.store(6, "all_reduce");
        b_calls.store(6, "all_reduce");
        let seq = a.publish(&[0; LEN]);
        let wait = |own: u64, limit: Duration| {
            let start = Instant::now();
            let end = a.wait(seq, start + limit, Duration::from_secs(1), || own, || None);
            (end, start.elapsed())
        };
        // Level with this rank, or behind it: only missing.
        let (end, _) = wait(6, Duration::from_millis(700));
        assert!(matches!(end, Err(Unfinished::Timeout)), "{end:?}");
        // Ahead: in a barrier this rank never called; named once it stayed ahead a while.
        b_calls.store(7, "barrier");
        let (end, took) = wait(6, Duration::from_secs(5));
        assert!(
            matches!(
                end,
                Err(Unfinished::PeerElsewhere {
                    peer: 1,
                    calls: 7,
                    last_call: Some("barrier")
                })
            ),
            "{end:?}"
        );
        assert!(
            took >= ELSEWHERE_AFTER && took < Duration::from_secs(3),
            "{took:?}"
        );
        // A collective without a name of its own is still counted.
        b_calls.store(8, "gather");
        let (end, _) = wait(7, Duration::from_secs(5));
        assert!(
            matches!(
                end,
                Err(Unfinished::PeerElsewhere {
                    calls: 8,
                    last_call: None,
                    ..
                })
            ),
            "{end:?}"
        );
        // The mapping outlives the segment while a mirror holds it.
        drop(b);
        b_calls.store(9, "all_reduce");
    }
}
