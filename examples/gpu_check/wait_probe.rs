//! Part 3, the wait probe: `Work::wait` on NCCL is stream-ordered (it does not wait for the GPU),
//! `wait_timeout` does wait.

use super::*;

/// This thread's CPU time.
pub(crate) fn thread_cpu() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime fills the timespec we own.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

pub(crate) fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

pub(crate) fn check_wait_probe(pg: &ProcessGroup) -> Outcome {
    if cpu() {
        return Outcome::Skip("needs NCCL");
    }
    let big = Tensor::ones([64 << 20], (Kind::Float, dev())); // 256 MiB
    let a = Tensor::randn([8192, 8192], (Kind::Float, dev())) * 0.01;
    // Warm-up: NCCL's buffers for this size, and the matmul's kernels.
    pg.all_reduce(&big, ReduceOp::Sum).unwrap();
    let _ = a.matmul(&a);
    tch::Cuda::synchronize(0);
    let busy = || {
        let mut m = a.shallow_clone();
        for _ in 0..8 {
            m = m.matmul(&a);
        }
        m
    };
    // Stream-ordered: wait() returns while the GPU still runs the matmuls and the all_reduce.
    let launched = Instant::now();
    let _m = busy();
    let work = pg.all_reduce_async(&big, ReduceOp::Sum).unwrap();
    let pending = !work.is_completed();
    let (t0, c0) = (Instant::now(), thread_cpu());
    work.wait().unwrap();
    let (wait_wall, wait_cpu) = (t0.elapsed(), thread_cpu() - c0);
    tch::Cuda::synchronize(0);
    let gpu = launched.elapsed();
    // CPU-bounded: wait_timeout blocks until the GPU is done.
    let _m = busy();
    let mut work = pg.all_reduce_async(&big, ReduceOp::Sum).unwrap();
    let (t1, c1) = (Instant::now(), thread_cpu());
    work.wait_timeout(Duration::from_secs(60)).unwrap();
    let (bounded_wall, bounded_cpu) = (t1.elapsed(), thread_cpu() - c1);
    tch::Cuda::synchronize(0);
    println!(
        "figure  wait_probe: 256 MiB NCCL all_reduce behind 8 matmuls 8192^2 (GPU busy {:.1} ms \
         from launch to done): wait() returned after {:.3} ms wall, {:.3} ms CPU; \
         wait_timeout() after {:.1} ms wall, {:.1} ms CPU",
        ms(gpu),
        ms(wait_wall),
        ms(wait_cpu),
        ms(bounded_wall),
        ms(bounded_cpu)
    );
    println!("figure  wait_probe_wait_ms={:.3}", ms(wait_wall));
    println!("figure  wait_probe_wait_cpu_ms={:.3}", ms(wait_cpu));
    println!("figure  wait_probe_gpu_ms={:.1}", ms(gpu));
    assert!(
        pending,
        "the all_reduce was already done at launch: the probe is too short"
    );
    assert!(
        wait_wall < gpu / 5 && wait_wall < Duration::from_millis(20),
        "wait() blocked the CPU for {:.1} ms of {:.1} ms",
        ms(wait_wall),
        ms(gpu)
    );
    assert!(
        bounded_wall > gpu / 4,
        "wait_timeout() returned after {:.1} ms, before the GPU could be done",
        ms(bounded_wall)
    );
    Outcome::Pass
}
