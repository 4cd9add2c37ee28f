//! Reading the launch environment: torchrun's variables, then Slurm's.

use std::time::Duration;

use crate::error::{EnvError, Result};

/// PyTorch's default timeout for process groups and their collectives (30 minutes), for
/// every backend string but `"nccl"` ([`DEFAULT_NCCL_TIMEOUT`]).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30 * 60);

/// PyTorch's default timeout for a group created with the backend string `"nccl"`
/// (`Backend::NcclOnly`): 10 minutes (`torch.distributed.constants.default_pg_nccl_timeout`).
/// Like PyTorch, `"cpu:gloo,cuda:nccl"` (`Backend::Nccl`) keeps [`DEFAULT_TIMEOUT`].
pub const DEFAULT_NCCL_TIMEOUT: Duration = Duration::from_secs(10 * 60);

/// torchrun's default MASTER_PORT.
pub const DEFAULT_MASTER_PORT: u16 = 29500;

/// The run id a launcher gives its ranks (torchrun's variable; `tch-dist-run` sets it too):
/// ranks that carry one refuse to join the rendezvous of a run with another id.
pub const RUN_ID_ENV: &str = "TORCHELASTIC_RUN_ID";

/// `TCH_DIST_DEBUG=OFF|INFO|DETAIL`: the [`DebugLevel`] (wins over [`TORCH_DEBUG_ENV`]).
pub const DEBUG_ENV: &str = "TCH_DIST_DEBUG";

/// PyTorch's `TORCH_DISTRIBUTED_DEBUG`, read when [`DEBUG_ENV`] is not set.
pub const TORCH_DEBUG_ENV: &str = "TORCH_DISTRIBUTED_DEBUG";

/// How much a process group checks, as PyTorch's `TORCH_DISTRIBUTED_DEBUG` levels.
///
/// ```
/// use tch_dist_runtime::DebugLevel;
/// let get = |k: &str| (k == "TORCH_DISTRIBUTED_DEBUG").then(|| "detail".to_string());
/// assert_eq!(DebugLevel::from_vars(get).unwrap(), DebugLevel::Detail);
/// assert_eq!(DebugLevel::from_vars(|_| None).unwrap(), DebugLevel::Off);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum DebugLevel {
    /// No checks beyond the ones tch-dist always makes (the default, as in PyTorch).
    #[default]
    Off,
    /// Accepted for PyTorch's `INFO`, which adds logs; tch-dist checks nothing more.
    Info,
    /// Every collective's fingerprint (op, sequence number, shapes, dtypes, devices) is
    /// checked across the group before it runs, by c10d's `ProcessGroupWrapper` over a Gloo
    /// backend of its own: a mismatch, or a rank that does not arrive, is a
    /// [`DistError::Desync`](crate::DistError::Desync) on every rank instead of garbage, an
    /// abort or a bare timeout. It costs a monitored barrier and two small all-gathers per
    /// collective (docs/PERFORMANCE.md).
    Detail,
}

impl DebugLevel {
    /// Reads `TCH_DIST_DEBUG`, else `TORCH_DISTRIBUTED_DEBUG`, through `get` (unset or empty:
    /// `Off`; values in any case).
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<DebugLevel> {
        let Some((var, value)) = [DEBUG_ENV, TORCH_DEBUG_ENV]
            .into_iter()
            .find_map(|var| get(var).map(|v| (var, v)))
        else {
            return Ok(DebugLevel::Off);
        };
        match value.trim().to_ascii_uppercase().as_str() {
            "" | "OFF" => Ok(DebugLevel::Off),
            "INFO" => Ok(DebugLevel::Info),
            "DETAIL" => Ok(DebugLevel::Detail),
            _ => Err(EnvError::BadDebugLevel { var, value }.into()),
        }
    }
}

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
    /// The launcher's run id (TORCHELASTIC_RUN_ID), if any.
    pub run_id: Option<String>,
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
        let run_id = get(RUN_ID_ENV)
            .map(|id| id.trim().to_string())
            .filter(|id| !id.is_empty());
        Ok(Self {
            rank,
            world_size,
            local_rank,
            master_addr,
            master_port,
            run_id,
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

/// Reads an on/off switch through `get`: unset or empty is off; `1`, `true`, `yes`, `on` are
/// on and `0`, `false`, `no`, `off` are off (any case); anything else is an error naming the
/// variable.
pub(crate) fn read_switch(var: &'static str, get: impl Fn(&str) -> Option<String>) -> Result<bool> {
    let Some(value) = get(var) else {
        return Ok(false);
    };
    match value.trim().to_ascii_lowercase().as_str() {
        "" | "0" | "false" | "no" | "off" => Ok(false),
        "1" | "true" | "yes" | "on" => Ok(true),
        _ => Err(EnvError::BadSwitch { var, value }.into()),
    }
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
                master_port: 1234,
                run_id: None,
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

    #[test]
    fn run_id_and_debug_level() {
        let e = env(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "1"),
            ("MASTER_ADDR", "h"),
            ("TORCHELASTIC_RUN_ID", " job-7 "),
        ])
        .unwrap();
        assert_eq!(e.run_id.as_deref(), Some("job-7"));
        let e = env(&[("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "h")]).unwrap();
        assert_eq!(e.run_id, None);

        let level = |vars: &[(&str, &str)]| {
            let vars: Vec<(String, String)> = vars
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            DebugLevel::from_vars(move |k| {
                vars.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone())
            })
        };
        assert_eq!(level(&[]).unwrap(), DebugLevel::Off);
        assert_eq!(
            level(&[("TCH_DIST_DEBUG", "Detail")]).unwrap(),
            DebugLevel::Detail
        );
        assert_eq!(
            level(&[("TORCH_DISTRIBUTED_DEBUG", "INFO")]).unwrap(),
            DebugLevel::Info
        );
        // tch-dist's variable wins over PyTorch's.
        assert_eq!(
            level(&[
                ("TCH_DIST_DEBUG", "off"),
                ("TORCH_DISTRIBUTED_DEBUG", "DETAIL")
            ])
            .unwrap(),
            DebugLevel::Off
        );
        let err = level(&[("TORCH_DISTRIBUTED_DEBUG", "verbose")]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "invalid launch environment: TORCH_DISTRIBUTED_DEBUG=\"verbose\" is not a debug level \
             (OFF, INFO or DETAIL)"
        );
    }

    #[test]
    fn switches() {
        let get = |v: &'static str| move |_: &str| Some(v.to_string());
        for on in ["1", "true", "YES", " on "] {
            assert!(read_switch("TCH_DIST_X", get(on)).unwrap(), "{on}");
        }
        for off in ["", "0", "False", "no", "off"] {
            assert!(!read_switch("TCH_DIST_X", get(off)).unwrap(), "{off}");
        }
        assert!(!read_switch("TCH_DIST_X", |_| None).unwrap());
        let err = read_switch("TCH_DIST_X", get("2")).unwrap_err();
        assert!(
            matches!(&err, DistError::Env(EnvError::BadSwitch { var: "TCH_DIST_X", value }) if value == "2"),
            "{err}"
        );
    }

    /// LOCAL_RANK (or SLURM_LOCALID) is the CUDA device an NCCL group binds by default.
    #[test]
    fn local_rank_picks_the_default_device() {
        use crate::c10d::group::{Backend, InitOptions};
        let e = env(&[
            ("RANK", "5"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "1"),
            ("MASTER_ADDR", "h"),
        ])
        .unwrap();
        let opts = InitOptions::new(Backend::Nccl, e.rank, e.world_size, e.master_addr, 1)
            .with_local_rank(e.local_rank);
        assert_eq!(opts.cuda_device(4).unwrap(), Some(1));
        assert!(!opts.eager_connect);
        // An explicit device_id wins, and connects eagerly (PyTorch's eager init).
        let explicit = opts.clone().with_device_id(3);
        assert_eq!(explicit.cuda_device(4).unwrap(), Some(3));
        assert!(explicit.eager_connect);
        // A device the process does not see is an error naming where the index came from.
        let err = opts.cuda_device(1).unwrap_err();
        assert_eq!(
            err,
            DistError::Env(EnvError::DeviceOutOfRange {
                from: "LOCAL_RANK",
                device: 1,
                count: 1
            })
        );
        let err = explicit.cuda_device(2).unwrap_err();
        assert!(matches!(
            err,
            DistError::Env(EnvError::DeviceOutOfRange {
                from: "device_id",
                device: 3,
                count: 2
            })
        ));
        // Without LOCAL_RANK, the local rank is the rank (a single node).
        let e = env(&[("RANK", "1"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h")]).unwrap();
        let opts = InitOptions::new(Backend::Nccl, e.rank, e.world_size, "h", 1)
            .with_local_rank(e.local_rank);
        assert_eq!(opts.cuda_device(2).unwrap(), Some(1));
        // Gloo binds nothing; CUDA through Gloo shares the GPUs round-robin (none on CPU).
        let gloo = InitOptions::new(Backend::Gloo, 5, 8, "h", 1).with_local_rank(3);
        assert_eq!(gloo.cuda_device(4).unwrap(), None);
        let shared = gloo.clone().with_cuda_via_gloo();
        assert_eq!(shared.cuda_device(1).unwrap(), Some(0));
        assert_eq!(shared.cuda_device(2).unwrap(), Some(1));
        assert_eq!(shared.cuda_device(0).unwrap(), None);
        let nccl_shared = InitOptions::new(Backend::Nccl, 1, 2, "h", 1).with_cuda_via_gloo();
        assert_eq!(nccl_shared.cuda_device(1).unwrap(), Some(0));
    }
}
