//! c10d's key-value stores: the TCPStore every group rendezvouses through, and prefixes.

use std::ffi::CString;
use std::os::fd::IntoRawFd;
use std::ptr::NonNull;
use std::sync::Arc;
use std::time::Duration;

use crate::error::{DistError, Result};
use crate::ffi;

/// A handle on a c10d store (TCPStore, or a PrefixStore over one). Cheap to clone.
#[derive(Clone)]
pub struct Store {
    inner: Arc<StoreHandle>,
}

struct StoreHandle(NonNull<ffi::TdrStore>);

// SAFETY: c10d stores are used from many threads by PyTorch itself (TCPStore serialises
// its socket traffic internally); the handle is only freed on drop of the last Arc.
unsafe impl Send for StoreHandle {}
unsafe impl Sync for StoreHandle {}

impl Drop for StoreHandle {
    fn drop(&mut self) {
        // SAFETY: the pointer came from the shim and is freed exactly once, here.
        unsafe { ffi::tdr_store_free(self.0.as_ptr()) }
    }
}

/// A store operation's failure (`DistError::Store`).
fn store_error(op: &'static str, key: &str, cause: impl Into<String>) -> DistError {
    DistError::Store {
        op,
        key: key.to_string(),
        cause: cause.into(),
    }
}

/// The socket rank 0's store listens on: bound to the address `host` (MASTER_ADDR) names on
/// this machine, so that the store is reached where the job says it is and nowhere else
/// (PyTorch's TCPStore binds every interface, `::` or `0.0.0.0`). `None` leaves the choice to
/// the TCPStore: when `host` does not resolve, or names no address of this machine (a
/// forwarded or virtual address), it listens on every interface as PyTorch's does, and says
/// so; when the port is taken, the TCPStore's own error names it.
fn listen_where(host: &str, port: u16) -> Option<std::net::TcpListener> {
    use std::net::ToSocketAddrs;
    let addrs: Vec<_> = (host, port).to_socket_addrs().ok()?.collect();
    let mut not_here = None;
    for addr in &addrs {
        match std::net::TcpListener::bind(addr) {
            Ok(listener) => return Some(listener),
            Err(e) if e.kind() == std::io::ErrorKind::AddrNotAvailable => not_here = Some(e),
            Err(_) => return None,
        }
    }
    if let Some(e) = not_here {
        eprintln!(
            "tch-dist: the store listens on every interface at port {port}: MASTER_ADDR \
             {host} is not an address of this machine ({e})"
        );
    }
    None
}

fn cstring(op: &'static str, s: &str) -> Result<CString> {
    CString::new(s).map_err(|_| store_error(op, s, "the key contains a NUL byte"))
}

impl Store {
    /// Connects to (or, with `is_server`, hosts) a TCPStore at `host:port`, waiting at most
    /// `connect_timeout` for the connection; `timeout` bounds every later wait. The error is
    /// the engine's message; the caller names the rendezvous. A server listens only where
    /// `host` points ([`listen_where`]).
    pub(crate) fn tcp(
        host: &str,
        port: u16,
        is_server: bool,
        world_size: usize,
        connect_timeout: Duration,
        timeout: Duration,
    ) -> std::result::Result<Store, String> {
        let listener = if is_server {
            listen_where(host, port)
        } else {
            None
        };
        let host = CString::new(host).map_err(|_| format!("{host:?} contains a NUL byte"))?;
        let mut out = std::ptr::null_mut();
        // The server takes the listening socket over (its fd is closed with the store).
        let listen_fd = listener.map_or(-1, IntoRawFd::into_raw_fd);
        // SAFETY: valid C string and out-pointer; `listen_fd` is a listening socket this
        // call hands over, or -1; the shim catches every exception.
        ffi::check(unsafe {
            ffi::tdr_store_tcp(
                host.as_ptr(),
                port,
                is_server,
                listen_fd,
                world_size as i32,
                millis(connect_timeout).max(1),
                millis(timeout),
                &mut out,
            )
        })?;
        Ok(Self::from_raw(out))
    }

    /// PyTorch's TCPStore handshake (`wait_for_workers=True`): checks this rank in on the
    /// store's worker count; on the server, then waits until the whole world checked in, at
    /// most `timeout`. The error is the engine's message.
    pub(crate) fn check_in(&self, timeout: Duration) -> std::result::Result<(), String> {
        // SAFETY: live store handle; the shim catches every exception.
        ffi::check(unsafe { ffi::tdr_store_check_in(self.raw(), millis(timeout).max(1)) })
            .map_err(|e| e.message)
    }

    fn from_raw(ptr: *mut ffi::TdrStore) -> Store {
        let ptr = NonNull::new(ptr).expect("the shim returns a store on success");
        Store {
            inner: Arc::new(StoreHandle(ptr)),
        }
    }

    /// A view of this store whose keys are all prefixed with `prefix` (c10d's `PrefixStore`).
    pub fn prefixed(&self, prefix: &str) -> Result<Store> {
        const OP: &str = "prefix";
        let c_prefix = cstring(OP, prefix)?;
        let mut out = std::ptr::null_mut();
        // SAFETY: live store handle, valid C string and out-pointer.
        ffi::check(unsafe { ffi::tdr_store_prefix(self.raw(), c_prefix.as_ptr(), &mut out) })
            .map_err(|e| store_error(OP, prefix, e))?;
        Ok(Self::from_raw(out))
    }

    /// Sets `key` to `value`.
    ///
    /// ```no_run
    /// # let pg = tch_dist_runtime::default_group()?;
    /// let store = pg.store();
    /// if pg.rank() == 0 {
    ///     store.set("epoch", b"3")?;
    /// }
    /// assert_eq!(store.get("epoch")?, b"3"); // waits for rank 0's key
    /// # Ok::<(), tch_dist_runtime::DistError>(())
    /// ```
    pub fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        const OP: &str = "set";
        let c_key = cstring(OP, key)?;
        // SAFETY: live store; `value` outlives the call, which copies it.
        ffi::check(unsafe {
            ffi::tdr_store_set(self.raw(), c_key.as_ptr(), value.as_ptr(), value.len())
        })
        .map_err(|e| store_error(OP, key, e))
    }

    /// Gets `key`, waiting for it up to the store's timeout.
    pub fn get(&self, key: &str) -> Result<Vec<u8>> {
        const OP: &str = "get";
        let c_key = cstring(OP, key)?;
        let mut data = std::ptr::null_mut();
        let mut len = 0usize;
        // SAFETY: live store, valid out-pointers.
        ffi::check(unsafe { ffi::tdr_store_get(self.raw(), c_key.as_ptr(), &mut data, &mut len) })
            .map_err(|e| store_error(OP, key, e))?;
        // SAFETY: on success `data` holds `len` malloc'ed bytes that we copy and free once.
        let value = unsafe { std::slice::from_raw_parts(data, len) }.to_vec();
        unsafe { ffi::tdr_bytes_free(data) };
        Ok(value)
    }

    /// Atomically adds `delta` to the integer at `key` (0 when absent) and returns the new
    /// value.
    pub fn add(&self, key: &str, delta: i64) -> Result<i64> {
        const OP: &str = "add";
        let c_key = cstring(OP, key)?;
        let mut out = 0i64;
        // SAFETY: live store, valid out-pointer.
        ffi::check(unsafe { ffi::tdr_store_add(self.raw(), c_key.as_ptr(), delta, &mut out) })
            .map_err(|e| store_error(OP, key, e))?;
        Ok(out)
    }

    /// Sets `key` to `desired` if it holds `expected`, or if it is absent and `expected` is
    /// empty, and returns what it holds afterwards (c10d's `compare_set`): `desired` when
    /// the swap happened.
    ///
    /// ```no_run
    /// # let pg = tch_dist_runtime::default_group()?;
    /// // The first rank to get here claims the key; the others read the winner's value.
    /// let winner = pg.store().compare_set("leader", b"", pg.rank().to_string().as_bytes())?;
    /// # Ok::<(), tch_dist_runtime::DistError>(())
    /// ```
    pub fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>> {
        const OP: &str = "compare_set";
        let c_key = cstring(OP, key)?;
        let mut data = std::ptr::null_mut();
        let mut len = 0usize;
        // SAFETY: live store; both slices outlive the call, which copies them; valid
        // out-pointers.
        ffi::check(unsafe {
            ffi::tdr_store_compare_set(
                self.raw(),
                c_key.as_ptr(),
                expected.as_ptr(),
                expected.len(),
                desired.as_ptr(),
                desired.len(),
                &mut data,
                &mut len,
            )
        })
        .map_err(|e| store_error(OP, key, e))?;
        // SAFETY: on success `data` holds `len` malloc'ed bytes that we copy and free once.
        let value = unsafe { std::slice::from_raw_parts(data, len) }.to_vec();
        unsafe { ffi::tdr_bytes_free(data) };
        Ok(value)
    }

    /// Whether `key` exists, without waiting for it.
    pub fn check(&self, key: &str) -> Result<bool> {
        const OP: &str = "check";
        let c_key = cstring(OP, key)?;
        let mut out = false;
        // SAFETY: live store, valid C string and out-pointer.
        ffi::check(unsafe { ffi::tdr_store_check(self.raw(), c_key.as_ptr(), &mut out) })
            .map_err(|e| store_error(OP, key, e))?;
        Ok(out)
    }

    pub(crate) fn raw(&self) -> *mut ffi::TdrStore {
        self.inner.0.as_ptr()
    }
}

/// A timeout in whole milliseconds for the shim, saturating instead of overflowing.
pub(crate) fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}
