//! Whether a build can find libtorch the way torch-sys looks for it (shared by the build
//! script's check and the library).

/// The variables torch-sys reads to find libtorch (and docs.rs's, where nothing links).
pub const VARIABLES: [&str; 3] = ["LIBTORCH", "LIBTORCH_USE_PYTORCH", "DOCS_RS"];

/// torch-sys's system-wide location, the one it finds without a variable.
const SYSTEM_LIBTORCH: &str = "/usr/lib/libtorch.so";

/// The message when no libtorch is configured.
pub const NOT_FOUND: &str = "\
tch-dist: libtorch was not found. Set one of:
  LIBTORCH=/path/to/torch          a libtorch folder, e.g. a Python environment's
                                   site-packages/torch (torch 2.11.0, as tch 0.24 expects)
  LIBTORCH_USE_PYTORCH=1           use the torch of the `python3` on PATH
In a checkout of tch-dist, `make setup` creates .venv with torch 2.11.0:
  LIBTORCH=<checkout>/.venv/torch     (a link to its torch, whatever the Python version)";

/// Ok when LIBTORCH or LIBTORCH_USE_PYTORCH is set, libtorch is installed system-wide, or
/// this is a docs.rs build (which compiles with tch's `doc-only` and links nothing).
pub fn libtorch_configured() -> Result<(), &'static str> {
    let set = |v: &str| std::env::var_os(v).is_some_and(|s| !s.is_empty());
    if VARIABLES.iter().any(|v| set(v)) || std::path::Path::new(SYSTEM_LIBTORCH).exists() {
        Ok(())
    } else {
        Err(NOT_FOUND)
    }
}
