//! `TCH_DIST_DEBUG=DETAIL` (PyTorch's `TORCH_DISTRIBUTED_DEBUG=DETAIL`): reading the shim's
//! desync reports into [`Desync`] values.
//!
//! With DETAIL every backend of a group is wrapped in c10d's `ProcessGroupWrapper`, which
//! before each collective runs a monitored barrier and compares the collectives'
//! fingerprints (op, sequence number, shapes, dtypes, devices) over a Gloo backend of its
//! own. When it finds a mismatch, every rank found it at the same step, so the shim gathers
//! every rank's call over that backend and reports them (c10d's own message cannot be
//! trusted to name the other rank's call: when the fingerprints differ in length it decodes
//! their lengths as if they were fingerprints). The report is
//!
//! ```text
//! tdr-desync:differ
//! RANK \t SEQ \t OP \t TENSORS \t ROOT        (one line per rank, in rank order)
//! ```
//!
//! or, when the monitored barrier failed (a rank did not arrive, or left),
//!
//! ```text
//! tdr-desync:missing
//! RANK \t SEQ \t OP \t TENSORS \t ROOT        (this rank's call)
//! what c10d said
//! ```
//!
//! where TENSORS is `|`-separated `d0,d1,...;Dtype;device` (c10's dtype names, c10's device
//! strings) and ROOT a broadcast's source rank (empty for other ops). c10d's fingerprint has
//! no root: the shim compares broadcasts' roots itself once the wrapper's check has passed,
//! and reports a difference the same way.

use std::time::Duration;

use tch::{Device, Kind};

use crate::error::{CallTensor, CollectiveCall, Desync, TensorSignature};

/// c10's names of the dtypes (`c10::toString(ScalarType)`).
const C10_DTYPES: &[(&str, Kind)] = &[
    ("Byte", Kind::Uint8),
    ("Char", Kind::Int8),
    ("Short", Kind::Int16),
    ("Int", Kind::Int),
    ("Long", Kind::Int64),
    ("Half", Kind::Half),
    ("Float", Kind::Float),
    ("Double", Kind::Double),
    ("ComplexHalf", Kind::ComplexHalf),
    ("ComplexFloat", Kind::ComplexFloat),
    ("ComplexDouble", Kind::ComplexDouble),
    ("Bool", Kind::Bool),
    ("QInt8", Kind::QInt8),
    ("QUInt8", Kind::QUInt8),
    ("QInt32", Kind::QInt32),
    ("BFloat16", Kind::BFloat16),
    ("Float8_e5m2", Kind::Float8e5m2),
    ("Float8_e4m3fn", Kind::Float8e4m3fn),
    ("Float8_e5m2fnuz", Kind::Float8e5m2fnuz),
    ("Float8_e4m3fnuz", Kind::Float8e4m3fnuz),
];

fn parse_kind(name: &str) -> Option<Kind> {
    C10_DTYPES.iter().find(|(n, _)| *n == name).map(|(_, k)| *k)
}

/// c10's device strings: `cpu`, `cuda`, `cuda:1`, `mps`.
fn parse_device(s: &str) -> Option<Device> {
    match s.split_once(':') {
        None if s == "cpu" => Some(Device::Cpu),
        None if s == "cuda" => Some(Device::Cuda(0)),
        None if s == "mps" => Some(Device::Mps),
        Some(("cuda", i)) => i.parse().ok().map(Device::Cuda),
        _ => None,
    }
}

fn parse_tensor(s: &str) -> Option<CallTensor> {
    let mut parts = s.split(';');
    let (shape, kind, device) = (parts.next()?, parts.next()?, parts.next()?);
    let shape = if shape.is_empty() {
        Vec::new()
    } else {
        shape
            .split(',')
            .map(|d| d.parse().ok())
            .collect::<Option<Vec<i64>>>()?
    };
    Some(CallTensor {
        signature: TensorSignature {
            shape,
            kind: parse_kind(kind)?,
        },
        device: parse_device(device)?,
    })
}

/// One `RANK \t SEQ \t OP \t TENSORS \t ROOT` line.
fn parse_call(line: &str) -> Option<CollectiveCall> {
    let mut fields = line.split('\t');
    let rank = fields.next()?.parse().ok()?;
    let seq = fields.next()?.parse().ok()?;
    let op = fields.next()?.to_string();
    let tensors = match fields.next()? {
        "" => Vec::new(),
        t => t.split('|').map(parse_tensor).collect::<Option<Vec<_>>>()?,
    };
    let root = match fields.next()? {
        "" => None,
        r => Some(r.parse().ok()?),
    };
    Some(CollectiveCall {
        rank,
        seq,
        op,
        tensors,
        root,
    })
}

/// The ranks Gloo's monitored barrier names: `[Rank 0]: Ranks 1, 2 failed to pass
/// monitoredBarrier in 5000 ms` (or `Rank 1 failed ...`).
fn missing_ranks(cause: &str) -> Vec<usize> {
    let Some(end) = cause.find(" failed to pass monitoredBarrier") else {
        return Vec::new();
    };
    let head = &cause[..end];
    let Some(start) = head.rfind("Rank") else {
        return Vec::new();
    };
    head[start + "Rank".len()..]
        .trim_start_matches('s')
        .split(',')
        .map(|r| r.trim().parse().ok())
        .collect::<Option<Vec<usize>>>()
        .unwrap_or_default()
}

/// Reads a shim desync report. `timeout` is the group's (the monitored barrier's limit),
/// `elapsed` the time since the launch: a barrier that failed before its timeout failed
/// because a connection closed. `None` when `report` is not one.
pub(crate) fn parse(report: &str, timeout: Duration, elapsed: Duration) -> Option<Desync> {
    let (kind, rest) = report.split_once('\n')?;
    match kind {
        "tdr-desync:differ" => {
            let calls = rest
                .lines()
                .filter(|l| !l.is_empty())
                .map(parse_call)
                .collect::<Option<Vec<_>>>()?;
            (!calls.is_empty()).then_some(Desync::Differ { calls })
        }
        "tdr-desync:missing" => {
            let (line, cause) = rest.split_once('\n').unwrap_or((rest, ""));
            let call = parse_call(line)?;
            // The barrier starts a little after the launch and measures its own timeout.
            let within = (elapsed * 10 >= timeout * 9).then_some(timeout);
            let cause = cause.to_string();
            if cause.contains("successfully reached monitoredBarrier") {
                Some(Desync::Unconfirmed {
                    call,
                    within,
                    cause,
                })
            } else {
                Some(Desync::Missing {
                    call,
                    ranks: missing_ranks(&cause),
                    within,
                    cause,
                })
            }
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(rank: usize, seq: u64, op: &str, tensors: &[(&[i64], Kind)]) -> CollectiveCall {
        CollectiveCall {
            rank,
            seq,
            op: op.into(),
            tensors: tensors
                .iter()
                .map(|(shape, kind)| CallTensor {
                    signature: TensorSignature {
                        shape: shape.to_vec(),
                        kind: *kind,
                    },
                    device: Device::Cpu,
                })
                .collect(),
            root: None,
        }
    }

    const T: Duration = Duration::from_secs(5);

    #[test]
    fn differing_calls() {
        let report =
            "tdr-desync:differ\n0\t3\tall_reduce\t4;Float;cpu\t\n1\t3\tall_reduce\t4;Int;cpu\t\n";
        assert_eq!(
            parse(report, T, Duration::ZERO),
            Some(Desync::Differ {
                calls: vec![
                    call(0, 3, "all_reduce", &[(&[4], Kind::Float)]),
                    call(1, 3, "all_reduce", &[(&[4], Kind::Int)]),
                ]
            })
        );
        // No tensors (a barrier), two tensors, a scalar, CUDA.
        let report = "tdr-desync:differ\n0\t7\tbarrier\t\t\n1\t7\treduce_scatter_tensor\t8,2;Double;cpu|4,2;Double;cpu\t\n2\t7\tbroadcast\t;BFloat16;cuda:1\t1\n";
        let Some(Desync::Differ { calls }) = parse(report, T, Duration::ZERO) else {
            panic!("not parsed");
        };
        assert_eq!(calls[0], call(0, 7, "barrier", &[]));
        assert_eq!(
            calls[1],
            call(
                1,
                7,
                "reduce_scatter_tensor",
                &[(&[8, 2], Kind::Double), (&[4, 2], Kind::Double)]
            )
        );
        assert_eq!(calls[2].tensors[0].signature.shape, Vec::<i64>::new());
        assert_eq!(calls[2].tensors[0].device, Device::Cuda(1));
        assert_eq!(
            (calls[2].op.as_str(), calls[2].root),
            ("broadcast", Some(1))
        );
        assert_eq!(calls[0].root, None);
    }

    #[test]
    fn missing_and_unconfirmed() {
        let mine = call(0, 2, "all_reduce", &[(&[4], Kind::Float)]);
        let report = "tdr-desync:missing\n0\t2\tall_reduce\t4;Float;cpu\t\n[Rank 0]: Ranks 1, 3 failed to pass monitoredBarrier in 5000 ms";
        let cause = "[Rank 0]: Ranks 1, 3 failed to pass monitoredBarrier in 5000 ms".to_string();
        assert_eq!(
            parse(report, T, Duration::from_millis(5004)),
            Some(Desync::Missing {
                call: mine.clone(),
                ranks: vec![1, 3],
                within: Some(T),
                cause: cause.clone(),
            })
        );
        // Failed at once: a connection closed.
        assert_eq!(
            parse(report, T, Duration::from_millis(12)),
            Some(Desync::Missing {
                call: mine,
                ranks: vec![1, 3],
                within: None,
                cause,
            })
        );
        let report = "tdr-desync:missing\n1\t2\tall_reduce\t4;Float;cpu\t\nRank 1 successfully reached monitoredBarrier, but received errors while waiting for send/recv from rank 0.";
        assert!(matches!(
            parse(report, T, Duration::from_secs(6)),
            Some(Desync::Unconfirmed {
                within: Some(_),
                ..
            })
        ));
        assert_eq!(
            missing_ranks("[Rank 0]: Rank 2 failed to pass monitoredBarrier in 10 ms"),
            vec![2]
        );
        assert_eq!(missing_ranks("something else"), Vec::<usize>::new());
    }

    #[test]
    fn other_text_is_not_a_report() {
        assert_eq!(parse("Detected mismatch between collectives", T, T), None);
        assert_eq!(
            parse("tdr-desync:differ\n0\tx\tall_reduce\t\t\n", T, T),
            None
        );
        assert_eq!(
            parse(
                "tdr-desync:differ\n0\t1\tall_reduce\t4;Quaternion;cpu\t\n",
                T,
                T
            ),
            None
        );
    }
}
