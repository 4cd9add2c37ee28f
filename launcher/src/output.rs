//! The ranks' output: one thread reads every rank's stdout and stderr pipe through one epoll
//! set and writes each line, whole and prefixed with `[rankR]: `, to the launcher's own
//! stdout or stderr.
//!
//! One thread for all pipes rather than one per pipe: with a thread per pipe, 1000 ranks
//! meant 2000 threads, and every later `fork` copied the page tables and mappings of all
//! their stacks, so starting ranks took time quadratic in their number.

use std::collections::hash_map::{Entry, HashMap};
use std::io::Write;
use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Which of the launcher's streams a pipe's lines go to.
#[derive(Clone, Copy)]
pub enum Stream {
    Stdout,
    Stderr,
}

/// Pipes handed over whose first event the reader thread has not seen yet: (rank, stream)
/// by fd, entered before the fd joins the epoll set.
type NewPipes = Arc<Mutex<HashMap<RawFd, (usize, Stream)>>>;

/// The reader thread's handle: hands it pipes, and tells when they have all ended.
pub struct Output {
    epoll: OwnedFd,
    new_pipes: NewPipes,
    /// Pipes handed over that have not reached their end of file yet.
    open: Arc<AtomicUsize>,
}

impl Output {
    /// Creates the epoll set and starts the reader thread; lines are prefixed `[rankR]: `,
    /// or `[replicaG/rankR]: ` for replica group `G` (`--replica-group`).
    pub fn start(replica_group: Option<usize>) -> Result<Output, String> {
        // SAFETY: epoll_create1(2); the fd is owned below.
        let fd = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if fd < 0 {
            return Err(format!(
                "cannot create an epoll set for the ranks' output: {}",
                std::io::Error::last_os_error()
            ));
        }
        // SAFETY: a fresh fd of our own.
        let epoll = unsafe { OwnedFd::from_raw_fd(fd) };
        let new_pipes = NewPipes::default();
        let open = Arc::new(AtomicUsize::new(0));
        let (epfd, pipes, count) = (epoll.as_raw_fd(), new_pipes.clone(), open.clone());
        std::thread::Builder::new()
            .name("output".into())
            .spawn(move || read_loop(epfd, &pipes, &count, replica_group))
            .map_err(|e| format!("cannot start the output thread: {e}"))?;
        Ok(Output {
            epoll,
            new_pipes,
            open,
        })
    }

    /// Hands `pipe` (a rank's stdout or stderr) to the reader thread, which closes it at its
    /// end of file.
    pub fn add(&self, rank: usize, pipe: impl Into<OwnedFd>, stream: Stream) -> Result<(), String> {
        let fd = pipe.into().into_raw_fd();
        self.open.fetch_add(1, Ordering::SeqCst);
        // Entered before the fd can produce an event, so the thread knows every fd it sees.
        lock(&self.new_pipes).insert(fd, (rank, stream));
        let mut ev = libc::epoll_event {
            events: (libc::EPOLLIN | libc::EPOLLHUP | libc::EPOLLERR) as u32,
            u64: fd as u64,
        };
        // SAFETY: epoll_ctl(2) on our epoll set and a pipe whose ownership passes to the
        // reader thread (it closes it after an event, which needs this registration).
        if unsafe { libc::epoll_ctl(self.epoll.as_raw_fd(), libc::EPOLL_CTL_ADD, fd, &mut ev) } != 0
        {
            let e = std::io::Error::last_os_error();
            lock(&self.new_pipes).remove(&fd);
            // SAFETY: the fd never got into the set, so the thread never closes it.
            unsafe { libc::close(fd) };
            self.open.fetch_sub(1, Ordering::SeqCst);
            return Err(format!("cannot read rank {rank}'s output: {e}"));
        }
        Ok(())
    }

    /// Waits until every pipe handed over has ended, or `limit` has passed (a process out of
    /// the launcher's reach may hold a pipe open forever).
    pub fn drain(&self, limit: Duration, tick: Duration) {
        let deadline = Instant::now() + limit;
        while self.open.load(Ordering::SeqCst) > 0 && Instant::now() < deadline {
            std::thread::sleep(tick);
        }
    }
}

/// A pipe being read: its prefix, its stream and the start of a line not yet ended.
struct Reading {
    prefix: String,
    stream: Stream,
    partial: Vec<u8>,
}

impl Reading {
    /// Writes every complete line of `partial` (all of it at the end of file), prefixed, in
    /// one write, so that ranks' lines never interleave mid-line.
    fn flush_lines(&mut self, at_eof: bool) {
        let end = if at_eof {
            self.partial.len()
        } else {
            match self.partial.iter().rposition(|&b| b == b'\n') {
                Some(i) => i + 1,
                None => return,
            }
        };
        if end == 0 {
            return;
        }
        let prefix = &self.prefix;
        let mut out = Vec::with_capacity(end + prefix.len() * 4);
        for line in self.partial[..end].split_inclusive(|&b| b == b'\n') {
            out.extend_from_slice(prefix.as_bytes());
            out.extend_from_slice(line);
            if line.last() != Some(&b'\n') {
                out.push(b'\n');
            }
        }
        self.partial.drain(..end);
        // A closed or full launcher stream must not stop the reading (a rank blocked on a
        // full pipe would hang): write errors are dropped.
        let _ = match self.stream {
            Stream::Stdout => std::io::stdout().lock().write_all(&out),
            Stream::Stderr => std::io::stderr().lock().write_all(&out),
        };
    }
}

/// The map, also after a panic elsewhere while it was held (it holds plain data).
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn read_loop(
    epoll: RawFd,
    new_pipes: &Mutex<HashMap<RawFd, (usize, Stream)>>,
    open: &AtomicUsize,
    replica_group: Option<usize>,
) {
    let mut reading: HashMap<RawFd, Reading> = HashMap::new();
    let mut events = vec![libc::epoll_event { events: 0, u64: 0 }; 256];
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        // SAFETY: epoll_wait(2) into a buffer of `events.len()` entries.
        let n = unsafe {
            libc::epoll_wait(epoll, events.as_mut_ptr(), events.len() as libc::c_int, -1)
        };
        if n < 0 {
            if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return;
        }
        for ev in &events[..n as usize] {
            let fd = ev.u64 as RawFd;
            if let Entry::Vacant(new) = reading.entry(fd)
                && let Some((rank, stream)) = lock(new_pipes).remove(&fd)
            {
                new.insert(Reading {
                    prefix: match replica_group {
                        Some(g) => format!("[replica{g}/rank{rank}]: "),
                        None => format!("[rank{rank}]: "),
                    },
                    stream,
                    partial: Vec::new(),
                });
            }
            let Some(r) = reading.get_mut(&fd) else {
                continue;
            };
            // Level-triggered and readable: one read does not block.
            // SAFETY: read(2) into `buf` on a pipe this thread owns.
            let got = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
            if got > 0 {
                r.partial.extend_from_slice(&buf[..got as usize]);
                r.flush_lines(false);
                continue;
            }
            if got < 0 && std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted
            {
                continue;
            }
            // End of file (or a read error): the last line, then the pipe is done.
            r.flush_lines(true);
            reading.remove(&fd);
            // SAFETY: the pipe is ours; closing it also removes it from the epoll set.
            unsafe { libc::close(fd) };
            open.fetch_sub(1, Ordering::SeqCst);
        }
    }
}
