//! Rules of the runtime's source tree that the compiler does not see, checked by reading the
//! files (as `ffi::tests::unsafe_files_are_listed` checks docs/ARCHITECTURE.md's list of the
//! files with `unsafe` code): each test names the rule in its doc comment and fails naming
//! the places that break it.

use std::path::{Path, PathBuf};

/// The workspace root (the runtime crate's parent).
fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The code of `file` (relative to the workspace root), without comments and literals.
fn code_of(file: &str) -> String {
    let text = std::fs::read_to_string(workspace_root().join(file))
        .unwrap_or_else(|e| panic!("{file}: {e}"));
    code_only(&text)
}

/// `s` without comments, string and character literals, so that only code is left.
pub(crate) fn code_only(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = String::with_capacity(s.len());
    let mut i = 0;
    while i < b.len() {
        let rest = &s[i..];
        if rest.starts_with("//") {
            i += rest.find('\n').unwrap_or(rest.len());
        } else if rest.starts_with("/*") {
            i += rest.find("*/").map_or(rest.len(), |e| e + 2);
        } else if rest.starts_with("r#\"") || rest.starts_with("r\"") {
            let hashes = rest[1..].bytes().take_while(|&c| c == b'#').count();
            let close = format!("\"{}", "#".repeat(hashes));
            let body = 2 + hashes;
            i += rest[body..]
                .find(&close)
                .map_or(rest.len(), |e| body + e + close.len());
        } else if b[i] == b'"' {
            let mut j = i + 1;
            while j < b.len() && b[j] != b'"' {
                j += if b[j] == b'\\' { 2 } else { 1 };
            }
            i = j + 1;
        } else if b[i] == b'\'' && (b.get(i + 1) == Some(&b'\\') || b.get(i + 2) == Some(&b'\'')) {
            // A character literal ('x', '\n', '\''); a lifetime ('a) is code.
            let start = if b[i + 1] == b'\\' { 3 } else { 2 };
            let close = b[(i + start).min(b.len())..]
                .iter()
                .position(|&c| c == b'\'');
            i += start + close.map_or(b.len(), |e| e + 1);
        } else {
            let c = rest.chars().next().expect("not at the end");
            out.push(c);
            i += c.len_utf8();
        }
    }
    out
}

/// The `.rs` files under `dir` (relative to the workspace root), recursively.
pub(crate) fn rust_files(root: &Path, dir: &str, out: &mut Vec<String>) {
    let mut entries: Vec<_> = std::fs::read_dir(root.join(dir))
        .unwrap_or_else(|e| panic!("{dir}: {e}"))
        .map(|e| e.expect("a directory entry").path())
        .collect();
    entries.sort();
    for path in entries {
        let rel = path.strip_prefix(root).expect("under the root");
        let rel = rel.to_str().expect("a UTF-8 path").to_string();
        if path.is_dir() {
            rust_files(root, &rel, out);
        } else if rel.ends_with(".rs") {
            out.push(rel);
        }
    }
}

/// The first path segments a `crate::` path at the start of `rest` names: one for
/// `crate::a::b`, one per item for `crate::{a::b, c}` (nested groups included).
fn crate_roots(rest: &str) -> Vec<String> {
    let ident = |s: &str| -> String {
        s.trim_start()
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect()
    };
    let Some(group) = rest.trim_start().strip_prefix('{') else {
        return vec![ident(rest)];
    };
    // The group's top-level items, up to its closing brace.
    let (mut depth, mut items, mut item) = (0usize, Vec::new(), String::new());
    for c in group.chars() {
        match c {
            '{' => depth += 1,
            '}' if depth == 0 => break,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                items.push(std::mem::take(&mut item));
                continue;
            }
            _ => {}
        }
        item.push(c);
    }
    items.push(item);
    items
        .iter()
        .map(|i| ident(i))
        .filter(|i| !i.is_empty())
        .collect()
}

/// `error/` imports no engine: in the code of every file under runtime/src/error/ (tests
/// included; comments, and so doc links, left out), a `crate::` path names only
/// `crate::error` or `crate::ffi`, and no `super::` climbs out of `error/`. The errors are
/// the vocabulary every engine speaks; what they carry (a step position, a reducer's
/// refusal) is defined in `error/` and the engines import it, never the other way round.
/// External crates (std, tch, tch-dist-core, thiserror) are below the runtime and free.
#[test]
fn error_imports_no_engine() {
    let root = workspace_root();
    let mut files = Vec::new();
    rust_files(&root, "runtime/src/error", &mut files);
    assert!(
        files.len() >= 10,
        "read only {} files of error/",
        files.len()
    );
    let mut broken = Vec::new();
    for file in &files {
        let code = code_of(file);
        for (at, _) in code.match_indices("crate::") {
            let before = code[..at].chars().next_back();
            if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
                continue; // another crate's name ending in `crate`
            }
            for segment in crate_roots(&code[at + "crate::".len()..]) {
                if segment != "error" && segment != "ffi" {
                    broken.push(format!("{file}: crate::{segment}"));
                }
            }
        }
        // Modules below error/: mod.rs is error itself, x.rs and sub/mod.rs one below it.
        let rel = file.trim_start_matches("runtime/src/error/");
        let depth = rel.matches('/').count() + usize::from(!rel.ends_with("mod.rs"));
        let climb = "super::".repeat(depth + 1);
        if code.contains(&climb) {
            broken.push(format!("{file}: {}", climb.trim_end_matches("::")));
        }
    }
    assert!(
        broken.is_empty(),
        "error/ names modules outside error/ and ffi: {broken:#?}"
    );
}

/// The return type of each `pub fn` (with `const`, `async`, `unsafe`, `extern` between) in
/// `code`, with the function's name: the text after the signature's `->` at parenthesis
/// depth 0 (an argument's `impl Fn(&str) -> String` is not it), up to its body or `where`.
fn pub_fn_returns(code: &str) -> Vec<(String, String)> {
    // Every identifier or keyword with its byte offset.
    let mut words: Vec<(usize, &str)> = Vec::new();
    let mut start = None;
    for (j, c) in code.char_indices().chain([(code.len(), ' ')]) {
        match (start, c.is_alphanumeric() || c == '_') {
            (None, true) => start = Some(j),
            (Some(s), false) => {
                words.push((s, &code[s..j]));
                start = None;
            }
            _ => {}
        }
    }
    let mut out = Vec::new();
    for (i, &(at, word)) in words.iter().enumerate() {
        // `pub` followed directly by its qualifiers and `fn`: `pub(crate) fn` does not match,
        // since `(` stands between `pub` and `crate`.
        if word != "pub" || code[at + 3..].trim_start().starts_with('(') {
            continue;
        }
        let mut rest = words[i + 1..].iter();
        let Some(&(_, name)) = rest
            .by_ref()
            .find(|(_, w)| !matches!(*w, "const" | "async" | "unsafe" | "extern"))
            .filter(|(_, w)| *w == "fn")
            .and_then(|_| rest.next())
        else {
            continue;
        };
        let sig_start = at;
        let sig_end = code[sig_start..]
            .find(['{', ';'])
            .map_or(code.len(), |e| sig_start + e);
        let sig = &code[sig_start..sig_end];
        let mut depth = 0i32;
        let mut arrow = None;
        for (j, c) in sig.char_indices() {
            match c {
                '(' => depth += 1,
                ')' => depth -= 1,
                '-' if depth == 0 && sig[j..].starts_with("->") => {
                    arrow = Some(j + 2);
                    break;
                }
                _ => {}
            }
        }
        let Some(arrow) = arrow else { continue };
        let ret = &sig[arrow..];
        let ret = ret.split(" where ").next().unwrap_or(ret);
        out.push((name.to_string(), ret.split_whitespace().collect()));
    }
    out
}

/// Whether type `ty` (whitespace removed) has a `Result<_, String>` in it: a `Result`
/// (any path to it) whose error argument is `String`.
fn has_string_error(ty: &str) -> bool {
    ty.match_indices("Result<").any(|(at, _)| {
        let args = &ty[at + "Result<".len()..];
        let (mut depth, mut last_comma, mut end) = (0i32, None, args.len());
        for (j, c) in args.char_indices() {
            match c {
                '<' | '(' | '[' => depth += 1,
                '>' if depth == 0 => {
                    end = j;
                    break;
                }
                '>' | ')' | ']' => depth -= 1,
                ',' if depth == 0 => last_comma = Some(j),
                _ => {}
            }
        }
        last_comma.is_some_and(|c| {
            matches!(
                &args[c + 1..end],
                "String" | "std::string::String" | "string::String"
            )
        })
    })
}

/// No runtime `pub fn` returns `Result<_, String>`: an error crossing the runtime's API is a
/// typed value (an enum of `error/`), whose text the caller can wrap and whose cases it can
/// tell apart; a text stays text only inside the crate (`pub(crate)`), and where libtorch
/// carries it (a callback's reply, a recomputation's failure). Every `pub fn` under
/// runtime/src counts, also inside private modules and impls: the crate re-exports them.
#[test]
fn no_pub_fn_returns_a_string_error() {
    let root = workspace_root();
    let mut files = Vec::new();
    rust_files(&root, "runtime/src", &mut files);
    let mut found = 0;
    let mut broken = Vec::new();
    for file in &files {
        for (name, ret) in pub_fn_returns(&code_of(file)) {
            found += 1;
            if has_string_error(&ret) {
                broken.push(format!("{file}: fn {name} -> {ret}"));
            }
        }
    }
    assert!(found >= 100, "read only {found} pub fns' return types");
    assert!(
        broken.is_empty(),
        "pub fns returning Result<_, String> (give them a typed error): {broken:#?}"
    );
}

#[test]
fn the_string_error_rule_reads_signatures() {
    let code = "pub fn a(f: impl Fn(&str) -> Result<(), String>) -> Result<u8, MyError> {}
                pub(crate) fn b() -> Result<(), String> {}
                pub unsafe fn c() -> std::result::Result<Vec<Option<u8>>, String>;
                pub fn d<T>(t: T) -> Option<Result<T, String>> where T: Clone {}
                pub fn e() -> Result<HashMap<String, u8>> {}";
    let returns = pub_fn_returns(code);
    let names: Vec<&str> = returns.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["a", "c", "d", "e"]);
    let flagged: Vec<bool> = returns.iter().map(|(_, r)| has_string_error(r)).collect();
    assert_eq!(flagged, [false, true, true, false]);
}

/// Every libtorch callback goes through `autograd/callback.rs`: no other file of runtime/src
/// defines an `extern "C" fn` that takes the shim's opaque context (`c_void`), so that the
/// unwinding, the reply's conventions and the context's cast are written once. (ffi.rs
/// declares the callback types; an `atexit` handler takes no context.)
#[test]
fn callbacks_go_through_callback_rs() {
    let root = workspace_root();
    let mut files = Vec::new();
    rust_files(&root, "runtime/src", &mut files);
    let mut broken = Vec::new();
    for file in &files {
        if file.ends_with("autograd/callback.rs") || file.ends_with("/ffi.rs") {
            continue;
        }
        // Without its literal `"C"`, `extern "C" fn` reads `extern fn` once the spaces are
        // joined.
        let code = code_of(file)
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ");
        for (at, _) in code.match_indices("extern fn") {
            let params = code[at..].split(')').next().unwrap_or("");
            if params.contains("c_void") {
                broken.push(format!("{file}: {params})"));
            }
        }
    }
    assert!(
        broken.is_empty(),
        "callbacks outside autograd/callback.rs: {broken:#?}"
    );
}
