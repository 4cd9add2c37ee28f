//! The project's binaries a test runs as processes (`tch-dist-run`, the examples), built once
//! per test binary in its own profile. Included with `#[path = "common/build.rs"] mod build;`
//! (tests/common/hosts.rs expects it at the crate root, as `crate::build`).

#![allow(dead_code)] // each includer uses part of it

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// `tch-dist-run`, built once in this test binary's profile.
pub fn launcher() -> &'static Path {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT.get_or_init(|| {
        cargo_build(&["-p", "tch-dist-launcher", "--bin", "tch-dist-run"]).join("tch-dist-run")
    })
}

/// `tch-dist-lighthouse` (fault tolerance's lighthouse), built once in this test binary's
/// profile, beside `tch-dist-run` (whose `--start-lighthouse` runs it from there).
pub fn lighthouse() -> &'static Path {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT.get_or_init(|| {
        cargo_build(&["-p", "tch-dist-ft", "--bin", "tch-dist-lighthouse"])
            .join("tch-dist-lighthouse")
    })
}

/// The example `name` of the facade crate (`train_lm`, `train_ddp_crash`, ...), built once
/// per name in this test binary's profile.
pub fn example(name: &str) -> PathBuf {
    static BUILT: std::sync::Mutex<Vec<(String, PathBuf)>> = std::sync::Mutex::new(Vec::new());
    let mut built = BUILT.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, path)) = built.iter().find(|(n, _)| n == name) {
        return path.clone();
    }
    let path = cargo_build(&["-p", "tch-dist", "--example", name])
        .join("examples")
        .join(name);
    built.push((name.to_string(), path.clone()));
    path
}

/// `cargo build` with `args` in this test binary's profile; returns `target/<profile>`.
fn cargo_build(args: &[&str]) -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("target/<profile>")
        .to_path_buf();
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml");
    let mut cmd = Command::new(env!("CARGO"));
    cmd.args(["build", "--quiet", "--manifest-path"])
        .arg(&manifest)
        .args(args);
    if profile_dir.ends_with("release") {
        cmd.arg("--release");
    }
    assert!(
        cmd.status().expect("cargo").success(),
        "cargo build {} failed",
        args.join(" ")
    );
    profile_dir
}
