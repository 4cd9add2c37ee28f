//! Object collectives that meet PyTorch's `broadcast_object_list` and `all_gather_object`
//! on the wire (torch 2.11.0), for the values both sides can represent: strings and bytes.
//!
//! PyTorch pickles each object (`pickle.Pickler`, protocol 4 in Python 3.11) into a uint8
//! tensor and exchanges its length first as an int64 tensor. Unpickling runs arbitrary code,
//! so tch-dist reads only a fixed subset of the format (a single `str` or `bytes`, nothing
//! that constructs other objects, imports or calls), and writes the same subset: a PyTorch
//! rank that sends anything else gets [`PickleError::Unsupported`] on the Rust ranks.

use tch::{Device, Kind, Tensor};

use crate::c10d::group::ProcessGroup;
use crate::error::{DistError, PickleError, Result};

/// A value an object collective carries: what a PyTorch rank sees as `str` or `bytes`.
///
/// ```
/// use tch_dist_runtime::Object;
/// let o = Object::from("policy-v3");
/// assert_eq!(Object::from_pickle(&o.to_pickle()).unwrap(), o);
/// assert_eq!(o.as_str(), Some("policy-v3"));
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Object {
    /// Python's `str`.
    Str(String),
    /// Python's `bytes`.
    Bytes(Vec<u8>),
}

const PROTO: u8 = 0x80;
const FRAME: u8 = 0x95;
const SHORT_BINUNICODE: u8 = 0x8c;
const BINUNICODE: u8 = b'X';
const BINUNICODE8: u8 = 0x8d;
const SHORT_BINBYTES: u8 = b'C';
const BINBYTES: u8 = b'B';
const BINBYTES8: u8 = 0x8e;
const BYTEARRAY8: u8 = 0x96;
const MEMOIZE: u8 = 0x94;
const BINPUT: u8 = b'q';
const LONG_BINPUT: u8 = b'r';
const STOP: u8 = b'.';

impl Object {
    /// The string, for a `Str`.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Object::Str(s) => Some(s),
            Object::Bytes(_) => None,
        }
    }

    /// The bytes, for a `Bytes`.
    pub fn as_bytes(&self) -> Option<&[u8]> {
        match self {
            Object::Bytes(b) => Some(b),
            Object::Str(_) => None,
        }
    }

    /// The pickle Python's `pickle.dumps(value)` makes (protocol 4, one frame).
    ///
    /// ```
    /// use tch_dist_runtime::Object;
    /// // python3 -c 'import pickle; print(pickle.dumps("hi"))'
    /// assert_eq!(Object::from("hi").to_pickle(), b"\x80\x04\x95\x06\0\0\0\0\0\0\0\x8c\x02hi\x94.");
    /// ```
    pub fn to_pickle(&self) -> Vec<u8> {
        let (data, short, long, huge) = match self {
            Object::Str(s) => (s.as_bytes(), SHORT_BINUNICODE, BINUNICODE, BINUNICODE8),
            Object::Bytes(b) => (b.as_slice(), SHORT_BINBYTES, BINBYTES, BINBYTES8),
        };
        let mut body = Vec::with_capacity(data.len() + 12);
        if let Ok(n) = u8::try_from(data.len()) {
            body.push(short);
            body.push(n);
        } else if let Ok(n) = u32::try_from(data.len()) {
            body.push(long);
            body.extend_from_slice(&n.to_le_bytes());
        } else {
            body.push(huge);
            body.extend_from_slice(&(data.len() as u64).to_le_bytes());
        }
        body.extend_from_slice(data);
        body.push(MEMOIZE);
        body.push(STOP);
        let mut out = Vec::with_capacity(body.len() + 11);
        out.extend_from_slice(&[PROTO, 4, FRAME]);
        out.extend_from_slice(&(body.len() as u64).to_le_bytes());
        out.extend_from_slice(&body);
        out
    }

    /// Reads a pickle of one `str` or `bytes` (any protocol from 2; `bytearray` reads as
    /// bytes). Anything else is an error, and nothing in it is executed.
    pub fn from_pickle(data: &[u8]) -> std::result::Result<Object, PickleError> {
        let mut at = 0usize;
        let take = |at: &mut usize, n: usize| -> std::result::Result<&[u8], PickleError> {
            let end = at
                .checked_add(n)
                .filter(|&e| e <= data.len())
                .ok_or(PickleError::Truncated { at: *at })?;
            let s = &data[*at..end];
            *at = end;
            Ok(s)
        };
        let len_of = |b: &[u8]| -> usize {
            let mut v = [0u8; 8];
            v[..b.len()].copy_from_slice(b);
            usize::try_from(u64::from_le_bytes(v)).unwrap_or(usize::MAX)
        };
        let mut value: Option<Object> = None;
        loop {
            let op_at = at;
            let op = take(&mut at, 1)?[0];
            let (n, is_str) = match op {
                PROTO => {
                    take(&mut at, 1)?;
                    continue;
                }
                FRAME => {
                    take(&mut at, 8)?;
                    continue;
                }
                MEMOIZE => continue,
                BINPUT => {
                    take(&mut at, 1)?;
                    continue;
                }
                LONG_BINPUT => {
                    take(&mut at, 4)?;
                    continue;
                }
                STOP => return value.ok_or(PickleError::Empty),
                SHORT_BINUNICODE => (len_of(take(&mut at, 1)?), true),
                BINUNICODE => (len_of(take(&mut at, 4)?), true),
                BINUNICODE8 => (len_of(take(&mut at, 8)?), true),
                SHORT_BINBYTES => (len_of(take(&mut at, 1)?), false),
                BINBYTES => (len_of(take(&mut at, 4)?), false),
                BINBYTES8 | BYTEARRAY8 => (len_of(take(&mut at, 8)?), false),
                opcode => return Err(PickleError::Unsupported { opcode, at: op_at }),
            };
            if value.is_some() {
                return Err(PickleError::Several { at: op_at });
            }
            let bytes = take(&mut at, n)?;
            value = Some(if is_str {
                Object::Str(String::from_utf8(bytes.to_vec()).map_err(|_| PickleError::NotUtf8)?)
            } else {
                Object::Bytes(bytes.to_vec())
            });
        }
    }
}

impl From<&str> for Object {
    fn from(s: &str) -> Object {
        Object::Str(s.to_string())
    }
}

impl From<String> for Object {
    fn from(s: String) -> Object {
        Object::Str(s)
    }
}

impl From<Vec<u8>> for Object {
    fn from(b: Vec<u8>) -> Object {
        Object::Bytes(b)
    }
}

impl From<&[u8]> for Object {
    fn from(b: &[u8]) -> Object {
        Object::Bytes(b.to_vec())
    }
}

fn bytes_of(t: &Tensor, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    t.narrow(0, 0, len as i64).copy_data(&mut out, len);
    out
}

impl ProcessGroup {
    /// Broadcasts `objects` from group rank `src` into every rank's `objects`, as PyTorch's
    /// `broadcast_object_list(objects, group_src=src)`: every rank passes a list of the same
    /// length (the others' entries are replaced). The lengths go first (an int64 broadcast),
    /// then the pickles, concatenated (a uint8 broadcast).
    ///
    /// ```no_run
    /// use tch_dist_runtime::Object;
    /// # let pg = tch_dist_runtime::default_group()?;
    /// let mut names = vec![Object::from(if pg.rank() == 0 { "run-42" } else { "" })];
    /// pg.broadcast_object_list(&mut names, 0)?;
    /// assert_eq!(names[0].as_str(), Some("run-42"));
    /// # Ok::<(), tch_dist_runtime::DistError>(())
    /// ```
    pub fn broadcast_object_list(&self, objects: &mut [Object], src: usize) -> Result<()> {
        const OP: &str = "broadcast_object_list";
        let cpu = (Kind::Int64, Device::Cpu);
        if self.rank() == src {
            let pickles: Vec<Vec<u8>> = objects.iter().map(Object::to_pickle).collect();
            let sizes: Vec<i64> = pickles.iter().map(|p| p.len() as i64).collect();
            self.broadcast(&Tensor::from_slice(&sizes), src)?;
            let all: Vec<u8> = pickles.concat();
            self.broadcast(&Tensor::from_slice(&all), src)?;
            return Ok(());
        }
        let sizes = Tensor::zeros([objects.len() as i64], cpu);
        self.broadcast(&sizes, src)?;
        let sizes: Vec<i64> = Vec::<i64>::try_from(&sizes).map_err(|e| DistError::Collective {
            rank: self.rank(),
            op: OP,
            cause: e.to_string(),
        })?;
        let total: i64 = sizes.iter().sum();
        let data = Tensor::zeros([total], (Kind::Uint8, Device::Cpu));
        self.broadcast(&data, src)?;
        let all = bytes_of(&data, total.max(0) as usize);
        let mut at = 0usize;
        for (slot, &n) in objects.iter_mut().zip(&sizes) {
            let n = n.max(0) as usize;
            let end = (at + n).min(all.len());
            *slot = Object::from_pickle(&all[at..end]).map_err(|problem| DistError::Object {
                rank: self.rank(),
                op: OP,
                from: src,
                problem,
            })?;
            at = end;
        }
        Ok(())
    }

    /// Gathers every rank's `object`, as PyTorch's `all_gather_object`: the pickles' lengths
    /// first (an all_gather of one int64 each), then the pickles padded to the longest (an
    /// all_gather of uint8 tensors). Entry `r` is group rank `r`'s.
    ///
    /// ```no_run
    /// use tch_dist_runtime::Object;
    /// # let pg = tch_dist_runtime::default_group()?;
    /// let all = pg.all_gather_object(&Object::from(format!("rank {}", pg.rank())))?;
    /// assert_eq!(all.len(), pg.world_size());
    /// # Ok::<(), tch_dist_runtime::DistError>(())
    /// ```
    pub fn all_gather_object(&self, object: &Object) -> Result<Vec<Object>> {
        const OP: &str = "all_gather_object";
        let w = self.world_size();
        let mine = object.to_pickle();
        let sizes: Vec<Tensor> = (0..w)
            .map(|_| Tensor::zeros([1], (Kind::Int64, Device::Cpu)))
            .collect();
        self.all_gather(&sizes, &Tensor::from_slice(&[mine.len() as i64]))?;
        let sizes: Vec<usize> = sizes
            .iter()
            .map(|s| s.int64_value(&[0]).max(0) as usize)
            .collect();
        let longest = sizes.iter().copied().max().unwrap_or(0);
        let mut padded = mine;
        padded.resize(longest, 0);
        let outs: Vec<Tensor> = (0..w)
            .map(|_| Tensor::zeros([longest as i64], (Kind::Uint8, Device::Cpu)))
            .collect();
        self.all_gather(&outs, &Tensor::from_slice(&padded))?;
        outs.iter()
            .zip(&sizes)
            .enumerate()
            .map(|(r, (t, &n))| {
                Object::from_pickle(&bytes_of(t, n.min(longest))).map_err(|problem| {
                    DistError::Object {
                        rank: self.rank(),
                        op: OP,
                        from: r,
                        problem,
                    }
                })
            })
            .collect()
    }
}

impl ProcessGroup {
    /// Sends `objects` to group rank `dst`, as PyTorch's `send_object_list(objects,
    /// group_dst=dst)`: the pickles' lengths (int64), then the pickles concatenated (uint8),
    /// both with tag 0.
    ///
    /// ```no_run
    /// use tch_dist_runtime::Object;
    /// # let pg = tch_dist_runtime::default_group()?;
    /// if pg.rank() == 0 {
    ///     pg.send_object_list(&[Object::from("ready")], 1)?;
    /// } else if pg.rank() == 1 {
    ///     let mut got = vec![Object::from("")];
    ///     pg.recv_object_list(&mut got, 0)?;
    /// }
    /// # Ok::<(), tch_dist_runtime::DistError>(())
    /// ```
    pub fn send_object_list(&self, objects: &[Object], dst: usize) -> Result<()> {
        let pickles: Vec<Vec<u8>> = objects.iter().map(Object::to_pickle).collect();
        let sizes: Vec<i64> = pickles.iter().map(|p| p.len() as i64).collect();
        self.send(&Tensor::from_slice(&sizes), dst, 0)?;
        self.send(&Tensor::from_slice(&pickles.concat()), dst, 0)
    }

    /// Receives `objects.len()` objects from group rank `src` into `objects`, as PyTorch's
    /// `recv_object_list(objects, group_src=src)` (see
    /// [`send_object_list`](Self::send_object_list)).
    pub fn recv_object_list(&self, objects: &mut [Object], src: usize) -> Result<()> {
        const OP: &str = "recv_object_list";
        let sizes = Tensor::zeros([objects.len() as i64], (Kind::Int64, Device::Cpu));
        self.recv(&sizes, src, 0)?;
        let sizes: Vec<i64> = Vec::<i64>::try_from(&sizes).map_err(|e| DistError::Collective {
            rank: self.rank(),
            op: OP,
            cause: e.to_string(),
        })?;
        let total: i64 = sizes.iter().map(|&n| n.max(0)).sum();
        let data = Tensor::zeros([total], (Kind::Uint8, Device::Cpu));
        self.recv(&data, src, 0)?;
        let all = bytes_of(&data, total as usize);
        let mut at = 0usize;
        for (slot, &n) in objects.iter_mut().zip(&sizes) {
            let end = (at + n.max(0) as usize).min(all.len());
            *slot = Object::from_pickle(&all[at..end]).map_err(|problem| DistError::Object {
                rank: self.rank(),
                op: OP,
                from: src,
                problem,
            })?;
            at = end;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pickles made by Python 3.11's `pickle.dumps` (protocol 4) and by other protocols.
    #[test]
    fn pythons_pickles() {
        let hi = b"\x80\x04\x95\x06\0\0\0\0\0\0\0\x8c\x02hi\x94.";
        assert_eq!(Object::from_pickle(hi).unwrap(), Object::from("hi"));
        assert_eq!(Object::from("hi").to_pickle(), hi);
        let ab = b"\x80\x04\x95\x06\0\0\0\0\0\0\0C\x02ab\x94.";
        assert_eq!(Object::from(&b"ab"[..]).to_pickle(), ab);
        // Protocol 3 (no frame, BINPUT memo) and protocol 2's str.
        let p3 = b"\x80\x03X\x03\0\0\0abcq\0.";
        assert_eq!(Object::from_pickle(p3).unwrap(), Object::from("abc"));
        for o in [
            Object::from("x".repeat(300)),
            Object::from(vec![7u8; 70_000]),
            Object::from("é"),
            Object::from(""),
        ] {
            assert_eq!(Object::from_pickle(&o.to_pickle()).unwrap(), o);
        }
        // An int (BININT1), a list, a global: refused, nothing run.
        assert_eq!(
            Object::from_pickle(b"\x80\x04K\x05.").unwrap_err(),
            PickleError::Unsupported {
                opcode: b'K',
                at: 2
            }
        );
        assert!(matches!(
            Object::from_pickle(b"\x80\x04\x8c\x05os\nsystem"),
            Err(PickleError::Truncated { .. }) | Err(PickleError::Unsupported { .. })
        ));
        assert_eq!(
            Object::from_pickle(b"\x80\x04.").unwrap_err(),
            PickleError::Empty
        );
        assert_eq!(
            Object::from_pickle(b"\x8c\x01a\x8c\x01b.").unwrap_err(),
            PickleError::Several { at: 3 }
        );
        assert_eq!(
            Object::from_pickle(b"\x8c\x05ab").unwrap_err(),
            PickleError::Truncated { at: 2 }
        );
    }
}
