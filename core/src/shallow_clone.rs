//! [`ShallowClone`] and its impls for tch's layers.

use std::mem::{needs_drop, size_of, ManuallyDrop};

use tch::{nn, Tensor};

/// A second handle on a module, sharing every tensor with the first
/// (`Tensor::shallow_clone`: same storage, same autograd identity), owning everything else.
///
/// Activation checkpointing runs a block's forward again during backward, after the call
/// that borrowed the block has returned: it needs a module of its own to run, with the very
/// tensors the block holds at that call (fully_shard's gathered parameters, a sharded
/// layer's shards). A shallow clone taken at the call is that module, without borrowing
/// the caller's.
///
/// Derive it with `#[derive(ShallowClone)]` (every field must implement it); it is
/// implemented here for `Tensor`, tch's layers, `Vec`, `Option`, `Box`, arrays and plain
/// data (numbers, `bool`, `String`, tch's `Init`/`Kind`/`Device`).
///
/// ```
/// use tch::{nn, Device, Tensor};
/// use tch_dist_core::ShallowClone;
///
/// let vs = nn::VarStore::new(Device::Cpu);
/// let fc = nn::linear(vs.root() / "fc", 3, 2, Default::default());
/// let twin = fc.shallow_clone();
/// // The same tensor, not a copy: a change through one handle shows in the other.
/// tch::no_grad(|| fc.ws.get(0).fill_(1.0));
/// assert!(twin.ws.equal(&fc.ws));
/// ```
///
/// tch's `Conv1D/2D/3D` hold a private `Vec` that cannot be copied from outside tch, so they
/// have no impl: a block that holds one cannot be checkpointed yet.
pub trait ShallowClone {
    /// A value equal to `self` whose tensors are `self`'s (shallow clones of them).
    fn shallow_clone(&self) -> Self;
}

impl ShallowClone for Tensor {
    fn shallow_clone(&self) -> Self {
        Tensor::shallow_clone(self)
    }
}

impl<T: ShallowClone> ShallowClone for Option<T> {
    fn shallow_clone(&self) -> Self {
        self.as_ref().map(T::shallow_clone)
    }
}

impl<T: ShallowClone> ShallowClone for Vec<T> {
    fn shallow_clone(&self) -> Self {
        self.iter().map(T::shallow_clone).collect()
    }
}

impl<T: ShallowClone> ShallowClone for Box<T> {
    fn shallow_clone(&self) -> Self {
        Box::new(T::shallow_clone(self))
    }
}

impl<T: ShallowClone, const N: usize> ShallowClone for [T; N] {
    fn shallow_clone(&self) -> Self {
        std::array::from_fn(|i| self[i].shallow_clone())
    }
}

macro_rules! plain_data {
    ($($t:ty),* $(,)?) => {$(
        /// Plain data: a clone.
        impl ShallowClone for $t {
            fn shallow_clone(&self) -> Self {
                self.clone()
            }
        }
    )*};
}

plain_data!(
    bool,
    u8,
    u16,
    u32,
    u64,
    usize,
    i8,
    i16,
    i32,
    i64,
    isize,
    f32,
    f64,
    String,
    tch::Kind,
    tch::Device,
    nn::Init,
);

impl ShallowClone for nn::Linear {
    fn shallow_clone(&self) -> Self {
        nn::Linear {
            ws: self.ws.shallow_clone(),
            bs: self.bs.shallow_clone(),
        }
    }
}

/// A copy of `value` in which `rewrite` has replaced every field that owns memory.
///
/// tch's normalisation and embedding layers keep their config in a private field, so they
/// cannot be built field by field from outside tch. Their private fields are plain data
/// (`Copy` configs: numbers, flags, `Init`), and every field that owns memory (tensors,
/// `Vec`s) is public. So a bitwise copy whose owning fields are each overwritten, without
/// dropping the aliased value, by a value of its own owns exactly what it will drop.
///
/// # Safety
/// Every field of `T` that `rewrite` does not overwrite must be plain data (no `Drop`, no
/// owned memory), and `rewrite` must overwrite each other field with `std::ptr::write`
/// (never assign: that would drop the value the copy shares with `value`). Each caller
/// pins `T`'s layout with [`assert_plain_rest`] so that a change in tch fails to compile.
unsafe fn copy_rewriting<T>(value: &T, rewrite: impl FnOnce(&mut T)) -> T {
    // SAFETY: a bitwise copy, never dropped as is (ManuallyDrop); the caller's promise makes
    // it own only what `rewrite` wrote into it.
    let mut copy = ManuallyDrop::new(unsafe { std::ptr::read(value) });
    rewrite(&mut copy);
    ManuallyDrop::into_inner(copy)
}

/// Compile-time check for [`copy_rewriting`]: `T` is exactly its `owning` bytes plus a
/// `Rest` that needs no drop (the private config), so no field was added or changed.
const fn assert_plain_rest<T, Rest>(owning: usize) {
    assert!(
        !needs_drop::<Rest>(),
        "a private field of a tch layer now owns memory"
    );
    assert!(
        size_of::<T>() == owning + size_of::<Rest>(),
        "a tch layer's fields changed: review its ShallowClone impl"
    );
}

const OPT: usize = size_of::<Option<Tensor>>();

const _: () =
    assert_plain_rest::<nn::LayerNorm, nn::LayerNormConfig>(2 * OPT + size_of::<Vec<i64>>());
impl ShallowClone for nn::LayerNorm {
    fn shallow_clone(&self) -> Self {
        // SAFETY: `config` (private) is a `LayerNormConfig`, plain data (checked above);
        // `ws`, `bs` and `normalized_shape` are written, never assigned.
        unsafe {
            copy_rewriting(self, |c| {
                std::ptr::write(&mut c.ws, self.ws.shallow_clone());
                std::ptr::write(&mut c.bs, self.bs.shallow_clone());
                std::ptr::write(&mut c.normalized_shape, self.normalized_shape.clone());
            })
        }
    }
}

const _: () =
    assert_plain_rest::<nn::GroupNorm, nn::GroupNormConfig>(2 * OPT + 2 * size_of::<i64>());
impl ShallowClone for nn::GroupNorm {
    fn shallow_clone(&self) -> Self {
        // SAFETY: `config` (private) is plain data (checked above); the tensors are written,
        // never assigned; `num_groups`/`num_channels` are plain data.
        unsafe {
            copy_rewriting(self, |c| {
                std::ptr::write(&mut c.ws, self.ws.shallow_clone());
                std::ptr::write(&mut c.bs, self.bs.shallow_clone());
            })
        }
    }
}

const _: () = assert_plain_rest::<nn::BatchNorm, nn::BatchNormConfig>(
    2 * size_of::<Tensor>() + 2 * OPT + size_of::<usize>(),
);
impl ShallowClone for nn::BatchNorm {
    fn shallow_clone(&self) -> Self {
        // SAFETY: `config` (private) is plain data (checked above); the tensors are written,
        // never assigned; `nd` is plain data.
        unsafe {
            copy_rewriting(self, |c| {
                std::ptr::write(&mut c.running_mean, self.running_mean.shallow_clone());
                std::ptr::write(&mut c.running_var, self.running_var.shallow_clone());
                std::ptr::write(&mut c.ws, self.ws.shallow_clone());
                std::ptr::write(&mut c.bs, self.bs.shallow_clone());
            })
        }
    }
}

const _: () = assert_plain_rest::<nn::Embedding, nn::EmbeddingConfig>(size_of::<Tensor>());
impl ShallowClone for nn::Embedding {
    fn shallow_clone(&self) -> Self {
        // SAFETY: `config` (private) is plain data (checked above); `ws` is written.
        unsafe {
            copy_rewriting(self, |c| {
                std::ptr::write(&mut c.ws, self.ws.shallow_clone());
            })
        }
    }
}

impl<ND: Copy> ShallowClone for nn::ConvTransposeND<ND> {
    fn shallow_clone(&self) -> Self {
        const {
            assert_plain_rest::<nn::ConvTransposeND<ND>, nn::ConvTransposeConfigND<ND>>(
                size_of::<Tensor>() + OPT,
            )
        };
        // SAFETY: `config` (private) is a `ConvTransposeConfigND<ND>` with `ND: Copy`, plain
        // data (checked above); `ws` and `bs` are written, never assigned.
        unsafe {
            copy_rewriting(self, |c| {
                std::ptr::write(&mut c.ws, self.ws.shallow_clone());
                std::ptr::write(&mut c.bs, self.bs.shallow_clone());
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind};

    fn same(a: &Tensor, b: &Tensor) -> bool {
        a.data_ptr() == b.data_ptr() && a.size() == b.size()
    }

    #[test]
    fn tch_layers_share_their_tensors_and_keep_their_config() {
        let vs = nn::VarStore::new(Device::Cpu);
        let root = vs.root();
        let ln = nn::layer_norm(&root / "ln", vec![4], Default::default());
        let x = Tensor::randn([2, 4], (Kind::Float, Device::Cpu));
        let twin = ln.shallow_clone();
        assert!(same(twin.ws.as_ref().unwrap(), ln.ws.as_ref().unwrap()));
        assert!(x.apply(&twin).equal(&x.apply(&ln)));
        drop(ln);
        // The twin owns what it holds: it outlives the original.
        assert_eq!(x.apply(&twin).size(), vec![2, 4]);

        let gn = nn::group_norm(&root / "gn", 2, 4, Default::default());
        assert!(x.apply(&gn.shallow_clone()).equal(&x.apply(&gn)));
        let bn = nn::batch_norm1d(&root / "bn", 4, Default::default());
        let bn_twin = bn.shallow_clone();
        assert!(same(&bn_twin.running_mean, &bn.running_mean));
        assert!(x.apply_t(&bn_twin, false).equal(&x.apply_t(&bn, false)));
        let emb = nn::embedding(&root / "emb", 5, 3, Default::default());
        let ids = Tensor::from_slice(&[0i64, 4, 2]);
        assert!(ids.apply(&emb.shallow_clone()).equal(&ids.apply(&emb)));
        let up = nn::conv_transpose1d(&root / "up", 4, 2, 3, Default::default());
        let seq = Tensor::randn([1, 4, 5], (Kind::Float, Device::Cpu));
        assert!(seq.apply(&up.shallow_clone()).equal(&seq.apply(&up)));
        let fc = nn::linear(&root / "fc", 4, 2, Default::default());
        let blocks = vec![fc.shallow_clone(), fc.shallow_clone()];
        assert!(same(&blocks.shallow_clone()[1].ws, &fc.ws));
    }
}
