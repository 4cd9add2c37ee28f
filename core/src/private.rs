//! Items used by code that `#[derive(Shardable)]` and `#[contract]` generate. Not public API.

pub use crate::contract::ContractGuard;
pub use inventory;

use crate::walk::Shardable;

/// `module` as `&dyn Shardable` (with a clear error when `M` is not `Shardable`).
pub fn as_dyn<M: Shardable + ?Sized>(module: &M) -> &dyn Shardable {
    module.as_dyn_shardable()
}

/// The last `::`-separated segment of a module path: the default name of a `#[contract]`
/// API (`"tch_dist::replicate"` → `"replicate"`).
pub const fn last_segment(path: &'static str) -> &'static str {
    let bytes = path.as_bytes();
    let mut i = bytes.len();
    while i > 0 {
        if bytes[i - 1] == b':' {
            break;
        }
        i -= 1;
    }
    let (_, tail) = bytes.split_at(i);
    match core::str::from_utf8(tail) {
        Ok(s) => s,
        Err(_) => path,
    }
}

#[cfg(test)]
mod tests {
    use super::last_segment;

    #[test]
    fn last_segment_of_paths() {
        assert_eq!(last_segment("tch_dist::replicate"), "replicate");
        assert_eq!(last_segment("a::b::fully_shard"), "fully_shard");
        assert_eq!(last_segment("crate_root"), "crate_root");
        const C: &str = last_segment(module_path!());
        assert_eq!(C, "tests");
    }
}
