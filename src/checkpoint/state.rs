//! [`State`]: what a checkpoint holds, described once for both directions (PyTorch's
//! `get_state_dict(model, optimizers)` with the application state DCP saves beside it).

use tch_dist_core::Shardable;

use crate::optim::Optimizer;

/// What a checkpoint holds: a model's parameters and buffers, optionally its optimizer's
/// state and settings, optionally a train state (step, epoch, data position: any JSON
/// value). [`save`](super::save) and [`async_save`](super::async_save()) write what it holds;
/// [`load`](super::load) fills it (the model's tensors, the optimizer when it holds one) and
/// sets its train state to the checkpoint's.
///
/// ```no_run
/// # use tch::nn;
/// # use tch_dist::Shardable;
/// # #[derive(Debug, Shardable)]
/// # struct Net { fc: nn::Linear }
/// # fn demo(model: &Net, opt: &mut tch_dist::optim::Optimizer) {
/// use tch_dist::checkpoint::State;
/// let state = State::new(model)
///     .with_optimizer(opt)
///     .with_train_state(serde_json::json!({ "step": 100, "epoch": 3 }));
/// assert_eq!(state.train_state().and_then(|s| s["step"].as_u64()), Some(100));
/// # }
/// ```
pub struct State<'a, M: ?Sized> {
    pub(super) model: &'a M,
    optimizer: Option<&'a mut Optimizer>,
    pub(super) train_state: Option<serde_json::Value>,
}

impl<M: ?Sized> std::fmt::Debug for State<'_, M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("State")
            .field("model", &std::any::type_name::<M>())
            .field("optimizer", &self.optimizer.is_some())
            .field("train_state", &self.train_state)
            .finish()
    }
}

impl<'a, M: Shardable + ?Sized> State<'a, M> {
    /// The model alone.
    pub fn new(model: &'a M) -> Self {
        State {
            model,
            optimizer: None,
            train_state: None,
        }
    }

    /// With `optimizer`'s state and settings: saved beside the model, or loaded into it
    /// (which is why it is borrowed mutably for both).
    pub fn with_optimizer(mut self, optimizer: &'a mut Optimizer) -> Self {
        self.optimizer = Some(optimizer);
        self
    }

    /// With a train state to save (a small JSON value, written by rank 0 as
    /// `train_state.json`).
    pub fn with_train_state(mut self, train_state: serde_json::Value) -> Self {
        self.train_state = Some(train_state);
        self
    }

    /// The train state: the one given to save, or after a [`load`](super::load) the
    /// checkpoint's (`None` when it holds none).
    pub fn train_state(&self) -> Option<&serde_json::Value> {
        self.train_state.as_ref()
    }

    /// The model.
    pub fn model(&self) -> &M {
        self.model
    }

    /// The optimizer, when the state holds one.
    pub fn optimizer(&self) -> Option<&Optimizer> {
        self.optimizer.as_deref()
    }

    /// The optimizer to load into, when the state holds one.
    pub(super) fn optimizer_mut(&mut self) -> Option<&mut Optimizer> {
        self.optimizer.as_deref_mut()
    }
}
