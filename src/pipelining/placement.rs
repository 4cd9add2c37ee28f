//! [`Placement`]: which rank of the pipeline's group holds each stage, in the loop placement
//! of every schedule but one and the V placement of the V-shaped zero bubble (PyTorch's
//! `_utils.py`, `generate_stage_to_rank_mapping` with `style="loop"` and `style="v"`).

/// Which rank of the pipeline's group holds each stage (PyTorch's
/// `generate_stage_to_rank_mapping` styles); the schedule that takes the stages sets it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Placement {
    /// Stage `s` on rank `s % P` (PyTorch's "loop"): every schedule but the V-shaped one.
    Loop,
    /// Two stages per rank, down then back up (PyTorch's "v"): rank `r` holds stages `r` and
    /// `2P - 1 - r`, so that rank 0 holds the first and the last.
    V,
}

impl Placement {
    /// The rank of a group of `group_size` that holds `stage`.
    pub(crate) fn rank_of(self, stage: usize, group_size: usize) -> usize {
        match self {
            Placement::Loop => stage % group_size,
            Placement::V => {
                let s = stage % (2 * group_size);
                if s < group_size {
                    s
                } else {
                    2 * group_size - 1 - s
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// PyTorch's `generate_stage_to_rank_mapping(pp_size, num_stages, style)`, whose "v"
    /// walks the ranks down and back up, staying on the border rank at each turn.
    fn pytorch_mapping(pp_size: usize, num_stages: usize, v: bool) -> Vec<usize> {
        let mut rank = 0i64;
        (0..num_stages)
            .map(|stage| {
                if !v {
                    return stage % pp_size;
                }
                let here = rank as usize;
                if (stage + 1) % pp_size != 0 {
                    rank += if (stage / pp_size).is_multiple_of(2) {
                        1
                    } else {
                        -1
                    };
                }
                here
            })
            .collect()
    }

    #[test]
    fn placements_are_pytorchs_loop_and_v() {
        for pp_size in 1..6 {
            for per_rank in 1..5 {
                let num_stages = pp_size * per_rank;
                for (placement, v) in [(Placement::Loop, false), (Placement::V, true)] {
                    let ours: Vec<usize> = (0..num_stages)
                        .map(|s| placement.rank_of(s, pp_size))
                        .collect();
                    assert_eq!(
                        ours,
                        pytorch_mapping(pp_size, num_stages, v),
                        "{placement:?}, {pp_size} ranks, {num_stages} stages"
                    );
                }
            }
        }
        // Rank 0 of the V holds the first stage and the last.
        assert_eq!(Placement::V.rank_of(3, 2), 0);
    }
}
