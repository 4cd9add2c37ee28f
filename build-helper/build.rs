//! Fails the build at once, with one message saying how to point it at libtorch, when none is
//! configured: otherwise torch-sys's build script fails later with its own (which does not
//! name this project's `make setup`) after minutes of compiling. Each crate of tch-dist
//! depends on this one, so this check runs before any of them is built.

#[path = "src/find.rs"]
mod find;

fn main() {
    for var in find::VARIABLES {
        println!("cargo:rerun-if-env-changed={var}");
    }
    if let Err(message) = find::libtorch_configured() {
        // One message, no panic and so no backtrace; cargo shows it under `--- stderr`.
        eprintln!("{message}");
        std::process::exit(1);
    }
}
