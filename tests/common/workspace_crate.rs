//! A crate of a test's own that builds into this workspace's target folder and reuses what
//! the workspace build compiled (a build of tch-dist from scratch takes minutes: libtorch's
//! C++ bindings in torch-sys's build script alone about two). Included with `#[path]` by
//! `own_crate.rs` (README's "In your own project") and `ui.rs` (the macros' compile errors).
//!
//! Reuse needs what the workspace build had: the same lock file, feature sets and profile
//! ([`workspace_dependencies`] and [`workspace_profile`] give the manifest lines of the last
//! two), and the same LIBTORCH.

#![allow(dead_code)] // each includer uses part of it

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

/// This checkout's root.
pub fn checkout() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The target folder this test binary was built into (`<target>/debug/deps/<test>-*`).
pub fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    exe.ancestors()
        .nth(3)
        .expect("<target>/<profile>/deps/<test>")
        .to_path_buf()
}

/// `[dependencies]` lines that give a crate's build the workspace's feature sets: the
/// facade's registry dev-dependencies (they change the features of crates that torch-sys's
/// build script is built with, e.g. flate2's; a different set would build torch-sys, and its
/// C++, again).
pub fn workspace_dependencies() -> String {
    let text = std::fs::read_to_string(checkout().join("Cargo.toml")).unwrap();
    let manifest: toml::Table = text.parse().unwrap();
    let workspace = &manifest["workspace"]["dependencies"];
    let mut lines = String::new();
    for (name, spec) in manifest["dev-dependencies"].as_table().unwrap() {
        let spec = match spec.get("workspace") {
            Some(_) => &workspace[name],
            None => spec,
        };
        // Path dependencies (tch-dist-build) are the crate's own business.
        if spec.get("path").is_none() {
            lines += &format!("{name} = {spec}\n");
        }
    }
    lines
}

/// The workspace's dev profile as manifest tables: its members at opt-level 0, everything
/// else at 1.
pub fn workspace_profile() -> String {
    let members = [
        "tch-dist",
        "tch-dist-core",
        "tch-dist-runtime",
        "tch-dist-macros",
        "tch-dist-build",
    ];
    let mut lines = String::from("\n[profile.dev.package.\"*\"]\nopt-level = 1\n");
    for p in members {
        lines += &format!("[profile.dev.package.{p}]\nopt-level = 0\n");
    }
    lines
}

/// `cargo ARGS` in `dir` into this workspace's target folder, without LD_LIBRARY_PATH and
/// without the variables that name libtorch (the caller adds what it documents).
pub fn cargo(dir: &Path, args: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO"));
    cmd.current_dir(dir)
        .args(args)
        .env("CARGO_TARGET_DIR", target_dir())
        .env_remove("LD_LIBRARY_PATH")
        .env_remove("LIBTORCH")
        .env_remove("LIBTORCH_USE_PYTORCH")
        .env_remove("CARGO_MANIFEST_DIR");
    cmd
}

/// The libtorch folder the workspace build used (LIBTORCH as cargo passed it on, else the
/// `.venv` that `make setup` creates).
pub fn libtorch() -> PathBuf {
    std::env::var_os("LIBTORCH")
        .map(PathBuf::from)
        .unwrap_or_else(|| checkout().join(".venv/torch"))
}

/// Runs `cmd` to its end with its output, killed after `limit`. The output is read while it
/// runs (a cargo or a trainer that fills a pipe nobody reads would block forever).
pub fn run_bounded(mut cmd: Command, limit: Duration) -> Output {
    let child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let pid = child.id();
    let (done, finished) = std::sync::mpsc::channel::<()>();
    let watchdog = std::thread::spawn(move || {
        if finished.recv_timeout(limit).is_err() {
            // SAFETY: `kill` takes plain integers; the pid is our own child's, not yet
            // reaped (wait_with_output has not returned).
            unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
        }
    });
    let out = child.wait_with_output().expect("wait");
    let _ = done.send(());
    watchdog.join().expect("the watchdog");
    out
}
