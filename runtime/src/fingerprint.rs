//! [`Fingerprint`]: FNV-1a, the one hash the runtime and the facade use where ranks agree on
//! a value by comparing one number (a step check's settings, context parallelism's lengths).

/// FNV-1a over bytes (64 bits), as [`std::hash::Hasher`]: the same bytes give the same
/// value on every rank and in every process, unlike `std`'s randomly keyed hasher.
///
/// ```
/// use std::hash::Hasher;
/// use tch_dist_runtime::Fingerprint;
/// let mut a = Fingerprint::default();
/// a.write(b"seq_len");
/// a.write_i64(4096);
/// let mut b = Fingerprint::default();
/// b.write(b"seq_len");
/// b.write_i64(4096);
/// assert_eq!(a.finish(), b.finish());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fingerprint(u64);

impl Default for Fingerprint {
    /// FNV-1a's offset basis.
    fn default() -> Self {
        Fingerprint(0xcbf2_9ce4_8422_2325)
    }
}

impl std::hash::Hasher for Fingerprint {
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 ^= u64::from(*b);
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }

    /// Little-endian, whatever the machine: the same on every rank.
    fn write_i64(&mut self, i: i64) {
        self.write(&i.to_le_bytes());
    }

    fn write_u64(&mut self, i: u64) {
        self.write(&i.to_le_bytes());
    }

    fn finish(&self) -> u64 {
        self.0
    }
}
