//! Striped reads: each tensor that every rank needs whole (a replicated model's, the
//! unsharded parts of a sharded one) is read by one rank and broadcast to the others
//! (torchtitan's "striped I/O + collective broadcast", RFC #4035; DCP itself has no
//! counterpart: every rank reads what it needs).
//!
//! The readers are assigned by bytes, largest tensor first, each to the rank with the
//! fewest bytes so far (ties to the lowest rank), so every rank reads about `1/world` of
//! those tensors. The assignment is a pure function of the tensors' FQNs, shapes and dtypes,
//! so every rank computes the same one; a load first checks (one all-gather of a digest of
//! that list) that every rank holds the same whole tensors, and reads each rank for itself
//! where they differ (pipeline stages, independent models), which is always right.

use tch::Tensor;
use tch_dist_runtime::{Object, ProcessGroup, BROADCAST_BUCKET_BYTES};

use super::{storage, CheckpointError};
use crate::state_dict::flat::Entry;
#[cfg(test)]
use crate::state_dict::flat::Part;

/// Which rank reads each target: `Some(rank)` for a whole tensor, striped; `None` for a
/// shard, which its holder reads.
pub(super) fn readers(targets: &[Entry], world: usize) -> Vec<Option<usize>> {
    let mut order: Vec<usize> = (0..targets.len())
        .filter(|&i| !targets[i].part.is_shard())
        .collect();
    let bytes = |i: usize| targets[i].tensor.numel() * targets[i].tensor.kind().elt_size_in_bytes();
    order.sort_by(|&a, &b| {
        bytes(b)
            .cmp(&bytes(a))
            .then_with(|| targets[a].fqn.cmp(&targets[b].fqn))
    });
    let mut load = vec![0usize; world.max(1)];
    let mut out = vec![None; targets.len()];
    for i in order {
        let rank = (0..load.len()).min_by_key(|&r| (load[r], r)).unwrap_or(0);
        load[rank] += bytes(i);
        out[i] = Some(rank);
    }
    out
}

/// Whether every rank of `group` holds the same whole tensors (FQN, shape, dtype) as this
/// one, so that the striped assignment is the same everywhere: one all-gather of a digest.
pub(super) fn same_on_every_rank(
    group: &ProcessGroup,
    targets: &[Entry],
) -> Result<bool, CheckpointError> {
    let mut list = String::new();
    for t in targets.iter().filter(|t| !t.part.is_shard()) {
        list.push_str(&format!("{}:{:?}:{:?};", t.fqn, t.global, t.tensor.kind()));
    }
    let mine = Object::Str(storage::sha256(list.as_bytes()));
    let all = group.all_gather_object(&mine)?;
    Ok(all.iter().all(|o| *o == mine))
}

/// Completes `staged` (this rank's targets' values, in the order of `targets`, the ones
/// others read left as placeholders) by broadcasting each striped target's values from its
/// reader: per reader, one coalesced broadcast of its tensors in target order.
pub(super) fn broadcast(
    group: &ProcessGroup,
    readers: &[Option<usize>],
    staged: &[(Tensor, Tensor)],
) -> Result<(), CheckpointError> {
    for src in 0..group.world_size() {
        let values: Vec<&Tensor> = readers
            .iter()
            .zip(staged)
            .filter(|(r, _)| **r == Some(src))
            .map(|(_, (_, v))| v)
            .collect();
        group.broadcast_coalesced(&values, src, BROADCAST_BUCKET_BYTES)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target(fqn: &str, numel: i64, sharded: bool) -> Entry {
        Entry {
            fqn: fqn.into(),
            tensor: Tensor::zeros([numel], tch::kind::FLOAT_CPU),
            offsets: vec![0],
            global: vec![numel],
            part: if sharded { Part::Shard } else { Part::Whole },
        }
    }

    #[test]
    fn whole_tensors_are_shared_out_by_bytes_and_shards_read_by_their_holder() {
        let targets = [
            target("a", 10, false),
            target("b", 40, false),
            target("s", 100, true),
            target("c", 30, false),
            target("d", 20, false),
        ];
        // Largest first: b (40) to 0, c (30) to 1, d (20) to 1 (30 < 40), a (10) to 0.
        assert_eq!(
            readers(&targets, 2),
            [Some(0), Some(0), None, Some(1), Some(1)]
        );
        // One rank reads everything whole; more ranks than tensors leave some idle.
        assert_eq!(
            readers(&targets, 1),
            [Some(0), Some(0), None, Some(0), Some(0)]
        );
        assert_eq!(
            readers(&targets, 8),
            [Some(3), Some(0), None, Some(1), Some(2)]
        );
    }
}
