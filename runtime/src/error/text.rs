//! The Display helpers several errors share: rank lists, per-rank values, joined items.

use std::fmt;

/// `rank 1 closed the connection`, or `a peer ...` when the rank is not known.
pub(super) struct PeerText(pub(super) Option<usize>);

impl fmt::Display for PeerText {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(p) => write!(f, "rank {p} closed the connection"),
            None => f.write_str("a peer closed the connection"),
        }
    }
}

/// `rank 1`, `ranks 1 and 3`, `ranks 1, 2 and 3`.
pub(super) struct RankList<'a>(pub(super) &'a [usize]);

impl fmt::Display for RankList<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            [one] => write!(f, "rank {one}"),
            [rest @ .., last] => {
                f.write_str("ranks ")?;
                for (i, r) in rest.iter().enumerate() {
                    if i > 0 {
                        f.write_str(", ")?;
                    }
                    write!(f, "{r}")?;
                }
                write!(f, " and {last}")
            }
            [] => f.write_str("no rank"),
        }
    }
}

/// `rank 0 has 25, rank 1 has 10`.
pub(super) struct RankValues<'a>(pub(super) &'a [String]);

impl fmt::Display for RankValues<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (rank, value) in self.0.iter().enumerate() {
            if rank > 0 {
                f.write_str(", ")?;
            }
            write!(f, "rank {rank} has {value}")?;
        }
        Ok(())
    }
}

/// Items joined by a separator.
pub(crate) struct Joined<'a, T>(pub(crate) &'a [T], pub(crate) &'static str);

impl<T: fmt::Display> fmt::Display for Joined<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, item) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(self.1)?;
            }
            write!(f, "{item}")?;
        }
        Ok(())
    }
}

/// `rank 1` / `ranks 1 and 2` / `a rank` (not known).
pub(super) struct MaybeRanks<'a>(pub(super) &'a [usize]);

impl fmt::Display for MaybeRanks<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_empty() {
            f.write_str("a rank")
        } else {
            write!(f, "{}", RankList(self.0))
        }
    }
}
