//! Build script shared by every package that builds binaries, tests or examples linked
//! against libtorch (see docs/LIBTORCH.md, "CUDA needs an explicit link").
//!
//! torch-sys publishes its library folder as `DEP_TCH_LIBTORCH_LIB` to packages that depend
//! on it directly. We turn it into an rpath so binaries find libtorch without
//! `LD_LIBRARY_PATH`, and force `libtorch_cuda` into the link: with the linker's default
//! `--as-needed` it would be dropped and CUDA would look unavailable on a GPU machine.
//! runtime/build.rs includes this file and calls `link_libtorch()` besides building its shim.

#[allow(dead_code)]
fn main() {
    link_libtorch();
}

pub fn link_libtorch() {
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    let Ok(lib) = std::env::var("DEP_TCH_LIBTORCH_LIB") else {
        return;
    };
    println!("cargo:rustc-link-arg=-Wl,-rpath,{lib}");
    println!("cargo:rustc-link-arg=-Wl,--no-as-needed");
    if std::path::Path::new(&lib).join("libtorch_cuda.so").exists() {
        println!("cargo:rustc-link-arg=-ltorch_cuda");
    }
    println!("cargo:rustc-link-arg=-ltorch");
    println!("cargo:rustc-link-arg=-Wl,--as-needed");
}
