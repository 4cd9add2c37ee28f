//! `examples/train_ddp` built for tests/resume.rs and tests/hosts/restarts.rs with a crash
//! the user-facing example does not carry (crash.rs: a rank SIGKILLs itself after a step the
//! test picks, on the first start only). Without `TCH_DIST_TEST_KILL_AT_STEP`, it is
//! train_ddp. Built as the example `train_ddp_crash` (Cargo.toml).

#[allow(dead_code)] // its `main`: this binary has its own
#[path = "../../examples/train_ddp.rs"]
mod train_ddp;

mod crash;

fn main() {
    let kill_at = crash::kill_step(train_ddp::restart_count(), train_ddp::rdzv_round());
    train_ddp::train_main(crash::after_step(kill_at));
}
