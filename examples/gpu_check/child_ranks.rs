//! 4, 5. Child ranks (this binary again, started by `tch_dist::testing::Launch`): two ranks on
//! one GPU through Gloo, and the duplicate-GPU error.

use super::*;

/// Starts this binary as `n` ranks with `mode` and torchrun's variables plus `env`
/// (`tch_dist::testing::Launch`), waits for them (killing them at CHILD_LIMIT) and returns
/// each rank's (success, output).
pub(crate) fn spawn_ranks(mode: &str, n: usize, env: &[(&str, &str)]) -> Vec<(bool, String)> {
    let exe = std::env::current_exe().expect("this binary's path");
    let mut argv = vec![exe.to_string_lossy().into_owned(), mode.to_string()];
    if cpu() {
        argv.push("--cpu".into());
    }
    let mut launch = Launch::new(mode, n)
        .timeout(CHILD_LIMIT)
        .env("TCH_DIST_TIMEOUT_SECS", "60");
    for &(key, value) in env {
        launch = launch.env(key, value);
    }
    for rank in 0..n {
        launch = launch.rank_program(rank, argv.clone());
    }
    launch
        .run()
        .into_iter()
        .map(|o| (o.success(), format!("{}{}", o.stdout, o.stderr)))
        .collect()
}

pub(crate) fn check_children(what: &str, ranks: &[(bool, String)]) {
    for (rank, (ok, out)) in ranks.iter().enumerate() {
        assert!(*ok, "{what}: rank {rank} failed:\n{out}");
    }
}

/// Runs this binary as two ranks with `mode` on `cuda:0` through Gloo, checks that both
/// succeeded (`what` names the pair in the failure), and prints each rank's first line that
/// starts with `report`.
pub(crate) fn check_pair_on_one_device(mode: &str, what: &str, report: &str) -> Outcome {
    // Both ranks on cuda:0 whatever the machine has: LOCAL_RANK=0 for both.
    let ranks = spawn_ranks(mode, 2, &[(CUDA_VIA_GLOO_ENV, "1"), ("LOCAL_RANK", "0")]);
    check_children(what, &ranks);
    for (_, out) in &ranks {
        if let Some(line) = out.lines().find(|l| l.starts_with(report)) {
            println!("        {line}");
        }
    }
    Outcome::Pass
}

pub(crate) fn check_gloo_pair() -> Outcome {
    check_pair_on_one_device("--pair-rank", "2 ranks through Gloo", "pair rank 0")
}

/// One rank of the pair: two ranks, one device, CUDA through Gloo; replicated training on
/// halves of each batch equals single-process training on the whole batch.
pub(crate) fn pair_rank() -> Result<(), String> {
    let pg = init_process_group(backend()).map_err(|e| e.to_string())?;
    if !cpu() {
        assert!(pg.cuda_via_gloo(), "TCH_DIST_CUDA_VIA_GLOO=1 was not seen");
        assert_eq!(
            pg.bound_device(),
            Some(Device::Cuda(0)),
            "both ranks on cuda:0"
        );
    }
    assert_eq!(pg.world_size(), 2);
    let cases = option_cases();
    let count = cases.len();
    let worst = each_case_against_plain(&pg, dev(), cases, 4, 1e-5)?;
    let d = replicate_net::no_sync_vs_one_step(&pg, dev(), 3);
    if d >= 1e-5 {
        return Err(format!("no_sync: {d}"));
    }
    println!(
        "pair rank {}: {count} replicate cases and no_sync on {:?} with {} collectives, max |replicate - plain| = {worst:.2e}",
        pg.rank(),
        dev(),
        pg.launched_collectives()
    );
    Ok(())
}

pub(crate) fn check_duplicate_gpu() -> Outcome {
    let ranks = spawn_ranks("--duplicate-rank", 2, &[]);
    check_children("two ranks on one GPU", &ranks);
    if let Some(line) = ranks[0]
        .1
        .lines()
        .find(|l| l.starts_with("duplicate rank 0"))
    {
        println!("        {line}");
    }
    Outcome::Pass
}

/// One rank of the duplicate case: both ranks bind cuda:0 for NCCL; creating the group must
/// fail on both with `DuplicateDevice` naming ranks 0 and 1. On CPU, the same check with
/// made-up claims over Gloo.
pub(crate) fn duplicate_rank() -> Result<(), String> {
    let rank: usize = std::env::var("RANK")
        .ok()
        .and_then(|r| r.parse().ok())
        .ok_or("RANK is not set")?;
    let result = if cpu() {
        let pg = init_process_group(Backend::Gloo).map_err(|e| e.to_string())?;
        let claim = DeviceClaim {
            host: "made-up-host".into(),
            device: 0,
            uuid: None,
        };
        pg.verify_distinct_devices(&claim)
    } else {
        let opts = InitOptions::from_env(Backend::Nccl)
            .map_err(|e| e.to_string())?
            .with_device_id(0);
        init_process_group_with(&opts).map(|_| ())
    };
    match result {
        Err(
            e @ DistError::DuplicateDevice {
                first: 0,
                second: 1,
                first_device: 0,
                second_device: 0,
                ..
            },
        ) => {
            println!("duplicate rank {rank}: {e}");
            Ok(())
        }
        Err(e) => Err(format!(
            "expected DuplicateDevice for ranks 0 and 1, got: {e}"
        )),
        Ok(()) => Err("two ranks on one GPU were accepted".into()),
    }
}

/// Runs a child mode and exits: 0 on success, 1 with the message otherwise.
pub(crate) fn child(run: fn() -> Result<(), String>) -> ! {
    let result = catch_unwind(run)
        .unwrap_or_else(|e| Err(panic_text(&*e)))
        .map_err(|e| eprintln!("{e}"));
    destroy_process_group();
    std::process::exit(if result.is_ok() { 0 } else { 1 });
}
