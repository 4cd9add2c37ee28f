//! Forward hooks through `call`/`call_t`: order, instance, replacement of inputs and outputs,
//! removal, moves; fallible hooks through `f_call`/`f_call_t`.

use std::sync::{Arc, Mutex};

use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};
use tch_dist::hooks::{
    num_forward_hooks, register_fallible_forward_hook, register_fallible_forward_pre_hook,
    register_forward_hook, register_forward_pre_hook, HookError,
};
use tch_dist::{Call, CallT, ForwardError, Shardable};

#[path = "common/mlp.rs"]
mod mlp;
#[path = "common/walk.rs"]
mod walk;
use mlp::{Activation, Mlp};
use walk::linear;

type Log = Arc<Mutex<Vec<String>>>;

fn log() -> Log {
    Arc::new(Mutex::new(Vec::new()))
}

fn push(log: &Log, s: impl Into<String>) {
    log.lock().unwrap().push(s.into());
}

fn entries(log: &Log) -> Vec<String> {
    log.lock().unwrap().clone()
}

fn ones(n: i64) -> Tensor {
    Tensor::ones([1, n], (Kind::Float, Device::Cpu))
}

/// 3 -> 3 -> 2 with ReLU; it calls its children through `call`, so hooks on them run.
fn mlp(vs: &nn::VarStore) -> Mlp {
    mlp::mlp(&vs.root(), 3, 3, 2, Activation::Relu)
}

#[test]
fn hooks_fire_in_order_around_forward() {
    let vs = nn::VarStore::new(Device::Cpu);
    let m = mlp(&vs);
    let l = log();
    let handles = [
        {
            let l = l.clone();
            register_forward_pre_hook(&m, move |_, _| {
                push(&l, "pre1");
                None
            })
        },
        {
            let l = l.clone();
            register_forward_pre_hook(&m, move |_, _| {
                push(&l, "pre2");
                None
            })
        },
        {
            let l = l.clone();
            register_forward_hook(&m, move |_, _, _| {
                push(&l, "post1");
                None
            })
        },
        {
            let l = l.clone();
            register_forward_hook(&m.fc1, move |_, _, _| {
                push(&l, "fc1.post");
                None
            })
        },
        {
            let l = l.clone();
            register_forward_pre_hook(&m.fc2, move |_, _| {
                push(&l, "fc2.pre");
                None
            })
        },
        {
            let l = l.clone();
            register_forward_hook(&m, move |_, _, _| {
                push(&l, "post2");
                None
            })
        },
    ]
    .map(Result::unwrap);
    assert_eq!(num_forward_hooks(&m), (2, 2));
    let ys = m.call(&ones(3));
    assert_eq!(
        entries(&l),
        ["pre1", "pre2", "fc1.post", "fc2.pre", "post1", "post2"]
    );

    // `forward` bypasses the module's own hooks (children called with `call` still run
    // theirs), as in PyTorch.
    l.lock().unwrap().clear();
    assert!(ys.allclose(&m.forward(&ones(3)), 1e-6, 1e-6, false));
    assert_eq!(entries(&l), ["fc1.post", "fc2.pre"]);

    for h in &handles {
        assert!(h.remove());
        assert!(!h.remove(), "a second removal finds nothing");
    }
    assert_eq!(num_forward_hooks(&m), (0, 0));
    l.lock().unwrap().clear();
    let _ = m.call(&ones(3));
    assert!(entries(&l).is_empty());
}

#[test]
fn hooks_replace_inputs_and_outputs() {
    let vs = nn::VarStore::new(Device::Cpu);
    let fc = linear(vs.root(), 3, 2);
    let seen: Arc<Mutex<Vec<f64>>> = Arc::default();
    let h1 = register_forward_pre_hook(&fc, |_, xs| Some(xs * 0.0)).unwrap();
    let h2 = {
        let seen = seen.clone();
        // Sees the input the first pre-hook produced.
        register_forward_pre_hook(&fc, move |_, xs| {
            seen.lock()
                .unwrap()
                .push(xs.abs().sum(Kind::Float).double_value(&[]));
            None
        })
        .unwrap()
    };
    let h3 = {
        let seen = seen.clone();
        // The post-hook gets the (replaced) input and the output.
        register_forward_hook(&fc, move |_, input, out| {
            seen.lock()
                .unwrap()
                .push(input.sum(Kind::Float).double_value(&[]));
            Some(out + 1.0)
        })
        .unwrap()
    };
    let h4 = register_forward_hook(&fc, |_, _, out| Some(out * 10.0)).unwrap();
    let ys = fc.call(&ones(3));
    let bias = fc.bs.as_ref().unwrap();
    assert!(ys.allclose(&((bias + 1.0) * 10.0).unsqueeze(0), 1e-6, 1e-6, false));
    assert_eq!(*seen.lock().unwrap(), [0.0, 0.0]);
    for h in [h1, h2, h3, h4] {
        h.remove();
    }
    assert!(fc
        .call(&ones(3))
        .allclose(&fc.forward(&ones(3)), 1e-6, 1e-6, false));
}

#[test]
fn hooks_belong_to_the_instance() {
    let vs = nn::VarStore::new(Device::Cpu);
    let a = linear(vs.root() / "a", 3, 3);
    let b = linear(vs.root() / "b", 3, 3);
    let l = log();
    let h = {
        let l = l.clone();
        register_forward_hook(&a, move |m, _, _| {
            push(&l, m.type_name());
            None
        })
        .unwrap()
    };
    let _ = b.call(&ones(3));
    assert!(entries(&l).is_empty(), "another instance of the same type");
    // The hook follows the instance when it moves, into a Box and a Vec.
    let boxed = Box::new(a);
    let _ = boxed.call(&ones(3));
    let v = [*boxed];
    let _ = v[0].call(&ones(3));
    assert_eq!(
        entries(&l),
        ["tch::nn::linear::Linear", "tch::nn::linear::Linear"]
    );
    assert!(h.remove());
}

#[test]
fn call_t_passes_the_train_flag() {
    let vs = nn::VarStore::new(Device::Cpu);
    let bn = nn::batch_norm1d(vs.root(), 3, Default::default());
    let l = log();
    let h = {
        let l = l.clone();
        register_forward_pre_hook(&bn, move |_, xs| {
            push(&l, "pre");
            Some(xs * 2.0)
        })
        .unwrap()
    };
    let xs = Tensor::randn([4, 3], (Kind::Float, Device::Cpu));
    let ys = bn.call_t(&xs, false);
    assert!(ys.allclose(
        &nn::ModuleT::forward_t(&bn, &(&xs * 2.0), false),
        1e-5,
        1e-5,
        false
    ));
    // In train mode the running statistics move.
    let before = bn.running_mean.copy();
    let _ = bn.call_t(&xs, true);
    assert!(!bn.running_mean.allclose(&before, 1e-9, 1e-9, false));
    assert_eq!(entries(&l), ["pre", "pre"]);
    h.remove();
}

#[test]
fn hooks_may_register_hooks() {
    let vs = nn::VarStore::new(Device::Cpu);
    let fc = linear(vs.root(), 2, 2);
    let l = log();
    let inner_l = l.clone();
    // The store is not locked while hooks run.
    let h = register_forward_pre_hook(&fc, move |m, _| {
        let l = inner_l.clone();
        let h = register_forward_hook(m, move |_, _, _| {
            push(&l, "late");
            None
        })
        .unwrap();
        push(&inner_l, format!("registered {}", h.id() > 0));
        None
    })
    .unwrap();
    let _ = fc.call(&ones(2));
    assert_eq!(entries(&l), ["registered true", "late"]);
    h.remove();
}

#[derive(Debug, Shardable)]
struct Relu;

impl Module for Relu {
    fn forward(&self, xs: &Tensor) -> Tensor {
        xs.relu()
    }
}

#[test]
fn parameterless_modules_cannot_have_hooks() {
    let err = register_forward_hook(&Relu, |_, _, _| None).unwrap_err();
    assert_eq!(
        err,
        HookError::NoIdentity {
            module: "hooks::Relu"
        }
    );
    assert!(err.to_string().contains("cannot be identified"));
    // Calling it still works.
    assert_eq!(
        Relu.call(&(ones(2) * -1.0))
            .sum(Kind::Float)
            .double_value(&[]),
        0.0
    );
}

/// The message of a panic payload (`panic!` with a format gives a `String`).
fn panic_message(payload: Box<dyn std::any::Any + Send>) -> String {
    match payload.downcast::<String>() {
        Ok(s) => *s,
        Err(p) => p
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .unwrap_or_else(|| "<not a message>".into()),
    }
}

#[test]
fn fallible_hooks_fail_the_call_as_a_value() {
    let vs = nn::VarStore::new(Device::Cpu);
    let m = mlp(&vs);
    let l = log();
    let pre = {
        let l = l.clone();
        register_fallible_forward_pre_hook(&m, move |_, xs| {
            push(&l, "pre");
            match xs.size()[..] {
                [_, 3] => Ok(None),
                _ => Err(ForwardError::new("rank 0: mlp: expected 3 features")),
            }
        })
        .unwrap()
    };
    let post = {
        let l = l.clone();
        register_forward_hook(&m, move |_, _, _| {
            push(&l, "post");
            None
        })
        .unwrap()
    };
    assert!(m.f_call(&ones(3)).is_ok());
    assert_eq!(entries(&l), ["pre", "post"]);

    // An Err stops the call before forward and the forward hooks.
    let err = m.f_call(&ones(4)).unwrap_err();
    assert_eq!(err, ForwardError::new("rank 0: mlp: expected 3 features"));
    assert_eq!(entries(&l), ["pre", "post", "pre"]);
    // `call` panics with the message, as PyTorch's module(x) raises.
    let payload = std::panic::catch_unwind(|| m.call(&ones(4))).unwrap_err();
    assert_eq!(panic_message(payload), "rank 0: mlp: expected 3 features");
    let err = m.f_call_t(&ones(4), true).unwrap_err();
    assert_eq!(err.message(), "rank 0: mlp: expected 3 features");
    pre.remove();
    post.remove();

    // A forward hook's Err.
    register_fallible_forward_hook(&m, |_, _, out| {
        Err(ForwardError::new(format!("output {:?}", out.size())))
    })
    .unwrap();
    assert_eq!(m.f_call(&ones(3)).unwrap_err().message(), "output [1, 2]");
}

/// A child's failing hook, reached through the parent's `forward` (which cannot return an
/// error), is the parent's `f_call` error; other panics in forward stay panics.
#[test]
fn f_call_returns_the_errors_of_hooks_on_children() {
    let vs = nn::VarStore::new(Device::Cpu);
    let m = mlp(&vs);
    let h = register_fallible_forward_pre_hook(&m.fc2, |_, _| {
        Err(ForwardError::new("rank 1: fc2: all_gather timed out"))
    })
    .unwrap();
    let err = m.f_call(&ones(3)).unwrap_err();
    assert_eq!(err.message(), "rank 1: fc2: all_gather timed out");
    // At the top, without f_call, it is a panic with the message.
    let payload = std::panic::catch_unwind(|| m.call(&ones(3))).unwrap_err();
    assert_eq!(panic_message(payload), "rank 1: fc2: all_gather timed out");
    h.remove();

    // A shape error inside forward is tch's panic, not a hook error.
    let payload = std::panic::catch_unwind(|| m.f_call(&ones(5))).unwrap_err();
    assert!(payload.downcast_ref::<ForwardError>().is_none());
    // And the next calls are unaffected.
    assert_eq!(m.f_call(&ones(3)).unwrap().size(), [1, 2]);
}

/// A call guard that refuses through a panic (as a refused op makes tch panic inside a
/// layer): `REFUSED` is set by the "op", taken by `refusal`.
struct PanicGuard;

thread_local! {
    static REFUSED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    static ENDED: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

impl tch_dist::hooks::CallGuard for PanicGuard {
    fn refusal(&self) -> Option<ForwardError> {
        REFUSED
            .with(|r| r.replace(false))
            .then(|| ForwardError::new("rank 0: test: `fc1` refused"))
    }

    fn outermost_call_ended(&self) {
        ENDED.with(|e| e.set(e.get() + 1));
    }
}

static PANIC_GUARD: PanicGuard = PanicGuard;

/// A model whose forward "refuses" inside its first layer while `REFUSE` is set.
#[derive(Debug, Shardable)]
struct Refusing {
    fc1: nn::Linear,
}

static REFUSE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

impl Module for Refusing {
    fn forward(&self, xs: &Tensor) -> Tensor {
        if REFUSE.load(std::sync::atomic::Ordering::Relaxed) {
            REFUSED.with(|r| r.set(true));
            panic!("the op was refused");
        }
        self.fc1.forward(xs)
    }
}

#[test]
fn a_call_guards_refusal_is_the_calls_error() {
    tch_dist::hooks::register_call_guard(&PANIC_GUARD);
    let vs = nn::VarStore::new(Device::Cpu);
    let m = Refusing {
        fc1: linear(vs.root() / "fc1", 3, 2),
    };
    let outer = mlp(&vs);
    register_forward_pre_hook(&m, |_, _| None).unwrap();
    register_forward_pre_hook(&outer, |_, _| None).unwrap();
    let ended = || ENDED.with(|e| e.get());
    let before = ended();
    assert_eq!(m.f_call(&ones(3)).unwrap().size(), [1, 2]);
    assert_eq!(ended(), before + 1, "one outermost call ended");
    REFUSE.store(true, std::sync::atomic::Ordering::Relaxed);
    // f_call returns the guard's error, call panics with its message.
    let err = m.f_call(&ones(3)).unwrap_err();
    assert_eq!(err.message(), "rank 0: test: `fc1` refused");
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| m.call(&ones(3))));
    assert_eq!(
        panic_message(panicked.unwrap_err()),
        "rank 0: test: `fc1` refused"
    );
    assert_eq!(ended(), before + 3, "ended also when the call failed");
    // A panic the guard did not cause goes on.
    REFUSE.store(false, std::sync::atomic::Ordering::Relaxed);
    let other = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        m.f_call(&ones(4)) // wrong width: tch panics, no refusal recorded
    }));
    assert!(other.is_err());
    let _ = outer;
}
