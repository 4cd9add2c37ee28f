//! [`ring_attention`]: attention over a sequence split across ranks, by passing keys and
//! values around the ranks (PyTorch's `_templated_ring_attention` and its backward): each
//! rank keeps its queries, attends to the block of keys and values it holds, merges the
//! partial result by log-sum-exp, and passes the block on while the next one arrives. The
//! backward replays the ring with the merged output and log-sum-exp; each block's key and
//! value gradients travel with it and a last hop brings them home.

use tch::{Kind, Tensor};
use tch_dist_runtime::{apply_function, Backward, ProcessGroup, Work};

use super::block;
use super::{AttentionOptions, CpError, CpProblem, SeqLayout};

/// Gloo matches a receive with its send by peer and tag: the blocks and their gradients.
const TAG_BLOCK: i32 = 0x6370_0001;
const TAG_GRADS: i32 = 0x6370_0002;

/// Scaled-dot-product attention of `q`, `k`, `v` `[batch, heads, local positions, head dim]`
/// split along the sequence as `opts.layout` says, equal to the attention of the whole
/// sequence at this rank's positions. Keys and values go around the ranks in `ranks − 1`
/// hops (sent while the block in hand is computed); the backward (a custom autograd function)
/// replays the ring and sends each block's gradients home, so only this rank's `q`, `k`, `v`,
/// output and log-sum-exp are kept between the passes. Causal attention masks by global
/// position; with [`SeqLayout::HeadTail`] every rank does the same work (PyTorch's
/// load-balanced ring), with [`SeqLayout::Contiguous`] rank `r` computes `r + 1` blocks.
///
/// Every rank calls it with the same shapes and options (checked together, one small
/// all-reduce, before any block moves): anything else, or inputs that are not alike 4-D
/// floats, is refused on every rank.
///
/// ```no_run
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use tch_dist::context_parallel::{ring_attention, AttentionOptions, SeqLayout};
/// let pg = tch_dist::init_process_group(tch_dist::Backend::Gloo)?; // 2 ranks
/// // A sequence of 16 positions, head-tail: rank 0 holds 0..4 and 12..16.
/// let q = tch::Tensor::randn([2, 4, 8, 32], tch::kind::FLOAT_CPU);
/// let (k, v) = (q.randn_like(), q.randn_like());
/// let opts = AttentionOptions { causal: true, layout: SeqLayout::HeadTail, ..Default::default() };
/// let out = ring_attention(&q, &k, &v, &pg, &opts)?;
/// assert_eq!(out.size(), [2, 4, 8, 32]);
/// # Ok(()) }
/// ```
pub fn ring_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    group: &ProcessGroup,
    opts: &AttentionOptions,
) -> Result<Tensor, CpError> {
    let ring = Ring::agreed(q, k, v, group, opts)?;
    let inputs = [q.shallow_clone(), k.shallow_clone(), v.shallow_clone()];
    let outputs = apply_function::<CpError>(&inputs, &mut |inputs| {
        let (q, k, v) = (&inputs[0], &inputs[1], &inputs[2]);
        let (out, lse) = ring.forward(q, k, v)?;
        let out = out.f_to_kind(q.kind()).map_err(|e| ring.kernel(e))?;
        let saved = Saved {
            q: q.detach(),
            k: k.detach(),
            v: v.detach(),
            out: out.detach(),
            lse,
        };
        let ring = ring.clone();
        let backward: Backward = Box::new(move |grads| {
            let (dq, dk, dv) = ring
                .backward(&saved, &grads[0])
                .map_err(|e| e.to_string())?;
            Ok(vec![Some(dq), Some(dk), Some(dv)])
        });
        Ok((vec![out], backward))
    })?;
    outputs.into_iter().next().ok_or_else(|| {
        CpError::Collective(tch_dist_runtime::DistError::Internal {
            rank: group.rank(),
            op: "ring_attention",
            what: "the custom function returned no output",
        })
    })
}

/// What the backward keeps: this rank's inputs, the merged output (in the inputs' kind) and
/// log-sum-exp (in the accumulation kind).
struct Saved {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
}

/// What a block step computes, for rank `rank` holding the block of rank `src`.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Step {
    /// Every query against every key of the block (`causal`: the block is this rank's own).
    Whole { causal: bool },
    /// Every query against the first half of the block's keys (head-tail, an earlier rank's
    /// block: its head chunk precedes both of ours, its tail follows both).
    FirstHalfOfKeys,
    /// The second half of the queries (our tail chunk) against every key (head-tail, a later
    /// rank's block: both its chunks precede our tail and follow our head).
    SecondHalfOfQueries,
    /// Nothing (contiguous causal: a later rank's block).
    Skip,
}

/// One call's ring, agreed by every rank.
#[derive(Clone)]
struct Ring {
    group: ProcessGroup,
    ranks: usize,
    rank: usize,
    causal: bool,
    scale: Option<f64>,
    layout: SeqLayout,
}

impl Ring {
    /// The checks of [`ring_attention`], made on every rank together.
    fn agreed(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        group: &ProcessGroup,
        opts: &AttentionOptions,
    ) -> Result<Ring, CpError> {
        let rank = group.rank();
        let shape = q.size();
        let own = if shape.len() != 4 || k.size() != shape || v.size() != shape {
            Some(CpProblem::Shapes {
                q: shape.clone(),
                k: k.size(),
                v: v.size(),
            })
        } else if !matches!(
            q.kind(),
            Kind::Float | Kind::Double | Kind::BFloat16 | Kind::Half
        ) || k.kind() != q.kind()
            || v.kind() != q.kind()
        {
            Some(CpProblem::Kind {
                q: q.kind(),
                k: k.kind(),
                v: v.kind(),
            })
        } else if shape[2] == 0 {
            Some(CpProblem::NoPositions)
        } else if opts.layout == SeqLayout::HeadTail && shape[2] % 2 != 0 {
            Some(CpProblem::OddHeadTail {
                positions: shape[2],
            })
        } else {
            None
        };
        let dims = if own.is_none() {
            shape.clone()
        } else {
            vec![0; 4]
        };
        let settings = [
            ("batch", dims[0]),
            ("heads", dims[1]),
            ("local positions", dims[2]),
            ("head dim", dims[3]),
            ("dtype", kind_code(q.kind())),
            ("causal", i64::from(opts.causal)),
            ("scale", opts.scale.map_or(-1, |s| s.to_bits() as i64)),
            ("layout", opts.layout.code()),
        ];
        group
            .agree_on_values("ring_attention", own, &settings)
            .map_err(|refusal| CpError::refused(rank, refusal))?;
        Ok(Ring {
            group: group.clone(),
            ranks: group.world_size(),
            rank,
            causal: opts.causal,
            scale: opts.scale,
            layout: opts.layout,
        })
    }

    /// What this rank computes with the block it holds at step `i`.
    fn step(&self, i: usize) -> Step {
        if i == 0 {
            return Step::Whole {
                causal: self.causal,
            };
        }
        if !self.causal {
            return Step::Whole { causal: false };
        }
        let earlier = i <= self.rank; // the block's rank precedes ours
        match (self.layout, earlier) {
            (SeqLayout::HeadTail, true) => Step::FirstHalfOfKeys,
            (SeqLayout::HeadTail, false) => Step::SecondHalfOfQueries,
            (SeqLayout::Contiguous, true) => Step::Whole { causal: false },
            (SeqLayout::Contiguous, false) => Step::Skip,
        }
    }

    fn next(&self) -> usize {
        (self.rank + 1) % self.ranks
    }

    fn prev(&self) -> usize {
        (self.rank + self.ranks - 1) % self.ranks
    }

    fn kernel(&self, e: tch::TchError) -> CpError {
        CpProblem::Kernel {
            message: e.to_string(),
        }
        .on(self.rank)
        .into()
    }

    /// Sends `block` on and receives the next one into a new tensor like it.
    fn pass_on(&self, block: &Tensor, tag: i32) -> Result<(Tensor, [Work; 2]), CpError> {
        let incoming = block.empty_like();
        let recv = self.group.recv_async(&incoming, self.prev(), tag)?;
        let send = self.group.send_async(block, self.next(), tag)?;
        Ok((incoming, [recv, send]))
    }

    /// `(out, lse)`: `out` in the accumulation kind.
    fn forward(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor), CpError> {
        let kernel = |e| self.kernel(e);
        let implementation = block::Kernel::of(q);
        let half = q.size()[2] / 2;
        // Keys and values travel as one tensor [2, B, H, L, d].
        let mut block = Tensor::f_stack(&[k, v], 0).map_err(kernel)?;
        let (out, lse) =
            block::forward(implementation, q, k, v, self.causal, self.scale).map_err(kernel)?;
        for i in 0..self.ranks {
            let hop = if i + 1 < self.ranks {
                Some(self.pass_on(&block, TAG_BLOCK)?)
            } else {
                None
            };
            if i > 0 {
                let (k, v) = (block.get(0), block.get(1));
                let partial = match self.step(i) {
                    Step::Whole { causal } => Some((
                        block::forward(implementation, q, &k, &v, causal, self.scale),
                        None,
                    )),
                    Step::FirstHalfOfKeys => Some((
                        block::forward(
                            implementation,
                            q,
                            &k.narrow(2, 0, half),
                            &v.narrow(2, 0, half),
                            false,
                            self.scale,
                        ),
                        None,
                    )),
                    Step::SecondHalfOfQueries => Some((
                        block::forward(
                            implementation,
                            &q.narrow(2, half, half),
                            &k,
                            &v,
                            false,
                            self.scale,
                        ),
                        Some(half),
                    )),
                    Step::Skip => None,
                };
                if let Some((computed, rows)) = partial {
                    let (out_blk, lse_blk) = computed.map_err(kernel)?;
                    let (out_rows, lse_rows) = match rows {
                        Some(start) => (out.narrow(2, start, half), lse.narrow(2, start, half)),
                        None => (out.shallow_clone(), lse.shallow_clone()),
                    };
                    block::merge(&out_rows, &lse_rows, &out_blk, &lse_blk).map_err(kernel)?;
                }
            }
            if let Some((incoming, works)) = hop {
                for work in works {
                    work.wait()?;
                }
                block = incoming;
            }
        }
        Ok((out, lse))
    }

    /// The gradients of this rank's `q`, `k`, `v` from its output's gradient.
    fn backward(
        &self,
        saved: &Saved,
        grad_out: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor), CpError> {
        let kernel = |e| self.kernel(e);
        let Saved { q, k, v, out, lse } = saved;
        let implementation = block::Kernel::of(q);
        let acc = block::accumulation_kind(q.kind());
        let half = q.size()[2] / 2;
        let grad_out = grad_out.contiguous();
        let dq = q
            .f_zeros_like()
            .and_then(|t| t.f_to_kind(acc))
            .map_err(kernel)?;
        let mut block = Tensor::f_stack(&[k, v], 0).map_err(kernel)?;
        // The gradients of the block in hand, [2, B, H, L, d], travelling with it.
        let mut grads = block
            .f_zeros_like()
            .and_then(|t| t.f_to_kind(acc))
            .map_err(kernel)?;
        for i in 0..self.ranks {
            let hop = if i + 1 < self.ranks {
                Some(self.pass_on(&block, TAG_BLOCK)?)
            } else {
                None
            };
            let (bk, bv) = (block.get(0), block.get(1));
            let (dk_acc, dv_acc) = (grads.get(0), grads.get(1));
            let add = |into: &Tensor, t: Tensor| -> Result<(), CpError> {
                let mut into = into.shallow_clone();
                into.f_add_(&t).map(|_| ()).map_err(kernel)
            };
            match self.step(i) {
                Step::Whole { causal } => {
                    let (dq_b, dk_b, dv_b) = block::backward(
                        implementation,
                        &grad_out,
                        q,
                        &bk,
                        &bv,
                        out,
                        lse,
                        causal,
                        self.scale,
                    )
                    .map_err(kernel)?;
                    add(&dq, dq_b)?;
                    add(&dk_acc, dk_b)?;
                    add(&dv_acc, dv_b)?;
                }
                Step::FirstHalfOfKeys => {
                    let first = |t: &Tensor| t.narrow(2, 0, half).contiguous();
                    let (dq_b, dk_b, dv_b) = block::backward(
                        implementation,
                        &grad_out,
                        q,
                        &first(&bk),
                        &first(&bv),
                        out,
                        lse,
                        false,
                        self.scale,
                    )
                    .map_err(kernel)?;
                    add(&dq, dq_b)?;
                    add(&dk_acc.narrow(2, 0, half), dk_b)?;
                    add(&dv_acc.narrow(2, 0, half), dv_b)?;
                }
                Step::SecondHalfOfQueries => {
                    let second = |t: &Tensor| t.narrow(2, half, half).contiguous();
                    let (dq_b, dk_b, dv_b) = block::backward(
                        implementation,
                        &second(&grad_out),
                        &second(q),
                        &bk,
                        &bv,
                        &second(out),
                        &second(lse),
                        false,
                        self.scale,
                    )
                    .map_err(kernel)?;
                    add(&dq.narrow(2, half, half), dq_b)?;
                    add(&dk_acc, dk_b)?;
                    add(&dv_acc, dv_b)?;
                }
                Step::Skip => {}
            }
            if let Some((incoming, works)) = hop {
                for work in works {
                    work.wait()?;
                }
                block = incoming;
            }
            // The gradients go on with their block; the last hop brings each rank's home.
            if self.ranks > 1 {
                let (incoming, works) = self.pass_on(&grads, TAG_GRADS)?;
                for work in works {
                    work.wait()?;
                }
                grads = incoming;
            }
        }
        let kind = q.kind();
        let to = |t: Tensor| t.f_to_kind(kind).map_err(kernel);
        Ok((to(dq)?, to(grads.get(0))?, to(grads.get(1))?))
    }
}

/// A number for a kind, for the ranks' agreement.
fn kind_code(kind: Kind) -> i64 {
    match kind {
        Kind::Float => 1,
        Kind::Double => 2,
        Kind::BFloat16 => 3,
        Kind::Half => 4,
        _ => 0,
    }
}
