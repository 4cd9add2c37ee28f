//! Compile errors of `#[derive(Shardable)]` and `#[contract]`, one folder per class under
//! tests/ui/, each file's diagnostics pinned by the `.stderr` beside it (regenerate with
//! `UI=overwrite cargo test --test ui`).
//!
//! The files build as the binaries of one scratch crate, into this workspace's target folder
//! (tests/common/workspace_crate.rs), so that they reuse the compiled tch-dist: trybuild,
//! which this replaced, builds in a target folder of its own with flags of its own, and so
//! compiled libtorch's C++ bindings and the shim again (minutes on a fresh machine).
//!
//! What is pinned is rustc's rendered text with what depends on the machine taken out: the
//! scratch binary's path is the file's own, other paths are relative to the checkout or
//! `$CARGO`/`$RUST` (their line numbers, which move with every edit there, dropped), the
//! gutter is as wide as the case's own line numbers need, and the count of a list's
//! unnamed entries is `$N`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

#[path = "common/workspace_crate.rs"]
mod workspace_crate;

use workspace_crate::{
    cargo, checkout, libtorch, run_bounded, workspace_dependencies, workspace_profile,
};

/// The classes of misuse, one folder each.
const CLASSES: [&str; 9] = [
    "unknown_attribute",
    "duplicate_attribute",
    "conflicting_attribute",
    "union",
    "not_shardable",
    "rename_dot",
    "duplicate_name",
    "contract_signature",
    "typed_path",
];

/// One compile-fail case: `tests/ui/<class>/<stem>.rs`, built as the binary `<class>-<stem>`.
struct Case {
    source: PathBuf,
    bin: String,
}

impl Case {
    /// The file's path as the snapshots show it (`tests/ui/<class>/<stem>.rs`).
    fn shown(&self) -> String {
        self.source
            .strip_prefix(checkout())
            .unwrap()
            .display()
            .to_string()
    }
}

fn cases() -> Vec<Case> {
    let mut cases = Vec::new();
    for class in CLASSES {
        let dir = checkout().join("tests/ui").join(class);
        let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|x| x == "rs"))
            .collect();
        files.sort();
        assert!(!files.is_empty(), "no cases in {}", dir.display());
        for source in files {
            let stem = source.file_stem().unwrap().to_string_lossy().to_string();
            cases.push(Case {
                bin: format!("{class}-{stem}"),
                source,
            });
        }
    }
    cases
}

/// Writes the scratch crate: every case a binary, the workspace's lock file, its own
/// `[workspace]` (it sits inside this checkout's target folder).
fn scratch_crate(cases: &[Case]) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("ui-crate");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("src/bin")).unwrap();
    let root = checkout().display().to_string();
    let mut manifest = format!(
        "[package]\nname = \"tch-dist-ui\"\nversion = \"0.0.0\"\nedition = \"2024\"\n\
         publish = false\n\n[workspace]\n\n[dependencies]\ntch-dist = {{ path = {root:?} }}\n\
         tch = \"0.24\"\n{}",
        workspace_dependencies()
    );
    manifest += &workspace_profile();
    std::fs::write(dir.join("Cargo.toml"), manifest).unwrap();
    std::fs::copy(checkout().join("Cargo.lock"), dir.join("Cargo.lock")).unwrap();
    for case in cases {
        let to = dir.join("src/bin").join(format!("{}.rs", case.bin));
        std::fs::copy(&case.source, to).unwrap();
    }
    dir
}

/// Builds every binary (`--keep-going`, so that each is tried) and returns each one's
/// rendered diagnostics in the order rustc gave them, with cargo's whole output.
fn build(dir: &Path) -> (BTreeMap<String, Vec<String>>, String) {
    let mut cmd = cargo(
        dir,
        &[
            "build",
            "--offline",
            "--bins",
            "--keep-going",
            "--message-format=json",
        ],
    );
    cmd.env("LIBTORCH", libtorch());
    let out = run_bounded(cmd, Duration::from_secs(900));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let mut diagnostics: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for line in stdout.lines() {
        let Ok(msg) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        if msg["reason"] != "compiler-message" || msg["target"]["kind"][0] != "bin" {
            continue;
        }
        let message = &msg["message"];
        let text = message["message"].as_str().unwrap_or_default();
        // rustc's closing tally and its pointer to `--explain` say nothing of their own.
        if message["level"] == "failure-note" || text.starts_with("aborting due to") {
            continue;
        }
        let bin = msg["target"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let rendered = message["rendered"].as_str().unwrap_or_default().to_string();
        diagnostics.entry(bin).or_default().push(rendered);
    }
    let all = format!("{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    (diagnostics, all)
}

/// Another file's path without what names this machine: the checkout's files relative to
/// it (`core/src/path.rs`), a registry crate's as `$CARGO/<crate>-<version>/...`, the
/// standard library's as `$RUST/library/...`.
fn machine_free(path: &str, checkout: &str) -> String {
    if let Some(rest) = path.strip_prefix(checkout) {
        return rest.to_string();
    }
    // `<CARGO_HOME>/registry/src/<index>/tch-0.24.0/src/...`
    if let Some((_, after)) = path.split_once("/registry/src/")
        && let Some((_, in_index)) = after.split_once('/')
    {
        return format!("$CARGO/{in_index}");
    }
    // `/rustc/<commit>/library/...`
    if let Some(after) = path.strip_prefix("/rustc/")
        && let Some((_, in_tree)) = after.split_once('/')
    {
        return format!("$RUST/{in_tree}");
    }
    path.to_string()
}

/// A line that opens with a line number in rustc's gutter (`  12 |`, `12 +`): the width of
/// indent and number, and what follows.
fn numbered(line: &str) -> Option<(usize, &str)> {
    let indent = line.len() - line.trim_start().len();
    let digits = line[indent..]
        .chars()
        .take_while(char::is_ascii_digit)
        .count();
    (digits > 0).then(|| (indent + digits, &line[indent + digits..]))
}

/// Takes out of rustc's text what depends on the machine or on unrelated edits.
fn normalize(rendered: &str, case: &Case) -> String {
    let own = format!("src/bin/{}.rs", case.bin);
    let root = format!("{}/", checkout().display());
    let mut out = Vec::new();
    // Inside a snippet of another file than the case's own: its line numbers are dropped.
    let mut other_file = false;
    for line in rendered.lines() {
        let mut line = line.replace(&own, &case.shown());
        if let Some(at) = line.find("--> ") {
            let path = &line[at + 4..];
            other_file = !path.starts_with(&case.shown());
            if other_file {
                let path = path.split(':').next().unwrap_or(path);
                line = format!("{}{}", &line[..at + 4], machine_free(path, &root));
            }
        } else if other_file
            && let Some((width, rest)) = numbered(&line).filter(|(_, r)| r.starts_with(" |"))
        {
            // `12 |     code` -> `   |     code`: the number blanked, the gutter kept.
            line = format!("{}{rest}", " ".repeat(width));
        }
        // `and 12 others`: the count grows with every impl of the trait.
        if let Some(at) = line.find("and ") {
            let tail = &line[at + 4..];
            let n = tail.chars().take_while(char::is_ascii_digit).count();
            if n > 0 && tail[n..].starts_with(" others") {
                line = format!("{}and $N{}", &line[..at], &tail[n..]);
            }
        }
        out.push(line.trim_end().to_string());
    }
    // rustc's gutter is as wide as the longest line number shown, other files' included:
    // narrowed to the case's own numbers, so that it does not move with those files.
    let digits = |line: &String| {
        let (width, rest) = numbered(line)?;
        let number = width - (line.len() - line.trim_start().len());
        [" |", " +", " -"]
            .iter()
            .any(|m| rest.starts_with(m))
            .then_some(number)
    };
    let own = out.iter().filter_map(digits).max().unwrap_or(1);
    let width = out
        .iter()
        .find_map(|l| l.find("--> ").filter(|&at| l[..at].trim().is_empty()));
    if let Some(width) = width {
        let extra = width.saturating_sub(own);
        for line in &mut out {
            if line.len() > extra && line[..extra].trim().is_empty() {
                *line = line[extra..].to_string();
            }
        }
    }
    out.join("\n").trim_end().to_string()
}

#[test]
fn ui() {
    let cases = cases();
    let dir = scratch_crate(&cases);
    let (mut diagnostics, all) = build(&dir);
    let overwrite = std::env::var_os("UI").is_some_and(|v| v == "overwrite");
    let mut failures = Vec::new();
    for case in &cases {
        let rendered = diagnostics.remove(&case.bin).unwrap_or_default();
        let got: Vec<String> = rendered.iter().map(|r| normalize(r, case)).collect();
        let got = got.join("\n\n") + "\n";
        if !got.lines().any(|l| l.starts_with("error")) {
            failures.push(format!(
                "{}: compiled without an error:\n{got}",
                case.shown()
            ));
            continue;
        }
        let snapshot = case.source.with_extension("stderr");
        if overwrite {
            std::fs::write(&snapshot, &got).unwrap();
            continue;
        }
        let want = std::fs::read_to_string(&snapshot).unwrap_or_default();
        if got != want {
            failures.push(format!(
                "{}: the errors differ from {}\n--- expected\n{want}\n--- got\n{got}",
                case.shown(),
                snapshot.display()
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "{}\n\ncargo's output:\n{all}",
        failures.join("\n\n")
    );
}

#[test]
fn other_files_paths_name_no_machine() {
    let root = "/home/me/tch-dist/";
    assert_eq!(
        machine_free("/home/me/tch-dist/core/src/path.rs", root),
        "core/src/path.rs"
    );
    assert_eq!(
        machine_free(
            "/root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/tch-0.24.0/src/lib.rs",
            root
        ),
        "$CARGO/tch-0.24.0/src/lib.rs"
    );
    assert_eq!(
        machine_free("/rustc/59807616e/library/core/src/ops/mod.rs", root),
        "$RUST/library/core/src/ops/mod.rs"
    );
    assert_eq!(machine_free("src/other.rs", root), "src/other.rs");
}
