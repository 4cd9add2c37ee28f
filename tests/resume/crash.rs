//! The crash of the test builds of `train_ddp` and `train_fsdp` (train_ddp_crash.rs,
//! train_fsdp_crash.rs): `TCH_DIST_TEST_KILL_AT_STEP=S` makes rank 1 (`TCH_DIST_TEST_KILL_RANK`
//! names another) SIGKILL itself after step S (after the step, before any checkpoint of it),
//! on the first start only (`TORCHELASTIC_RESTART_COUNT` and `TCH_DIST_RDZV_ROUND` 0 or unset:
//! across hosts a node restarted for another's failure counts no restart, but the round
//! moves on).

/// The step after which this rank kills itself, if it does; an error for a step that is not
/// a number.
pub fn kill_step(restart_count: Result<u64, String>, round: Result<u64, String>) -> Option<u64> {
    let victim = std::env::var("TCH_DIST_TEST_KILL_RANK").unwrap_or_else(|_| "1".into());
    let chosen = std::env::var("RANK").is_ok_and(|r| r == victim);
    let first_start = restart_count == Ok(0) && round == Ok(0);
    match std::env::var("TCH_DIST_TEST_KILL_AT_STEP") {
        Ok(v) if chosen && first_start => match v.parse() {
            Ok(step) => Some(step),
            Err(_) => {
                eprintln!("error: TCH_DIST_TEST_KILL_AT_STEP={v:?} is not a step");
                std::process::exit(1);
            }
        },
        _ => None,
    }
}

/// The hook to call after each step: SIGKILL after `kill_at`.
pub fn after_step(kill_at: Option<u64>) -> impl FnMut(u64) {
    move |step| {
        if kill_at == Some(step) {
            // SAFETY: raise(3) with a valid signal; SIGKILL ends this process here.
            unsafe { libc::raise(libc::SIGKILL) };
        }
    }
}
