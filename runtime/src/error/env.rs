//! [`EnvError`]: what is wrong with the launch environment, naming the variable.

/// What is wrong with the launch environment (the variables torchrun, Slurm or
/// `tch-dist-run` set, or the explicit [`InitOptions`](crate::InitOptions)).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EnvError {
    /// Neither RANK nor SLURM_PROCID is set.
    #[error(
        "neither RANK (torchrun, tch-dist-run) nor SLURM_PROCID is set; start the program \
         with tch-dist-run, torchrun or srun"
    )]
    NoRank,
    /// Neither WORLD_SIZE nor SLURM_NTASKS is set.
    #[error("neither WORLD_SIZE nor SLURM_NTASKS is set")]
    NoWorldSize,
    /// A variable that must hold a non-negative integer does not.
    #[error("{var}={value:?} is not a non-negative integer")]
    NotAnInteger {
        /// The variable.
        var: &'static str,
        /// Its value.
        value: String,
    },
    /// The world size is zero.
    #[error("{var}=0: the world size must be at least 1")]
    ZeroWorldSize {
        /// WORLD_SIZE or SLURM_NTASKS.
        var: &'static str,
    },
    /// The rank is not below the world size.
    #[error("{rank_var}={rank} is out of range for {world_var}={world_size} (ranks are 0..{world_size})")]
    RankOutOfRange {
        /// RANK or SLURM_PROCID (`rank` for explicit options).
        rank_var: &'static str,
        /// The rank.
        rank: usize,
        /// WORLD_SIZE or SLURM_NTASKS (`world_size` for explicit options).
        world_var: &'static str,
        /// The world size.
        world_size: usize,
    },
    /// MASTER_ADDR is set but empty.
    #[error("MASTER_ADDR is empty")]
    EmptyMasterAddr,
    /// MASTER_ADDR is needed and not set.
    #[error("MASTER_ADDR is not set (the rendezvous host, rank 0's address)")]
    NoMasterAddr,
    /// MASTER_PORT is not a port number.
    #[error("MASTER_PORT={value:?} is not a port number (1-65535)")]
    BadPort {
        /// Its value.
        value: String,
    },
    /// A timeout's variable (`TCH_DIST_TIMEOUT_SECS`, `TCH_DIST_HEARTBEAT_TIMEOUT_SECS`) is
    /// not a positive number of seconds.
    #[error("{var}={value:?} is not a positive number")]
    BadTimeout {
        /// The variable.
        var: &'static str,
        /// Its value.
        value: String,
    },
    /// NCCL was asked for, but this build of tch-dist has no NCCL support.
    #[error("tch-dist was built without NCCL support")]
    NcclNotCompiled,
    /// The CUDA device a rank would bind (its local rank, or an explicit `device_id`) does
    /// not exist in this process.
    #[error(
        "{from} {device} names CUDA device {device}, but this process sees {count} CUDA \
         device(s); start at most one rank per GPU (or set device_id, CUDA_VISIBLE_DEVICES)"
    )]
    DeviceOutOfRange {
        /// Where the index came from: `LOCAL_RANK` (the local rank) or `device_id`.
        from: &'static str,
        /// The index.
        device: usize,
        /// How many CUDA devices this process sees.
        count: usize,
    },
    /// TCH_DIST_DEBUG (or TORCH_DISTRIBUTED_DEBUG) is not a debug level.
    #[error("{var}={value:?} is not a debug level (OFF, INFO or DETAIL)")]
    BadDebugLevel {
        /// The variable.
        var: &'static str,
        /// Its value.
        value: String,
    },
    /// A test switch (TCH_DIST_NO_SHORTCUTS, TCH_DIST_CUDA_VIA_GLOO) has a value that is not
    /// a switch.
    #[error("{var}={value:?} is not a switch (1, true, yes, on; or 0, false, no, off)")]
    BadSwitch {
        /// The variable.
        var: &'static str,
        /// Its value.
        value: String,
    },
}
