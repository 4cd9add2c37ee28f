//! [`Backend`]: which c10d backends a group has, as PyTorch's backend strings name them
//! (`distributed_c10d.py`'s `Backend` and its device-to-backend map).

use std::time::Duration;

use crate::c10d::env::{DEFAULT_NCCL_TIMEOUT, DEFAULT_TIMEOUT};
use crate::error::{DistError, Result};
use crate::ffi;

/// Which c10d backends a group has, as PyTorch's backend strings name them.
///
/// `Gloo` is PyTorch's `"gloo"` (CPU tensors), `Nccl` its `"cpu:gloo,cuda:nccl"`
/// (ProcessGroupNCCL for CUDA tensors, with Gloo beside it for CPU tensors and control
/// traffic: barriers, monitored barriers, metadata checks) and `NcclOnly` its `"nccl"`
/// (CUDA tensors only; barriers go through NCCL, CPU tensors and monitored barriers are
/// refused). A Rust rank and a PyTorch rank of one job must name the same set: each backend
/// has a rendezvous of its own, which waits for every rank. A CPU-only machine simply never
/// asks for NCCL, so one binary serves both.
///
/// ```
/// use tch_dist_runtime::Backend;
/// assert_eq!("gloo".parse::<Backend>().unwrap(), Backend::Gloo);
/// assert_eq!("nccl".parse::<Backend>().unwrap(), Backend::NcclOnly);
/// assert_eq!(Backend::try_from("cpu:gloo,cuda:nccl").unwrap(), Backend::Nccl);
/// assert_eq!(Backend::Nccl.to_string(), "cpu:gloo,cuda:nccl");
/// assert!("mpi".parse::<Backend>().is_err());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Backend {
    /// Gloo only: CPU tensors (PyTorch's `"gloo"`).
    Gloo,
    /// NCCL for CUDA tensors, with Gloo beside it for CPU tensors (PyTorch's
    /// `"cpu:gloo,cuda:nccl"`).
    Nccl,
    /// NCCL only (PyTorch's `"nccl"`, also what its bare `init_process_group()` picks on a
    /// machine with CUDA).
    NcclOnly,
}

impl Backend {
    /// `Nccl` when CUDA is available, else `Gloo` (PyTorch's usual choice, with Gloo kept
    /// beside NCCL for CPU tensors).
    pub fn default_for_machine() -> Backend {
        if tch::Cuda::is_available() {
            Backend::Nccl
        } else {
            Backend::Gloo
        }
    }

    /// PyTorch's default timeout for a group of this backend (`_get_default_timeout`): 10
    /// minutes for `"nccl"` ([`Backend::NcclOnly`]), 30 minutes otherwise, `"cpu:gloo,cuda:nccl"`
    /// included.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tch_dist_runtime::Backend;
    /// assert_eq!(Backend::NcclOnly.default_timeout(), Duration::from_secs(600));
    /// assert_eq!(Backend::Nccl.default_timeout(), Duration::from_secs(1800));
    /// ```
    pub fn default_timeout(&self) -> Duration {
        match self {
            Backend::NcclOnly => DEFAULT_NCCL_TIMEOUT,
            Backend::Gloo | Backend::Nccl => DEFAULT_TIMEOUT,
        }
    }

    /// Whether this build of tch-dist can create NCCL groups.
    pub fn nccl_compiled() -> bool {
        // SAFETY: a constant query without arguments.
        unsafe { ffi::tdr_nccl_compiled() }
    }

    /// PyTorch's string for this backend set.
    ///
    /// ```
    /// assert_eq!(tch_dist_runtime::Backend::NcclOnly.as_str(), "nccl");
    /// ```
    pub fn as_str(self) -> &'static str {
        match self {
            Backend::Gloo => "gloo",
            Backend::Nccl => "cpu:gloo,cuda:nccl",
            Backend::NcclOnly => "nccl",
        }
    }

    /// Whether the group has a Gloo backend (CPU tensors).
    pub fn has_gloo(self) -> bool {
        self != Backend::NcclOnly
    }

    /// Whether the group has an NCCL backend (CUDA tensors).
    pub fn has_nccl(self) -> bool {
        self != Backend::Gloo
    }

    /// Reads PyTorch's backend strings, in any case: `"gloo"`, `"nccl"`, and the
    /// device-to-backend map `"cpu:gloo,cuda:nccl"` (either order; `"cpu:gloo"` alone is
    /// `"gloo"`, `"cuda:nccl"` alone is `"nccl"`). Anything else is
    /// [`DistError::UnknownBackend`].
    pub fn parse(value: &str) -> Result<Backend> {
        let unknown = || DistError::UnknownBackend {
            value: value.to_string(),
        };
        let lower = value.trim().to_ascii_lowercase();
        match lower.as_str() {
            "gloo" => return Ok(Backend::Gloo),
            "nccl" => return Ok(Backend::NcclOnly),
            _ => {}
        }
        let (mut cpu, mut cuda) = (false, false);
        for pair in lower.split(',') {
            match pair.split_once(':').map(|(d, b)| (d.trim(), b.trim())) {
                Some(("cpu", "gloo")) if !cpu => cpu = true,
                Some(("cuda", "nccl")) if !cuda => cuda = true,
                _ => return Err(unknown()),
            }
        }
        Ok(match (cpu, cuda) {
            (true, true) => Backend::Nccl,
            (true, false) => Backend::Gloo,
            (false, true) => Backend::NcclOnly,
            (false, false) => return Err(unknown()),
        })
    }
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Backend {
    type Err = DistError;
    fn from_str(s: &str) -> Result<Backend> {
        Backend::parse(s)
    }
}

impl TryFrom<&str> for Backend {
    type Error = DistError;
    fn try_from(s: &str) -> Result<Backend> {
        Backend::parse(s)
    }
}

impl TryFrom<String> for Backend {
    type Error = DistError;
    fn try_from(s: String) -> Result<Backend> {
        Backend::parse(&s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backend_strings_are_pytorchs() {
        for (text, backend) in [
            ("gloo", Backend::Gloo),
            ("GLOO", Backend::Gloo),
            ("nccl", Backend::NcclOnly),
            ("cpu:gloo,cuda:nccl", Backend::Nccl),
            ("cuda:nccl, cpu:gloo", Backend::Nccl),
            ("cpu:gloo", Backend::Gloo),
            ("cuda:nccl", Backend::NcclOnly),
        ] {
            assert_eq!(Backend::parse(text).unwrap(), backend, "{text}");
        }
        for b in [Backend::Gloo, Backend::Nccl, Backend::NcclOnly] {
            assert_eq!(Backend::parse(b.as_str()).unwrap(), b);
        }
        for bad in [
            "",
            "mpi",
            "cpu:nccl",
            "cpu:gloo,cpu:gloo",
            "gloo,nccl",
            "cuda:gloo",
        ] {
            assert_eq!(
                Backend::parse(bad).unwrap_err(),
                DistError::UnknownBackend {
                    value: bad.to_string()
                },
                "{bad}"
            );
        }
        assert_eq!(
            Backend::parse("ucc").unwrap_err().to_string(),
            "unknown backend \"ucc\": expected \"gloo\", \"nccl\" or \"cpu:gloo,cuda:nccl\""
        );
        // init_process_group's argument: a Backend or a string.
        fn takes<B: TryInto<Backend>>(b: B) -> Result<Backend>
        where
            DistError: From<B::Error>,
        {
            Ok(b.try_into()?)
        }
        assert_eq!(takes(Backend::Gloo).unwrap(), Backend::Gloo);
        assert_eq!(takes("nccl").unwrap(), Backend::NcclOnly);
        assert!(takes(String::from("bogus")).is_err());
    }
}
