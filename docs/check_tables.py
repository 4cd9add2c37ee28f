#!/usr/bin/env python3
"""The file tables match the tree, and live in one place.

- Every source folder below a crate's root opens its module docs (mod.rs) with a table of its
  files (file -> job -> PyTorch's counterpart): the table names exactly the folder's files
  and subfolders, no more, no fewer. The shim's C++ files (runtime/csrc/) are listed the same
  way in runtime/src/ffi.rs's docs.
- Those tables are the only file tables: no Markdown page under docs/ (nor README.md) has a
  table whose rows are keyed by a source file or folder (see `file_key`), so that a list of
  files cannot go stale in a second place.
- docs/ARCHITECTURE.md is a map of at most MAP_LINES lines; its detail lives in docs/design/.
- Every path of the repository that docs/ARCHITECTURE.md and docs/design/*.md name
  (`runtime/src/c10d/group/mod.rs`, `src/checkpoint/`) exists, and every relative link of
  those pages (`design/launcher.md`, `../ARCHITECTURE.md#the-unsafe-code`, `#contents`)
  reaches a file and, where it names one, a heading: their prose does not outlive a move.

Run from anywhere: python3 docs/check_tables.py (make lint runs it);
python3 docs/check_tables.py --self-test checks the rules on small cases.
"""

import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
# The crates' source roots: their own lib.rs/main.rs describe them, and docs/ARCHITECTURE.md's
# "Crates and layers" table lists them; the folders below each must open with a table.
SOURCE_ROOTS = ["src", "runtime/src", "core/src", "macros/src", "launcher/src", "ft/src"]
# Inline unit tests beside the file they test (`#[cfg(test)] mod tests;`) are not listed.
UNLISTED = {"tests.rs", "tests"}
# A table row's first cell: the backquoted names in it (`a.rs`, `b/`, `c.rs` (`Thing`)).
ROW = re.compile(r"^//! \| (.*?) \|")
NAME = re.compile(r"`([A-Za-z0-9_]+(?:\.rs|/))`")
# The shim's files and the module docs that list them.
SHIM_FOLDER = "runtime/csrc"
SHIM_TABLE = "runtime/src/ffi.rs"
SHIM_NAME = re.compile(r"`([A-Za-z0-9_]+\.(?:cpp|h))`")
# The map's length, and the pages whose paths and links are checked.
MAP = "docs/ARCHITECTURE.md"
MAP_LINES = 600
DESIGN = "docs/design"


def listed(mod_rs, name=NAME):
    """The names the module docs' table lists, or None without a table."""
    names = set()
    found = False
    for line in mod_rs.read_text().splitlines():
        m = ROW.match(line)
        if not m:
            continue
        found = True
        names.update(name.findall(m.group(1)))
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


def check_shim():
    """runtime/src/ffi.rs's docs list exactly the shim's .cpp and .h files."""
    names = listed(ROOT / SHIM_TABLE, SHIM_NAME)
    if names is None:
        return [f"{SHIM_TABLE}: no table of {SHIM_FOLDER}/'s files"]
    here = {p.name for p in (ROOT / SHIM_FOLDER).iterdir() if p.suffix in (".cpp", ".h")}
    problems = [f"{SHIM_TABLE}: the table does not list `{n}`" for n in sorted(here - names)]
    problems += [
        f"{SHIM_TABLE}: the table lists `{n}`, which is not in {SHIM_FOLDER}/"
        for n in sorted(names - here)
    ]
    return problems


# A file table, where it is not a module's: a Markdown table row whose first cell names a
# source file or folder as its key. The key is
#   - a name ending in .rs, .cpp or .h, in backquotes or bare (`reader.rs`, `PipelineStage`
#     (stage.rs), `runtime/src/error/mod.rs`, `fence.cpp`);
#   - a folder in backquotes: a path ending in "/" (`group/`, `src/checkpoint/`);
#   - a repository path in backquotes (`src/checkpoint`, `tests/common/mlp.rs`).
# Rows keyed by anything else (an option, a variable, a type, a checkpoint's own files such
# as `manifest.json`, a link to a page, prose) are other tables and pass, and so does
# every line of a fenced code block.
TOP_FOLDERS = (
    "src", "runtime", "core", "macros", "launcher", "build-helper", "build", "tests",
    "examples", "bench", "docs", "tools",
)
SOURCE_FILE = re.compile(r"[A-Za-z0-9_./-]*[A-Za-z0-9_]\.(?:rs|cpp|h)")
FOLDER = re.compile(r"[A-Za-z0-9_.-]+(?:/[A-Za-z0-9_.-]+)*/")
REPO_PATH = re.compile(r"(?:%s)/[A-Za-z0-9_./-]+" % "|".join(re.escape(t) for t in TOP_FOLDERS))
CODE = re.compile(r"`([^`]*)`")
FENCE = re.compile(r"^\s*(```+|~~~+)")


def first_cell(line):
    """A table row's first cell, or None for a line that is no row (or a separator row)."""
    s = line.strip()
    if not s.startswith("|"):
        return None
    cell = s[1:].split("|", 1)[0].strip()
    if not cell or set(cell) <= set("-: "):
        return None
    return cell


def file_key(cell):
    """The source file or folder that keys a table row, or None."""
    quoted = [q.strip() for q in CODE.findall(cell)]
    bare = [w for w in re.split(r"[\s(),;:]+", CODE.sub(" ", cell)) if w]
    for name in quoted + bare:
        if SOURCE_FILE.fullmatch(name):
            return name
    for name in quoted:
        if FOLDER.fullmatch(name) or REPO_PATH.fullmatch(name):
            return name
    return None


def file_table_rows(text):
    """(line number, key) of every file-table row of a Markdown text."""
    fence = None
    for number, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if m:
            if fence is None:
                fence = m.group(1)[0] * 3
            elif line.strip().startswith(fence):
                fence = None
            continue
        if fence is not None:
            continue
        cell = first_cell(line)
        key = file_key(cell) if cell is not None else None
        if key is not None:
            yield number, key


def markdown_pages():
    return [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))


def check_file_tables():
    problems = []
    for page in markdown_pages():
        for number, key in file_table_rows(page.read_text()):
            problems.append(
                f"{page.relative_to(ROOT)}:{number}: a table row keyed by `{key}`: a folder's "
                f"files are listed only in its module docs (its mod.rs's table); name the "
                f"module instead"
            )
    return problems


def check_map_length():
    lines = len((ROOT / MAP).read_text().splitlines())
    if lines > MAP_LINES:
        return [
            f"{MAP}: {lines} lines, more than {MAP_LINES}: it is a map; move the detail to a "
            f"page of {DESIGN}/"
        ]
    return []


# A repository path in the prose or a table: a known top folder, then path segments.
PATH = re.compile(
    r"(?<![\w./-])((?:src|runtime|core|macros|launcher|build-helper|tests|examples|bench|docs|tools)"
    r"/[A-Za-z0-9_./-]*[A-Za-z0-9_/])"
)
# A Markdown link's target: `[text](target)`, `![alt](target)`.
LINK = re.compile(r"\]\(([^()\s]+)\)")


def slug(heading):
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = CODE.sub(lambda m: m.group(1), heading.strip().lstrip("#").strip()).lower()
    return "".join(c for c in text if c.isalnum() or c in " -_").replace(" ", "-")


def anchors(page):
    found = set()
    fence = False
    for line in page.read_text().splitlines():
        if FENCE.match(line):
            fence = not fence
        elif not fence and line.startswith("#"):
            found.add(slug(line))
    return found


def design_pages():
    return [ROOT / MAP] + sorted((ROOT / DESIGN).glob("*.md"))


def check_paths_and_links():
    problems = []
    for page in design_pages():
        name = page.relative_to(ROOT)
        for number, line in enumerate(page.read_text().splitlines(), 1):
            for path in PATH.findall(line):
                # A test target's or example's name (`tests/fully_shard.rs` for the folder
                # `tests/fully_shard/`, `examples/train_ddp` for `train_ddp.rs`) names it too.
                candidates = [ROOT / path, ROOT / (path + ".rs")]
                if path.endswith(".rs"):
                    candidates.append(ROOT / path[: -len(".rs")])
                if "*" in path or "{" in path:
                    continue
                if not any(c.exists() for c in candidates):
                    problems.append(f"{name}:{number}: `{path}` does not exist")
            for target in LINK.findall(line):
                if re.match(r"[a-z]+:", target):
                    continue  # https:, mailto:
                file, _, anchor = target.partition("#")
                linked = (page.parent / file).resolve() if file else page
                if not linked.exists():
                    problems.append(f"{name}:{number}: the link `{target}` reaches no file")
                elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                    problems.append(f"{name}:{number}: the link `{target}` reaches no heading")
    return problems


def self_test():
    """The file-table rule on small cases: `python3 docs/check_tables.py --self-test`."""
    def rows(md):
        return [key for _, key in file_table_rows(md)]
    head = "| file | what it does |\n|---|---|\n"
    assert rows(head + "| `mod.rs` | the API |\n") == ["mod.rs"], "a module's file"
    assert rows(head + "| `group/` | groups |\n") == ["group/"], "a folder"
    assert rows(head + "| `runtime/src/error/env.rs` | env |\n") == ["runtime/src/error/env.rs"]
    assert rows(head + "| `PipelineStage<M>` (stage.rs) | a stage |\n") == ["stage.rs"]
    assert rows(head + "| `fence.cpp` | fences |\n") == ["fence.cpp"], "the shim's files"
    assert rows(head + "| `src/checkpoint` | checkpoints |\n") == ["src/checkpoint"]
    assert rows("| key | default |\n| --- | --- |\n| `join_timeout` | 600 |\n") == [], "options"
    assert rows("| crate | path |\n|---|---|\n| `tch-dist` | `./` |\n") == [], "a crate"
    assert rows(head + "| `manifest.json` | rank 0, last |\n") == [], "a checkpoint's files"
    assert rows(head + "| `TCH_DIST_TRACE` | traces |\n") == [], "a variable"
    assert rows(head + "| [Errors](design/errors.md) | errors |\n") == [], "a link to a page"
    assert rows(head + "| a hooked module's forward | `core::hooks` |\n") == [], "prose"
    assert rows("```text\n| `mod.rs` | the API |\n```\n") == [], "a code block"
    assert rows("    | `mod.rs` | indented |\n") == ["mod.rs"], "an indented table"
    assert slug("### Start-up: the launcher and the rendezvous") == (
        "start-up-the-launcher-and-the-rendezvous"
    )
    assert slug("## PyTorch's wire layout, so that ranks can mix") == (
        "pytorchs-wire-layout-so-that-ranks-can-mix"
    )
    assert slug("### `fully_shard` and HSDP") == "fully_shard-and-hsdp"
    print("check_tables: self-test passed")
    return 0


def main(argv):
    if argv[1:] == ["--self-test"]:
        return self_test()
    problems = (
        check_folders()
        + check_shim()
        + check_file_tables()
        + check_map_length()
        + check_paths_and_links()
    )
    for p in problems:
        print(p)
    if problems:
        print(
            f"{len(problems)} problem(s): the file tables, the map or its pages and the tree "
            f"differ",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
