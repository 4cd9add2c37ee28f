//! The checks a schedule makes on each rank of its stages and microbatch count before the
//! ranks agree (PyTorch's `schedules.py`: the `ValueError`s of `Schedule1F1B`,
//! `ScheduleInterleaved1F1B`, `ScheduleZBVZeroBubble` and `_validate_schedule`; `stage.py`'s
//! stage index and group checks). What a schedule asks is plain data ([`Rules`]), so that the
//! checks read the same for every schedule.

use tch_dist_runtime::ProcessGroup;

use super::error::PipelineProblem;
use super::order;
use super::placement::Placement;
use super::stage::PipelineStage;
use super::transport::tags_fit;

/// How many stages a schedule takes on each rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StagesPerRank {
    /// One (GPipe, 1F1B).
    One,
    /// Exactly two (the V placement).
    Two,
    /// Any number, the same on every rank (the interleaved schedules).
    Several,
}

/// What a schedule asks of its microbatch count, beyond one at least.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Microbatches {
    /// Any count.
    Any,
    /// At least one per stage (1F1B's warmup fills the pipeline).
    AtLeastOnePerStage,
    /// A multiple of the interleaved schedules' rounds (see `order::rounds`).
    InRounds,
}

/// What a schedule asks of its stages and microbatches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Rules {
    pub placement: Placement,
    pub stages_per_rank: StagesPerRank,
    pub microbatches: Microbatches,
}

/// This rank's own problem with its `stages` (sorted by stage index, at least one) on
/// `group` and `n` microbatches under `rules`, if any: the first of the checks in PyTorch's
/// order of concern (the group, the stage count, the placement, then the microbatches).
pub(crate) fn own_problem<M>(
    rules: Rules,
    stages: &[PipelineStage<M>],
    group: &ProcessGroup,
    n: usize,
) -> Option<PipelineProblem> {
    let (rank, group_size) = (group.rank(), group.world_size());
    let num_stages = stages[0].num_stages();
    let local_stages = stages.len();
    if group_size < 2 {
        return Some(PipelineProblem::GroupTooSmall { group_size });
    }
    if stages
        .iter()
        .any(|s| s.group().group_name() != group.group_name() || s.num_stages() != num_stages)
    {
        return Some(PipelineProblem::Groups);
    }
    let wrong_count = PipelineProblem::NumStages {
        num_stages,
        group_size,
        local_stages,
    };
    if rules.stages_per_rank == StagesPerRank::One && local_stages != 1 {
        return Some(wrong_count);
    }
    if let Some(s) = stages.iter().find(|s| s.stage_index() >= num_stages) {
        return Some(PipelineProblem::StageIndex {
            stage_index: s.stage_index(),
            num_stages,
        });
    }
    if rules.stages_per_rank == StagesPerRank::Two && local_stages != 2 {
        return Some(PipelineProblem::TwoStagesPerRank { local_stages });
    }
    if num_stages != group_size * local_stages {
        return Some(wrong_count);
    }
    // Every stage on the rank its placement puts it on (the stages are distinct: as many as
    // the ranks' share, each on this rank).
    let distinct = stages
        .windows(2)
        .all(|w| w[0].stage_index() != w[1].stage_index());
    if let Some(s) = stages
        .iter()
        .find(|s| s.expected_rank() != rank || !distinct)
    {
        let stage_index = s.stage_index();
        return Some(match rules.placement {
            Placement::V => PipelineProblem::VPlacement {
                stage_index,
                rank,
                group_size,
            },
            Placement::Loop => PipelineProblem::Placement {
                stage_index,
                rank,
                group_size,
            },
        });
    }
    microbatch_problem(rules.microbatches, group_size, num_stages, n)
}

/// What is wrong with `n` microbatches for `num_stages` stages on `group_size` ranks.
fn microbatch_problem(
    rule: Microbatches,
    group_size: usize,
    num_stages: usize,
    n: usize,
) -> Option<PipelineProblem> {
    if n == 0 {
        return Some(PipelineProblem::ZeroMicrobatches);
    }
    match rule {
        Microbatches::AtLeastOnePerStage if n < num_stages => {
            return Some(PipelineProblem::FewerMicrobatchesThanStages {
                n_microbatches: n,
                num_stages,
            });
        }
        Microbatches::InRounds => {
            let (rounds, _) = order::rounds(group_size, n);
            if !n.is_multiple_of(rounds) {
                return Some(PipelineProblem::Rounds {
                    n_microbatches: n,
                    rounds,
                });
            }
        }
        _ => {}
    }
    if !tags_fit(num_stages, n) {
        return Some(PipelineProblem::TooManyTags {
            num_stages,
            n_microbatches: n,
        });
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn microbatch_rules_refuse_as_pytorch_does() {
        let any = Microbatches::Any;
        assert_eq!(
            microbatch_problem(any, 2, 2, 0),
            Some(PipelineProblem::ZeroMicrobatches)
        );
        assert_eq!(microbatch_problem(any, 2, 4, 1), None);
        // Schedule1F1B: "Number of microbatches (2) must be greater than or equal to the
        // number of stages (4)".
        assert_eq!(
            microbatch_problem(Microbatches::AtLeastOnePerStage, 4, 4, 2),
            Some(PipelineProblem::FewerMicrobatchesThanStages {
                n_microbatches: 2,
                num_stages: 4
            })
        );
        // ScheduleInterleaved1F1B at 4 ranks: 6 microbatches are 1 round of 6, 9 are not a
        // multiple of 2 rounds.
        assert_eq!(microbatch_problem(Microbatches::InRounds, 4, 8, 6), None);
        assert_eq!(
            microbatch_problem(Microbatches::InRounds, 4, 8, 9),
            Some(PipelineProblem::Rounds {
                n_microbatches: 9,
                rounds: 2
            })
        );
        assert_eq!(
            microbatch_problem(any, 2, 1 << 16, 1 << 16),
            Some(PipelineProblem::TooManyTags {
                num_stages: 1 << 16,
                n_microbatches: 1 << 16
            })
        );
    }
}
