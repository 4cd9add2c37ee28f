//! Checks that every rank passes the same tensors (PyTorch's
//! `_verify_param_shape_across_processes`): every rank all-gathers every rank's list of
//! (name, shape, dtype) in one encoding, compares it with the reference rank's, and all fail
//! together, each naming the first difference. Also the agreements before work that one
//! rank's refusal would otherwise leave its peers waiting for: [`ProcessGroup::agree`] (a
//! check each rank made), [`ProcessGroup::agree_on_values`] and
//! [`ProcessGroup::exchange_values`] (a check and integer settings, in one all-reduce).

use tch::{Device, Kind, Tensor};
use tch_dist_core::sharding::Dtype;

use crate::c10d::collectives::ReduceOp;
use crate::c10d::group::ProcessGroup;
use crate::error::{DistError, Mismatch, MisuseProblem, NamedSignature, Result, TensorSignature};

/// Why the ranks of a group did not agree ([`ProcessGroup::agree_on_values`],
/// [`ProcessGroup::exchange_values`]). Every rank learns the same facts and reports them in
/// the same order: its own problem first (as the caller gave it), else the lowest rank that
/// refused, else the first setting that differs; so a refusal on one rank fails the call on
/// every rank, each naming what it knows.
#[derive(Debug, PartialEq)]
pub enum Refusal<P> {
    /// This rank's own check failed: its problem, given back.
    Own(P),
    /// Another rank's own check failed (its own error says why).
    Peer {
        /// The lowest such rank of the group.
        rank: usize,
    },
    /// Every rank passed its own check, but was given another value of a setting.
    Differs {
        /// The setting's name (the first that differs, in the order given).
        setting: &'static str,
        /// This rank's value.
        this: i64,
        /// The lowest rank whose value differs from this rank's.
        other_rank: usize,
        /// Its value.
        other: i64,
    },
    /// The exchange itself failed (boxed, so that every `Result` stays small).
    Exchange(Box<DistError>),
}

impl ProcessGroup {
    /// Fails on every rank, with a [`DistError::Mismatch`] naming the first difference, unless
    /// every rank passes the same list of named tensors (names, shapes and dtypes, in order)
    /// as `reference_rank`. `what` names the list in the message ("parameters", "buffers").
    ///
    /// ```no_run
    /// # let pg = tch_dist_runtime::default_group()?;
    /// let w = tch::Tensor::zeros([4, 2], tch::kind::FLOAT_CPU);
    /// pg.verify_same_tensors("replicate", "parameters", 0, &[("fc.weight", &w)])?;
    /// # Ok::<(), tch_dist_runtime::DistError>(())
    /// ```
    pub fn verify_same_tensors(
        &self,
        op: &'static str,
        what: &'static str,
        reference_rank: usize,
        tensors: &[(&str, &Tensor)],
    ) -> Result<()> {
        let lists = self.gather_signatures(op, reference_rank, tensors)?;
        let reference = &lists[reference_rank];
        for (other_rank, list) in lists.iter().enumerate() {
            let Some(index) =
                (0..reference.len().max(list.len())).find(|&i| reference.get(i) != list.get(i))
            else {
                continue;
            };
            let mismatch = match (reference.get(index), list.get(index)) {
                (Some(a), Some(b)) if a.fqn == b.fqn => Mismatch::Tensor {
                    what,
                    fqn: a.fqn.clone(),
                    reference_rank,
                    reference: a.signature.clone(),
                    other_rank,
                    other: b.signature.clone(),
                },
                (a, b) => Mismatch::List {
                    what,
                    reference_rank,
                    reference_len: reference.len(),
                    other_rank,
                    other_len: list.len(),
                    index,
                    reference_entry: a.cloned(),
                    other_entry: b.cloned(),
                },
            };
            return Err(self.mismatch(op, mismatch));
        }
        Ok(())
    }

    /// Turns a check each rank made on its own into a verdict every rank shares: when
    /// `local` failed on this rank it is returned as it is; when it passed here but failed on
    /// other ranks, this rank returns [`DistError::PeersFailed`] naming them. So bad input on
    /// one rank is an error on every rank, before anything is sent or changed.
    ///
    /// ```no_run
    /// # let pg = tch_dist_runtime::default_group()?;
    /// let local: Result<(), tch_dist_runtime::DistError> = Ok(()); // e.g. a device check
    /// pg.agree("replicate", local)?;
    /// # Ok::<(), tch_dist_runtime::DistError>(())
    /// ```
    pub fn agree<T, E: From<DistError>>(
        &self,
        op: &'static str,
        local: std::result::Result<T, E>,
    ) -> std::result::Result<T, E> {
        let failed = self.failed_ranks(local.is_err())?;
        match local {
            Ok(_) if !failed.is_empty() => Err(DistError::PeersFailed {
                rank: self.rank(),
                op,
                ranks: failed,
            }
            .into()),
            local => local,
        }
    }

    /// Checks, on every rank together (one all-reduce), that no rank refused and that every
    /// rank was given the same value of each of `settings`; `own_problem` is what this rank's
    /// own check found wrong, if anything. On every rank the verdict is the same but for who
    /// says what: [`Refusal::Own`] on a rank that refused, [`Refusal::Peer`] naming the
    /// lowest one that refused on the others, else [`Refusal::Differs`] naming the first
    /// setting that differs and the lowest rank with another value of it. Every rank passes
    /// the same settings (names and their order); only the values are exchanged.
    ///
    /// ```no_run
    /// use tch_dist_runtime::Refusal;
    /// # let pg = tch_dist_runtime::default_group()?;
    /// let n_microbatches = 8;
    /// let own = (n_microbatches == 0).then_some("n_microbatches must be at least 1");
    /// match pg.agree_on_values("MySchedule::new", own, &[("n_microbatches", n_microbatches)]) {
    ///     Ok(()) => {}
    ///     Err(Refusal::Own(problem)) => eprintln!("{problem}"),
    ///     Err(Refusal::Peer { rank }) => eprintln!("rank {rank} refused"),
    ///     Err(Refusal::Differs { setting, this, other_rank, other }) => {
    ///         eprintln!("{setting} is {this} here but {other} on rank {other_rank}")
    ///     }
    ///     Err(Refusal::Exchange(e)) => return Err(*e),
    /// }
    /// # Ok::<(), tch_dist_runtime::DistError>(())
    /// ```
    pub fn agree_on_values<P>(
        &self,
        op: &'static str,
        own_problem: Option<P>,
        settings: &[(&'static str, i64)],
    ) -> std::result::Result<(), Refusal<P>> {
        let values: Vec<i64> = settings.iter().map(|&(_, value)| value).collect();
        let every_rank = self.exchange_values(op, own_problem, &values)?;
        for (i, &(setting, this)) in settings.iter().enumerate() {
            if let Some((other_rank, other)) = every_rank
                .iter()
                .map(|values| values[i])
                .enumerate()
                .find(|&(_, other)| other != this)
            {
                return Err(Refusal::Differs {
                    setting,
                    this,
                    other_rank,
                    other,
                });
            }
        }
        Ok(())
    }

    /// Every rank's `values`, in rank order, once no rank refused: the exchange of
    /// [`agree_on_values`](Self::agree_on_values) where the values need not be equal (each
    /// rank contributes what only it knows; a value that is no rank's stays 0). Refused as
    /// `agree_on_values` refuses, but never with [`Refusal::Differs`]. Every rank passes as
    /// many values.
    ///
    /// ```no_run
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let pg = tch_dist_runtime::default_group()?;
    /// // Only rank 0 holds the batch: every rank learns its size.
    /// let rows = if pg.rank() == 0 { 32 } else { 0 };
    /// let every_rank = pg
    ///     .exchange_values("step", None::<&str>, &[rows])
    ///     .map_err(|refusal| format!("{refusal:?}"))?;
    /// let batch: i64 = every_rank.iter().map(|values| values[0]).sum();
    /// # Ok(()) }
    /// ```
    pub fn exchange_values<P>(
        &self,
        op: &'static str,
        own_problem: Option<P>,
        values: &[i64],
    ) -> std::result::Result<Vec<Vec<i64>>, Refusal<P>> {
        let (rank, world) = (self.rank(), self.world_size());
        // Every rank fills its own row of a zeroed table (its values, then whether it
        // refused), so that the table's sum over the ranks is every rank's rows.
        let width = values.len() + 1;
        let mut table = vec![0i64; world * width];
        let row = &mut table[rank * width..(rank + 1) * width];
        row[..values.len()].copy_from_slice(values);
        row[values.len()] = i64::from(own_problem.is_some());
        let summed = self
            .sum_over_ranks(op, &table)
            .map_err(|e| Refusal::Exchange(Box::new(e)))?;
        if let Some(problem) = own_problem {
            return Err(Refusal::Own(problem));
        }
        let mut rows: Vec<Vec<i64>> = summed.chunks(width).map(<[i64]>::to_vec).collect();
        if let Some(peer) = rows.iter().position(|row| row[values.len()] != 0) {
            return Err(Refusal::Peer { rank: peer });
        }
        rows.iter_mut().for_each(|row| row.truncate(values.len()));
        Ok(rows)
    }

    /// `values` summed over every rank (one all-reduce on the CPU).
    fn sum_over_ranks(&self, op: &'static str, values: &[i64]) -> Result<Vec<i64>> {
        let t = Tensor::from_slice(values);
        self.all_reduce(&t, ReduceOp::Sum)?;
        Vec::<i64>::try_from(&t.to_kind(Kind::Int64)).map_err(|_| DistError::Internal {
            rank: self.rank(),
            op,
            what: "the check's sums could not be read back",
        })
    }

    /// Fails on every rank, with a [`DistError::Mismatch`] naming the first option that
    /// differs and every rank's value of it, unless every rank passes the same `options`
    /// (name, value as text), in the same order.
    ///
    /// ```no_run
    /// # let pg = tch_dist_runtime::default_group()?;
    /// pg.verify_same_options("replicate", &[("bucket_cap_mb".into(), "25".into())])?;
    /// # Ok::<(), tch_dist_runtime::DistError>(())
    /// ```
    pub fn verify_same_options(
        &self,
        op: &'static str,
        options: &[(String, String)],
    ) -> Result<()> {
        let encoded: String = options
            .iter()
            .map(|(name, value)| {
                let clean = |s: &str| s.replace(['\t', '\n'], " ");
                format!("{}\t{}\n", clean(name), clean(value))
            })
            .collect();
        let texts = self
            .all_gather_bytes(op, encoded.as_bytes())?
            .into_iter()
            .map(|b| String::from_utf8(b).map_err(|_| self.garbled(op)))
            .collect::<Result<Vec<String>>>()?;
        let lists: Vec<Vec<(&str, &str)>> = texts
            .iter()
            .map(|t| {
                t.lines()
                    .map(|l| l.split_once('\t').unwrap_or((l, "")))
                    .collect()
            })
            .collect();
        let longest = lists.iter().map(Vec::len).max().unwrap_or(0);
        let Some(i) = (0..longest).find(|&i| lists.iter().any(|l| l.get(i) != lists[0].get(i)))
        else {
            return Ok(());
        };
        // The option at the first difference (the reference rank's name, or the first rank
        // that has one there), and every rank's value of that option.
        let option = lists
            .iter()
            .find_map(|l| l.get(i))
            .map_or("", |(name, _)| *name)
            .to_string();
        let values = lists
            .iter()
            .map(|l| {
                l.iter()
                    .find(|(name, _)| *name == option)
                    .map_or_else(|| "nothing".to_string(), |(_, v)| v.to_string())
            })
            .collect();
        Err(self.mismatch(op, Mismatch::OptionValue { option, values }))
    }

    /// The ranks (of every rank's `failed` flag) whose own check failed; every rank calls
    /// it, so every rank learns the same list.
    ///
    /// ```no_run
    /// # let pg = tch_dist_runtime::default_group()?;
    /// let failed = pg.failed_ranks(false)?; // this rank's check passed
    /// assert!(!failed.contains(&pg.rank()));
    /// # Ok::<(), tch_dist_runtime::DistError>(())
    /// ```
    pub fn failed_ranks(&self, failed: bool) -> Result<Vec<usize>> {
        let mine = Tensor::from_slice(&[failed as i64]);
        let all: Vec<Tensor> = (0..self.world_size()).map(|_| mine.zeros_like()).collect();
        self.all_gather(&all, &mine)?;
        Ok(all
            .iter()
            .enumerate()
            .filter(|(_, t)| t.int64_value(&[0]) != 0)
            .map(|(r, _)| r)
            .collect())
    }

    /// Fails on every rank unless every rank passes a tensor of the same shape and dtype as
    /// `reference_rank` (the source of a scatter).
    pub(crate) fn verify_same_shape(
        &self,
        op: &'static str,
        reference_rank: usize,
        tensor: &Tensor,
    ) -> Result<()> {
        let lists = self.gather_signatures(op, reference_rank, &[("", tensor)])?;
        let reference = &lists[reference_rank];
        match lists.iter().position(|l| l != reference) {
            None => Ok(()),
            Some(other_rank) => {
                let unnamed = |l: &[NamedSignature]| {
                    l.first()
                        .map(|e| e.signature.clone())
                        .unwrap_or(TensorSignature {
                            shape: Vec::new(),
                            kind: Kind::Float,
                        })
                };
                Err(self.mismatch(
                    op,
                    Mismatch::Shape {
                        reference_rank,
                        reference: unnamed(reference),
                        other_rank,
                        other: unnamed(&lists[other_rank]),
                    },
                ))
            }
        }
    }

    /// Every rank's list of signatures, decoded.
    fn gather_signatures(
        &self,
        op: &'static str,
        reference_rank: usize,
        tensors: &[(&str, &Tensor)],
    ) -> Result<Vec<Vec<NamedSignature>>> {
        self.check_rank(op, "reference rank", reference_rank)?;
        let encoded = encode(tensors);
        self.all_gather_bytes(op, encoded.as_bytes())?
            .iter()
            .map(|bytes| decode(bytes).ok_or_else(|| self.garbled(op)))
            .collect()
    }

    /// All-gathers a byte string of any length from every rank (lengths first, then the
    /// bytes padded to the longest), in rank order.
    ///
    /// ```no_run
    /// # let pg = tch_dist_runtime::default_group()?;
    /// let all = pg.all_gather_bytes("checkpoint", b"my file's checksum")?;
    /// assert_eq!(all.len(), pg.world_size());
    /// # Ok::<(), tch_dist_runtime::DistError>(())
    /// ```
    pub fn all_gather_bytes(&self, op: &'static str, bytes: &[u8]) -> Result<Vec<Vec<u8>>> {
        let w = self.world_size();
        let len = Tensor::from_slice(&[bytes.len() as i64]);
        let lens: Vec<Tensor> = (0..w)
            .map(|_| Tensor::zeros([1], (Kind::Int64, Device::Cpu)))
            .collect();
        self.all_gather(&lens, &len)?;
        let lens: Vec<usize> = lens
            .iter()
            .map(|t| t.int64_value(&[0]).max(0) as usize)
            .collect();
        let max = lens.iter().copied().max().unwrap_or(0).max(1);
        let mut padded = bytes.to_vec();
        padded.resize(max, 0);
        let mine = Tensor::from_slice(&padded);
        let outs: Vec<Tensor> = (0..w)
            .map(|_| Tensor::zeros([max as i64], (Kind::Uint8, Device::Cpu)))
            .collect();
        self.all_gather(&outs, &mine)?;
        outs.iter()
            .zip(lens)
            .map(|(t, n)| {
                let v = Vec::<u8>::try_from(t).map_err(|_| self.garbled(op))?;
                Ok(v[..n.min(v.len())].to_vec())
            })
            .collect()
    }

    fn mismatch(&self, op: &'static str, mismatch: Mismatch) -> DistError {
        DistError::Mismatch {
            rank: self.rank(),
            op,
            mismatch: Box::new(mismatch),
        }
    }

    fn garbled(&self, op: &'static str) -> DistError {
        DistError::Misuse {
            rank: self.rank(),
            op,
            problem: Box::new(MisuseProblem::Undecodable {
                what: "tensor signatures",
                from: None,
            }),
        }
    }
}

/// One line per tensor: `name \t dims separated by commas \t dtype code`.
fn encode(tensors: &[(&str, &Tensor)]) -> String {
    tensors
        .iter()
        .map(|(name, t)| {
            let dims: Vec<String> = t.size().iter().map(i64::to_string).collect();
            format!("{name}\t{}\t{}\n", dims.join(","), Dtype(t.kind()).code())
        })
        .collect()
}

fn decode(bytes: &[u8]) -> Option<Vec<NamedSignature>> {
    std::str::from_utf8(bytes)
        .ok()?
        .lines()
        .map(|line| {
            let mut fields = line.split('\t');
            let fqn = fields.next()?.to_string();
            let dims = fields.next()?;
            let shape = if dims.is_empty() {
                Vec::new()
            } else {
                dims.split(',')
                    .map(|d| d.parse().ok())
                    .collect::<Option<Vec<i64>>>()?
            };
            let kind = Dtype::from_code(fields.next()?.parse().ok()?)?.0;
            Some(NamedSignature {
                fqn,
                signature: TensorSignature { shape, kind },
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signatures_round_trip() {
        let a = Tensor::zeros([4, 2], (Kind::Float, Device::Cpu));
        let b = Tensor::zeros([] as [i64; 0], (Kind::BFloat16, Device::Cpu));
        let decoded = decode(encode(&[("fc.weight", &a), ("scale", &b)]).as_bytes()).unwrap();
        assert_eq!(
            decoded,
            vec![
                NamedSignature {
                    fqn: "fc.weight".into(),
                    signature: TensorSignature {
                        shape: vec![4, 2],
                        kind: Kind::Float
                    }
                },
                NamedSignature {
                    fqn: "scale".into(),
                    signature: TensorSignature {
                        shape: vec![],
                        kind: Kind::BFloat16
                    }
                },
            ]
        );
        assert_eq!(decode(b"x\t1,y\t6\n"), None);
    }
}
