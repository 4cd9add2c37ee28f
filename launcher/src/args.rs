//! The command line, and how many ranks this machine lets the launcher start.

pub const USAGE: &str = "usage: tch-dist-run --nproc-per-node N [--nnodes K --node-rank R] [--master-addr ADDR] [--master-port PORT] [--max-restarts M] [--rdzv-id ID] -- CMD [ARGS...]
       tch-dist-run --replica-groups R [--start-lighthouse MIN | --lighthouse URL] --nproc-per-node N [--max-restarts M] -- CMD [ARGS...]
       tch-dist-run --nproc-per-node N --nnodes MIN[:MAX] --rdzv-backend c10d --rdzv-endpoint HOST[:PORT] [--rdzv-conf K=V,...] [--local-addr ADDR] [--max-restarts M] [--rdzv-id ID] -- CMD [ARGS...]";

pub const HELP: &str = "\
Starts N ranks of CMD with torchrun's variables and prefixes their output with [rankR]: .
Each rank runs in its own process group. When a rank fails (also while others are still
being started), or the launcher gets SIGTERM, SIGINT, SIGHUP or SIGQUIT, no further rank is
started, every rank's group gets SIGTERM (SIGKILL 5 s later) and the launcher exits with the
failed rank's status, or 128+N after signal N. Nothing a rank starts outlives the launcher:
what ranks left running (a `sleep 30 &`) is killed once all ranks have exited, even
successfully.

--nproc-per-node N: a positive integer, at most what the open-file limit (2 pipes per rank,
`ulimit -n`) and the process limit (`ulimit -u`) allow.
--max-restarts M: after a rank fails, all ranks are stopped and started again, up to M times
(TORCHELASTIC_RESTART_COUNT tells them which start they are). --nnodes K --node-rank R: this
launcher starts ranks R*N .. R*N+N-1 of K*N, with the same --master-addr and --master-port
(required) on every node (the static rendezvous: no restarts with K > 1). --rdzv-id ID: the
run id (default: TORCHELASTIC_RUN_ID, else a new one; with K > 1, one derived from the
master's address and port, the same on every node).

Restarts across hosts (--rdzv-backend c10d, torchrun's dynamic rendezvous, between
tch-dist-run launchers only: torchrun's own launchers keep its state as a Python pickle):
run the same command on every host. The launchers meet in rounds at --rdzv-endpoint
HOST[:PORT] (port 29400 by default), which the launcher on that host serves on that address
alone (one whose interface has the address, first to bind it; --rdzv-conf is_host=1 or 0
decides instead). A round completes at MAX nodes, or MIN..MAX once a last call passes after
MIN came; nodes are ranked by address (then pid), their ranks contiguous: GROUP_RANK,
GROUP_WORLD_SIZE, RANK = the ranks of earlier nodes + LOCAL_RANK, WORLD_SIZE, ROLE_RANK,
ROLE_WORLD_SIZE, MASTER_ADDR (node 0's address towards the endpoint, or its --local-addr),
MASTER_PORT (a fresh free port of node 0's each round, so that each round's ranks meet in
a store of their own), TORCHELASTIC_RESTART_COUNT (this node's own restarts),
TORCHELASTIC_MAX_RESTARTS, TORCHELASTIC_RUN_ID (--rdzv-id, else the launcher's own
TORCHELASTIC_RUN_ID, else tch-dist-run-HOST:PORT), and TCH_DIST_RDZV_ROUND (the round, the same on every node: key
per-attempt state on it, not on the restart count). When a rank fails, its node stops its
ranks, spends one of its own --max-restarts and joins the next round; the other nodes see it
waiting and restart theirs without spending any. A node silent for keep_alive_interval x
keep_alive_max_attempt (5 s x 3) is dropped and the others meet again without it; a node
may join later (up to MAX), which restarts the others too. A node out of restarts closes the
rendezvous: every launcher stops its ranks and exits non-zero, naming that node. A node
whose ranks all succeed closes it too (nobody restarts any more). --node-rank,
--master-addr and --master-port are not used. --rdzv-conf takes torchrun's keys, times in
seconds: join_timeout=600, last_call_timeout=30, close_timeout=30 (how long the host stays
for the others to hear of a closure), heartbeat=5 (one request), keep_alive_interval=5,
keep_alive_max_attempt=3, is_host; others (read_timeout, use_libuv) are taken and unused.
The rendezvous, like PyTorch's TCPStore, is unauthenticated: trusted networks only.

Fault tolerance (tch_dist::ft, torchft's model): --replica-groups R runs R replica groups of
N ranks each on this host, each a job of its own (its own store on a free port, its own
run id ID-replicaG), restarted alone when one of its ranks fails (up to --max-restarts
times per group) while the others go on; the launcher exits once every group has ended,
with the first failed group's status. Ranks get REPLICA_GROUP_ID (G) and
NUM_REPLICA_GROUPS (R), their lines are prefixed [replicaG/rankR]: , and --replica-group G
runs one such group alone (another host's, say). --start-lighthouse MIN starts a lighthouse
(tch-dist-lighthouse --min_replicas MIN, from the launcher's own directory, else PATH) on
--master-addr and a free port for the job's life; --lighthouse URL names a running one.
Either way ranks get TORCHFT_LIGHTHOUSE.";

/// The parsed command line.
pub struct Args {
    /// `--rdzv-backend c10d`: the dynamic rendezvous' settings (then `nnodes`, `node_rank`,
    /// `master_addr` and `master_port` are not used).
    pub rdzv: Option<crate::rendezvous::Config>,
    pub nproc: usize,
    pub nnodes: usize,
    pub node_rank: usize,
    pub master_addr: String,
    pub master_port: Option<u16>,
    pub max_restarts: u32,
    pub rdzv_id: Option<String>,
    /// `--replica-groups R`: run R replica groups (`replicas.rs`).
    pub replica_groups: Option<usize>,
    /// `--replica-group G`: this launcher runs replica group G.
    pub replica_group: Option<usize>,
    /// `--lighthouse URL`: the ranks' TORCHFT_LIGHTHOUSE.
    pub lighthouse: Option<String>,
    /// `--start-lighthouse MIN`: start a lighthouse with `--min_replicas MIN`.
    pub start_lighthouse: Option<u64>,
    pub cmd: Vec<String>,
}

/// Parses the arguments after the program name. `Err("")` asks for the help text.
pub fn parse_args(mut args: impl Iterator<Item = String>) -> Result<Args, String> {
    let mut nproc = None;
    let mut master_addr = "127.0.0.1".to_string();
    let mut master_port = None;
    let (mut nnodes, mut node_rank, mut max_restarts, mut rdzv_id) = ((1, 1), 0, 0, None);
    let (mut backend, mut endpoint, mut local_addr) = (None::<String>, None::<String>, None);
    let mut conf = Vec::new();
    let (mut replica_groups, mut replica_group, mut lighthouse, mut start_lighthouse) =
        (None, None, None, None);
    let mut cmd = Vec::new();
    while let Some(a) = args.next() {
        let (flag, inline) = match a.split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f.to_string(), Some(v.to_string())),
            _ => (a.clone(), None),
        };
        let mut value = |name: &str| {
            inline
                .clone()
                .or_else(|| args.next())
                .ok_or_else(|| format!("{name} needs a value"))
        };
        match flag.as_str() {
            "--nproc-per-node" | "--nproc_per_node" => {
                let v = value("--nproc-per-node")?;
                let n = v.parse::<usize>().ok().filter(|n| *n > 0);
                nproc =
                    Some(n.ok_or_else(|| {
                        format!("--nproc-per-node {v:?} is not a positive integer")
                    })?);
            }
            "--master-addr" | "--master_addr" => master_addr = value("--master-addr")?,
            "--master-port" | "--master_port" => {
                let v = value("--master-port")?;
                let p = v.parse::<u16>().ok().filter(|p| *p > 0);
                master_port =
                    Some(p.ok_or_else(|| format!("--master-port {v:?} is not a port number"))?);
            }
            "--nnodes" => {
                // torchrun's N or MIN:MAX (an elastic range needs --rdzv-backend c10d).
                let v = value("--nnodes")?;
                let n = |s: &str| s.parse::<usize>().ok().filter(|n| *n > 0);
                let parsed = match v.split_once(':') {
                    Some((lo, hi)) => n(lo).zip(n(hi)).filter(|(lo, hi)| lo <= hi),
                    None => n(&v).map(|n| (n, n)),
                };
                nnodes = parsed.ok_or_else(|| {
                    format!("--nnodes {v:?} is not a positive integer or MIN:MAX with MIN <= MAX")
                })?;
            }
            "--rdzv-backend" | "--rdzv_backend" => backend = Some(value("--rdzv-backend")?),
            "--rdzv-endpoint" | "--rdzv_endpoint" => endpoint = Some(value("--rdzv-endpoint")?),
            "--rdzv-conf" | "--rdzv_conf" => conf.push(value("--rdzv-conf")?),
            "--local-addr" | "--local_addr" => {
                let v = value("--local-addr")?;
                if v.is_empty() || v.len() > 255 || v.chars().any(|c| c.is_whitespace()) {
                    return Err(format!("--local-addr {v:?} is not an address"));
                }
                local_addr = Some(v);
            }
            "--node-rank" | "--node_rank" => {
                let v = value("--node-rank")?;
                node_rank = v
                    .parse::<usize>()
                    .map_err(|_| format!("--node-rank {v:?} is not a non-negative integer"))?;
            }
            "--max-restarts" | "--max_restarts" => {
                let v = value("--max-restarts")?;
                max_restarts = v
                    .parse::<u32>()
                    .map_err(|_| format!("--max-restarts {v:?} is not a non-negative integer"))?;
            }
            "--rdzv-id" | "--rdzv_id" => {
                let v = value("--rdzv-id")?;
                if v.trim().is_empty() {
                    return Err("--rdzv-id needs a non-empty value".into());
                }
                rdzv_id = Some(v);
            }
            "--replica-groups" | "--replica_groups" => {
                let v = value("--replica-groups")?;
                let n = v.parse::<usize>().ok().filter(|n| *n > 0);
                replica_groups =
                    Some(n.ok_or_else(|| {
                        format!("--replica-groups {v:?} is not a positive integer")
                    })?);
            }
            "--replica-group" | "--replica_group" => {
                let v = value("--replica-group")?;
                replica_group =
                    Some(v.parse::<usize>().map_err(|_| {
                        format!("--replica-group {v:?} is not a non-negative integer")
                    })?);
            }
            "--lighthouse" => {
                let v = value("--lighthouse")?;
                if !(v.starts_with("http://") || v.starts_with("https://")) {
                    return Err(format!(
                        "--lighthouse {v:?} is not an http:// or https:// URL"
                    ));
                }
                lighthouse = Some(v);
            }
            "--start-lighthouse" | "--start_lighthouse" => {
                let v = value("--start-lighthouse")?;
                let n = v.parse::<u64>().ok().filter(|n| *n > 0);
                start_lighthouse = Some(n.ok_or_else(|| {
                    format!("--start-lighthouse {v:?} is not a positive integer (min_replicas)")
                })?);
            }
            "-h" | "--help" => return Err(String::new()),
            "--" => {
                cmd.extend(args.by_ref());
                break;
            }
            other if other.starts_with('-') => return Err(format!("unknown option {other}")),
            _ => {
                cmd.push(a);
                cmd.extend(args.by_ref());
                break;
            }
        }
    }
    let nproc = nproc.ok_or("--nproc-per-node is required")?;
    if cmd.is_empty() {
        return Err("no command given after --".into());
    }
    let (min_nodes, max_nodes) = nnodes;
    if max_nodes.checked_mul(nproc).is_none() {
        return Err(format!(
            "--nnodes {max_nodes} times --nproc-per-node {nproc} is not a world size"
        ));
    }
    let rdzv = match backend.as_deref().unwrap_or("static") {
        "static" => {
            for (given, flag) in [
                (endpoint.is_some(), "--rdzv-endpoint"),
                (!conf.is_empty(), "--rdzv-conf"),
                (local_addr.is_some(), "--local-addr"),
            ] {
                if given {
                    return Err(format!("{flag} needs --rdzv-backend c10d"));
                }
            }
            None
        }
        "c10d" => {
            let endpoint = endpoint.ok_or(
                "--rdzv-backend c10d needs --rdzv-endpoint HOST[:PORT] (the same on every node)",
            )?;
            let mut config = crate::rendezvous::Config::new(&endpoint, min_nodes, max_nodes)?;
            for c in &conf {
                config.apply_conf(c)?;
            }
            config.local_addr = local_addr;
            Some(config)
        }
        other => {
            return Err(format!(
                "--rdzv-backend {other:?} is not supported (static or c10d; etcd is torchrun's)"
            ))
        }
    };
    if let Some(r) = replica_groups {
        let refused = [
            (rdzv.is_some(), "--rdzv-backend c10d"),
            (max_nodes > 1, "--nnodes above 1"),
            (
                master_port.is_some(),
                "--master-port (each group takes a free port)",
            ),
            (replica_group.is_some(), "--replica-group"),
        ];
        if let Some((_, what)) = refused.iter().find(|(given, _)| *given) {
            return Err(format!("--replica-groups {r} does not go with {what}"));
        }
    } else if start_lighthouse.is_some() {
        return Err("--start-lighthouse needs --replica-groups".into());
    }
    if start_lighthouse.is_some() && lighthouse.is_some() {
        return Err("--start-lighthouse and --lighthouse name two lighthouses: give one".into());
    }
    if rdzv.is_none() {
        if min_nodes != max_nodes {
            return Err(format!(
                "--nnodes {min_nodes}:{max_nodes} is an elastic range, which needs --rdzv-backend \
                 c10d --rdzv-endpoint HOST:PORT"
            ));
        }
        if node_rank >= max_nodes {
            return Err(format!(
                "--node-rank {node_rank} is not below --nnodes {max_nodes}"
            ));
        }
        if max_nodes > 1 && master_port.is_none() {
            return Err("--nnodes above 1 needs --master-port (the same on every node)".into());
        }
        if max_nodes > 1 && max_restarts > 0 {
            // Restarting one node's ranks alone cannot meet the other nodes' running ranks:
            // the nodes must meet again, in rounds.
            return Err(
                "--max-restarts with --nnodes above 1 needs the dynamic rendezvous: \
                        --rdzv-backend c10d --rdzv-endpoint HOST:PORT"
                    .into(),
            );
        }
    }
    Ok(Args {
        rdzv,
        nproc,
        nnodes: max_nodes,
        node_rank,
        master_addr,
        master_port,
        max_restarts,
        rdzv_id,
        replica_groups,
        replica_group,
        lighthouse,
        start_lighthouse,
        cmd,
    })
}

/// The launcher's own file descriptors besides the ranks' pipes: the standard streams, the
/// output's epoll, the pipes a start holds for a moment (the rank's write ends and std's
/// exec-error pipe), the free-port socket and /proc reads, with room to spare.
pub const OWN_FDS: u64 = 16;

/// Each rank's pipes that stay open in the launcher for the rank's life: stdout, stderr.
pub const FDS_PER_RANK: u64 = 2;

/// Refuses an `nproc` this machine's limits cannot start: each rank holds
/// [`FDS_PER_RANK`] pipes in the launcher (so RLIMIT_NOFILE bounds the ranks), and needs a
/// process of the user's (RLIMIT_NPROC, which root is exempt from). torchrun bounds neither
/// and fails part-way through starting; this launcher says so before it starts any rank.
pub fn check_capacity(nproc: usize) -> Result<(), String> {
    let nproc = nproc as u64;
    // SAFETY (both getrlimit calls): getrlimit(2) with a valid out pointer.
    if let Some(files) = soft_limit(|l| unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, l) }) {
        let ranks = files.saturating_sub(OWN_FDS) / FDS_PER_RANK;
        if nproc > ranks {
            return Err(format!(
                "--nproc-per-node {nproc} is more ranks than the open-file limit allows: each \
                 rank needs {FDS_PER_RANK} pipes in the launcher, and RLIMIT_NOFILE (ulimit -n) \
                 {files} is enough for {ranks}; raise it or start fewer ranks"
            ));
        }
    }
    // SAFETY: geteuid(2) has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    let procs = soft_limit(|l| unsafe { libc::getrlimit(libc::RLIMIT_NPROC, l) });
    if let (false, Some(procs)) = (root, procs)
        && nproc > procs
    {
        return Err(format!(
            "--nproc-per-node {nproc} is more ranks than the process limit allows: each \
                 rank needs a process, and RLIMIT_NPROC (ulimit -u) is {procs}; raise it or \
                 start fewer ranks"
        ));
    }
    Ok(())
}

/// The soft limit that `getrlimit` reads (a closure: the resource's type differs between
/// C libraries), or None when it is unlimited or cannot be read.
fn soft_limit(getrlimit: impl FnOnce(&mut libc::rlimit) -> libc::c_int) -> Option<u64> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    if getrlimit(&mut limit) != 0 || limit.rlim_cur == libc::RLIM_INFINITY {
        return None;
    }
    Some(limit.rlim_cur)
}
