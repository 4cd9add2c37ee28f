//! Builds the C++ shim (every csrc/*.cpp, sharing csrc/internal.h, compiled as one unity
//! translation unit; warnings on, and errors in a checkout) against the libtorch headers that
//! torch-sys found, with Gloo always and NCCL whenever that libtorch is a CUDA build (a CUDA
//! libtorch without NCCL's headers fails the build unless `TCH_DIST_NO_NCCL=1`), and sets the
//! run-time rpath for this package's own tests (`tch_dist_build::link_libtorch`).

use std::path::{Path, PathBuf};

fn main() {
    // docs.rs (tch's doc-only): no libtorch, nothing to compile or link.
    if std::env::var_os("CARGO_FEATURE_DOC_ONLY").is_some() {
        return;
    }
    let unity = unity_source(&shim_sources());
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
    // The CUDA and NCCL headers are pip packages beside torch, in its site-packages. LIBTORCH
    // is often a link (make setup's `.venv/torch`), whose own parent is not that folder: look
    // beside the folder it points to.
    let site_packages = std::fs::canonicalize(&torch)
        .unwrap_or_else(|_| torch.clone())
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_default();

    // Warnings on (-Wall -Wextra) for the shim's own code: libtorch's headers (and the CUDA
    // ones below) are system headers, whose warnings do not count, as gloo's in /usr/include.
    let mut build = cc::Build::new();
    build
        .cpp(true)
        .std("c++17")
        .warnings(true)
        .extra_warnings(true)
        .warnings_into_errors(warnings_are_errors())
        // In one translation unit every section's anonymous namespace is the unity file's,
        // so GCC's check that a header's types use none (-Wsubobject-linkage) misfires on
        // the section files it includes.
        .flag("-Wno-subobject-linkage")
        .file(&unity)
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
    let with_nccl = match nccl_choice(&lib, &nccl_includes) {
        NcclChoice::Build => true,
        NcclChoice::NotCuda => false,
        NcclChoice::OptedOut => {
            println!("cargo:warning=building tch-dist without NCCL (TCH_DIST_NO_NCCL=1)");
            false
        }
        NcclChoice::HeadersMissing(missing) => panic!(
            "tch-dist: the libtorch in {} is a CUDA build (it has libtorch_cuda.so), but NCCL's \
             headers are missing, so Backend::Nccl could not be built: {missing} not found. \
             Install them beside torch (`pip install \"nvidia-cuda-crt==13.0.*\" \
             \"nvidia-cuda-cccl==13.0.*\"`; in a checkout, `make setup`), or build for CPU only \
             with TCH_DIST_NO_NCCL=1.",
            lib.display()
        ),
    };
    if with_nccl {
        build
            .define("USE_C10D_NCCL", None)
            .define("TDR_WITH_NCCL", None);
        for dir in &nccl_includes {
            build.flag("-isystem").flag(dir.display().to_string());
        }
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

/// Whether the shim is built with NCCL.
enum NcclChoice {
    /// A CUDA libtorch with NCCL's headers beside it.
    Build,
    /// A CPU-only libtorch: nothing to build NCCL against.
    NotCuda,
    /// A CUDA libtorch, and the user asked for no NCCL (`TCH_DIST_NO_NCCL=1`).
    OptedOut,
    /// A CUDA libtorch without the header named here: a build error, never a silent CPU build.
    HeadersMissing(String),
}

/// A CUDA libtorch (`libtorch_cuda.so` in its `lib`) always gets NCCL, unless opted out: a
/// build that quietly left NCCL out would only show itself on a GPU machine.
fn nccl_choice(lib: &Path, includes: &[PathBuf; 3]) -> NcclChoice {
    println!("cargo:rerun-if-env-changed=TCH_DIST_NO_NCCL");
    if !lib.join("libtorch_cuda.so").exists() {
        return NcclChoice::NotCuda;
    }
    if std::env::var("TCH_DIST_NO_NCCL").is_ok_and(|v| v == "1") {
        return NcclChoice::OptedOut;
    }
    let needed = [
        includes[0].join("nccl.h"),
        includes[1].join("crt/host_config.h"),
        includes[2].join("nv/target"),
    ];
    match needed.iter().find(|header| !header.exists()) {
        Some(header) => NcclChoice::HeadersMissing(header.display().to_string()),
        None => NcclChoice::Build,
    }
}

/// A warning fails the build in a checkout (so `make lint` keeps the shim clean), not in a
/// published package (cargo writes `Cargo.toml.orig`, the manifest as written, into every
/// package it makes): a user's newer compiler may warn about something new, and that must not
/// stop their build.
fn warnings_are_errors() -> bool {
    !Path::new("Cargo.toml.orig").exists()
}

/// One file that includes every section of the shim (`OUT_DIR/shim_unity.cpp`): the sections
/// stay one file each for readers, but libtorch's headers, most of the compile time, are
/// parsed once instead of once per section (twelve times as much CPU otherwise, paid again by
/// every build that compiles the runtime from scratch).
fn unity_source(sections: &[PathBuf]) -> PathBuf {
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let here = std::env::current_dir().expect("the package folder");
    let text: String = sections
        .iter()
        .map(|file| format!("#include \"{}\"\n", here.join(file).display()))
        .collect();
    let unity = out.join("shim_unity.cpp");
    // Rewritten only when it changes, so that cc's output stays fresh only when it should.
    if std::fs::read_to_string(&unity).ok().as_deref() != Some(text.as_str()) {
        std::fs::write(&unity, text).expect("OUT_DIR is writable");
    }
    unity
}

/// The shim's sections (csrc/*.cpp, sorted), after telling cargo to rerun this
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
