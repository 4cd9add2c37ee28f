//! Which parameters share a bucket, and how a bucket's memory is laid out: PyTorch's
//! `compute_bucket_assignment_by_size`, the flat buffer whose slices alias each copied
//! member's gradient, the members all-reduced in place, and the one rebuild from the order
//! in which gradients became ready.

use std::collections::HashMap;

use tch::{Device, Kind, Tensor};

/// A managed parameter and where its gradient goes (fixed between rebuilds).
pub(crate) struct Param {
    pub fqn: String,
    pub tensor: Tensor,
    /// Its bucket.
    pub bucket: usize,
    /// Index into the bucket's `views` (copied) or `in_place` (in place).
    pub slot: usize,
    /// All-reduced in place in `.grad` instead of through the bucket's flat buffer.
    pub in_place: bool,
}

impl Param {
    pub fn new(fqn: String, tensor: Tensor) -> Param {
        Param {
            fqn,
            tensor,
            bucket: 0,
            slot: 0,
            in_place: false,
        }
    }

    pub fn bytes(&self) -> usize {
        self.tensor.numel() * self.tensor.kind().elt_size_in_bytes()
    }
}

/// A contiguous buffer whose slices hold the gradients of some parameters of one dtype and
/// device, all-reduced as one tensor.
pub(crate) struct Bucket {
    /// The copied (not in-place) members' gradients, back to back.
    pub flat: Tensor,
    /// Parameter indices, in bucket order.
    pub params: Vec<usize>,
    /// One slice per copied member (`Param::slot`), aliasing `flat`'s storage (not an
    /// autograd view, so that optimizers may treat it as an ordinary `.grad`).
    pub views: Vec<Tensor>,
    /// The members all-reduced in place, in bucket order (`Param::slot` indexes this).
    pub in_place: Vec<usize>,
}

/// The parameters and their buckets.
pub(crate) struct Layout {
    pub params: Vec<Param>,
    pub buckets: Vec<Bucket>,
}

impl Layout {
    /// Buckets `params` in `order` (PyTorch's: reverse registration order at first, the
    /// gradient-ready order after the rebuild). Parameters of at least `in_place_min_bytes`
    /// (`None`: none) take no room in their bucket's flat buffer. `limits`: the caps in
    /// bytes of the buckets of one dtype and device, in order (the last repeats).
    pub fn new(
        mut params: Vec<Param>,
        order: &[usize],
        limits: &[usize],
        in_place_min_bytes: Option<usize>,
    ) -> Layout {
        for p in params.iter_mut() {
            p.in_place = in_place_min_bytes.is_some_and(|min| p.bytes() >= min);
        }
        let members = assign_buckets(&sizes(&params), order, limits);
        let buckets = build_buckets(&mut params, &members);
        Layout { params, buckets }
    }

    /// The FQNs of each bucket, in launch order.
    pub fn bucket_fqns(&self) -> Vec<Vec<String>> {
        self.buckets
            .iter()
            .map(|b| {
                b.params
                    .iter()
                    .map(|&i| self.params[i].fqn.clone())
                    .collect()
            })
            .collect()
    }

    /// Re-buckets by `order` (the rebuild); returns whether the layout changed.
    pub fn rebuild(&mut self, order: &[usize], limits: &[usize]) -> bool {
        let members = assign_buckets(&sizes(&self.params), order, limits);
        if members.iter().eq(self.buckets.iter().map(|b| &b.params)) {
            return false;
        }
        self.buckets = build_buckets(&mut self.params, &members);
        true
    }

    /// The copied member `i`'s slice of its bucket.
    pub fn view(&self, i: usize) -> &Tensor {
        let p = &self.params[i];
        &self.buckets[p.bucket].views[p.slot]
    }
}

fn sizes(params: &[Param]) -> Vec<(usize, Kind, Device)> {
    params
        .iter()
        .map(|p| (p.tensor.numel(), p.tensor.kind(), p.tensor.device()))
        .collect()
}

/// PyTorch's `compute_bucket_assignment_by_size`: walks `order`, fills one open bucket per
/// (dtype, device) up to its current cap (the k-th bucket of a dtype and device closes at
/// `limits[k]`, the last limit for every bucket after), never splitting a tensor; buckets
/// are then sorted by their earliest position in `order`.
pub(crate) fn assign_buckets(
    sizes: &[(usize, Kind, Device)],
    order: &[usize],
    limits: &[usize],
) -> Vec<Vec<usize>> {
    struct Open {
        key: (Kind, Device),
        members: Vec<usize>,
        bytes: usize,
        closed_before: usize,
    }
    let mut open: Vec<Open> = Vec::new();
    let mut done: Vec<Vec<usize>> = Vec::new();
    for &i in order {
        let (numel, kind, device) = sizes[i];
        let key = (kind, device);
        let pos = match open.iter().position(|o| o.key == key) {
            Some(p) => p,
            None => {
                open.push(Open {
                    key,
                    members: Vec::new(),
                    bytes: 0,
                    closed_before: 0,
                });
                open.len() - 1
            }
        };
        let o = &mut open[pos];
        o.members.push(i);
        o.bytes += numel * kind.elt_size_in_bytes();
        let limit = limits
            .get(o.closed_before)
            .or(limits.last())
            .copied()
            .unwrap_or(usize::MAX);
        if o.bytes >= limit {
            done.push(std::mem::take(&mut o.members));
            o.bytes = 0;
            o.closed_before += 1;
        }
    }
    done.extend(
        open.into_iter()
            .map(|o| o.members)
            .filter(|m| !m.is_empty()),
    );
    let position: HashMap<usize, usize> = order.iter().enumerate().map(|(p, &i)| (i, p)).collect();
    done.sort_by_key(|b| b.iter().map(|i| position[i]).min().unwrap_or(usize::MAX));
    done
}

/// Builds the buckets of `layout`; members with `Param::in_place` set get no room in the
/// flat buffer.
fn build_buckets(params: &mut [Param], layout: &[Vec<usize>]) -> Vec<Bucket> {
    tch::no_grad(|| {
        layout
            .iter()
            .enumerate()
            .map(|(b, members)| {
                let first = &params[members[0]].tensor;
                let (kind, device) = (first.kind(), first.device());
                let total: i64 = members
                    .iter()
                    .filter(|&&i| !params[i].in_place)
                    .map(|&i| params[i].tensor.numel() as i64)
                    .sum();
                let flat = Tensor::zeros([total], (kind, device));
                let mut views = Vec::with_capacity(members.len());
                let mut in_place = Vec::new();
                let mut off = 0i64;
                for &i in members {
                    let p = &mut params[i];
                    p.bucket = b;
                    if p.in_place {
                        p.slot = in_place.len();
                        in_place.push(i);
                    } else {
                        p.slot = views.len();
                        views.push(storage_alias(&flat, off, &p.tensor.size()));
                        off += p.tensor.numel() as i64;
                    }
                }
                Bucket {
                    flat,
                    params: members.clone(),
                    views,
                    in_place,
                }
            })
            .collect()
    })
}

/// A tensor of `shape` at element `offset` of `flat`'s storage, contiguous, sharing memory
/// without being an autograd view of `flat`.
fn storage_alias(flat: &Tensor, offset: i64, shape: &[i64]) -> Tensor {
    let mut strides = vec![1i64; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        strides[d] = strides[d + 1] * shape[d + 1].max(1);
    }
    let mut t = Tensor::empty([0], (flat.kind(), flat.device()));
    t.set_source_tensor_storage_offset_(flat, offset, shape, strides.as_slice())
}

/// The rebuild's order from the order in which gradients became ready (each parameter once;
/// those never seen follow in reverse registration order).
pub(crate) fn rebuild_order(ready_order: &[usize], n: usize) -> Vec<usize> {
    let mut seen = vec![false; n];
    let mut order: Vec<usize> = ready_order
        .iter()
        .copied()
        .filter(|&i| !std::mem::replace(&mut seen[i], true))
        .collect();
    order.extend((0..n).rev().filter(|&i| !seen[i]));
    order
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_follow_pytorch_assignment() {
        let f = |n: usize| (n, Kind::Float, Device::Cpu);
        // 4 bytes per element; first cap 1000 bytes, then 2000.
        let sizes = [
            f(100),
            f(200),
            f(300),
            f(400),
            (10, Kind::Double, Device::Cpu),
            f(50),
        ];
        let order: Vec<usize> = (0..sizes.len()).rev().collect(); // 5,4,3,2,1,0
        let b = assign_buckets(&sizes, &order, &[1000, 2000]);
        // float: 5 (200B) + 3 (1600B) -> closes the first (>=1000); 2 (1200B) + 1 (800B) -> 2000
        // closes; 0 stays open. double: 4 alone.
        assert_eq!(b, vec![vec![5, 3], vec![4], vec![2, 1], vec![0]]);
        // One bucket for all when the caps are huge (per dtype).
        let b = assign_buckets(&sizes, &order, &[usize::MAX]);
        assert_eq!(b, vec![vec![5, 3, 2, 1, 0], vec![4]]);
        // A tiny cap: one bucket per parameter.
        let b = assign_buckets(&sizes, &order, &[1]);
        assert_eq!(
            b,
            vec![vec![5], vec![4], vec![3], vec![2], vec![1], vec![0]]
        );
        // A list of caps (`bucket_cap_mb_list`): per dtype, the k-th bucket closes at the k-th
        // cap, the last one repeating. float: 5 (200B) >= 100 closes; 3 (1600B) >= 1000
        // closes; 2 (1200B) + 1 (800B) = 2000 >= 1500 closes; 0 stays open. double: 4
        // (80B) < 100 stays open.
        let b = assign_buckets(&sizes, &order, &[100, 1000, 1500]);
        assert_eq!(b, vec![vec![5], vec![4], vec![3], vec![2, 1], vec![0]]);
    }

    #[test]
    fn rebuild_order_keeps_first_sightings_then_the_rest_reversed() {
        assert_eq!(rebuild_order(&[2, 0, 2, 3], 5), vec![2, 0, 3, 4, 1]);
        assert_eq!(rebuild_order(&[], 3), vec![2, 1, 0]);
    }

    #[test]
    fn copied_members_alias_the_flat_buffer() {
        let p = |name: &str, n: i64| {
            Param::new(name.into(), Tensor::zeros([n], (Kind::Float, Device::Cpu)))
        };
        // 100 floats (400 B) in place from 256 B up; 10 and 20 floats copied.
        let layout = Layout::new(
            vec![p("a", 10), p("b", 100), p("c", 20)],
            &[2, 1, 0],
            &[usize::MAX],
            Some(256),
        );
        assert_eq!(layout.bucket_fqns(), vec![vec!["c", "b", "a"]]);
        let bucket = &layout.buckets[0];
        assert_eq!(bucket.flat.size(), [30]);
        assert_eq!(bucket.in_place, vec![1]);
        let _ = layout.view(0).shallow_clone().fill_(7.0);
        // c comes first in the bucket, so a's slice starts at element 20.
        assert_eq!(bucket.flat.double_value(&[20]), 7.0);
        assert_eq!(bucket.flat.double_value(&[0]), 0.0);
    }
}
