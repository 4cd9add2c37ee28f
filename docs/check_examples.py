#!/usr/bin/env python3
"""Every public item of the facade crate `tch-dist` that rustdoc expects an example on has one.

rustdoc's documentation coverage (nightly only: `--show-coverage` is unstable) counts, per
source file, the items that should carry an example (functions, methods, structs, enums,
traits, ... that are public at their own path; not fields, variants, constants, modules nor
trait impls) and those whose docs hold a Rust code block. This check builds the coverage of
`tch-dist` as docs.rs builds its docs (no libtorch: `DOCS_RS=1`, tch's `doc-only` feature),
in its own target dir (target/doc-nightly; about 3 minutes the first time), and fails, naming
the files short of examples, unless the total of the Examples column is 100%:

    DOCS_RS=1 LIBTORCH=/nonexistent CARGO_TARGET_DIR=target/doc-nightly \\
      cargo +nightly rustdoc -p tch-dist --features doc-only -- \\
      -Z unstable-options --show-coverage --output-format json

(the same command without `--output-format json` prints the table). To see each item
without an example: `-Z unstable-options -Zcrate-attr="feature(rustdoc_missing_doc_code_examples)"
-W rustdoc::missing-doc-code-examples` instead of the coverage options.

Where no nightly toolchain is installed (`cargo +nightly --version` fails), it prints one line
saying the check was skipped and why, and exits 0.

Run from anywhere: python3 docs/check_examples.py (make lint runs it);
python3 docs/check_examples.py --self-test checks the verdict on small cases.
"""

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
CRATE = "tch-dist"
TARGET_DIR = "target/doc-nightly"


def nightly_missing():
    """Why the check cannot run here (None when `cargo +nightly` works)."""
    try:
        r = subprocess.run(["cargo", "+nightly", "--version"], capture_output=True, text=True)
    except OSError as e:
        return f"cargo not found ({e})"
    if r.returncode != 0:
        why = (r.stderr.strip().splitlines() or ["no output"])[0]
        return f"`cargo +nightly --version` failed: {why}"
    return None


def short_files(coverage):
    """The files of a `--show-coverage --output-format json` report lacking examples, as
    (file, with_examples, total_examples), and the totals (with, expected)."""
    short, have, want = [], 0, 0
    for path, c in sorted(coverage.items()):
        have += c["with_examples"]
        want += c["total_examples"]
        if c["with_examples"] < c["total_examples"]:
            short.append((path, c["with_examples"], c["total_examples"]))
    return short, have, want


def percent(have, want):
    return 100.0 if want == 0 else 100.0 * have / want


def coverage_json():
    env = dict(os.environ, DOCS_RS="1", LIBTORCH="/nonexistent", CARGO_TARGET_DIR=TARGET_DIR)
    cmd = ["cargo", "+nightly", "rustdoc", "-p", CRATE, "--features", "doc-only", "--",
           "-Z", "unstable-options", "--show-coverage", "--output-format", "json"]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        sys.stderr.write(r.stderr)
        sys.exit(f"check_examples: `{' '.join(cmd)}` failed (exit {r.returncode})")
    # The report is the one JSON line on stdout.
    line = next((l for l in r.stdout.splitlines() if l.startswith("{")), None)
    if line is None:
        sys.exit(f"check_examples: no coverage report in the output of `{' '.join(cmd)}`")
    return json.loads(line)


def self_test():
    """The verdict on small cases: `python3 docs/check_examples.py --self-test`."""
    full = {"src/a.rs": {"total": 5, "with_docs": 5, "total_examples": 2, "with_examples": 2},
            "src/b.rs": {"total": 3, "with_docs": 3, "total_examples": 0, "with_examples": 0}}
    assert short_files(full) == ([], 2, 2)
    assert percent(2, 2) == 100.0 and percent(0, 0) == 100.0
    part = dict(full, **{"src/c.rs": {"total": 4, "with_docs": 4, "total_examples": 3,
                                       "with_examples": 1}})
    assert short_files(part) == ([("src/c.rs", 1, 3)], 3, 5)
    assert percent(3, 5) == 60.0
    print("check_examples: self-test passed")


def main(argv):
    if argv[1:] == ["--self-test"]:
        self_test()
        return 0
    if argv[1:]:
        sys.exit(f"usage: {argv[0]} [--self-test]")
    why = nightly_missing()
    if why:
        print(f"check_examples: skipped, no nightly toolchain for rustdoc's coverage ({why})")
        return 0
    short, have, want = short_files(coverage_json())
    if short:
        lines = [f"  {path}: {w} of {t} items with an example" for path, w, t in short]
        sys.exit(
            f"check_examples: {CRATE}'s items with examples: {have} of {want} "
            f"({percent(have, want):.1f}%), not 100%:\n" + "\n".join(lines)
            + "\n(rustdoc's -W rustdoc::missing-doc-code-examples names the items: see this "
            "script's docstring)"
        )
    print(f"check_examples: every one of {CRATE}'s {want} items that should have an example has one")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
