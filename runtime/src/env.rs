//! Reading the launch environment: torchrun's variables, then Slurm's.

use std::time::Duration;

use crate::error::{EnvError, Result};

/// PyTorch's default timeout for process groups and their collectives (30 minutes).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30 * 60);

/// torchrun's default MASTER_PORT.
pub const DEFAULT_MASTER_PORT: u16 = 29500;

/// Where this process sits in the job, as torchrun or Slurm describes it.
///
/// ```
/// use tch_dist_runtime::LaunchEnv;
/// let vars = [("RANK", "1"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29501")];
/// let env = LaunchEnv::from_vars(|k| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())).unwrap();
/// assert_eq!((env.rank, env.world_size, env.local_rank, env.master_port), (1, 2, 1, 29501));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchEnv {
    /// Global rank (RANK or SLURM_PROCID).
    pub rank: usize,
    /// Number of processes (WORLD_SIZE or SLURM_NTASKS).
    pub world_size: usize,
    /// Rank on this node (LOCAL_RANK or SLURM_LOCALID); defaults to `rank`.
    pub local_rank: usize,
    /// Rendezvous host (MASTER_ADDR); 127.0.0.1 for single-node Slurm jobs without it.
    pub master_addr: String,
    /// Rendezvous port (MASTER_PORT, default 29500).
    pub master_port: u16,
}

impl LaunchEnv {
    /// Reads the process environment.
    pub fn from_process_env() -> Result<Self> {
        Self::from_vars(|k| std::env::var(k).ok())
    }

    /// Reads the variables through `get`; torchrun's names win over Slurm's.
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let pick =
            |torchrun: &'static str, slurm: &'static str| -> Option<(&'static str, String)> {
                get(torchrun)
                    .map(|v| (torchrun, v))
                    .or_else(|| get(slurm).map(|v| (slurm, v)))
            };
        let (rank_var, rank) = pick("RANK", "SLURM_PROCID").ok_or(EnvError::NoRank)?;
        let rank = parse_usize(rank_var, &rank)?;
        let (world_var, world) = pick("WORLD_SIZE", "SLURM_NTASKS").ok_or(EnvError::NoWorldSize)?;
        let world_size = parse_usize(world_var, &world)?;
        if world_size == 0 {
            return Err(EnvError::ZeroWorldSize { var: world_var }.into());
        }
        if rank >= world_size {
            return Err(EnvError::RankOutOfRange {
                rank_var,
                rank,
                world_var,
                world_size,
            }
            .into());
        }
        let local_rank = match pick("LOCAL_RANK", "SLURM_LOCALID") {
            Some((var, v)) => parse_usize(var, &v)?,
            None => rank,
        };
        let master_addr = match get("MASTER_ADDR") {
            Some(a) if !a.trim().is_empty() => a.trim().to_string(),
            Some(_) => return Err(EnvError::EmptyMasterAddr.into()),
            None => {
                let single_node = get("SLURM_NNODES").is_none_or(|n| n.trim() == "1");
                if rank_var == "SLURM_PROCID" && single_node {
                    "127.0.0.1".to_string()
                } else {
                    return Err(EnvError::NoMasterAddr.into());
                }
            }
        };
        let master_port = match get("MASTER_PORT") {
            Some(p) => p
                .trim()
                .parse::<u16>()
                .ok()
                .filter(|p| *p != 0)
                .ok_or_else(|| EnvError::BadPort { value: p.clone() })?,
            None => DEFAULT_MASTER_PORT,
        };
        Ok(Self {
            rank,
            world_size,
            local_rank,
            master_addr,
            master_port,
        })
    }
}

fn parse_usize(var: &'static str, value: &str) -> Result<usize> {
    value.trim().parse::<usize>().map_err(|_| {
        EnvError::NotAnInteger {
            var,
            value: value.to_string(),
        }
        .into()
    })
}

/// True when `addr` names this machine's loopback interface.
pub(crate) fn is_loopback(addr: &str) -> bool {
    addr == "localhost"
        || addr
            .parse::<std::net::IpAddr>()
            .map(|ip| ip.is_loopback())
            .unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::DistError;

    fn env(vars: &[(&str, &str)]) -> Result<LaunchEnv> {
        LaunchEnv::from_vars(|k| {
            vars.iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        })
    }

    #[test]
    fn torchrun_variables() {
        let e = env(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "1"),
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "1234"),
        ])
        .unwrap();
        assert_eq!(
            e,
            LaunchEnv {
                rank: 3,
                world_size: 4,
                local_rank: 1,
                master_addr: "10.0.0.1".into(),
                master_port: 1234
            }
        );
    }

    #[test]
    fn slurm_variables_and_defaults() {
        let e = env(&[
            ("SLURM_PROCID", "1"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_LOCALID", "1"),
        ])
        .unwrap();
        assert_eq!((e.rank, e.world_size, e.local_rank), (1, 2, 1));
        assert_eq!(
            (e.master_addr.as_str(), e.master_port),
            ("127.0.0.1", 29500)
        );
        // Multi-node Slurm needs MASTER_ADDR.
        let err = env(&[
            ("SLURM_PROCID", "1"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_NNODES", "2"),
        ]);
        assert!(matches!(err, Err(DistError::Env(EnvError::NoMasterAddr))));
        // torchrun's names win.
        let e = env(&[
            ("RANK", "0"),
            ("SLURM_PROCID", "1"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "h"),
        ])
        .unwrap();
        assert_eq!(e.rank, 0);
    }

    #[test]
    fn bad_values_are_named() {
        let err = env(&[("RANK", "2"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h")]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "invalid launch environment: RANK=2 is out of range for WORLD_SIZE=2 (ranks are 0..2)"
        );
        let err = env(&[("RANK", "x"), ("WORLD_SIZE", "2")]).unwrap_err();
        assert!(
            err.to_string()
                .contains("RANK=\"x\" is not a non-negative integer"),
            "{err}"
        );
        let err = env(&[("RANK", "0"), ("WORLD_SIZE", "two")]).unwrap_err();
        assert!(err.to_string().contains("WORLD_SIZE=\"two\""), "{err}");
        let err = env(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "1"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "99999"),
        ])
        .unwrap_err();
        assert!(err.to_string().contains("MASTER_PORT=\"99999\""), "{err}");
        let err = env(&[("WORLD_SIZE", "1")]).unwrap_err();
        assert!(err.to_string().contains("RANK"), "{err}");
        assert!(is_loopback("127.0.0.1") && is_loopback("localhost") && !is_loopback("10.1.1.1"));
    }
}
