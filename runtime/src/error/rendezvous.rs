//! [`RendezvousError`]: why a rendezvous failed (the `problem` of
//! [`DistError::Rendezvous`](super::DistError::Rendezvous)).

use std::fmt;
use std::time::Duration;

use super::text::RankList;

/// Why a rendezvous failed (the `problem` of [`DistError::Rendezvous`](crate::DistError::Rendezvous)).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RendezvousError {
    /// MASTER_ADDR names no host the resolver knows.
    #[error("MASTER_ADDR `{host}` does not resolve: {cause}")]
    UnresolvableHost {
        /// MASTER_ADDR.
        host: String,
        /// What the resolver said.
        cause: String,
    },
    /// Nothing accepted a connection at MASTER_ADDR:MASTER_PORT within the timeout.
    #[error(
        "no rendezvous store accepted a connection within {timeout:?} (last attempt: {cause}); \
         rank 0 hosts it: is rank 0 running, with the same MASTER_ADDR and MASTER_PORT?"
    )]
    NobodyListening {
        /// The timeout that passed.
        timeout: Duration,
        /// What the last connection attempt got.
        cause: String,
    },
    /// Ranks of the group never joined its rendezvous within the timeout.
    #[error(
        "{} never joined within {timeout:?}{}",
        RankList(ranks),
        Refused(refused)
    )]
    NeverJoined {
        /// The ranks that never joined.
        ranks: Vec<usize>,
        /// The timeout that passed.
        timeout: Duration,
        /// Processes of other runs that came as one of those ranks and were refused, as
        /// (rank, their run id).
        refused: Vec<(usize, String)>,
    },
    /// A rank of the group exited before it joined the group's rendezvous, as its launcher
    /// reported (it will never join): seen within seconds, where the rendezvous would have
    /// waited out its timeout.
    #[error("rank {rank} {status} (its launcher reported it) without joining")]
    Departed {
        /// The rank, in the group.
        rank: usize,
        /// The launcher's words (`exited with status 0`).
        status: String,
    },
    /// The store at MASTER_ADDR:MASTER_PORT belongs to another run (TORCHELASTIC_RUN_ID,
    /// which `tch-dist-run` and torchrun set); this rank did not join it.
    #[error(
        "this rank belongs to run `{mine}` but the rendezvous store there belongs to run \
         `{theirs}` (TORCHELASTIC_RUN_ID): is MASTER_PORT another job's?"
    )]
    OtherRun {
        /// This rank's run id.
        mine: String,
        /// The run id of the ranks that created the store.
        theirs: String,
    },
    /// Fewer ranks than the world size checked in at a store-side count by the timeout: the
    /// TCPStore's worker count (`init/`, rank 0 waits for it) or PyTorch's store-based
    /// barrier; used when the store cannot tell which ranks are missing.
    #[error("{what}: {joined} of {world_size} ranks checked in within {timeout:?}")]
    NotAllCheckedIn {
        /// The count that fell short.
        what: &'static str,
        /// How many checked in (-1: the store could not say).
        joined: i64,
        /// How many should have.
        world_size: usize,
        /// The timeout that passed.
        timeout: Duration,
    },
    /// The engine failed the rendezvous for another reason.
    #[error("{cause}")]
    Engine {
        /// What the engine said.
        cause: String,
    },
}

/// ` (a process of run `b` came as rank 1 and was refused)`, or nothing.
struct Refused<'a>(&'a [(usize, String)]);

impl fmt::Display for Refused<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, (rank, run)) in self.0.iter().enumerate() {
            f.write_str(if i == 0 { " (" } else { "; " })?;
            write!(
                f,
                "a process of run `{run}` came as rank {rank} and was refused"
            )?;
        }
        if !self.0.is_empty() {
            f.write_str(")")?;
        }
        Ok(())
    }
}
