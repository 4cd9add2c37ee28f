//! Compile errors of `#[derive(Shardable)]` and `#[contract]`, one folder per class, pinned
//! by `.stderr` snapshots (regenerate with `TRYBUILD=overwrite cargo test --test ui`).

#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    for class in [
        "unknown_attribute",
        "duplicate_attribute",
        "conflicting_attribute",
        "union",
        "not_shardable",
        "rename_dot",
        "duplicate_name",
        "contract_signature",
        "typed_path",
    ] {
        t.compile_fail(format!("tests/ui/{class}/*.rs"));
    }
}
