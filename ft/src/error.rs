//! The control plane's one error type: what went wrong (a kind), in which operation against
//! which address (the context, written once), and the cause through `source()`.

use std::error::Error as StdError;
use std::fmt;
use std::time::Duration;

/// A boxed cause.
type Cause = Box<dyn StdError + Send + Sync + 'static>;

/// What kind of failure an [`FtError`] is.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum FtErrorKind {
    /// The address did not parse as `http://host:port` (a client) or `host:port` (a server).
    BadAddress,
    /// A server could not listen on its address.
    Bind,
    /// No connection to the peer within the connect timeout.
    Connect,
    /// The peer did not answer within the operation's timeout.
    TimedOut(Duration),
    /// The peer answered with a gRPC error (its code and message are the cause).
    Rpc(tonic::Code),
    /// The peer's answer lacks a field the protocol requires.
    Malformed(&'static str),
    /// The process could not start the control plane's threads.
    Runtime,
}

impl fmt::Display for FtErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FtErrorKind::BadAddress => f.write_str("not an address"),
            FtErrorKind::Bind => f.write_str("cannot listen there"),
            FtErrorKind::Connect => f.write_str("cannot connect"),
            FtErrorKind::TimedOut(t) => write!(f, "no answer within {t:?}"),
            FtErrorKind::Rpc(code) => write!(f, "the peer answered {code:?}"),
            FtErrorKind::Malformed(field) => write!(f, "the answer has no {field}"),
            FtErrorKind::Runtime => f.write_str("cannot start the control plane's threads"),
        }
    }
}

/// A failure of the fault-tolerance control plane: `"{op} at {address}: {kind}"`, the cause
/// (a transport error, the peer's gRPC status) through `source()`.
///
/// ```
/// use tch_dist_ft::{FtErrorKind, LighthouseClient};
/// use std::time::Duration;
///
/// let err = LighthouseClient::connect("not a url", Duration::from_millis(10)).unwrap_err();
/// assert_eq!(err.kind(), &FtErrorKind::BadAddress);
/// assert_eq!(err.to_string(), "lighthouse connect at not a url: not an address");
/// ```
#[derive(Debug)]
pub struct FtError {
    kind: FtErrorKind,
    op: &'static str,
    address: String,
    cause: Option<Cause>,
}

impl FtError {
    pub(crate) fn new(kind: FtErrorKind, op: &'static str, address: impl Into<String>) -> Self {
        FtError {
            kind,
            op,
            address: address.into(),
            cause: None,
        }
    }

    pub(crate) fn because(mut self, cause: impl Into<Cause>) -> Self {
        self.cause = Some(cause.into());
        self
    }

    /// From a gRPC status the peer (or tonic, for a transport failure) answered.
    pub(crate) fn from_status(op: &'static str, address: &str, status: tonic::Status) -> Self {
        let kind = match status.code() {
            tonic::Code::Unavailable => FtErrorKind::Connect,
            code => FtErrorKind::Rpc(code),
        };
        FtError::new(kind, op, address).because(StatusText(status))
    }

    /// A thread of the caller's that asked `op` and panicked (a bug, reported as an error).
    pub fn panicked(op: &'static str, what: &str) -> Self {
        FtError::new(FtErrorKind::Runtime, op, what)
    }

    /// What kind of failure this is.
    pub fn kind(&self) -> &FtErrorKind {
        &self.kind
    }

    /// The operation (`"lighthouse quorum"`, `"manager should_commit"`, ...).
    pub fn op(&self) -> &'static str {
        self.op
    }

    /// The peer's address, or the server's own for [`FtErrorKind::Bind`].
    pub fn address(&self) -> &str {
        &self.address
    }
}

impl fmt::Display for FtError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} at {}: {}", self.op, self.address, self.kind)
    }
}

impl StdError for FtError {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        self.cause
            .as_deref()
            .map(|c| c as &(dyn StdError + 'static))
    }
}

/// A gRPC status as a cause: its message (tonic's `Display` repeats the code and metadata).
#[derive(Debug)]
struct StatusText(tonic::Status);

impl fmt::Display for StatusText {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.0.message())
    }
}

impl StdError for StatusText {}

/// A result of the control plane.
pub type Result<T, E = FtError> = std::result::Result<T, E>;
