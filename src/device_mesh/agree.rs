//! Every rank agrees on a mesh call before any group is made: the same shape, names and
//! order (`init_device_mesh`), the same dims and name (`DeviceMesh::flatten`). Ranks that
//! named their dims in different orders would otherwise pair one rank's `dp` collectives
//! with another's `tp` ones, every collective returning Ok; a rank given another shape would
//! create other groups and leave the others waiting in a rendezvous it never joins.
//!
//! The agreement goes through the rendezvous store (`ProcessGroup::exchange_in_store`), not
//! a collective: a PyTorch rank building the same mesh in the same job takes no part, and a
//! collective would meet its next one.

use tch_dist_runtime::ProcessGroup;

use super::{MeshError, MeshProblem};

/// What a rank that refused the call writes before its request.
const REFUSED: &str = "refused ";
/// What a rank that accepted it writes before its request.
const ACCEPTED: &str = "ok ";

/// Fails on every rank unless every tch-dist rank of `world` makes the same `request` (a
/// description of the call, the same text for the same arguments) and accepts it: `local` is
/// this rank's own verdict (its problem is its error; the others get
/// [`MeshProblem::PeerRefused`]); a rank whose request differs is [`MeshProblem::Disagree`]
/// on every rank, naming both requests.
pub(super) fn agree(
    world: &ProcessGroup,
    op: &'static str,
    request: &str,
    local: Result<(), MeshProblem>,
) -> Result<(), MeshError> {
    let rank = world.rank();
    let fail = |problem: MeshProblem| problem.on(rank, op);
    let verdict = if local.is_ok() { ACCEPTED } else { REFUSED };
    let all = world
        .exchange_in_store(op, format!("{verdict}{request}").as_bytes())
        .map_err(Box::new)
        .map_err(|source| fail(MeshProblem::Agreement { source }))?;
    local.map_err(fail)?;
    for (other_rank, theirs) in all.iter().enumerate() {
        let Some(theirs) = theirs else {
            continue; // a PyTorch rank
        };
        let theirs = String::from_utf8_lossy(theirs);
        if theirs.starts_with(REFUSED) {
            return Err(fail(MeshProblem::PeerRefused { peer: other_rank }));
        }
        let their_request = theirs.strip_prefix(ACCEPTED).unwrap_or(&theirs);
        if their_request != request {
            return Err(fail(MeshProblem::Disagree {
                other_rank,
                this: request.to_string(),
                other: their_request.to_string(),
            }));
        }
    }
    Ok(())
}
