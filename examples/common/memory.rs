//! What a process holds: its resident set (peak and current) and the bytes malloc has handed
//! out. Included with `#[path]` by the benchmark (bench_ddp/measure.rs) and train_fsdp.

/// Peak and current resident set size in MiB (VmHWM and VmRSS of /proc/self/status).
pub fn rss_mib() -> (f64, f64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|kb| kb.parse::<f64>().ok())
            .map_or(0.0, |kb| kb / 1024.0)
    };
    (field("VmHWM:"), field("VmRSS:"))
}

/// Bytes malloc has handed out and not had back (`mallinfo2`: small blocks in use plus
/// mmapped ones): tensors' memory on CPU, counted exactly; bench/pytorch_ddp.py reads the same.
pub fn malloc_in_use() -> f64 {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallinfo2(3) only reads the allocator's counters.
        let m = unsafe { libc::mallinfo2() };
        (m.uordblks + m.hblkhd) as f64
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        0.0
    }
}
