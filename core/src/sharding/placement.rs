//! [`Placement`]: PyTorch's `_remote_device` in its `rank:<rank>/<device>` form.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use tch::Device;

/// Where a shard lives: a rank of the process group and a device on that rank.
///
/// This is PyTorch's `torch.distributed._remote_device` restricted to its rank form,
/// `rank:<rank>/<device>`: `"rank:0/cpu"`, `"rank:1/cuda:1"`, `"rank:0/cuda"`. As in PyTorch,
/// `"rank:<rank>"` without a device means the CPU. The worker-name forms (`"trainer0/cpu"`)
/// need PyTorch's RPC framework and the bare device form (`"cuda:0"`) names no rank; both are
/// refused.
///
/// Devices are those of [`tch::Device`]: `cpu`, `cuda`, `cuda:<index>`, `mps`, `vulkan`. A
/// `cuda` without an index is kept as written (PyTorch's "the current CUDA device"):
/// [`device_index`](Self::device_index) is `None`, [`device`](Self::device) reads it as
/// `Cuda(0)` (as [`Device::cuda_if_available`] does) and
/// [`resolve_device`](Self::resolve_device) picks the index of the caller's choice.
///
/// [`Display`](fmt::Display) writes the canonical string, which parses back to an equal
/// placement; serde uses the same string.
///
/// # Examples
///
/// ```
/// use tch::Device;
/// use tch_dist_core::sharding::Placement;
///
/// let p: Placement = "rank:1/cuda:1".parse()?;
/// assert_eq!((p.rank(), p.device()), (1, Device::Cuda(1)));
/// assert_eq!(p.to_string(), "rank:1/cuda:1");
///
/// let q: Placement = "rank:0/cuda".parse()?;
/// assert_eq!(q.device_index(), None);
/// assert_eq!(q.to_string(), "rank:0/cuda");
///
/// // As in PyTorch, the device defaults to the CPU.
/// assert_eq!("rank:3".parse::<Placement>()?, Placement::new(3, Device::Cpu));
/// # Ok::<(), tch_dist_core::sharding::ParsePlacementError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Placement {
    rank: usize,
    device: Device,
    /// `false` only for a `cuda` written without an index.
    indexed: bool,
}

impl Placement {
    /// A placement on `rank`, `device`; a CUDA device keeps its index.
    ///
    /// # Examples
    ///
    /// ```
    /// use tch::Device;
    /// use tch_dist_core::sharding::Placement;
    ///
    /// assert_eq!(Placement::new(2, Device::Cuda(0)).to_string(), "rank:2/cuda:0");
    /// assert_eq!(Placement::new(0, Device::Cpu).to_string(), "rank:0/cpu");
    /// ```
    pub fn new(rank: usize, device: Device) -> Self {
        Placement {
            rank,
            device,
            indexed: true,
        }
    }

    /// A placement on `rank`'s current CUDA device (`"rank:<rank>/cuda"`, no index).
    ///
    /// # Examples
    ///
    /// ```
    /// use tch_dist_core::sharding::Placement;
    ///
    /// let p = Placement::current_cuda(1);
    /// assert_eq!(p.to_string(), "rank:1/cuda");
    /// assert_eq!(p, "rank:1/cuda".parse()?);
    /// # Ok::<(), tch_dist_core::sharding::ParsePlacementError>(())
    /// ```
    pub fn current_cuda(rank: usize) -> Self {
        Placement {
            rank,
            device: Device::Cuda(0),
            indexed: false,
        }
    }

    /// The rank (in the process group) that holds the shard.
    ///
    /// # Examples
    ///
    /// ```
    /// use tch_dist_core::sharding::Placement;
    ///
    /// assert_eq!("rank:5/cpu".parse::<Placement>()?.rank(), 5);
    /// # Ok::<(), tch_dist_core::sharding::ParsePlacementError>(())
    /// ```
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The device on that rank; a `cuda` without an index reads as `Cuda(0)`.
    ///
    /// # Examples
    ///
    /// ```
    /// use tch::Device;
    /// use tch_dist_core::sharding::Placement;
    ///
    /// assert_eq!("rank:0/cuda:3".parse::<Placement>()?.device(), Device::Cuda(3));
    /// assert_eq!("rank:0/cuda".parse::<Placement>()?.device(), Device::Cuda(0));
    /// assert_eq!("rank:0/mps".parse::<Placement>()?.device(), Device::Mps);
    /// # Ok::<(), tch_dist_core::sharding::ParsePlacementError>(())
    /// ```
    pub fn device(&self) -> Device {
        self.device
    }

    /// The CUDA device index as written: `Some` for `cuda:<index>`, `None` for a `cuda`
    /// without one and for the other device types.
    ///
    /// # Examples
    ///
    /// ```
    /// use tch_dist_core::sharding::Placement;
    ///
    /// assert_eq!("rank:0/cuda:1".parse::<Placement>()?.device_index(), Some(1));
    /// assert_eq!("rank:0/cuda".parse::<Placement>()?.device_index(), None);
    /// assert_eq!("rank:0/cpu".parse::<Placement>()?.device_index(), None);
    /// # Ok::<(), tch_dist_core::sharding::ParsePlacementError>(())
    /// ```
    pub fn device_index(&self) -> Option<usize> {
        match self.device {
            Device::Cuda(i) if self.indexed => Some(i),
            _ => None,
        }
    }

    /// The device, with a `cuda` written without an index resolved to
    /// `Cuda(current_cuda_index)` (typically the process's local rank).
    ///
    /// # Examples
    ///
    /// ```
    /// use tch::Device;
    /// use tch_dist_core::sharding::Placement;
    ///
    /// let local_rank = 1;
    /// assert_eq!("rank:1/cuda".parse::<Placement>()?.resolve_device(local_rank), Device::Cuda(1));
    /// assert_eq!("rank:1/cuda:0".parse::<Placement>()?.resolve_device(local_rank), Device::Cuda(0));
    /// assert_eq!("rank:1/cpu".parse::<Placement>()?.resolve_device(local_rank), Device::Cpu);
    /// # Ok::<(), tch_dist_core::sharding::ParsePlacementError>(())
    /// ```
    pub fn resolve_device(&self, current_cuda_index: usize) -> Device {
        match self.device {
            Device::Cuda(_) if !self.indexed => Device::Cuda(current_cuda_index),
            d => d,
        }
    }
}

impl fmt::Display for Placement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rank:{}/", self.rank)?;
        match self.device {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(i) if self.indexed => write!(f, "cuda:{i}"),
            Device::Cuda(_) => f.write_str("cuda"),
            Device::Mps => f.write_str("mps"),
            Device::Vulkan => f.write_str("vulkan"),
        }
    }
}

/// Why a string is not a [`Placement`]; its message names the string and what is wrong.
///
/// # Examples
///
/// ```
/// use tch_dist_core::sharding::Placement;
///
/// let err = "rank:x/cpu".parse::<Placement>().unwrap_err();
/// assert_eq!(err.input(), "rank:x/cpu");
/// assert_eq!(
///     err.to_string(),
///     "placement `rank:x/cpu`: rank `x` is not a non-negative integer \
///      (expected `rank:<rank>/<device>`, e.g. `rank:0/cuda:0`)"
/// );
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("placement `{input}`: {reason} (expected `rank:<rank>/<device>`, e.g. `rank:0/cuda:0`)")]
pub struct ParsePlacementError {
    input: String,
    reason: String,
}

impl ParsePlacementError {
    fn new(input: &str, reason: impl Into<String>) -> Self {
        ParsePlacementError {
            input: input.to_string(),
            reason: reason.into(),
        }
    }

    /// The string that failed to parse.
    ///
    /// # Examples
    ///
    /// ```
    /// use tch_dist_core::sharding::Placement;
    ///
    /// assert_eq!("cuda:0".parse::<Placement>().unwrap_err().input(), "cuda:0");
    /// ```
    pub fn input(&self) -> &str {
        &self.input
    }

    /// What is wrong with it, without the string itself.
    ///
    /// # Examples
    ///
    /// ```
    /// use tch_dist_core::sharding::Placement;
    ///
    /// let err = "rank:0/tpu".parse::<Placement>().unwrap_err();
    /// assert!(err.reason().starts_with("unknown device `tpu`"));
    /// ```
    pub fn reason(&self) -> &str {
        &self.reason
    }
}

/// `true` for a non-empty string of ASCII digits (Python's `str.isdigit` on ASCII; Rust's
/// integer parsing would also take a leading `+`).
fn all_digits(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit())
}

/// Parses the device part: `(device, indexed)`.
fn parse_device(input: &str, device: &str) -> Result<(Device, bool), ParsePlacementError> {
    if device.is_empty() {
        return Err(ParsePlacementError::new(input, "the device is empty"));
    }
    let (kind, index) = match device.split_once(':') {
        Some((kind, index)) => (kind, Some(index)),
        None => (device, None),
    };
    match (kind, index) {
        ("cpu", None) => Ok((Device::Cpu, true)),
        ("mps", None) => Ok((Device::Mps, true)),
        ("vulkan", None) => Ok((Device::Vulkan, true)),
        ("cuda", None) => Ok((Device::Cuda(0), false)),
        ("cuda", Some(index)) => {
            if !all_digits(index) {
                return Err(ParsePlacementError::new(
                    input,
                    format!("CUDA device index `{index}` is not a non-negative integer"),
                ));
            }
            let index = index.parse::<usize>().map_err(|_| {
                ParsePlacementError::new(input, format!("CUDA device index `{index}` is too large"))
            })?;
            Ok((Device::Cuda(index), true))
        }
        ("cpu" | "mps" | "vulkan", Some(_)) => Err(ParsePlacementError::new(
            input,
            format!("device `{device}`: only cuda devices take an index here"),
        )),
        _ => Err(ParsePlacementError::new(
            input,
            format!(
                "unknown device `{device}`; tch supports cpu, cuda, cuda:<index>, mps and vulkan"
            ),
        )),
    }
}

fn looks_like_device(s: &str) -> bool {
    let kind = s.split_once(':').map_or(s, |(kind, _)| kind);
    matches!(
        kind,
        "cpu" | "cuda" | "mps" | "vulkan" | "meta" | "xpu" | "hip"
    )
}

impl FromStr for Placement {
    type Err = ParsePlacementError;

    /// Parses `rank:<rank>/<device>` or `rank:<rank>` (the CPU).
    fn from_str(input: &str) -> Result<Self, Self::Err> {
        if input.is_empty() {
            return Err(ParsePlacementError::new(input, "the string is empty"));
        }
        let mut fields = input.split('/');
        let worker = fields.next().unwrap_or_default();
        let device = fields.next();
        if fields.next().is_some() {
            return Err(ParsePlacementError::new(
                input,
                "too many `/`-separated fields",
            ));
        }
        if worker.is_empty() {
            return Err(ParsePlacementError::new(input, "the rank is missing"));
        }
        let Some(rank) = worker.strip_prefix("rank:") else {
            let reason = if device.is_none() && looks_like_device(worker) {
                format!("`{worker}` is a device without a rank")
            } else if worker.contains(':') {
                format!("`{worker}` is not of the form `rank:<rank>`")
            } else {
                format!(
                    "worker names (`{worker}`) need PyTorch's RPC framework, which tch-dist does \
                     not use; name the rank"
                )
            };
            return Err(ParsePlacementError::new(input, reason));
        };
        if !all_digits(rank) {
            return Err(ParsePlacementError::new(
                input,
                format!("rank `{rank}` is not a non-negative integer"),
            ));
        }
        let rank = rank
            .parse::<usize>()
            .map_err(|_| ParsePlacementError::new(input, format!("rank `{rank}` is too large")))?;
        let (device, indexed) = match device {
            // PyTorch's default device for a remote device without one.
            None => (Device::Cpu, true),
            Some(device) => parse_device(input, device)?,
        };
        Ok(Placement {
            rank,
            device,
            indexed,
        })
    }
}

impl TryFrom<&str> for Placement {
    type Error = ParsePlacementError;

    fn try_from(s: &str) -> Result<Self, Self::Error> {
        s.parse()
    }
}

impl Serialize for Placement {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Placement {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let s = String::deserialize(deserializer)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(s: &str) -> Placement {
        s.parse().unwrap_or_else(|e| panic!("{e}"))
    }

    fn err(s: &str) -> String {
        s.parse::<Placement>().unwrap_err().to_string()
    }

    #[test]
    fn parses_rank_and_device() {
        assert_eq!(p("rank:0/cpu"), Placement::new(0, Device::Cpu));
        assert_eq!(p("rank:1/cuda:1"), Placement::new(1, Device::Cuda(1)));
        assert_eq!(p("rank:12/cuda:0").rank(), 12);
        assert_eq!(p("rank:0/mps").device(), Device::Mps);
        assert_eq!(p("rank:0/vulkan").device(), Device::Vulkan);
        // PyTorch: "rank:0" is on the CPU; leading zeros are read as int() does.
        assert_eq!(p("rank:0"), Placement::new(0, Device::Cpu));
        assert_eq!(p("rank:007/cpu").rank(), 7);
    }

    #[test]
    fn unindexed_cuda_is_kept() {
        let q = p("rank:0/cuda");
        assert_eq!(q, Placement::current_cuda(0));
        assert_ne!(q, Placement::new(0, Device::Cuda(0)));
        assert_eq!(q.device(), Device::Cuda(0));
        assert_eq!(q.device_index(), None);
        assert_eq!(q.resolve_device(3), Device::Cuda(3));
        assert_eq!(p("rank:0/cuda:2").resolve_device(3), Device::Cuda(2));
    }

    #[test]
    fn display_round_trips() {
        for s in [
            "rank:0/cpu",
            "rank:1/cuda:1",
            "rank:0/cuda",
            "rank:3/mps",
            "rank:9/vulkan",
            "rank:123/cuda:15",
        ] {
            assert_eq!(p(s).to_string(), s);
            assert_eq!(p(&p(s).to_string()), p(s));
        }
        assert_eq!(p("rank:4").to_string(), "rank:4/cpu");
        assert_eq!(p("rank:04/cpu").to_string(), "rank:4/cpu");
    }

    #[test]
    fn bad_strings_name_the_string_and_the_problem() {
        let cases = [
            ("", "placement ``: the string is empty"),
            (
                "rank:x/cpu",
                "placement `rank:x/cpu`: rank `x` is not a non-negative integer",
            ),
            ("rank:-1/cpu", "rank `-1` is not a non-negative integer"),
            ("rank:+1/cpu", "rank `+1` is not a non-negative integer"),
            ("rank:/cpu", "rank `` is not a non-negative integer"),
            (
                "rank:99999999999999999999999/cpu",
                "rank `99999999999999999999999` is too large",
            ),
            ("/cpu", "the rank is missing"),
            ("rank:0/", "the device is empty"),
            ("rank:0/cpu/x", "too many `/`-separated fields"),
            ("rank:0/tpu", "unknown device `tpu`; tch supports cpu, cuda"),
            ("rank:0/xpu:0", "unknown device `xpu:0`"),
            (
                "rank:0/cuda:x",
                "CUDA device index `x` is not a non-negative integer",
            ),
            (
                "rank:0/cuda:",
                "CUDA device index `` is not a non-negative integer",
            ),
            (
                "rank:0/cpu:0",
                "device `cpu:0`: only cuda devices take an index here",
            ),
            ("cuda:0", "`cuda:0` is a device without a rank"),
            ("cpu", "`cpu` is a device without a rank"),
            (
                "trainer0/cpu",
                "worker names (`trainer0`) need PyTorch's RPC framework",
            ),
            ("rnk:0/cpu", "`rnk:0` is not of the form `rank:<rank>`"),
        ];
        for (input, expected) in cases {
            let message = err(input);
            assert!(
                message.contains(expected),
                "{input:?}: {message:?} does not contain {expected:?}"
            );
            assert!(
                message.starts_with(&format!("placement `{input}`: ")),
                "{message}"
            );
        }
    }

    #[test]
    fn serde_as_the_string() {
        let q = p("rank:1/cuda:1");
        assert_eq!(serde_json::to_string(&q).unwrap(), "\"rank:1/cuda:1\"");
        assert_eq!(
            serde_json::from_str::<Placement>("\"rank:0/cuda\"").unwrap(),
            p("rank:0/cuda")
        );
        let e = serde_json::from_str::<Placement>("\"rank:x/cpu\"").unwrap_err();
        assert!(
            e.to_string().contains("placement `rank:x/cpu`: rank `x`"),
            "{e}"
        );
        assert!(serde_json::from_str::<Placement>("0").is_err());
    }
}
