//! [`TensorMeta`]: the shape and dtype of a stage's activations, and the string that carries
//! them to the next stage ahead of the first microbatch, so that it can allocate its receive
//! buffers (PyTorch's `stage.py`: `_make_tensor_from_meta`, and `PipelineStage._shape_inference`
//! sending its outputs' metadata by `send_object_list`).

use std::fmt;

use tch::{Kind, Tensor};

/// The shape and dtype of one activation, as the first microbatch had it (PyTorch's
/// `_make_tensor_from_meta` goes by the same two).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorMeta {
    /// The activation's shape (the microbatch's, dim 0 included).
    pub shape: Vec<i64>,
    /// Its dtype.
    pub kind: Kind,
}

/// The dtypes an activation may have, with PyTorch's names (what the metadata string says).
const KINDS: [(Kind, &str); 10] = [
    (Kind::Float, "float32"),
    (Kind::Double, "float64"),
    (Kind::Half, "float16"),
    (Kind::BFloat16, "bfloat16"),
    (Kind::Int64, "int64"),
    (Kind::Int, "int32"),
    (Kind::Int16, "int16"),
    (Kind::Int8, "int8"),
    (Kind::Uint8, "uint8"),
    (Kind::Bool, "bool"),
];

/// What the metadata string starts with (a version, so that a change is an error, not a
/// misread).
const META_PREFIX: &str = "tch-dist-pipelining-meta-v1";

impl TensorMeta {
    /// The metadata of `t`.
    pub fn of(t: &Tensor) -> Self {
        Self {
            shape: t.size(),
            kind: t.kind(),
        }
    }

    fn kind_name(&self) -> String {
        KINDS
            .iter()
            .find(|(k, _)| *k == self.kind)
            .map_or_else(|| format!("{:?}", self.kind), |(_, n)| n.to_string())
    }

    /// The string sent ahead: `tch-dist-pipelining-meta-v1 float32 4,16`.
    pub(crate) fn encode(&self) -> String {
        let dims: Vec<String> = self.shape.iter().map(i64::to_string).collect();
        format!("{META_PREFIX} {} {}", self.kind_name(), dims.join(","))
    }

    /// The metadata a string from [`encode`](Self::encode) describes.
    pub(crate) fn decode(text: &str) -> Option<Self> {
        let mut words = text.split(' ');
        if words.next()? != META_PREFIX {
            return None;
        }
        let name = words.next()?;
        let kind = KINDS.iter().find(|(_, n)| *n == name)?.0;
        let dims = words.next()?;
        let shape = if dims.is_empty() {
            Vec::new()
        } else {
            dims.split(',')
                .map(|d| d.parse::<i64>().ok().filter(|&d| d >= 0))
                .collect::<Option<Vec<i64>>>()?
        };
        words.next().is_none().then_some(Self { shape, kind })
    }
}

impl fmt::Display for TensorMeta {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{:?}", self.kind_name(), self.shape)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metadata_round_trips_and_refuses_what_is_not_it() {
        let meta = TensorMeta {
            shape: vec![4, 16],
            kind: Kind::Float,
        };
        assert_eq!(meta.encode(), "tch-dist-pipelining-meta-v1 float32 4,16");
        assert_eq!(TensorMeta::decode(&meta.encode()), Some(meta.clone()));
        assert_eq!(meta.to_string(), "float32[4, 16]");
        let scalar = TensorMeta {
            shape: vec![],
            kind: Kind::Int64,
        };
        assert_eq!(TensorMeta::decode(&scalar.encode()), Some(scalar));
        for bad in [
            "",
            "tch-dist-pipelining-meta-v2 float32 4",
            "tch-dist-pipelining-meta-v1 complex 4",
            "tch-dist-pipelining-meta-v1 float32 4,-1",
            "tch-dist-pipelining-meta-v1 float32 4 extra",
        ] {
            assert_eq!(TensorMeta::decode(bad), None, "{bad}");
        }
    }
}
