//! Gives this crate's binaries an rpath to the libtorch that tch-dist was built against, so
//! they start without LD_LIBRARY_PATH (and links libtorch_cuda, for CUDA on a GPU machine).

fn main() {
    tch_dist_build::link_libtorch();
}
