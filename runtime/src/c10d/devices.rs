//! Which GPU each rank uses: the claim a rank makes on its CUDA device, and the check, across
//! every rank of an NCCL group, that no two ranks claim the same GPU (NCCL refuses such a
//! group with "Duplicate GPU detected", naming neither the launch mistake nor the ranks'
//! devices; this check runs first and names both ranks).

use std::ffi::{c_char, CStr};

use crate::c10d::group::ProcessGroup;
use crate::error::{DistError, MisuseProblem, Result};
use crate::ffi;

/// The GPU a rank uses, as the other ranks compare it.
///
/// Two claims name the same GPU when both carry the GPU's UUID and the UUIDs are equal (one
/// physical GPU has one UUID, whatever `CUDA_VISIBLE_DEVICES` calls it), or, where a UUID is
/// missing, when host and device index are equal.
///
/// ```
/// use tch_dist_runtime::DeviceClaim;
/// let on = |host: &str, device, uuid: Option<&str>| DeviceClaim {
///     host: host.into(),
///     device,
///     uuid: uuid.map(Into::into),
/// };
/// assert!(on("a", 0, None).same_gpu(&on("a", 0, None)));
/// assert!(!on("a", 0, None).same_gpu(&on("b", 0, None)));
/// // Two indices, one GPU (two CUDA_VISIBLE_DEVICES settings):
/// assert!(on("a", 0, Some("GPU-1")).same_gpu(&on("a", 1, Some("GPU-1"))));
/// assert!(!on("a", 0, Some("GPU-1")).same_gpu(&on("a", 0, Some("GPU-2"))));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceClaim {
    /// The host's name.
    pub host: String,
    /// The CUDA device index in the claiming process.
    pub device: usize,
    /// The GPU's UUID (`GPU-...`, as nvidia-smi prints it), where known.
    pub uuid: Option<String>,
}

impl DeviceClaim {
    /// This process's claim on CUDA device `device`: this host and the GPU's UUID.
    pub fn of_cuda_device(device: usize) -> Result<DeviceClaim> {
        let mut out: *mut c_char = std::ptr::null_mut();
        // SAFETY: valid out-pointer; the shim catches every exception.
        let uuid = match ffi::check(unsafe { ffi::tdr_cuda_device_uuid(device as i32, &mut out) }) {
            Ok(()) => {
                // SAFETY: on success `out` is a NUL-terminated malloc'ed string we free once.
                let s = unsafe { CStr::from_ptr(out) }
                    .to_string_lossy()
                    .into_owned();
                unsafe { ffi::tdr_string_free(out) };
                Some(s)
            }
            Err(_) => None,
        };
        Ok(DeviceClaim {
            host: hostname(),
            device,
            uuid,
        })
    }

    /// Whether `self` and `other` name the same GPU (see the type's docs).
    pub fn same_gpu(&self, other: &DeviceClaim) -> bool {
        match (&self.uuid, &other.uuid) {
            (Some(a), Some(b)) => a == b,
            _ => self.host == other.host && self.device == other.device,
        }
    }

    fn encode(&self) -> String {
        format!(
            "{}\n{}\n{}",
            self.device,
            self.uuid.as_deref().unwrap_or(""),
            self.host
        )
    }

    fn decode(bytes: &[u8]) -> Option<DeviceClaim> {
        let text = std::str::from_utf8(bytes).ok()?;
        let mut parts = text.splitn(3, '\n');
        let device = parts.next()?.parse().ok()?;
        let uuid = parts.next()?;
        let host = parts.next()?.to_string();
        Some(DeviceClaim {
            host,
            device,
            uuid: (!uuid.is_empty()).then(|| uuid.to_string()),
        })
    }
}

/// The first pair of ranks (in rank order) whose claims name the same GPU.
pub fn first_shared_gpu(claims: &[DeviceClaim]) -> Option<(usize, usize)> {
    (0..claims.len()).find_map(|b| {
        (0..b)
            .find(|&a| claims[a].same_gpu(&claims[b]))
            .map(|a| (a, b))
    })
}

/// This host's name (`gethostname`), or `localhost` when it cannot be read.
fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most `len` bytes into the buffer we own.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr() as *mut c_char, buf.len()) };
    if rc != 0 {
        return "localhost".to_string();
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

impl ProcessGroup {
    /// Makes the group's bound device the calling thread's current CUDA device
    /// (`torch.cuda.set_device(local_rank)`); nothing for a group without one.
    ///
    /// Creating the group does this on the creating thread. CUDA's current device is per
    /// thread: another thread that allocates tensors or waits on works for this group calls
    /// it first.
    pub fn set_current_device(&self) -> Result<()> {
        let Some(tch::Device::Cuda(d)) = self.bound_device() else {
            return Ok(());
        };
        // SAFETY: a plain call with an integer; the shim catches every exception.
        ffi::check(unsafe { ffi::tdr_cuda_set_device(d as i32) }).map_err(|e| {
            DistError::Collective {
                rank: self.rank(),
                op: "set_current_device",
                cause: e.message,
            }
        })
    }

    /// Fails on every rank, with a [`DistError::DuplicateDevice`] naming the first pair of
    /// ranks whose claims name the same GPU, unless every rank claims a GPU of its own (one
    /// all-gather over Gloo). An NCCL group runs it while it is created, with each rank's
    /// [`DeviceClaim::of_cuda_device`].
    pub fn verify_distinct_devices(&self, claim: &DeviceClaim) -> Result<()> {
        const OP: &str = "init_process_group";
        let claims = self
            .all_gather_bytes(OP, claim.encode().as_bytes())?
            .iter()
            .map(|b| DeviceClaim::decode(b))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| DistError::Misuse {
                rank: self.rank(),
                op: OP,
                problem: Box::new(MisuseProblem::Undecodable {
                    what: "a device claim",
                    from: None,
                }),
            })?;
        match first_shared_gpu(&claims) {
            None => Ok(()),
            Some((a, b)) => Err(DistError::DuplicateDevice {
                rank: self.rank(),
                first: a,
                first_device: claims[a].device,
                second: b,
                second_device: claims[b].device,
                host: claims[a].host.clone(),
                gpu: claims[a].uuid.clone(),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claim(host: &str, device: usize, uuid: Option<&str>) -> DeviceClaim {
        DeviceClaim {
            host: host.into(),
            device,
            uuid: uuid.map(Into::into),
        }
    }

    #[test]
    fn the_first_pair_in_rank_order() {
        // Two nodes of two GPUs, launched right: no pair.
        let fine = [
            claim("n0", 0, None),
            claim("n0", 1, None),
            claim("n1", 0, None),
            claim("n1", 1, None),
        ];
        assert_eq!(first_shared_gpu(&fine), None);
        // Rank 3 also took n0's cuda:1, and rank 2 took rank 0's: (0, 2) comes first.
        let clash = [
            claim("n0", 0, None),
            claim("n0", 1, None),
            claim("n0", 0, None),
            claim("n0", 1, None),
        ];
        assert_eq!(first_shared_gpu(&clash), Some((0, 2)));
        // One GPU under two indices (CUDA_VISIBLE_DEVICES=1 and =0,1): the UUID tells.
        let renamed = [claim("n0", 0, Some("GPU-b")), claim("n0", 1, Some("GPU-b"))];
        assert_eq!(first_shared_gpu(&renamed), Some((0, 1)));
        // Two GPUs both called cuda:0 in their processes: distinct by UUID.
        let visible = [claim("n0", 0, Some("GPU-a")), claim("n0", 0, Some("GPU-b"))];
        assert_eq!(first_shared_gpu(&visible), None);
        assert_eq!(first_shared_gpu(&[]), None);
    }

    #[test]
    fn claims_cross_ranks_unchanged() {
        for c in [
            claim("gpu-node-3", 7, Some("GPU-5e7c2a1b")),
            claim("h\nwith newline", 0, None),
        ] {
            assert_eq!(DeviceClaim::decode(c.encode().as_bytes()), Some(c));
        }
        assert_eq!(DeviceClaim::decode(b"x\n\nh"), None);
    }
}
