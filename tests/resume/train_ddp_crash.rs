//! `examples/train_ddp` built for tests/resume.rs with a crash the user-facing example does
//! not carry: `TCH_DIST_TEST_KILL_AT_STEP=S` makes rank 1 SIGKILL itself after step S (after
//! the step, before any checkpoint of it), on the first start only
//! (`TORCHELASTIC_RESTART_COUNT` 0 or unset). Without it, it is train_ddp.
//! Built as the example `train_ddp_crash` (Cargo.toml).

#[allow(dead_code)] // its `main`: this binary has its own
#[path = "../../examples/train_ddp.rs"]
mod train_ddp;

fn main() {
    let rank_1 = std::env::var("RANK").as_deref() == Ok("1");
    let first_start = train_ddp::restart_count() == Ok(0);
    let kill_at: Option<u64> = match std::env::var("TCH_DIST_TEST_KILL_AT_STEP") {
        Ok(v) if rank_1 && first_start => match v.parse() {
            Ok(step) => Some(step),
            Err(_) => {
                eprintln!("error: TCH_DIST_TEST_KILL_AT_STEP={v:?} is not a step");
                std::process::exit(1);
            }
        },
        _ => None,
    };
    train_ddp::train_main(|step| {
        if kill_at == Some(step) {
            // SAFETY: raise(3) with a valid signal; SIGKILL ends this process here.
            unsafe { libc::raise(libc::SIGKILL) };
        }
    });
}
