//! Builds the C++ shim (every csrc/*.cpp, sharing csrc/internal.h; warnings on, and errors in
//! a checkout) against the libtorch headers that torch-sys found, with Gloo always and NCCL
//! when its headers and libtorch_cuda are present, and sets the run-time rpath for this
//! package's own tests (`tch_dist_build::link_libtorch`).

use std::path::{Path, PathBuf};

fn main() {
    // docs.rs (tch's doc-only): no libtorch, nothing to compile or link.
    if std::env::var_os("CARGO_FEATURE_DOC_ONLY").is_some() {
        return;
    }
    let sources = shim_sources();
    let Ok(lib) = std::env::var("DEP_TCH_LIBTORCH_LIB") else {
        panic!(
            "torch-sys did not report its libtorch folder (DEP_TCH_LIBTORCH_LIB); run `make setup`"
        );
    };
    let lib = PathBuf::from(lib);
    let torch = lib
        .parent()
        .expect("libtorch lib folder has a parent")
        .to_path_buf();
    let include = torch.join("include");
    let site_packages = torch.parent().map(Path::to_path_buf).unwrap_or_default();

    // Warnings on (-Wall -Wextra) for the shim's own code: libtorch's headers (and the CUDA
    // ones below) are system headers, whose warnings do not count, as gloo's in /usr/include.
    let mut build = cc::Build::new();
    build
        .cpp(true)
        .std("c++17")
        .warnings(true)
        .extra_warnings(true)
        .warnings_into_errors(warnings_are_errors())
        .files(&sources)
        .include("csrc")
        .flag("-isystem")
        .flag(include.display().to_string())
        .flag("-isystem")
        .flag(include.join("torch/csrc/api/include").display().to_string())
        .define("_GLIBCXX_USE_CXX11_ABI", "1")
        .define("USE_C10D_GLOO", None);
    if !Path::new("/usr/include/gloo/config.h").exists() {
        panic!("gloo's headers are missing (Debian's libgloo-dev); run `make setup`");
    }

    let nccl_includes = [
        site_packages.join("nvidia/nccl/include"),
        site_packages.join("nvidia/cu13/include"),
        site_packages.join("nvidia/cu13/include/cccl"),
    ];
    let with_nccl = lib.join("libtorch_cuda.so").exists()
        && nccl_includes[0].join("nccl.h").exists()
        && nccl_includes[1].join("crt/host_config.h").exists()
        && std::env::var_os("TCH_DIST_NO_NCCL").is_none();
    println!("cargo:rerun-if-env-changed=TCH_DIST_NO_NCCL");
    if with_nccl {
        build
            .define("USE_C10D_NCCL", None)
            .define("TDR_WITH_NCCL", None);
        for dir in &nccl_includes {
            build.flag("-isystem").flag(dir.display().to_string());
        }
    } else {
        println!("cargo:warning=building tch-dist without NCCL (no CUDA libtorch or NCCL headers)");
    }
    build.compile("tch_dist_shim");

    // The shim's own references; these propagate to every crate that links the runtime.
    println!("cargo:rustc-link-search=native={}", lib.display());
    if with_nccl {
        println!("cargo:rustc-link-lib=dylib=torch_cuda");
        println!("cargo:rustc-link-lib=dylib=c10_cuda");
    }
    println!("cargo:rustc-link-lib=dylib=torch_cpu");
    println!("cargo:rustc-link-lib=dylib=c10");
    tch_dist_build::link_libtorch();
}

/// A warning fails the build in a checkout (so `make lint` keeps the shim clean), not in a
/// published package (cargo writes `Cargo.toml.orig`, the manifest as written, into every
/// package it makes): a user's newer compiler may warn about something new, and that must not
/// stop their build.
fn warnings_are_errors() -> bool {
    !Path::new("Cargo.toml.orig").exists()
}

/// The shim's translation units (csrc/*.cpp, sorted), after telling cargo to rerun this
/// script when any file in csrc/ changes or a file is added there.
fn shim_sources() -> Vec<PathBuf> {
    println!("cargo:rerun-if-changed=csrc");
    let mut files: Vec<PathBuf> = std::fs::read_dir("csrc")
        .expect("runtime/csrc is readable")
        .map(|entry| entry.expect("runtime/csrc is readable").path())
        .collect();
    files.sort();
    for file in &files {
        println!("cargo:rerun-if-changed={}", file.display());
    }
    files.retain(|file| file.extension().is_some_and(|ext| ext == "cpp"));
    files
}
