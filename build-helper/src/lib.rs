//! Build-script helper for crates that use tch-dist.
//!
//! A binary linked against libtorch must find `libtorch_cpu.so` and friends when it starts.
//! The rpath that tch-dist's own build gives its binaries does not reach a downstream
//! crate's binaries (cargo passes a package's link arguments only to its own targets), so
//! your crate's `build.rs` calls [`link_libtorch`]:
//!
//! ```no_run
//! // build.rs
//! fn main() {
//!     tch_dist_build::link_libtorch();
//! }
//! ```
//!
//! with, in Cargo.toml, `tch-dist` among `[dependencies]` and `tch-dist-build` among
//! `[build-dependencies]`. It reads the libtorch folder that tch-dist's build found
//! (`DEP_TCH_DIST_LIBTORCH_LIB`, from tch-dist's `links = "tch_dist"`) and emits:
//!
//! - `-Wl,-rpath,<libtorch lib folder>`, so the binaries start without `LD_LIBRARY_PATH`;
//! - `libtorch_cuda` (when the folder has it) and `libtorch` linked with `--no-as-needed`:
//!   the linker would otherwise drop them (no symbol of theirs is referenced) and CUDA
//!   would look unavailable on a GPU machine.
//!
//! Also, this crate's own build script stops the build at once with one message naming
//! `LIBTORCH` and `LIBTORCH_USE_PYTORCH` when neither is set (see [`NOT_FOUND`]).

#![warn(missing_docs)]
// The example is a build script, whose `fn main` is the point.
#![allow(clippy::needless_doctest_main)]

mod find;

pub use find::{libtorch_configured, NOT_FOUND};

/// The variables, in the order looked at, that name the libtorch `lib` folder in a build
/// script: tch-dist's (to its direct dependents), then torch-sys's (to its direct dependents,
/// e.g. tch-dist's own crates).
const LIB_FOLDER_VARIABLES: [&str; 2] = ["DEP_TCH_DIST_LIBTORCH_LIB", "DEP_TCH_LIBTORCH_LIB"];

/// The libtorch `lib` folder this build links against, as tch-dist or torch-sys reported it
/// (None in a build script that depends on neither directly, or on docs.rs).
pub fn libtorch_lib() -> Option<String> {
    LIB_FOLDER_VARIABLES.iter().find_map(|v| {
        println!("cargo:rerun-if-env-changed={v}");
        std::env::var(v).ok().filter(|s| !s.is_empty())
    })
}

/// Makes this package's binaries, tests and examples find libtorch at run time (an rpath to
/// its folder) and links `libtorch_cuda` and `libtorch` even though no symbol of theirs is
/// referenced. Call it from `build.rs`; it prints cargo instructions. It also passes the
/// folder on as `cargo:libtorch_lib`, which reaches direct dependents of a package with a
/// `links` key. Without a folder (see [`libtorch_lib`]) it does nothing but say so in a
/// cargo warning.
pub fn link_libtorch() {
    let Some(lib) = libtorch_lib() else {
        if std::env::var_os("DOCS_RS").is_none() {
            println!(
                "cargo:warning=tch-dist-build: no libtorch folder reported (does this package \
                 depend on tch-dist directly?); its binaries get no rpath to libtorch"
            );
        }
        return;
    };
    println!("cargo:libtorch_lib={lib}");
    println!("cargo:rustc-link-arg=-Wl,-rpath,{lib}");
    println!("cargo:rustc-link-arg=-Wl,--no-as-needed");
    if std::path::Path::new(&lib).join("libtorch_cuda.so").exists() {
        println!("cargo:rustc-link-arg=-ltorch_cuda");
    }
    println!("cargo:rustc-link-arg=-ltorch");
    println!("cargo:rustc-link-arg=-Wl,--as-needed");
}
