//! c10d's key-value stores: the TCPStore every group rendezvouses through, and prefixes.

use std::ffi::CString;
use std::ptr::NonNull;
use std::sync::Arc;
use std::time::Duration;

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

fn cstring(s: &str) -> Result<CString, String> {
    CString::new(s).map_err(|_| format!("{s:?} contains a NUL byte"))
}

impl Store {
    /// Connects to (or, with `is_server`, hosts) a TCPStore at `host:port`.
    pub fn tcp(
        host: &str,
        port: u16,
        is_server: bool,
        world_size: usize,
        timeout: Duration,
    ) -> Result<Store, String> {
        let host = cstring(host)?;
        let mut out = std::ptr::null_mut();
        // SAFETY: valid C string and out-pointer; the shim catches every exception.
        let err = unsafe {
            ffi::tdr_store_tcp(
                host.as_ptr(),
                port,
                is_server,
                world_size as i32,
                millis(timeout),
                &mut out,
            )
        };
        // SAFETY: `err` is the shim's return value.
        unsafe { ffi::take_error(err) }?;
        Ok(Self::from_raw(out))
    }

    fn from_raw(ptr: *mut ffi::TdrStore) -> Store {
        let ptr = NonNull::new(ptr).expect("the shim returns a store on success");
        Store {
            inner: Arc::new(StoreHandle(ptr)),
        }
    }

    /// A view of this store whose keys are all prefixed with `prefix`.
    pub fn prefixed(&self, prefix: &str) -> Result<Store, String> {
        let prefix = cstring(prefix)?;
        let mut out = std::ptr::null_mut();
        // SAFETY: live store handle, valid C string and out-pointer.
        let err = unsafe { ffi::tdr_store_prefix(self.raw(), prefix.as_ptr(), &mut out) };
        // SAFETY: `err` is the shim's return value.
        unsafe { ffi::take_error(err) }?;
        Ok(Self::from_raw(out))
    }

    /// Sets `key` to `value`.
    pub fn set(&self, key: &str, value: &[u8]) -> Result<(), String> {
        let key = cstring(key)?;
        // SAFETY: live store; `value` outlives the call, which copies it.
        let err =
            unsafe { ffi::tdr_store_set(self.raw(), key.as_ptr(), value.as_ptr(), value.len()) };
        // SAFETY: `err` is the shim's return value.
        unsafe { ffi::take_error(err) }
    }

    /// Gets `key`, waiting for it up to the store's timeout.
    pub fn get(&self, key: &str) -> Result<Vec<u8>, String> {
        let key = cstring(key)?;
        let mut data = std::ptr::null_mut();
        let mut len = 0usize;
        // SAFETY: live store, valid out-pointers.
        let err = unsafe { ffi::tdr_store_get(self.raw(), key.as_ptr(), &mut data, &mut len) };
        // SAFETY: `err` is the shim's return value.
        unsafe { ffi::take_error(err) }?;
        // SAFETY: on success `data` holds `len` malloc'ed bytes that we copy and free once.
        let value = unsafe { std::slice::from_raw_parts(data, len) }.to_vec();
        unsafe { ffi::tdr_bytes_free(data) };
        Ok(value)
    }

    /// Atomically adds `delta` to the integer at `key` and returns the new value.
    pub fn add(&self, key: &str, delta: i64) -> Result<i64, String> {
        let key = cstring(key)?;
        let mut out = 0i64;
        // SAFETY: live store, valid out-pointer.
        let err = unsafe { ffi::tdr_store_add(self.raw(), key.as_ptr(), delta, &mut out) };
        // SAFETY: `err` is the shim's return value.
        unsafe { ffi::take_error(err) }?;
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
