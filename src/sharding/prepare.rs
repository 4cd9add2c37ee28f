//! Sharders that lay out a module's inputs or outputs for `parallelize_module`'s styles:
//! [`Prepare`] (PyTorch's `PrepareModuleInput` and `PrepareModuleOutput`, on any module, per
//! positional input or output, by its [`Side`]), and the wrappers
//! that give the linear and embedding sharders sequence-sharded inputs and outputs:
//! [`GatherInput`] (`ColwiseParallel(input_layouts=Shard(d))`: the pieces all-gathered before
//! the column-parallel layer) and [`ReshardOutput`] (`RowwiseParallel(output_layouts=
//! Shard(d))`: the partial sums reduce-scattered).

use std::sync::Mutex;

use tch::Tensor;
use tch_dist_core::hooks::{
    register_fallible_forward_hook, register_fallible_forward_hook_n,
    register_fallible_forward_pre_hook, register_fallible_forward_pre_hook_n, RemovableHandle,
};
use tch_dist_core::Shardable;
use tch_dist_runtime::ProcessGroup;

use super::error::{ForwardProblem, HookSite, ShardError, SharderError, StyleProblem};
use super::output::OutputLayout;
use super::parallel::Layout;
use super::redistribute::{to_shard, Redistribute};
use super::sharder::{hook_error, ShardedModule, Sharder};

/// `inner` with its input all-gathered along `dim` first (its pre-hook runs before
/// `inner`'s): a sequence-sharded input into a column-parallel layer. In backward the
/// column-parallel layer sums the input's gradient over the ranks and the gather keeps this
/// rank's piece: a reduce-scatter, Megatron's sequence-parallel input.
#[derive(Debug, Clone, Copy)]
pub(super) struct GatherInput<S> {
    pub inner: S,
    pub dim: i64,
}

impl<S: Sharder> Sharder for GatherInput<S> {
    fn name(&self) -> String {
        format!("{}(input=Shard({}))", self.inner.name(), self.dim)
    }

    fn check(
        &self,
        fqn: &str,
        module: &dyn Shardable,
        group: &ProcessGroup,
    ) -> Result<(), SharderError> {
        self.inner.check(fqn, module, group)
    }

    fn splits_output(&self) -> bool {
        self.inner.splits_output()
    }

    fn shard(
        &self,
        fqn: &str,
        module: &dyn Shardable,
        src_rank: usize,
        group: &ProcessGroup,
    ) -> Result<ShardedModule, ShardError> {
        let (g, name, gather) = (
            group.clone(),
            fqn.to_string(),
            Redistribute::Gather(self.dim),
        );
        let hook = register_fallible_forward_pre_hook(module, move |_m, x| {
            gather
                .apply(x, &g)
                .map_err(|p| hook_error(&g, &name, HookSite::ColumnParallel, p))
        })
        .map_err(|source| ShardError::unhookable(group, fqn, source))?;
        let mut done = match self.inner.shard(fqn, module, src_rank, group) {
            Ok(done) => done,
            Err(e) => {
                hook.remove();
                return Err(e);
            }
        };
        done.hooks.insert(0, hook);
        Ok(done)
    }
}

/// `inner` with its output resharded to this rank's even piece along `dim` by its own
/// output hook (see [`to_shard`]), undivided: sequence parallelism goes on with one model
/// on pieces of one sequence (an `output_plan` spec is for data parallelism instead, and
/// averages the gradient). `shard_module` sees the output as needing nothing more.
#[derive(Debug, Clone, Copy)]
pub(super) struct ReshardOutput<S> {
    pub inner: S,
    pub dim: i64,
}

impl<S: Sharder> Sharder for ReshardOutput<S> {
    fn name(&self) -> String {
        format!("{}(output=Shard({}))", self.inner.name(), self.dim)
    }

    fn check(
        &self,
        fqn: &str,
        module: &dyn Shardable,
        group: &ProcessGroup,
    ) -> Result<(), SharderError> {
        self.inner.check(fqn, module, group)
    }

    fn shard(
        &self,
        fqn: &str,
        module: &dyn Shardable,
        src_rank: usize,
        group: &ProcessGroup,
    ) -> Result<ShardedModule, ShardError> {
        let mut done = self.inner.shard(fqn, module, src_rank, group)?;
        let layout = std::mem::replace(&mut done.output, OutputLayout::Replicated);
        // Tensors are Send but not Sync; hooks must be both.
        let layout = Mutex::new(layout);
        let (g, name, dim) = (group.clone(), fqn.to_string(), self.dim);
        let hook = register_fallible_forward_hook(module, move |_m, _x, out| {
            let layout = layout.lock().unwrap_or_else(|e| e.into_inner());
            to_shard(out, &layout, dim, &g)
                .map(Some)
                .map_err(|p| hook_error(&g, &name, HookSite::Output, p))
        });
        match hook {
            Ok(hook) => done.hooks.push(hook),
            Err(source) => {
                remove_all(&done.hooks);
                return Err(ShardError::unhookable(group, fqn, source));
            }
        }
        Ok(done)
    }
}

fn remove_all(hooks: &[RemovableHandle]) {
    for h in hooks {
        h.remove();
    }
}

/// The layouts of a `PrepareModuleInput` / `PrepareModuleOutput`, for names: `[Shard(1),
/// None] -> [Replicate, None]`.
fn layouts_label(from: &[Option<Layout>], to: &[Option<Layout>]) -> String {
    let list = |ls: &[Option<Layout>]| {
        let items: Vec<String> = ls
            .iter()
            .map(|l| l.map_or("None".to_string(), |l| format!("{l:?}")))
            .collect();
        format!("[{}]", items.join(", "))
    };
    format!("{} -> {}", list(from), list(to))
}

/// Runs each change on its tensor; `None` when nothing changed. A call with another number
/// of tensors than changes is `count` of the two (expected, got).
fn convert(
    changes: &[Redistribute],
    tensors: &[Tensor],
    g: &ProcessGroup,
    count: fn(usize, usize) -> ForwardProblem,
) -> Result<Option<Vec<Tensor>>, ForwardProblem> {
    if tensors.len() != changes.len() {
        return Err(count(changes.len(), tensors.len()));
    }
    let mut out = Vec::with_capacity(tensors.len());
    let mut changed = false;
    for (change, t) in changes.iter().zip(tensors) {
        match change.apply(t, g)? {
            Some(new) => {
                changed = true;
                out.push(new);
            }
            None => out.push(t.shallow_clone()),
        }
    }
    Ok(changed.then_some(out))
}

/// Which tensors of a call a [`Prepare`] lays out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Side {
    /// Each positional input, by a forward pre-hook (PyTorch's `PrepareModuleInput`).
    Input,
    /// Each output, by a forward hook (PyTorch's `PrepareModuleOutput`).
    Output,
}

impl Side {
    /// PyTorch's style of this side and what it lays out: `("PrepareModuleInput",
    /// "input")`.
    fn names(self) -> (&'static str, &'static str) {
        match self {
            Side::Input => ("PrepareModuleInput", "input"),
            Side::Output => ("PrepareModuleOutput", "output"),
        }
    }
}

/// PyTorch's `PrepareModuleInput` / `PrepareModuleOutput` on any module: each input (or
/// output) of a call changed from its layout to the desired one (a call of another arity is
/// refused). The module's parameters stay as they are; its submodules are other entries'.
#[derive(Debug, Clone)]
pub(super) struct Prepare {
    pub side: Side,
    pub changes: Vec<Redistribute>,
    /// The layouts, for the name.
    pub label: String,
}

impl Prepare {
    /// The sharder of a `PrepareModuleInput` (`side` input) or `PrepareModuleOutput` that
    /// changes each tensor from its layout in `from` to the one in `to`, or what tch-dist
    /// does not build.
    pub(super) fn new(
        side: Side,
        from: &[Option<Layout>],
        to: &[Option<Layout>],
    ) -> Result<Prepare, StyleProblem> {
        Ok(Prepare {
            side,
            changes: changes(side, from, to)?,
            label: layouts_label(from, to),
        })
    }
}

/// The change of layout of each input (or output) a `PrepareModule*` style asks for.
fn changes(
    side: Side,
    from: &[Option<Layout>],
    to: &[Option<Layout>],
) -> Result<Vec<Redistribute>, StyleProblem> {
    let (style, which) = side.names();
    if from.len() != to.len() {
        return Err(StyleProblem::LayoutCount {
            style,
            which,
            layouts: from.len(),
            desired: to.len(),
        });
    }
    from.iter()
        .zip(to)
        .enumerate()
        .map(|(index, (&from, &to))| {
            Redistribute::new(from, to).ok_or(StyleProblem::Redistribute {
                style,
                which,
                index,
                from,
                to,
            })
        })
        .collect()
}

impl Sharder for Prepare {
    fn name(&self) -> String {
        let (_, side) = self.side.names();
        format!("prepare_module_{side}({})", self.label)
    }

    fn check(&self, _: &str, _: &dyn Shardable, _: &ProcessGroup) -> Result<(), SharderError> {
        Ok(())
    }

    fn owns_subtree(&self) -> bool {
        false
    }

    fn shard(
        &self,
        fqn: &str,
        module: &dyn Shardable,
        _src_rank: usize,
        group: &ProcessGroup,
    ) -> Result<ShardedModule, ShardError> {
        let (g, name, changes) = (group.clone(), fqn.to_string(), self.changes.clone());
        let hook = match self.side {
            Side::Input => register_fallible_forward_pre_hook_n(module, move |_m, inputs| {
                let count = |expected, got| ForwardProblem::InputCount { expected, got };
                convert(&changes, inputs, &g, count)
                    .map_err(|p| hook_error(&g, &name, HookSite::Input, p))
            }),
            Side::Output => {
                register_fallible_forward_hook_n(module, move |_m, _inputs, outputs| {
                    let count = |expected, got| ForwardProblem::OutputCount { expected, got };
                    convert(&changes, outputs, &g, count)
                        .map_err(|p| hook_error(&g, &name, HookSite::Output, p))
                })
            }
        }
        .map_err(|source| ShardError::unhookable(group, fqn, source))?;
        Ok(ShardedModule::hook_only(hook))
    }
}
