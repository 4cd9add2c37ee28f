//! Checks that every rank passes the same tensors (PyTorch's
//! `_verify_param_shape_across_processes`): every rank all-gathers every rank's list of
//! (name, shape, dtype) in one encoding, compares it with the reference rank's, and all fail
//! together, each naming the first difference.

use tch::{Device, Kind, Tensor};
use tch_dist_core::sharding::Dtype;

use crate::c10d::group::ProcessGroup;
use crate::error::{DistError, Mismatch, MisuseProblem, NamedSignature, Result, TensorSignature};

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
