//! Which host a rank is on, and the check that a tensor-parallel dim stays within one.
//!
//! torchrun (and `tch-dist-run`) numbers ranks host by host: host `h`'s ranks are `h * L ..
//! h * L + L - 1`, `L` being `LOCAL_WORLD_SIZE`. Tensor parallelism runs collectives inside
//! every layer's forward and backward, which a host's own links carry many times faster than
//! the network between hosts; so the mesh's `tp` dim must be the innermost (last) one, with a
//! size that divides `LOCAL_WORLD_SIZE`, and data parallelism (`dp`, `dp_replicate`) outer,
//! where its few large collectives per step cross the network. PyTorch says nothing when a
//! mesh puts `tp` across hosts; [`init_device_mesh`](super::init_device_mesh) warns.

use std::fmt;

/// The dim names that [`tp_group_across_hosts`] checks: tensor parallelism's, as torchtitan
/// and PyTorch's examples name it.
pub const TENSOR_PARALLEL_DIM: &str = "tp";

/// A dim whose process groups hold ranks of more than one host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AcrossHosts {
    /// The dim's name.
    pub dim: String,
    /// The first of its groups that spans hosts, as global ranks.
    pub group: Vec<usize>,
    /// Ranks per host (`LOCAL_WORLD_SIZE`).
    pub local_world_size: usize,
}

impl AcrossHosts {
    /// The hosts that [`group`](Self::group)'s ranks are on, in increasing order.
    pub fn hosts(&self) -> Vec<usize> {
        let mut hosts: Vec<usize> = self
            .group
            .iter()
            .map(|r| r / self.local_world_size)
            .collect();
        hosts.sort_unstable();
        hosts.dedup();
        hosts
    }
}

impl fmt::Display for AcrossHosts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let hosts: Vec<String> = self.hosts().iter().map(usize::to_string).collect();
        write!(
            f,
            "the `{}` dim's group of ranks {:?} spans hosts {} (LOCAL_WORLD_SIZE={} ranks per \
             host): its collectives, in every layer's forward and backward, would cross the \
             network; make `{}` the last dim of the mesh, with a size that divides {}",
            self.dim,
            self.group,
            hosts.join(", "),
            self.local_world_size,
            self.dim,
            self.local_world_size,
        )
    }
}

/// The first group of the mesh's `tp` dim (of `shape`, dims named `names`) that holds ranks
/// of more than one host, each host holding `local_world_size` consecutive ranks; `None`
/// when every such group stays within a host, or the mesh has no `tp` dim.
///
/// ```
/// use tch_dist::device_mesh::tp_group_across_hosts;
/// // 2 hosts x 2 ranks: tp inside a host, dp across.
/// assert_eq!(tp_group_across_hosts(&[2, 2], &["dp", "tp"], 2), None);
/// // The other order puts ranks 0 and 2 (hosts 0 and 1) in one tp group.
/// let across = tp_group_across_hosts(&[2, 2], &["tp", "dp"], 2).unwrap();
/// assert_eq!(across.group, [0, 2]);
/// assert_eq!(across.hosts(), [0, 1]);
/// ```
pub fn tp_group_across_hosts(
    shape: &[usize],
    names: &[&str],
    local_world_size: usize,
) -> Option<AcrossHosts> {
    if local_world_size == 0 {
        return None;
    }
    let dim = names.iter().position(|&n| n == TENSOR_PARALLEL_DIM)?;
    super::subgroups(shape, &[dim])
        .into_iter()
        .find(|group| {
            let host = group[0] / local_world_size;
            group.iter().any(|r| r / local_world_size != host)
        })
        .map(|group| AcrossHosts {
            dim: TENSOR_PARALLEL_DIM.to_string(),
            group,
            local_world_size,
        })
}

/// Ranks per host as the launcher set it (`LOCAL_WORLD_SIZE`); `None` when unset or not a
/// positive number (a job not started by torchrun or tch-dist-run: no hosts to tell apart).
pub(crate) fn local_world_size_from_env() -> Option<usize> {
    std::env::var("LOCAL_WORLD_SIZE")
        .ok()?
        .trim()
        .parse::<usize>()
        .ok()
        .filter(|&n| n > 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tp_inside_hosts_passes_and_across_is_named() {
        // One host: nothing spans.
        assert_eq!(tp_group_across_hosts(&[2, 2], &["tp", "dp"], 4), None);
        // No tp dim, or unnamed dims: nothing to check.
        assert_eq!(tp_group_across_hosts(&[2, 2], &["dp", "cp"], 2), None);
        assert_eq!(tp_group_across_hosts(&[2, 2], &[], 2), None);
        // tp of 2 within hosts of 4 (a 2 x 2 x 2 mesh over 2 hosts).
        let names = ["dp_replicate", "dp_shard", "tp"];
        assert_eq!(tp_group_across_hosts(&[2, 2, 2], &names, 4), None);
        // tp of 4 over hosts of 2: ranks 0..4 span hosts 0 and 1.
        let across = tp_group_across_hosts(&[2, 4], &["dp", "tp"], 2).unwrap();
        assert_eq!(across.group, [0, 1, 2, 3]);
        assert_eq!(across.hosts(), [0, 1]);
        assert_eq!(
            across.to_string(),
            "the `tp` dim's group of ranks [0, 1, 2, 3] spans hosts 0, 1 (LOCAL_WORLD_SIZE=2 \
             ranks per host): its collectives, in every layer's forward and backward, would \
             cross the network; make `tp` the last dim of the mesh, with a size that divides 2"
        );
        // tp first over 3 hosts of 2.
        let across = tp_group_across_hosts(&[2, 3], &["tp", "dp"], 2).unwrap();
        assert_eq!(across.group, [0, 3]);
        assert_eq!(across.hosts(), [0, 1]);
    }
}
