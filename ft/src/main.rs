//! `tch-dist-lighthouse`: a lighthouse for fault-tolerant replica groups, with the options of
//! torchft's `torchft_lighthouse` (same names, same defaults), so either serves either's
//! groups.
//!
//! ```text
//! tch-dist-lighthouse --min_replicas 2 [--bind [::]:29510] [--join_timeout_ms 60000]
//!                     [--quorum_tick_ms 100] [--heartbeat_timeout_ms 5000]
//! ```
//!
//! It prints `lighthouse listening on http://host:port` once it listens, and serves until
//! killed.

use std::process::ExitCode;
use std::time::Duration;

use tch_dist_ft::{LighthouseOptions, LighthouseServer};

const USAGE: &str = "usage: tch-dist-lighthouse --min_replicas N [--bind HOST:PORT] \
[--join_timeout_ms MS] [--quorum_tick_ms MS] [--heartbeat_timeout_ms MS]";

/// The options from the command line (`--name value` or `--name=value`).
fn parse(args: impl Iterator<Item = String>) -> Result<LighthouseOptions, String> {
    let mut opts = LighthouseOptions::new(0);
    let mut min_replicas = None;
    let mut args = args.peekable();
    while let Some(arg) = args.next() {
        let (name, inline) = match arg.split_once('=') {
            Some((n, v)) => (n.to_string(), Some(v.to_string())),
            None => (arg.clone(), None),
        };
        if name == "--help" || name == "-h" {
            return Err(USAGE.to_string());
        }
        let value = match inline.or_else(|| args.next()) {
            Some(v) => v,
            None => return Err(format!("{name} needs a value\n{USAGE}")),
        };
        let millis = |v: &str| {
            v.parse::<u64>()
                .map(Duration::from_millis)
                .map_err(|_| format!("{name} takes milliseconds, not {v:?}"))
        };
        match name.as_str() {
            "--min_replicas" => {
                min_replicas = Some(
                    value
                        .parse::<u64>()
                        .map_err(|_| format!("--min_replicas takes a count, not {value:?}"))?,
                )
            }
            "--bind" => opts.bind = value,
            "--join_timeout_ms" => opts.join_timeout = millis(&value)?,
            "--quorum_tick_ms" => opts.quorum_tick = millis(&value)?,
            "--heartbeat_timeout_ms" => opts.heartbeat_timeout = millis(&value)?,
            other => return Err(format!("unknown option {other}\n{USAGE}")),
        }
    }
    opts.min_replicas =
        min_replicas.ok_or_else(|| format!("--min_replicas is required\n{USAGE}"))?;
    if opts.quorum_tick.is_zero() {
        return Err("--quorum_tick_ms must be at least 1".to_string());
    }
    Ok(opts)
}

fn main() -> ExitCode {
    let opts = match parse(std::env::args().skip(1)) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("tch-dist-lighthouse: {e}");
            return ExitCode::from(2);
        }
    };
    match LighthouseServer::start(opts) {
        Ok(lighthouse) => {
            println!("lighthouse listening on {}", lighthouse.address());
            loop {
                std::thread::park();
            }
        }
        Err(e) => {
            eprintln!("tch-dist-lighthouse: {e}");
            let mut cause = std::error::Error::source(&e);
            while let Some(c) = cause {
                eprintln!("  caused by: {c}");
                cause = c.source();
            }
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &str) -> impl Iterator<Item = String> {
        s.split_whitespace()
            .map(str::to_string)
            .collect::<Vec<_>>()
            .into_iter()
    }

    #[test]
    fn options_parse_as_torchft_names_them() {
        let o = parse(args(
            "--min_replicas 2 --bind=127.0.0.1:0 --join_timeout_ms 5",
        ))
        .unwrap();
        assert_eq!(o.min_replicas, 2);
        assert_eq!(o.bind, "127.0.0.1:0");
        assert_eq!(o.join_timeout, Duration::from_millis(5));
        assert_eq!(o.quorum_tick, Duration::from_millis(100));
        assert!(parse(args("--bind x"))
            .unwrap_err()
            .starts_with("--min_replicas is required"));
        assert_eq!(
            parse(args("--min_replicas two")).unwrap_err(),
            "--min_replicas takes a count, not \"two\""
        );
        assert!(parse(args("--min_replicas"))
            .unwrap_err()
            .starts_with("--min_replicas needs a value"));
        assert!(parse(args("--min-replicas 2"))
            .unwrap_err()
            .starts_with("unknown option --min-replicas"));
        assert_eq!(
            parse(args("--min_replicas 1 --quorum_tick_ms 0")).unwrap_err(),
            "--quorum_tick_ms must be at least 1"
        );
    }
}
