#!/usr/bin/env python3
"""Fails when a Rust block of the Markdown docs would not compile as a reader copies it.

README.md and docs/FROM_PYTORCH.md are compiled as doctests of the tch-dist crate
(src/lib.rs includes them), so rustdoc compiles each Rust block with its hidden `# ` lines.
GitHub and crates.io show those lines as they are, and the reader who copies a block gets
text that differs from what was compiled. So every Rust block is one of:

- a program: no hidden lines and its own `fn main`, so that the doctest compiles exactly
  what is displayed (a copy compiles in a crate that depends on tch and tch-dist);
- a fragment: its first displayed line is a comment starting `// Fragment`, which says
  where the names it uses come from and where the complete program is; its hidden lines
  (the set-up rustdoc needs) are then allowed.

README.md's blocks are its quickstarts: each is at most 20 lines (`QUICKSTART_LINES`), so
that a reader sees a whole program at a glance.

`make lint` runs it; `python3 docs/check_blocks.py FILE...` checks other files.
"""

import re
import sys

DEFAULT_FILES = ["README.md", "docs/FROM_PYTORCH.md"]

# rustdoc's own words in a code block's info string: a block whose words are all of these
# (or that has none) is Rust to rustdoc.
RUSTDOC_ATTRIBUTES = {
    "rust", "no_run", "ignore", "should_panic", "compile_fail", "test_harness",
    "standalone_crate", "edition2015", "edition2018", "edition2021", "edition2024",
}
FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*(.*)$")
FRAGMENT = "// Fragment"
# The pages whose Rust blocks are quickstarts, and their longest block.
QUICKSTART_PAGES = {"README.md"}
QUICKSTART_LINES = 20


def is_rust(info):
    words = [w for w in re.split(r"[\s,]+", info.strip()) if w]
    if not words:
        return True
    if "rust" in words:
        return True
    return all(w in RUSTDOC_ATTRIBUTES or w.startswith("ignore-") for w in words)


def is_hidden(line):
    """rustdoc hides `# x` and a lone `#`; `##` is an escaped `#`, `#[..]` and `#!` are code."""
    s = line.strip()
    return s == "#" or s.startswith("# ")


def blocks(text):
    """(line number of the opening fence, info string, body lines) of each fenced block."""
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, info, start = m.group(2), m.group(3), i + 1
        body = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i])
            i += 1
        yield start, info, body
        i += 1


def problems(path, text):
    for start, info, body in blocks(text):
        if not is_rust(info):
            continue
        shown = [l for l in body if not is_hidden(l)]
        hidden = len(body) - len(shown)
        first = next((l.strip() for l in shown if l.strip()), "")
        if first.startswith(FRAGMENT):
            continue
        has_main = any(re.match(r"\s*(pub\s+)?fn\s+main\s*\(", l) for l in shown)
        if hidden:
            yield (f"{path}:{start}: a Rust block with {hidden} hidden `# ` line(s) does not "
                   f"compile as displayed: show them, or start the block with a "
                   f"`{FRAGMENT}: ...` comment saying where the rest is")
        elif not has_main:
            yield (f"{path}:{start}: a Rust block without `fn main` is not a program as "
                   f"copied: add `fn main`, or start it with a `{FRAGMENT}: ...` comment")
        if path.split("/")[-1] in QUICKSTART_PAGES and len(body) > QUICKSTART_LINES:
            yield (f"{path}:{start}: a quickstart of {len(body)} lines: at most "
                   f"{QUICKSTART_LINES} (point to a whole program in examples/ for more)")


def self_test():
    """The rules on small cases: `python3 docs/check_blocks.py --self-test`."""
    def count(md):
        return len(list(problems("t.md", md)))
    program = "```rust,no_run\nfn main() {\n    #[derive(Debug)]\n    struct A;\n}\n```\n"
    assert count(program) == 0, "a program with `#[derive]` (not a hidden line)"
    assert count("```rust\n# fn main() {\nlet x = 1;\n# }\n```\n") == 1, "hidden lines"
    assert count("```\nlet x = 1;\n```\n") == 1, "a bare block is Rust to rustdoc, no main"
    assert count("```rust,no_run\n# use a::b;\n// Fragment: see x.rs\nb();\n```\n") == 0
    assert count("```python\n# a comment\nx = 1\n```\n") == 0, "not Rust"
    assert count("```sh\nmake\n```\n") == 0
    assert count("```rust\nfn main() {\n    ## not hidden\n}\n```\n") == 0, "`##` escapes"
    assert count("~~~rust\n# x\n~~~\n") == 1, "tilde fences"
    long_block = "```rust,no_run\nfn main() {\n" + "    f();\n" * 19 + "}\n```\n"
    assert len(list(problems("README.md", long_block))) == 1, "a quickstart of 21 lines"
    assert len(list(problems("docs/X.md", long_block))) == 0, "other pages: no limit"
    print("check_blocks: self-test passed")
    return 0


def main(argv):
    if argv[1:] == ["--self-test"]:
        return self_test()
    files = argv[1:] or DEFAULT_FILES
    found = []
    for path in files:
        with open(path, encoding="utf-8") as f:
            found.extend(problems(path, f.read()))
    for p in found:
        print(p, file=sys.stderr)
    if found:
        print(f"check_blocks: {len(found)} block(s) to fix", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
