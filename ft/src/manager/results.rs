//! One group rank's view of a quorum (torchft's `compute_quorum_results`, src/manager.rs):
//! its replica rank, the members at the highest step (the divisor of an average), which
//! group's TCPStore its cross-group process group meets at, and who heals from whom.

use std::collections::BTreeMap;

use crate::proto::{ManagerQuorumResponse, Quorum, QuorumMember};

/// `replica_id`'s group is not among the quorum's members.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct NotAMember(pub String);

/// What `group_rank` of the group `replica_id` makes of `quorum`.
///
/// - Members sort by id (as strings); the replica rank is the position there.
/// - The store is that of the member at the highest step chosen as `group_rank % count`:
///   each group rank meets at another group's store, spreading the load.
/// - A member heals when its step is behind, or, with `init_sync` at step 0, when it is not
///   the store's member (one set of initial weights). Sources are the up-to-date members,
///   taken round robin from an offset of `group_rank`.
pub(crate) fn quorum_results(
    replica_id: &str,
    group_rank: i64,
    quorum: &Quorum,
    init_sync: bool,
) -> Result<ManagerQuorumResponse, NotAMember> {
    let mut members: Vec<&QuorumMember> = quorum.participants.iter().collect();
    members.sort_by(|a, b| a.replica_id.cmp(&b.replica_id));
    let replica_rank = members
        .iter()
        .position(|p| p.replica_id == replica_id)
        .ok_or_else(|| NotAMember(replica_id.to_string()))?;
    let max_step = members.iter().map(|p| p.step).max().unwrap_or(0);
    let at_max: Vec<&QuorumMember> = members
        .iter()
        .copied()
        .filter(|p| p.step == max_step)
        .collect();
    let max_replica_rank = at_max
        .iter()
        .position(|p| p.replica_id == replica_id)
        .map(|i| i as i64);
    // A group rank is non-negative; its remainder picks among the up-to-date members.
    let spread = usize::try_from(group_rank).unwrap_or(0);
    let primary = at_max[spread % at_max.len()];
    let force = init_sync && max_step == 0;
    let healing: Vec<usize> = members
        .iter()
        .enumerate()
        .filter(|(_, p)| p.step != max_step || (force && p.replica_id != primary.replica_id))
        .map(|(i, _)| i)
        .collect();
    let sources: Vec<usize> = (0..members.len())
        .filter(|i| !healing.contains(i))
        .collect();
    let mut sends_to: BTreeMap<usize, Vec<i64>> = BTreeMap::new();
    let mut recover_src_replica_rank = None;
    for (i, &dst) in healing.iter().enumerate() {
        let src = sources[(i + spread) % sources.len()];
        sends_to.entry(src).or_default().push(dst as i64);
        if dst == replica_rank {
            recover_src_replica_rank = Some(src as i64);
        }
    }
    Ok(ManagerQuorumResponse {
        quorum_id: quorum.quorum_id,
        recover_src_manager_address: recover_src_replica_rank
            .map(|r| members[r as usize].address.clone())
            .unwrap_or_default(),
        recover_src_replica_rank,
        recover_dst_replica_ranks: sends_to.remove(&replica_rank).unwrap_or_default(),
        store_address: primary.store_address.clone(),
        max_step,
        max_replica_rank,
        max_world_size: at_max.len() as i64,
        replica_rank: replica_rank as i64,
        replica_world_size: members.len() as i64,
        heal: recover_src_replica_rank.is_some(),
        commit_failures: members.iter().map(|p| p.commit_failures).max().unwrap_or(0),
        replica_ids: members.iter().map(|p| p.replica_id.clone()).collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(id: &str, step: i64) -> QuorumMember {
        QuorumMember {
            replica_id: id.into(),
            address: format!("addr_{id}"),
            store_address: format!("store_{id}"),
            step,
            world_size: 1,
            ..QuorumMember::default()
        }
    }

    fn quorum(members: Vec<QuorumMember>) -> Quorum {
        Quorum {
            quorum_id: 1,
            participants: members,
            created: None,
        }
    }

    // torchft's test_compute_quorum_results_first_step: at step 0 with init_sync, every group
    // but the primary heals from it.
    #[test]
    fn at_step_zero_every_group_but_the_primary_heals() {
        let q = quorum(vec![member("replica_0", 0), member("replica_1", 0)]);
        let r0 = quorum_results("replica_0", 0, &q, true).unwrap();
        assert!(!r0.heal);
        assert_eq!(r0.replica_rank, 0);
        assert_eq!(r0.recover_src_replica_rank, None);
        assert_eq!(r0.recover_dst_replica_ranks, [1]);
        assert_eq!(r0.store_address, "store_replica_0");
        let r1 = quorum_results("replica_1", 0, &q, true).unwrap();
        assert!(r1.heal);
        assert_eq!(r1.replica_rank, 1);
        assert_eq!(r1.recover_src_replica_rank, Some(0));
        assert_eq!(r1.recover_src_manager_address, "addr_replica_0");
        assert_eq!(r1.recover_dst_replica_ranks, Vec::<i64>::new());
        // Group rank 1: the second member is its primary, meets at its store and sends.
        let r1g1 = quorum_results("replica_1", 1, &q, true).unwrap();
        assert!(!r1g1.heal);
        assert_eq!(r1g1.recover_dst_replica_ranks, [0]);
        assert_eq!(r1g1.store_address, "store_replica_1");
        // Without init_sync nobody heals at step 0 (torchft's
        // test_compute_quorum_results_skip_init_sync), but a group behind still does.
        assert!(!quorum_results("replica_1", 0, &q, false).unwrap().heal);
        let mut ahead = q.clone();
        ahead.participants[0].step = 1;
        assert!(quorum_results("replica_1", 0, &ahead, false).unwrap().heal);
    }

    // torchft's test_compute_quorum_results_recovery: groups behind heal from the up-to-date
    // ones, spread round robin.
    #[test]
    fn groups_behind_heal_round_robin_from_the_up_to_date_ones() {
        let q = quorum(vec![
            member("replica_0", 0),
            member("replica_1", 1),
            member("replica_2", 0),
            member("replica_3", 1),
            member("replica_4", 0),
        ]);
        let r = |id, group_rank| quorum_results(id, group_rank, &q, true).unwrap();
        let r0 = r("replica_0", 0);
        assert!(r0.heal);
        assert_eq!(r0.max_step, 1);
        assert_eq!(r0.max_replica_rank, None);
        assert_eq!(r0.max_world_size, 2);
        assert_eq!(r0.recover_src_replica_rank, Some(1));
        assert_eq!(r0.store_address, "store_replica_1");
        let r1 = r("replica_1", 0);
        assert!(!r1.heal);
        assert_eq!(r1.max_replica_rank, Some(0));
        assert_eq!(r1.recover_dst_replica_ranks, [0, 4]);
        let r3 = r("replica_3", 0);
        assert_eq!(r3.recover_dst_replica_ranks, [2]);
        // Group rank 1: the offset moves every assignment along.
        let r1g1 = r("replica_1", 1);
        assert_eq!(r1g1.recover_dst_replica_ranks, [2]);
        assert_eq!(r1g1.store_address, "store_replica_3");
        assert_eq!(r("replica_0", 1).recover_src_replica_rank, Some(3));
    }

    // torchft's test_compute_quorum_results_commit_failures, and a group the quorum left out.
    #[test]
    fn commit_failures_are_the_highest_and_a_non_member_is_refused() {
        let q = quorum(vec![
            QuorumMember {
                commit_failures: 2,
                ..member("replica_0", 3)
            },
            member("replica_1", 3),
        ]);
        let r = quorum_results("replica_1", 0, &q, true).unwrap();
        assert_eq!(r.commit_failures, 2);
        assert_eq!(r.replica_ids, ["replica_0", "replica_1"]);
        assert_eq!(
            quorum_results("replica_9", 0, &q, true),
            Err(NotAMember("replica_9".into()))
        );
    }
}
