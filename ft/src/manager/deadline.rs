//! The deadline a call carries in gRPC's `grpc-timeout` header (an integer of at most eight
//! digits and a unit: `H`, `M`, `S`, `m`, `u`, `n`). A manager's quorum call must carry one
//! (torchft's manager refuses it without: "missing timeout"), since the manager's own call to
//! the lighthouse takes the same bound.

use std::time::Duration;

use tonic::metadata::MetadataMap;
use tonic::Status;

/// The call's deadline, or the refusal torchft's manager answers.
// A `Status` is what a tonic handler answers with; boxing it here only to unbox it there
// would gain nothing.
#[allow(clippy::result_large_err)]
pub(super) fn of(metadata: &MetadataMap) -> Result<Duration, Status> {
    let value = metadata
        .get("grpc-timeout")
        .ok_or_else(|| Status::invalid_argument("missing timeout"))?;
    let text = value.to_str().unwrap_or("");
    parse(text).ok_or_else(|| Status::invalid_argument(format!("invalid timeout {text}")))
}

fn parse(text: &str) -> Option<Duration> {
    let split = text.len().checked_sub(1)?;
    let (digits, unit) = text.split_at(split);
    if digits.is_empty() || digits.len() > 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n * 3600),
        "M" => Duration::from_secs(n * 60),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deadlines_parse_as_grpc_writes_them() {
        assert_eq!(parse("10m"), Some(Duration::from_millis(10)));
        assert_eq!(parse("60S"), Some(Duration::from_secs(60)));
        assert_eq!(parse("2H"), Some(Duration::from_secs(7200)));
        assert_eq!(parse("99999999n"), Some(Duration::from_nanos(99_999_999)));
        for bad in ["", "m", "123456789S", "10x", "-1S", "1.5S"] {
            assert_eq!(parse(bad), None, "{bad}");
        }
        let mut metadata = MetadataMap::new();
        assert_eq!(of(&metadata).unwrap_err().message(), "missing timeout");
        metadata.insert("grpc-timeout", "5q".parse().unwrap());
        assert_eq!(of(&metadata).unwrap_err().message(), "invalid timeout 5q");
    }
}
