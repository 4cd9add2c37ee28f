//! The checkpoint functions of the previous release, one per combination of options, kept
//! for one release as wrappers of the three verbs over a [`State`] ([`save`], [`async_save`],
//! [`load`]): each says what to write instead.

#![allow(deprecated)]

use std::path::Path;

use tch_dist_core::Shardable;
use tch_dist_runtime::ProcessGroup;

use super::{
    async_save, load, save, save_parts, AsyncSave, CheckpointError, LoadOptions, LoadStats, Parts,
    SaveOptions, State,
};
use crate::optim::Optimizer;

/// [`save`] with `opts`.
#[deprecated(note = "use `checkpoint::save(dir, &State::new(module), group, opts)`")]
pub fn save_with<M: Shardable + ?Sized>(
    dir: impl AsRef<Path>,
    module: &M,
    group: &ProcessGroup,
    opts: &SaveOptions,
) -> Result<(), CheckpointError> {
    save(dir, &State::new(module), group, opts)
}

/// [`save`] with an optimizer's state and settings.
#[deprecated(
    note = "use `checkpoint::save(dir, &State::new(module).with_optimizer(opt), group, opts)`"
)]
pub fn save_with_optimizer<M: Shardable + ?Sized>(
    dir: impl AsRef<Path>,
    module: &M,
    optimizer: &Optimizer,
    group: &ProcessGroup,
    opts: &SaveOptions,
) -> Result<(), CheckpointError> {
    let parts = Parts {
        model: module,
        optimizer: Some(optimizer),
        train_state: None,
    };
    save_parts(dir.as_ref(), &parts, group, opts)
}

/// [`async_save`](async_save()) with `opts`.
#[deprecated(note = "use `checkpoint::async_save(dir, &State::new(module), group, opts)`")]
pub fn async_save_with<M: Shardable + ?Sized>(
    dir: impl AsRef<Path>,
    module: &M,
    group: &ProcessGroup,
    opts: &SaveOptions,
) -> Result<AsyncSave, CheckpointError> {
    async_save(dir, &State::new(module), group, opts)
}

/// [`async_save`](async_save()) with an optimizer's state and settings.
#[deprecated(
    note = "use `checkpoint::async_save(dir, &State::new(module).with_optimizer(opt), group, opts)`"
)]
pub fn async_save_with_optimizer<M: Shardable + ?Sized>(
    dir: impl AsRef<Path>,
    module: &M,
    optimizer: &Optimizer,
    group: &ProcessGroup,
    opts: &SaveOptions,
) -> Result<AsyncSave, CheckpointError> {
    let parts = Parts {
        model: module,
        optimizer: Some(optimizer),
        train_state: None,
    };
    super::async_save::start(dir.as_ref(), &parts, group, opts)
}

/// [`load`] with `opts`.
#[deprecated(note = "use `checkpoint::load(dir, &mut State::new(module), group, opts)`")]
pub fn load_with<M: Shardable + ?Sized>(
    path: impl AsRef<Path>,
    module: &M,
    group: &ProcessGroup,
    opts: &LoadOptions,
) -> Result<LoadStats, CheckpointError> {
    load(path, &mut State::new(module), group, opts)
}

/// [`load`], returning what this rank read.
#[deprecated(
    note = "use `checkpoint::load(dir, &mut State::new(module), group, &LoadOptions::default())`"
)]
pub fn load_with_stats<M: Shardable + ?Sized>(
    path: impl AsRef<Path>,
    module: &M,
    group: &ProcessGroup,
) -> Result<LoadStats, CheckpointError> {
    load(
        path,
        &mut State::new(module),
        group,
        &LoadOptions::default(),
    )
}

/// [`load`] with an optimizer's state and settings.
#[deprecated(
    note = "use `checkpoint::load(dir, &mut State::new(module).with_optimizer(opt), group, opts)`"
)]
pub fn load_with_optimizer<M: Shardable + ?Sized>(
    path: impl AsRef<Path>,
    module: &M,
    optimizer: &mut Optimizer,
    group: &ProcessGroup,
) -> Result<(), CheckpointError> {
    let mut state = State::new(module).with_optimizer(optimizer);
    load(path, &mut state, group, &LoadOptions::default()).map(|_| ())
}

/// The train state a checkpoint holds, without the model: read on every rank of `group`.
#[deprecated(note = "use `checkpoint::load` and `State::train_state`")]
pub fn load_train_state(
    dir: impl AsRef<Path>,
    group: &ProcessGroup,
) -> Result<Option<serde_json::Value>, CheckpointError> {
    super::train_state_only(dir.as_ref(), group)
}
