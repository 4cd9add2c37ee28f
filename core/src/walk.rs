//! The module walker: [`Shardable`], its visitors and the collectors behind
//! `named_parameters()` / `named_buffers()` / `named_modules()`.
//!
//! A walk is a depth-first, pre-order traversal. A module reports its own parameters and
//! buffers under their *local* names ("weight") and each child module between
//! [`ModuleVisitor::enter_module`] and [`ModuleVisitor::exit_module`] under the child's local
//! name ("fc1"). Visitors that need fully qualified names (FQNs, "encoder.fc1.weight") keep a
//! [`FqnPath`] stack, exactly like PyTorch's `named_parameters()` and tch's `VarStore` paths.

use tch::Tensor;

/// Whether a tensor is a trainable parameter or a buffer (PyTorch's `register_buffer`, tch's
/// `Path::zeros_no_train`: running statistics and other state that is saved but not trained).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TensorKind {
    /// A parameter (`nn.Parameter`): trained, gradients are synchronised by `replicate`.
    Parameter,
    /// A buffer: part of the module state but not trained.
    Buffer,
}

/// Read-only visitor of a module tree.
///
/// Every method has an empty default, so a visitor implements only what it needs. Names are
/// local (one FQN component); keep an [`FqnPath`] to build fully qualified names. The
/// lifetime `'a` is the lifetime of the walked module, so a visitor can keep the references
/// it is handed (that is how [`Shardable::named_parameters`] returns `&Tensor`s).
pub trait ModuleVisitor<'a> {
    /// Called before the contents of child module `name` are visited.
    fn enter_module(&mut self, name: &str, module: &'a dyn Shardable) {
        let _ = (name, module);
    }
    /// Called after the contents of child module `name` were visited.
    fn exit_module(&mut self, name: &str) {
        let _ = name;
    }
    /// A parameter of the current module.
    fn visit_param(&mut self, name: &str, tensor: &'a Tensor) {
        let _ = (name, tensor);
    }
    /// A buffer of the current module.
    fn visit_buffer(&mut self, name: &str, tensor: &'a Tensor) {
        let _ = (name, tensor);
    }
}

/// Mutable visitor of a module tree: it may replace tensors in place (sharding does).
///
/// To keep a module's identity (its [`ModuleKey`](crate::ModuleKey), and with it the state
/// that composable APIs and hooks attached to it), change a tensor's data with
/// [`Tensor::set_data`] rather than assigning a new `Tensor`; `#[contract]` functions that
/// take `&mut M` and do assign new tensors have their state moved to the new identity.
pub trait ModuleVisitorMut<'a> {
    /// Called before the contents of child module `name` (of type `type_name`) are visited.
    fn enter_module(&mut self, name: &str, type_name: &'static str) {
        let _ = (name, type_name);
    }
    /// Called after the contents of child module `name` were visited.
    fn exit_module(&mut self, name: &str) {
        let _ = name;
    }
    /// A parameter of the current module.
    fn visit_param(&mut self, name: &str, tensor: &'a mut Tensor) {
        let _ = (name, tensor);
    }
    /// A buffer of the current module.
    fn visit_buffer(&mut self, name: &str, tensor: &'a mut Tensor) {
        let _ = (name, tensor);
    }
}

/// Upcast to `&dyn Shardable`; implemented for every sized [`Shardable`] type (and so for
/// `dyn Shardable` itself), which lets [`Shardable`]'s provided methods hand `self` to visitors.
pub trait AsDynShardable {
    /// `self` as a trait object.
    fn as_dyn_shardable(&self) -> &dyn Shardable;
}

impl<T: Shardable> AsDynShardable for T {
    fn as_dyn_shardable(&self) -> &dyn Shardable {
        self
    }
}

/// A module whose parameters, buffers and child modules can be walked under PyTorch's fully
/// qualified names: the Rust counterpart of `nn.Module`'s `named_parameters()`,
/// `named_buffers()` and `named_modules()`.
///
/// Derive it with `#[derive(Shardable)]`; it is implemented here for tch's layers (with
/// PyTorch's names), `Vec<T>` and `[T; N]` (elements named `0`, `1`, … like `nn.ModuleList`),
/// and for `Box<T>` and `Option<T>`, which are transparent: they add no name and no module.
///
/// The trait is object safe: `&dyn Shardable` works everywhere a module is expected.
pub trait Shardable: AsDynShardable {
    /// Visits this module's own parameters and buffers and, between
    /// `enter_module`/`exit_module`, its children (via [`Shardable::visit_child`]).
    fn visit<'a>(&'a self, visitor: &mut dyn ModuleVisitor<'a>);

    /// The mutable twin of [`Shardable::visit`].
    fn visit_mut<'a>(&'a mut self, visitor: &mut dyn ModuleVisitorMut<'a>);

    /// The module's type name (used in messages and in [`ModuleKey`](crate::ModuleKey)).
    /// Transparent wrappers report the type of what they wrap.
    fn type_name(&self) -> &'static str {
        std::any::type_name::<Self>()
    }

    /// Visits `self` as the child `name` of the module being walked. The default reports a
    /// module boundary; transparent wrappers (`Box`, `Option`, newtype enum variants) forward
    /// to what they wrap instead.
    fn visit_child<'a>(&'a self, name: &str, visitor: &mut dyn ModuleVisitor<'a>) {
        visitor.enter_module(name, self.as_dyn_shardable());
        self.visit(visitor);
        visitor.exit_module(name);
    }

    /// The mutable twin of [`Shardable::visit_child`].
    fn visit_child_mut<'a>(&'a mut self, name: &str, visitor: &mut dyn ModuleVisitorMut<'a>) {
        visitor.enter_module(name, self.type_name());
        self.visit_mut(visitor);
        visitor.exit_module(name);
    }

    /// Parameters with their fully qualified names, in walk order (PyTorch's
    /// `named_parameters()`; tensors shared between two fields are listed under both names).
    fn named_parameters(&self) -> Vec<(String, &Tensor)> {
        let mut c = Collect::new(true, false, false);
        self.visit(&mut c);
        c.params
    }

    /// Buffers with their fully qualified names, in walk order (PyTorch's `named_buffers()`).
    fn named_buffers(&self) -> Vec<(String, &Tensor)> {
        let mut c = Collect::new(false, true, false);
        self.visit(&mut c);
        c.buffers
    }

    /// Every module of the tree with its fully qualified name, pre-order; the root comes
    /// first under `""` (PyTorch's `named_modules()`).
    fn named_modules(&self) -> Vec<(String, &dyn Shardable)> {
        let mut c = Collect::new(false, false, true);
        c.modules.push((String::new(), self.as_dyn_shardable()));
        self.visit(&mut c);
        c.modules
    }

    /// The direct children with their local names (PyTorch's `named_children()`).
    fn named_children(&self) -> Vec<(String, &dyn Shardable)> {
        let mut c = Collect::new(false, false, true);
        c.children_only = true;
        self.visit(&mut c);
        c.modules
    }

    /// Parameters in walk order (PyTorch's `parameters()`).
    fn parameters(&self) -> Vec<&Tensor> {
        self.named_parameters()
            .into_iter()
            .map(|(_, t)| t)
            .collect()
    }

    /// Buffers in walk order (PyTorch's `buffers()`).
    fn buffers(&self) -> Vec<&Tensor> {
        self.named_buffers().into_iter().map(|(_, t)| t).collect()
    }

    /// Mutable parameters with their fully qualified names, in walk order.
    fn named_parameters_mut(&mut self) -> Vec<(String, &mut Tensor)> {
        let mut c = CollectMut::new(true, false);
        self.visit_mut(&mut c);
        c.tensors
    }

    /// Mutable buffers with their fully qualified names, in walk order.
    fn named_buffers_mut(&mut self) -> Vec<(String, &mut Tensor)> {
        let mut c = CollectMut::new(false, true);
        self.visit_mut(&mut c);
        c.tensors
    }
}

/// A stack of FQN components: push on `enter_module`, pop on `exit_module`, and
/// [`FqnPath::join`] a leaf name to get `"encoder.layers.0.weight"`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FqnPath {
    parts: Vec<String>,
}

impl FqnPath {
    /// An empty path (the root module).
    pub fn new() -> Self {
        Self::default()
    }
    /// Enters child `name`.
    pub fn push(&mut self, name: &str) {
        self.parts.push(name.to_owned());
    }
    /// Leaves the current child.
    pub fn pop(&mut self) {
        self.parts.pop();
    }
    /// Depth below the root.
    pub fn depth(&self) -> usize {
        self.parts.len()
    }
    /// The FQN of the current module (`""` at the root).
    pub fn current(&self) -> String {
        self.parts.join(".")
    }
    /// The FQN of `leaf` inside the current module.
    pub fn join(&self, leaf: &str) -> String {
        if self.parts.is_empty() {
            leaf.to_owned()
        } else {
            let mut s = self.parts.join(".");
            s.push('.');
            s.push_str(leaf);
            s
        }
    }
}

/// The collector behind the `named_*` methods.
struct Collect<'a> {
    path: FqnPath,
    want_params: bool,
    want_buffers: bool,
    want_modules: bool,
    children_only: bool,
    params: Vec<(String, &'a Tensor)>,
    buffers: Vec<(String, &'a Tensor)>,
    modules: Vec<(String, &'a dyn Shardable)>,
}

impl Collect<'_> {
    fn new(want_params: bool, want_buffers: bool, want_modules: bool) -> Self {
        Collect {
            path: FqnPath::new(),
            want_params,
            want_buffers,
            want_modules,
            children_only: false,
            params: Vec::new(),
            buffers: Vec::new(),
            modules: Vec::new(),
        }
    }
}

impl<'a> ModuleVisitor<'a> for Collect<'a> {
    fn enter_module(&mut self, name: &str, module: &'a dyn Shardable) {
        if self.want_modules && (!self.children_only || self.path.depth() == 0) {
            self.modules.push((self.path.join(name), module));
        }
        self.path.push(name);
    }
    fn exit_module(&mut self, _name: &str) {
        self.path.pop();
    }
    fn visit_param(&mut self, name: &str, tensor: &'a Tensor) {
        if self.want_params {
            self.params.push((self.path.join(name), tensor));
        }
    }
    fn visit_buffer(&mut self, name: &str, tensor: &'a Tensor) {
        if self.want_buffers {
            self.buffers.push((self.path.join(name), tensor));
        }
    }
}

struct CollectMut<'a> {
    path: FqnPath,
    want_params: bool,
    want_buffers: bool,
    tensors: Vec<(String, &'a mut Tensor)>,
}

impl CollectMut<'_> {
    fn new(want_params: bool, want_buffers: bool) -> Self {
        CollectMut {
            path: FqnPath::new(),
            want_params,
            want_buffers,
            tensors: Vec::new(),
        }
    }
}

impl<'a> ModuleVisitorMut<'a> for CollectMut<'a> {
    fn enter_module(&mut self, name: &str, _type_name: &'static str) {
        self.path.push(name);
    }
    fn exit_module(&mut self, _name: &str) {
        self.path.pop();
    }
    fn visit_param(&mut self, name: &str, tensor: &'a mut Tensor) {
        if self.want_params {
            self.tensors.push((self.path.join(name), tensor));
        }
    }
    fn visit_buffer(&mut self, name: &str, tensor: &'a mut Tensor) {
        if self.want_buffers {
            self.tensors.push((self.path.join(name), tensor));
        }
    }
}

/// Every tensor of a module tree (parameters and buffers, walk order) with no names: what
/// [`ModuleKey`](crate::ModuleKey) is built from.
pub(crate) fn all_tensors(module: &dyn Shardable) -> Vec<&Tensor> {
    struct All<'a>(Vec<&'a Tensor>);
    impl<'a> ModuleVisitor<'a> for All<'a> {
        fn visit_param(&mut self, _: &str, t: &'a Tensor) {
            self.0.push(t);
        }
        fn visit_buffer(&mut self, _: &str, t: &'a Tensor) {
            self.0.push(t);
        }
    }
    let mut all = All(Vec::new());
    module.visit(&mut all);
    all.0
}

/// The FQN lists that `#[contract]` compares before and after an API runs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct FqnSnapshot {
    pub params: Vec<String>,
    pub buffers: Vec<String>,
    pub modules: Vec<String>,
}

impl FqnSnapshot {
    pub(crate) fn of(module: &dyn Shardable) -> (Self, Vec<&dyn Shardable>) {
        let mut c = Collect::new(true, true, true);
        c.modules.push((String::new(), module));
        module.visit(&mut c);
        let (modules, refs): (Vec<String>, Vec<&dyn Shardable>) = c.modules.into_iter().unzip();
        let snap = FqnSnapshot {
            params: c.params.into_iter().map(|(n, _)| n).collect(),
            buffers: c.buffers.into_iter().map(|(n, _)| n).collect(),
            modules,
        };
        (snap, refs)
    }
}

/// A tensor field of a derived module: what `#[shardable(param)]` and
/// `#[shardable(buffer)]` accept. Implemented for `Tensor` and `Option<Tensor>` (an absent
/// optional tensor, like a bias-free layer's bias, is simply not reported).
pub trait TensorField {
    /// Reports the field to `visitor` as a parameter or buffer called `name`.
    fn visit_field<'a>(&'a self, name: &str, kind: TensorKind, visitor: &mut dyn ModuleVisitor<'a>);
    /// The mutable twin of [`TensorField::visit_field`].
    fn visit_field_mut<'a>(
        &'a mut self,
        name: &str,
        kind: TensorKind,
        visitor: &mut dyn ModuleVisitorMut<'a>,
    );
}

impl TensorField for Tensor {
    fn visit_field<'a>(
        &'a self,
        name: &str,
        kind: TensorKind,
        visitor: &mut dyn ModuleVisitor<'a>,
    ) {
        match kind {
            TensorKind::Parameter => visitor.visit_param(name, self),
            TensorKind::Buffer => visitor.visit_buffer(name, self),
        }
    }
    fn visit_field_mut<'a>(
        &'a mut self,
        name: &str,
        kind: TensorKind,
        visitor: &mut dyn ModuleVisitorMut<'a>,
    ) {
        match kind {
            TensorKind::Parameter => visitor.visit_param(name, self),
            TensorKind::Buffer => visitor.visit_buffer(name, self),
        }
    }
}

impl TensorField for Option<Tensor> {
    fn visit_field<'a>(
        &'a self,
        name: &str,
        kind: TensorKind,
        visitor: &mut dyn ModuleVisitor<'a>,
    ) {
        if let Some(t) = self {
            t.visit_field(name, kind, visitor);
        }
    }
    fn visit_field_mut<'a>(
        &'a mut self,
        name: &str,
        kind: TensorKind,
        visitor: &mut dyn ModuleVisitorMut<'a>,
    ) {
        if let Some(t) = self {
            t.visit_field_mut(name, kind, visitor);
        }
    }
}

// ---- containers -------------------------------------------------------------------------

/// `Box<T>` is transparent: the boxed module appears under the field's own name.
impl<T: Shardable + ?Sized> Shardable for Box<T> {
    fn visit<'a>(&'a self, visitor: &mut dyn ModuleVisitor<'a>) {
        (**self).visit(visitor)
    }
    fn visit_mut<'a>(&'a mut self, visitor: &mut dyn ModuleVisitorMut<'a>) {
        (**self).visit_mut(visitor)
    }
    fn type_name(&self) -> &'static str {
        (**self).type_name()
    }
    fn visit_child<'a>(&'a self, name: &str, visitor: &mut dyn ModuleVisitor<'a>) {
        (**self).visit_child(name, visitor)
    }
    fn visit_child_mut<'a>(&'a mut self, name: &str, visitor: &mut dyn ModuleVisitorMut<'a>) {
        (**self).visit_child_mut(name, visitor)
    }
}

/// `Option<T>` is transparent: `Some(m)` is `m` under the field's name, `None` is absent
/// (no module, no names), like a PyTorch attribute set to `None`.
impl<T: Shardable> Shardable for Option<T> {
    fn visit<'a>(&'a self, visitor: &mut dyn ModuleVisitor<'a>) {
        if let Some(m) = self {
            m.visit(visitor)
        }
    }
    fn visit_mut<'a>(&'a mut self, visitor: &mut dyn ModuleVisitorMut<'a>) {
        if let Some(m) = self {
            m.visit_mut(visitor)
        }
    }
    fn type_name(&self) -> &'static str {
        match self {
            Some(m) => m.type_name(),
            None => std::any::type_name::<Self>(),
        }
    }
    fn visit_child<'a>(&'a self, name: &str, visitor: &mut dyn ModuleVisitor<'a>) {
        if let Some(m) = self {
            m.visit_child(name, visitor)
        }
    }
    fn visit_child_mut<'a>(&'a mut self, name: &str, visitor: &mut dyn ModuleVisitorMut<'a>) {
        if let Some(m) = self {
            m.visit_child_mut(name, visitor)
        }
    }
}

/// A sequence of modules is a module like `nn.ModuleList`: its elements are children `0`,
/// `1`, … (`Vec<T>` and `[T; N]`).
fn visit_seq<'a, T: Shardable>(items: &'a [T], visitor: &mut dyn ModuleVisitor<'a>) {
    for (i, m) in items.iter().enumerate() {
        m.visit_child(&i.to_string(), visitor);
    }
}

fn visit_seq_mut<'a, T: Shardable>(items: &'a mut [T], visitor: &mut dyn ModuleVisitorMut<'a>) {
    for (i, m) in items.iter_mut().enumerate() {
        m.visit_child_mut(&i.to_string(), visitor);
    }
}

/// `Vec<T>` is a module like `nn.ModuleList`: its elements are children `0`, `1`, ….
impl<T: Shardable> Shardable for Vec<T> {
    fn visit<'a>(&'a self, visitor: &mut dyn ModuleVisitor<'a>) {
        visit_seq(self, visitor)
    }
    fn visit_mut<'a>(&'a mut self, visitor: &mut dyn ModuleVisitorMut<'a>) {
        visit_seq_mut(self, visitor)
    }
}

/// `[T; N]` is a module like `nn.ModuleList`: its elements are children `0`, `1`, ….
impl<T: Shardable, const N: usize> Shardable for [T; N] {
    fn visit<'a>(&'a self, visitor: &mut dyn ModuleVisitor<'a>) {
        visit_seq(self, visitor)
    }
    fn visit_mut<'a>(&'a mut self, visitor: &mut dyn ModuleVisitorMut<'a>) {
        visit_seq_mut(self, visitor)
    }
}

/// `PhantomData` holds nothing and is not a module, so generic models need not skip it.
impl<T: ?Sized> Shardable for std::marker::PhantomData<T> {
    fn visit<'a>(&'a self, _visitor: &mut dyn ModuleVisitor<'a>) {}
    fn visit_mut<'a>(&'a mut self, _visitor: &mut dyn ModuleVisitorMut<'a>) {}
    fn visit_child<'a>(&'a self, _name: &str, _visitor: &mut dyn ModuleVisitor<'a>) {}
    fn visit_child_mut<'a>(&'a mut self, _name: &str, _visitor: &mut dyn ModuleVisitorMut<'a>) {}
}
