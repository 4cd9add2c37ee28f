//! `examples/train_fsdp` built for tests/hosts/restarts.rs with a crash the user-facing
//! example does not carry (crash.rs: a rank SIGKILLs itself after a step the test picks, on
//! the first start only). Without `TCH_DIST_TEST_KILL_AT_STEP`, it is train_fsdp. Built as
//! the example `train_fsdp_crash` (Cargo.toml).

#[allow(dead_code)] // its `main`: this binary has its own
#[path = "../../examples/train_fsdp.rs"]
mod train_fsdp;

mod crash;

fn main() {
    let kill_at = crash::kill_step(train_fsdp::restart_count(), train_fsdp::rdzv_round());
    train_fsdp::train_main(crash::after_step(kill_at));
}
