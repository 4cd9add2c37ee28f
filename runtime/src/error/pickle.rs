//! [`PickleError`]: why an object from a PyTorch rank is not a pickle tch-dist reads.

/// Why a pickle is not one tch-dist reads (the `problem` of [`DistError::Object`](crate::DistError::Object)): it reads
/// one `str` or `bytes` and nothing else, so that no received object runs code.
///
/// ```
/// use tch_dist_runtime::{Object, PickleError};
/// // pickle.dumps(5): an int
/// let err = Object::from_pickle(b"\x80\x04K\x05.").unwrap_err();
/// assert_eq!(err, PickleError::Unsupported { opcode: b'K', at: 2 });
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PickleError {
    /// The data ends inside an opcode or its argument.
    #[error("it ends early, at byte {at}")]
    Truncated {
        /// Where the opcode that runs past the end starts.
        at: usize,
    },
    /// An opcode outside the subset (a value other than one str or bytes).
    #[error(
        "opcode 0x{opcode:02x} at byte {at} is outside what tch-dist reads (one str or bytes)"
    )]
    Unsupported {
        /// The opcode.
        opcode: u8,
        /// Its offset.
        at: usize,
    },
    /// It stops before any value.
    #[error("it holds no value")]
    Empty,
    /// A second value follows the first.
    #[error("a second value starts at byte {at} (tch-dist reads one str or bytes)")]
    Several {
        /// Where the second value starts.
        at: usize,
    },
    /// A `str` whose bytes are not UTF-8.
    #[error("its str is not UTF-8")]
    NotUtf8,
}
