//! What every example's command line shares: its flags ([`Flags`]) and its `main`
//! ([`main_with`]: run, shut the default group down, end a failure with one line).
//! Included by each example with `#[path = "common/cli.rs"] mod cli;`.

#![allow(dead_code)] // each example uses part of it

use std::fmt::Display;
use std::str::FromStr;

/// One intra-op thread per rank: the benchmarks, the demo and CI run several ranks on one
/// 2-core machine. A setting for that machine, not advice: on your machine give each rank
/// its share of the cores (or leave libtorch's default).
pub fn one_thread_per_rank() {
    tch::set_num_threads(1);
}

/// Runs `run`; then, whatever happened, shuts the default group's backends down (NCCL's
/// threads must not outlive CUDA's teardown); a failure ends the process with one line,
/// `error: ` and the error's composed message ([`tch_dist::report`]: its own context, then
/// each cause's) on stderr, and exit status 1.
pub fn main_with<E: Into<Box<dyn std::error::Error>>>(run: impl FnOnce() -> Result<(), E>) {
    let result = run();
    tch_dist::destroy_process_group();
    if let Err(e) = result {
        let e: Box<dyn std::error::Error> = e.into();
        eprintln!("error: {}", tch_dist::report(&*e));
        std::process::exit(1);
    }
}

/// The program's arguments, read flag by flag: `while let Some(flag) = flags.next_flag()`,
/// then [`Flags::value`] or [`Flags::parsed`] for the flag's value, and
/// [`unknown`] for a flag the example does not know (a misspelt flag must not silently run
/// with the default).
pub struct Flags {
    args: std::iter::Skip<std::env::Args>,
}

impl Flags {
    /// The arguments after the program's name.
    pub fn from_env() -> Flags {
        Flags {
            args: std::env::args().skip(1),
        }
    }

    /// The next flag, if any.
    pub fn next_flag(&mut self) -> Option<String> {
        self.args.next()
    }

    /// `flag`'s value: the next argument (`{flag} needs a value` if there is none).
    pub fn value(&mut self, flag: &str) -> Result<String, String> {
        self.args
            .next()
            .ok_or_else(|| format!("{flag} needs a value"))
    }

    /// `flag`'s value, parsed (`{flag}: {why}` if it does not parse).
    pub fn parsed<T: FromStr>(&mut self, flag: &str) -> Result<T, String>
    where
        T::Err: Display,
    {
        self.value(flag)?
            .parse()
            .map_err(|e| format!("{flag}: {e}"))
    }
}

/// The error for a flag the example does not know.
pub fn unknown(flag: &str) -> String {
    format!("unknown argument {flag}")
}

/// `--verify DIR`: checks every byte of the checkpoint folder `DIR` against its manifest
/// ([`tch_dist::checkpoint::verify`], one process, no process group) and says so; a damaged
/// or incomplete checkpoint is the error (and exit status 1 through [`main_with`]).
pub fn verify_checkpoint(
    dir: &std::path::Path,
) -> Result<(), tch_dist::checkpoint::CheckpointError> {
    tch_dist::checkpoint::verify(dir)?;
    println!(
        "verified {}: every file matches its manifest",
        dir.display()
    );
    Ok(())
}
