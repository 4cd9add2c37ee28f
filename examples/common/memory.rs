//! What a process holds: its resident set (peak and current) and the bytes malloc has handed
//! out. Included with `#[path]` by the benchmarks (bench_ddp/measure.rs, bench_checkpoint),
//! train_fsdp and train_lm.

/// Fields of /proc/self/status (`"VmHWM:"`, `"VmRSS:"`) in KiB, read from one snapshot of
/// the file; 0 for a field it lacks.
pub fn status_kib<const N: usize>(fields: [&str; N]) -> [u64; N] {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    fields.map(|field| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(field))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|kib| kib.parse().ok())
            .unwrap_or(0)
    })
}

/// Peak and current resident set size in MiB (VmHWM and VmRSS of /proc/self/status).
pub fn rss_mib() -> (f64, f64) {
    let [peak, current] = status_kib(["VmHWM:", "VmRSS:"]);
    (peak as f64 / 1024.0, current as f64 / 1024.0)
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
