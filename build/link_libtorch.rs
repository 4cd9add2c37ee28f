//! The facade's build script (core/build.rs makes the same call, and runtime/build.rs too,
//! besides building its shim): an rpath to libtorch and `libtorch_cuda` forced into the link (see
//! docs/LIBTORCH.md, "CUDA needs an explicit link", and the `tch-dist-build` crate, which
//! crates using tch-dist call the same way). The facade's `links = "tch_dist"` passes the
//! folder on to its dependents' build scripts.

fn main() {
    tch_dist_build::link_libtorch();
}
