//! An rpath to libtorch and `libtorch_cuda` forced into the link for this package's tests
//! (see the `tch-dist-build` crate).

fn main() {
    tch_dist_build::link_libtorch();
}
