//! `#[contract]`: apply-once, conflicts (also across crates, through the catalogue), PyTorch's
//! two FQN errors, per-instance state across moves and boxes, and the catalogue.

use std::sync::atomic::{AtomicUsize, Ordering};

use tch::nn;
use tch::{Device, Tensor};
use tch_dist::testing::record_names;
use tch_dist::{contract, registry, ContractError, Shardable};

#[derive(Debug, PartialEq, thiserror::Error)]
enum ApiError {
    #[error(transparent)]
    Contract(#[from] ContractError),
    #[error("bucket size must be positive, got {0}")]
    BadBucket(i64),
}

/// A DDP-like stand-in declared in this crate; it conflicts with `record_names` (declared in
/// tch-dist-core, which does not know about it).
mod ddp_like {
    use super::*;

    #[derive(Debug)]
    pub struct State {
        pub params: Vec<String>,
        pub bucket_mb: i64,
        pub forward_calls: AtomicUsize,
    }

    /// Applies the stand-in.
    #[contract(conflicts(record_names))]
    pub fn apply<M: Shardable + ?Sized>(module: &M, bucket_mb: i64) -> Result<State, ApiError> {
        if bucket_mb <= 0 {
            return Err(ApiError::BadBucket(bucket_mb));
        }
        let params = module
            .named_parameters()
            .into_iter()
            .map(|(n, _)| n)
            .collect();
        Ok(State {
            params,
            bucket_mb,
            forward_calls: AtomicUsize::new(0),
        })
    }
}

/// An API with an explicit name, a renamed state accessor and a `Result` alias.
mod named {
    use super::*;

    type Result<T> = std::result::Result<T, ContractError>;

    #[contract(name = "activation_checkpoint", state = checkpoint_state)]
    pub fn checkpoint<M: Shardable + ?Sized>(_module: &M) -> Result<u32> {
        Ok(7)
    }
}

#[derive(Debug, Shardable)]
struct Mlp {
    fc1: nn::Linear,
    fc2: nn::Linear,
}

fn mlp(vs: &nn::VarStore) -> Mlp {
    let root = vs.root();
    Mlp {
        fc1: nn::linear(&root / "fc1", 4, 4, Default::default()),
        fc2: nn::linear(&root / "fc2", 4, 4, Default::default()),
    }
}

#[test]
fn applies_once_only() {
    let vs = nn::VarStore::new(Device::Cpu);
    let m = mlp(&vs);
    let state = ddp_like::apply(&m, 25).unwrap();
    assert_eq!(
        state.params,
        ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    );
    assert_eq!(registry(&m), ["ddp_like"]);
    let err = ddp_like::apply(&m, 25).unwrap_err();
    assert_eq!(
        err,
        ApiError::Contract(ContractError::AlreadyApplied {
            api: "ddp_like",
            module: "contract::Mlp"
        })
    );
    assert_eq!(
        err.to_string(),
        "Each distinct composable distributed API can only be applied to a module once. \
         ddp_like has already been applied to the following module: contract::Mlp"
    );
    assert_eq!(registry(&m), ["ddp_like"]);
}

#[test]
fn state_belongs_to_the_instance() {
    let vs = nn::VarStore::new(Device::Cpu);
    let a = mlp(&vs);
    let b = mlp(&vs);
    assert!(ddp_like::state(&a).is_none());
    let applied = ddp_like::apply(&a, 10).unwrap();
    assert!(
        ddp_like::state(&b).is_none(),
        "two instances never share state"
    );
    ddp_like::apply(&b, 20).unwrap();
    assert_eq!(ddp_like::state(&b).unwrap().bucket_mb, 20);

    // Moving the struct keeps its state; so does boxing it, and it is the same state.
    applied.forward_calls.fetch_add(1, Ordering::Relaxed);
    let moved = a;
    let boxed: Box<Mlp> = Box::new(moved);
    let state = ddp_like::state(&boxed).unwrap();
    assert_eq!(state.bucket_mb, 10);
    assert_eq!(state.forward_calls.load(Ordering::Relaxed), 1);
    assert!(std::sync::Arc::ptr_eq(&state, &applied));
    let in_vec = vec![*boxed];
    assert_eq!(ddp_like::state(&in_vec[0]).unwrap().bucket_mb, 10);
    // Through a trait object too.
    let dynamic: &dyn Shardable = &in_vec[0];
    assert_eq!(registry(dynamic), ["ddp_like"]);
    assert_eq!(ddp_like::state(dynamic).unwrap().bucket_mb, 10);
    // The Vec itself is a different module.
    assert!(registry(&in_vec).is_empty());
}

#[test]
fn parent_and_child_have_separate_registries() {
    let vs = nn::VarStore::new(Device::Cpu);
    // A parent whose only child holds all its parameters.
    #[derive(Shardable)]
    struct Wrapper {
        inner: nn::Linear,
    }
    let w = Wrapper {
        inner: nn::linear(vs.root() / "inner", 2, 2, Default::default()),
    };
    ddp_like::apply(&w.inner, 1).unwrap();
    assert_eq!(registry(&w.inner), ["ddp_like"]);
    assert!(registry(&w).is_empty());
    assert!(ddp_like::state(&w).is_none());
    ddp_like::apply(&w, 2).unwrap();
    assert_eq!(ddp_like::state(&w).unwrap().bucket_mb, 2);
    assert_eq!(ddp_like::state(&w.inner).unwrap().bucket_mb, 1);
}

#[test]
fn registry_lists_apis_in_order_and_names_can_be_overridden() {
    let vs = nn::VarStore::new(Device::Cpu);
    let m = mlp(&vs);
    assert_eq!(*named::checkpoint(&m).unwrap(), 7);
    ddp_like::apply(&m, 1).unwrap();
    assert_eq!(registry(&m), ["activation_checkpoint", "ddp_like"]);
    assert_eq!(named::checkpoint_state(&m).as_deref(), Some(&7));
    assert_eq!(
        tch_dist::contract::contract_state::<u32, _>("activation_checkpoint", &m).as_deref(),
        Some(&7)
    );
    // Asking for the wrong type is a `None`, not a panic.
    assert!(tch_dist::contract::contract_state::<String, _>("activation_checkpoint", &m).is_none());
}

#[test]
fn declared_conflicts_are_refused_in_both_orders() {
    let vs = nn::VarStore::new(Device::Cpu);
    let m = mlp(&vs);
    record_names::apply(&m).unwrap();
    let err = ddp_like::apply(&m, 1).unwrap_err();
    assert_eq!(
        err,
        ApiError::Contract(ContractError::Conflict {
            api: "ddp_like",
            existing: "record_names",
            declared_by: "ddp_like"
        })
    );
    assert_eq!(
        err.to_string(),
        "Cannot apply `ddp_like` to a module already managed by `record_names`: `ddp_like` \
         declares the two composable APIs as conflicting"
    );

    // record_names (tch-dist-core) knows nothing of ddp_like; the catalogue tells it.
    let other = mlp(&vs);
    ddp_like::apply(&other, 1).unwrap();
    let err = record_names::apply(&other).unwrap_err();
    assert_eq!(
        err,
        ContractError::Conflict {
            api: "record_names",
            existing: "ddp_like",
            declared_by: "ddp_like"
        }
    );
    assert_eq!(registry(&other), ["ddp_like"]);
    assert!(tch_dist::contract::apis_conflict(
        "record_names",
        "ddp_like"
    ));
    assert!(!tch_dist::contract::apis_conflict(
        "record_names",
        "activation_checkpoint"
    ));
}

#[test]
fn catalogue_lists_apis_of_every_crate() {
    let cat = tch_dist::contract::catalogue();
    let rn = cat
        .iter()
        .find(|a| a.name == "record_names")
        .expect("record_names is catalogued");
    assert_eq!(rn.module_path, "tch_dist_core::testing::record_names");
    let ddp = cat
        .iter()
        .find(|a| a.name == "ddp_like")
        .expect("ddp_like is catalogued");
    assert_eq!(ddp.module_path, "contract::ddp_like");
    assert_eq!(ddp.conflicts, ["record_names"]);
    assert!(cat.iter().any(|a| a.name == "activation_checkpoint"));
    // The real fully_shard and replicate refuse each other.
    let fs = tch_dist::contract::find_api("fully_shard");
    assert_eq!(fs.len(), 1, "{fs:?}");
    assert_eq!(fs[0].module_path, "tch_dist::fully_shard");
    assert!(tch_dist::contract::apis_conflict(
        "fully_shard",
        "replicate"
    ));
    assert_eq!(tch_dist::contract::find_api("ddp_like").len(), 1);
}

#[test]
fn errors_of_the_body_record_nothing() {
    let vs = nn::VarStore::new(Device::Cpu);
    let m = mlp(&vs);
    assert_eq!(ddp_like::apply(&m, 0).unwrap_err(), ApiError::BadBucket(0));
    assert!(registry(&m).is_empty());
    assert!(ddp_like::state(&m).is_none());
    ddp_like::apply(&m, 3).unwrap();
}

#[derive(Debug, Shardable)]
struct Relu;

#[derive(Debug, Shardable)]
struct Changing {
    fc: nn::Linear,
    extra: Option<nn::Linear>,
    act: Option<Relu>,
    order: Order,
    #[shardable(buffer)]
    stats: Option<Tensor>,
}

#[derive(Debug, Shardable)]
enum Order {
    Ab { a: nn::Linear, b: nn::Linear },
    Ba { b: nn::Linear, a: nn::Linear },
}

impl Order {
    fn flip(&mut self) {
        let placeholder = Order::Ab {
            a: dummy(),
            b: dummy(),
        };
        *self = match std::mem::replace(self, placeholder) {
            Order::Ab { a, b } => Order::Ba { b, a },
            Order::Ba { b, a } => Order::Ab { a, b },
        };
    }
}

fn dummy() -> nn::Linear {
    let vs = nn::VarStore::new(Device::Cpu);
    nn::linear(vs.root(), 1, 1, Default::default())
}

fn changing(vs: &nn::VarStore) -> Changing {
    let root = vs.root();
    Changing {
        fc: nn::linear(&root / "fc", 2, 2, Default::default()),
        extra: Some(nn::linear(&root / "extra", 2, 2, Default::default())),
        act: None,
        order: Order::Ab {
            a: nn::linear(&root / "order" / "a", 2, 2, Default::default()),
            b: nn::linear(&root / "order" / "b", 2, 2, Default::default()),
        },
        stats: Some(root.zeros_no_train("stats", &[1])),
    }
}

/// APIs that break the contract by changing what the module reports.
mod breakers {
    use super::*;

    #[contract]
    pub fn drop_extra(module: &mut Changing) -> Result<(), ContractError> {
        module.extra = None;
        Ok(())
    }

    #[contract]
    pub fn flip_order(module: &mut Changing) -> Result<(), ContractError> {
        module.order.flip();
        Ok(())
    }

    #[contract]
    pub fn add_activation(module: &mut Changing) -> Result<(), ContractError> {
        module.act = Some(Relu);
        Ok(())
    }

    #[contract]
    pub fn drop_stats(module: &mut Changing) -> Result<(), ContractError> {
        module.stats = None;
        Ok(())
    }
}

#[test]
fn changing_fqns_is_refused() {
    let vs = nn::VarStore::new(Device::Cpu);
    let mut m = changing(&vs);
    let err = breakers::drop_extra(&mut m).unwrap_err();
    assert_eq!(
        err,
        ContractError::FqnsChanged {
            kind: tch_dist::contract::FqnKind::Parameters,
            only_in_original: vec!["extra.weight".into(), "extra.bias".into()],
            only_in_new: vec![],
        }
    );
    assert_eq!(
        err.to_string(),
        "Check parameters, Composable distributed API implementations cannot modify FQNs.\n\
         Only in original FQNs: [\"extra.weight\", \"extra.bias\"],\nOnly in new FQNs: []"
    );
    assert!(registry(&m).is_empty());

    let mut m = changing(&vs);
    let err = breakers::add_activation(&mut m).unwrap_err();
    assert_eq!(
        err,
        ContractError::FqnsChanged {
            kind: tch_dist::contract::FqnKind::Modules,
            only_in_original: vec![],
            only_in_new: vec!["act".into()],
        }
    );
    assert!(err.to_string().starts_with("Check modules, "));

    let mut m = changing(&vs);
    let err = breakers::drop_stats(&mut m).unwrap_err();
    assert!(err.to_string().starts_with(
        "Check buffer, Composable distributed API implementations cannot modify FQNs."
    ));
}

#[test]
fn reordering_fqns_is_refused() {
    let vs = nn::VarStore::new(Device::Cpu);
    let mut m = changing(&vs);
    let err = breakers::flip_order(&mut m).unwrap_err();
    let original: Vec<String> = [
        "fc.weight",
        "fc.bias",
        "extra.weight",
        "extra.bias",
        "order.a.weight",
        "order.a.bias",
        "order.b.weight",
        "order.b.bias",
    ]
    .map(String::from)
    .to_vec();
    let mut new = original.clone();
    new[4..].rotate_left(2);
    assert_eq!(
        err,
        ContractError::FqnOrderChanged {
            kind: tch_dist::contract::FqnKind::Parameters,
            original: original.clone(),
            new: new.clone()
        }
    );
    assert_eq!(
        err.to_string(),
        format!(
            "Check parameters, Composable distributed API implementations cannot modify the \
             order of FQNs.\nOriginal FQNs: {original:?}\nNew FQNs: {new:?}"
        )
    );
    assert!(registry(&m).is_empty());
}

#[test]
fn modules_without_tensors_cannot_be_identified() {
    let err = ddp_like::apply(&Relu, 1).unwrap_err();
    assert_eq!(
        err,
        ApiError::Contract(ContractError::NoIdentity {
            api: "ddp_like",
            module: "contract::Relu"
        })
    );
    assert!(registry(&Relu).is_empty());
}

/// An API that replaces the module's tensors (as sharding does).
mod reinit {
    use super::*;

    #[contract]
    pub fn apply<M: Shardable + ?Sized>(module: &mut M) -> Result<usize, ContractError> {
        let mut n = 0;
        for (_, t) in module.named_parameters_mut() {
            *t = t.zeros_like();
            n += 1;
        }
        Ok(n)
    }
}

#[test]
fn state_follows_modules_whose_tensors_are_replaced() {
    let vs = nn::VarStore::new(Device::Cpu);
    let mut m = mlp(&vs);
    ddp_like::apply(&m.fc1, 5).unwrap();
    let before = m.fc1.ws.as_ptr();
    assert_eq!(*reinit::apply(&mut m).unwrap(), 4);
    assert_ne!(m.fc1.ws.as_ptr(), before, "new tensors, new identity");
    assert_eq!(registry(&m), ["reinit"]);
    assert_eq!(registry(&m.fc1), ["ddp_like"]);
    assert_eq!(ddp_like::state(&m.fc1).unwrap().bucket_mb, 5);
    assert!(registry(&m.fc2).is_empty());
}

#[test]
fn dropped_modules_leave_nothing_behind() {
    // Handles of dropped tensors are reused by the allocator; a new module must still start
    // with an empty registry.
    for i in 0..50 {
        let vs = nn::VarStore::new(Device::Cpu);
        let m = mlp(&vs);
        assert!(registry(&m).is_empty(), "iteration {i}");
        assert!(ddp_like::state(&m).is_none(), "iteration {i}");
        ddp_like::apply(&m, 1).unwrap();
        if i % 2 == 0 {
            assert!(tch_dist::contract::release(&m));
            assert!(registry(&m).is_empty());
        }
    }
}
