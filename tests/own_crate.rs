//! tch-dist used from a crate of one's own, as README.md's "In your own project" says:
//! `examples/own-crate/` copied to a folder outside this workspace, its dependencies pointed
//! at this checkout by path, built with `LIBTORCH` set and nothing else (no
//! `LD_LIBRARY_PATH`), run on 2 ranks under the launcher installed with `cargo install
//! --path launcher` and under `torchrun --no-python`. And a build with no libtorch
//! configured stops with tch-dist-build's one message.
//!
//! The copy builds into this workspace's target folder with the workspace's lock file and
//! profile, so that it reuses what the workspace build compiled (a build of tch-dist from
//! scratch takes minutes).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

#[path = "common/workspace_crate.rs"]
mod workspace_crate;

use workspace_crate::{
    cargo, checkout, libtorch, run_bounded, target_dir, workspace_dependencies, workspace_profile,
};

/// A fresh folder outside the workspace (under the system's temporary folder), removed when
/// dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Scratch {
        let dir = std::env::temp_dir().join(format!("tch-dist-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("src")).unwrap();
        Scratch(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Copies the template into `dir` with its dependencies on this checkout by absolute path and
/// the workspace's lock file. `like_the_workspace` adds what makes its build reuse this
/// workspace's artifacts (tests/common/workspace_crate.rs).
fn copy_template(dir: &Path, like_the_workspace: bool) {
    let template = checkout().join("examples/own-crate");
    let manifest = std::fs::read_to_string(template.join("Cargo.toml")).unwrap();
    let root = checkout().display().to_string();
    let (extra_dependencies, profile) = if like_the_workspace {
        (workspace_dependencies(), workspace_profile())
    } else {
        (String::new(), String::new())
    };
    let manifest = manifest
        .replace(
            "tch-dist = { path = \"../..\" }",
            &format!("tch-dist = {{ path = {root:?} }}\n{extra_dependencies}"),
        )
        .replace(
            "tch-dist-build = { path = \"../../build-helper\" }",
            &format!("tch-dist-build = {{ path = \"{root}/build-helper\" }}"),
        );
    assert!(!manifest.contains("\"../.."), "{manifest}");
    std::fs::write(dir.join("Cargo.toml"), manifest + &profile).unwrap();
    for file in ["build.rs", "src/main.rs"] {
        std::fs::copy(template.join(file), dir.join(file)).unwrap();
    }
    std::fs::copy(checkout().join("Cargo.lock"), dir.join("Cargo.lock")).unwrap();
}

fn text(out: &Output) -> String {
    format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Both ranks trained (the loss went down) and ended with equal parameters.
fn assert_trained(out: &Output) {
    let all = text(out);
    assert!(out.status.success(), "{all}");
    let mut sums = Vec::new();
    for r in 0..2 {
        let line = all
            .lines()
            .find(|l| l.contains(&format!("rank={r} world=2 ")))
            .unwrap_or_else(|| panic!("no line of rank {r}: {all}"));
        let field = |name: &str| -> f64 {
            let v = line.split(&format!("{name}=")).nth(1).unwrap();
            v.split_whitespace().next().unwrap().parse().unwrap()
        };
        assert!(field("last_loss") < field("first_loss") / 4.0, "{line}");
        sums.push(field("params_sum"));
    }
    assert_eq!(sums[0], sums[1], "the replicas differ: {all}");
}

#[test]
fn a_crate_of_ones_own_builds_and_runs_under_both_launchers() {
    let scratch = Scratch::new("own-crate");
    copy_template(&scratch.0, true);
    // The documented build: LIBTORCH set, nothing else.
    let mut build = cargo(&scratch.0, &["build", "--quiet", "--offline"]);
    build.env("LIBTORCH", libtorch());
    let out = run_bounded(build, Duration::from_secs(900));
    assert!(out.status.success(), "{}", text(&out));
    let binary = target_dir().join("debug/my-trainer");

    // The launcher, installed on its own.
    let install = scratch.0.join("installed");
    let mut cmd = cargo(&scratch.0, &["install", "--quiet", "--offline", "--path"]);
    cmd.arg(checkout().join("launcher"))
        .arg("--root")
        .arg(&install);
    let out = run_bounded(cmd, Duration::from_secs(600));
    assert!(out.status.success(), "{}", text(&out));
    let mut cmd = Command::new(install.join("bin/tch-dist-run"));
    cmd.args(["--nproc-per-node", "2", "--"])
        .arg(&binary)
        .env_remove("LD_LIBRARY_PATH");
    let out = run_bounded(cmd, Duration::from_secs(120));
    assert_trained(&out);
    assert!(
        text(&out).contains("[rank1]: rank=1 world=2 "),
        "{}",
        text(&out)
    );

    // torchrun, the binary as it is.
    let torchrun = checkout().join(".venv/bin/torchrun");
    let mut cmd = Command::new(torchrun);
    cmd.args(["--standalone", "--nproc-per-node", "2", "--no-python"])
        .arg(&binary)
        .env("OMP_NUM_THREADS", "1")
        .env_remove("LD_LIBRARY_PATH");
    assert_trained(&run_bounded(cmd, Duration::from_secs(120)));
}

/// Neither LIBTORCH nor LIBTORCH_USE_PYTORCH: tch-dist-build's message, before torch-sys
/// fails with its own (or tries a download). In a target folder of its own, from scratch:
/// torch-sys's build script can only run once zip and its C libraries, its build
/// dependencies, are compiled, while tch-dist-build's has no dependencies. (In the
/// workspace's target folder torch-sys's build script is compiled already and could fail
/// first; and its failed run there would make the next build compile its C++ again.)
#[test]
fn a_build_without_libtorch_says_how_to_find_it() {
    if Path::new("/usr/lib/libtorch.so").exists() {
        eprintln!("a system-wide libtorch is installed: nothing to check");
        return;
    }
    let scratch = Scratch::new("no-libtorch");
    copy_template(&scratch.0, false);
    let mut build = cargo(&scratch.0, &["build", "--offline"]);
    build.env("CARGO_TARGET_DIR", scratch.0.join("target"));
    let out = run_bounded(build, Duration::from_secs(600));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("failed to run custom build command for `tch-dist-build"),
        "{stderr}"
    );
    // Cargo shows a build script's stderr indented by two spaces.
    let message: String = tch_dist_build::NOT_FOUND
        .lines()
        .map(|l| format!("  {l}\n"))
        .collect();
    assert!(stderr.contains(&message), "{stderr}");
    assert!(!stderr.contains("stack backtrace"), "{stderr}");
}
