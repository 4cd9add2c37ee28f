#!/usr/bin/env python3
"""The file tables match the tree.

Every source folder below a crate's root opens its module docs (mod.rs) with a table of its
files (file -> job -> PyTorch's counterpart): the table names exactly the folder's files
and subfolders, no more, no fewer. And every path of the repository that docs/ARCHITECTURE.md
names (`runtime/src/c10d/group/mod.rs`, `src/checkpoint/`) exists, so that its tables and
prose do not outlive a move.

Run from the repository's root: python3 docs/check_tables.py (make lint runs it).
"""

import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
# The crates' source roots: their own lib.rs/main.rs describe them, and docs/ARCHITECTURE.md's
# "Crates" table lists them; the folders below each must open with a table.
SOURCE_ROOTS = ["src", "runtime/src", "core/src", "macros/src", "launcher/src"]
# Inline unit tests beside the file they test (`#[cfg(test)] mod tests;`) are not listed.
UNLISTED = {"tests.rs", "tests"}
# A table row's first cell: the backquoted names in it (`a.rs`, `b/`, `c.rs` (`Thing`)).
ROW = re.compile(r"^//! \| (.*?) \|")
NAME = re.compile(r"`([A-Za-z0-9_]+(?:\.rs|/))`")


def listed(mod_rs):
    """The names the module docs' table lists, or None without a table."""
    names = set()
    found = False
    for line in mod_rs.read_text().splitlines():
        m = ROW.match(line)
        if not m:
            continue
        found = True
        names.update(NAME.findall(m.group(1)))
    return names if found else None


def present(folder):
    """The folder's files and subfolders, as a table names them."""
    names = set()
    for p in folder.iterdir():
        if p.name in UNLISTED:
            continue
        if p.is_dir() and any(f.name not in UNLISTED for f in p.rglob("*.rs")):
            names.add(p.name + "/")
        elif p.suffix == ".rs":
            names.add(p.name)
    return names


def check_folders():
    problems = []
    for root in SOURCE_ROOTS:
        for folder in sorted((ROOT / root).rglob("*")):
            if not folder.is_dir() or folder.name in UNLISTED:
                continue
            if any(part in UNLISTED for part in folder.relative_to(ROOT / root).parts):
                continue
            rel = folder.relative_to(ROOT)
            mod_rs = folder / "mod.rs"
            if not mod_rs.exists():
                # A folder of a file's inline tests or submodules (`error/` beside error.rs).
                sibling = folder.with_suffix(".rs")
                if sibling.exists():
                    mod_rs = sibling
                else:
                    problems.append(f"{rel}/: no mod.rs")
                    continue
            names = listed(mod_rs)
            here = present(folder)
            if mod_rs.parent == folder:
                here.discard("mod.rs")
                if names is not None:
                    names.discard("mod.rs")
            if names is None:
                if len(here) > 1:
                    problems.append(
                        f"{mod_rs.relative_to(ROOT)}: no table of its folder's files "
                        f"({', '.join(sorted(here))})"
                    )
                continue
            for name in sorted(here - names):
                problems.append(f"{mod_rs.relative_to(ROOT)}: the table does not list `{name}`")
            # A table may list the inline tests beside the code they test.
            for name in sorted(names - here - {n for n in UNLISTED if (folder / n).exists()}):
                problems.append(
                    f"{mod_rs.relative_to(ROOT)}: the table lists `{name}`, which is not in {rel}/"
                )
    return problems


# A repository path in the prose or a table: a known top folder, then path segments.
PATH = re.compile(
    r"(?<![\w./-])((?:src|runtime|core|macros|launcher|build-helper|tests|examples|bench|docs|tools)"
    r"/[A-Za-z0-9_./-]*[A-Za-z0-9_/])"
)


def check_architecture():
    problems = []
    doc = ROOT / "docs" / "ARCHITECTURE.md"
    for number, line in enumerate(doc.read_text().splitlines(), 1):
        for path in PATH.findall(line):
            # `tests/fully_shard.rs`-style names of a test target stay valid as folders.
            # A test target's or example's name (`tests/fully_shard.rs` for the folder
            # `tests/fully_shard/`, `examples/train_ddp` for `train_ddp.rs`) names it too.
            candidates = [ROOT / path, ROOT / (path + ".rs")]
            if path.endswith(".rs"):
                candidates.append(ROOT / path[: -len(".rs")])
            if "*" in path or "{" in path:
                continue
            if not any(c.exists() for c in candidates):
                problems.append(f"docs/ARCHITECTURE.md:{number}: `{path}` does not exist")
    return problems


def main():
    problems = check_folders() + check_architecture()
    for p in problems:
        print(p)
    if problems:
        print(f"{len(problems)} problem(s): the file tables and the tree differ", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
