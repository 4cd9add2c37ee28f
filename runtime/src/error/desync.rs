//! [`Desync`]: what `TCH_DIST_DEBUG=DETAIL` found, each rank's [`CollectiveCall`] named (or
//! a step check in shared memory: a peer in a collective this rank never called).

use std::fmt;
use std::time::Duration;

use tch::Device;

use super::mismatch::TensorSignature;
use super::text::{MaybeRanks, RankList};

/// What `TCH_DIST_DEBUG=DETAIL` found, or a step check through shared memory (the `desync`
/// of [`DistError::Desync`](crate::DistError::Desync)).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Desync {
    /// The ranks called different collectives, or the same with other tensors: each rank's
    /// call, in rank order.
    #[error(
        "the ranks called different collectives (TCH_DIST_DEBUG=DETAIL checks each one before \
         it runs): {}; nothing was sent",
        Calls(calls)
    )]
    Differ {
        /// Every rank's call, in rank order.
        calls: Vec<CollectiveCall>,
    },
    /// Seen from rank 0, which runs the check: ranks did not reach this collective.
    #[error(
        "{} {} (rank {} called {}; TCH_DIST_DEBUG=DETAIL checks that every rank calls each \
         collective before it runs)",
        MaybeRanks(ranks),
        Gone(*within, "without reaching this collective", "did not reach this collective"),
        call.rank,
        call
    )]
    Missing {
        /// This rank's call.
        call: CollectiveCall,
        /// The ranks that did not reach it (empty: the engine did not say).
        ranks: Vec<usize>,
        /// `Some(timeout)`: they did not arrive within it; `None`: a connection closed
        /// before the timeout (a rank left).
        within: Option<Duration>,
        /// What the engine said.
        cause: String,
    },
    /// Seen from the other ranks: rank 0, which runs the check, did not confirm that every
    /// rank reached this collective.
    #[error(
        "rank {} called {}, but rank 0 {} that every rank called it (see rank 0's error; \
         TCH_DIST_DEBUG=DETAIL checks each collective before it runs)",
        call.rank,
        call,
        Confirm(*within)
    )]
    Unconfirmed {
        /// This rank's call.
        call: CollectiveCall,
        /// `Some(timeout)`: rank 0 did not answer within it; `None`: its connection closed.
        within: Option<Duration>,
        /// What the engine said.
        cause: String,
    },
    /// Seen by a rank waiting for a peer's step-check header in shared memory (every rank on
    /// one host; without DETAIL): the peer launched a collective this rank never called, and
    /// waits there as this rank waits for its header. Named once the peer stayed ahead for a
    /// moment, not after the group's timeout.
    #[error(
        "rank {peer} called {} as its collective {seq} on the group, where this rank waits for \
         its step-check header after {own}: the ranks called different collectives \
         (TCH_DIST_DEBUG=DETAIL names each call)",
        call.unwrap_or("a collective")
    )]
    Elsewhere {
        /// The peer.
        peer: usize,
        /// Its last collective, where the mirror names it.
        call: Option<&'static str>,
        /// How many collectives the peer ran before that one (c10d's sequence number).
        seq: u64,
        /// How many this rank launched on the group.
        own: u64,
    },
}

/// One rank's collective as `TCH_DIST_DEBUG=DETAIL` checks it (c10d's collective
/// fingerprint, and a broadcast's root): written `all_reduce of [4] (Float) on Cpu as its
/// collective 3`, `broadcast from rank 1 of [4] (Float) on Cpu as its collective 0`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CollectiveCall {
    /// The rank that called it.
    pub rank: usize,
    /// How many collectives the rank's backend ran before it (c10d's sequence number).
    pub seq: u64,
    /// The operation, named as in torch.distributed.
    pub op: String,
    /// The tensors the check compares (none for a barrier or an all-to-all).
    pub tensors: Vec<CallTensor>,
    /// A broadcast's source rank.
    pub root: Option<usize>,
}

/// A tensor of a [`CollectiveCall`]: its shape, dtype and device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CallTensor {
    /// Shape and dtype.
    pub signature: TensorSignature,
    /// Device.
    pub device: Device,
}

impl fmt::Display for CollectiveCall {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.describe(f)?;
        write!(f, " as its collective {}", self.seq)
    }
}

impl CollectiveCall {
    /// `all_reduce of [4] (Float) on Cpu`: the call without its rank and number.
    fn describe(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.op)?;
        if let Some(root) = self.root {
            write!(f, " from rank {root}")?;
        }
        let Some(first) = self.tensors.first() else {
            return Ok(());
        };
        f.write_str(" of ")?;
        let one_device = self.tensors.iter().all(|t| t.device == first.device);
        for (i, t) in self.tensors.iter().enumerate() {
            if i > 0 {
                f.write_str(" and ")?;
            }
            write!(f, "{}", t.signature)?;
            if !one_device {
                write!(f, " on {:?}", t.device)?;
            }
        }
        if one_device {
            write!(f, " on {:?}", first.device)?;
        }
        Ok(())
    }

    /// The same call, ignoring the rank.
    fn same_as(&self, other: &CollectiveCall) -> bool {
        (self.seq, &self.op, &self.tensors, self.root)
            == (other.seq, &other.op, &other.tensors, other.root)
    }
}

/// `rank 0 called X as its collective 3, ranks 1 and 2 called Y as their collective 3`:
/// consecutive ranks with the same call are named together.
struct Calls<'a>(&'a [CollectiveCall]);

impl fmt::Display for Calls<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut rest = self.0;
        let mut first = true;
        while let Some(call) = rest.first() {
            let n = rest.iter().take_while(|c| c.same_as(call)).count();
            let ranks: Vec<usize> = rest[..n].iter().map(|c| c.rank).collect();
            if !first {
                f.write_str(", ")?;
            }
            first = false;
            write!(f, "{} called ", RankList(&ranks))?;
            struct Described<'a>(&'a CollectiveCall);
            impl fmt::Display for Described<'_> {
                fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                    self.0.describe(f)
                }
            }
            write!(
                f,
                "{} as {} collective {}",
                Described(call),
                if n == 1 { "its" } else { "their" },
                call.seq
            )?;
            rest = &rest[n..];
        }
        Ok(())
    }
}

/// `did not reach this collective within 5s`, or `left (closed its connection) without
/// reaching this collective`.
struct Gone(Option<Duration>, &'static str, &'static str);

impl fmt::Display for Gone {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(t) => write!(f, "{} within {t:?}", self.2),
            None => write!(f, "left (closed the connection) {}", self.1),
        }
    }
}

/// `did not confirm within 5s` or `closed its connection before confirming`.
struct Confirm(Option<Duration>);

impl fmt::Display for Confirm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(t) => write!(f, "did not confirm within {t:?}"),
            None => f.write_str("closed its connection before confirming"),
        }
    }
}
