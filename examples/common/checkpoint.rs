//! Resuming from a safetensors checkpoint only when it fits the model exactly: the same key
//! set, and each tensor's shape and dtype. tch's `VarStore::load` ignores extra keys and
//! converts dtypes silently (a float64 checkpoint loads into a float32 model), so the
//! mismatch shows up later, or never.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use tch::nn::VarStore;
use tch::{Kind, Tensor};

/// One way a checkpoint differs from the model, naming the key.
#[derive(Debug, Clone, PartialEq)]
pub enum Difference {
    /// The model has the key, the checkpoint does not.
    Missing { key: String },
    /// The checkpoint has a key the model does not.
    Unexpected { key: String },
    /// Same key, another shape.
    Shape {
        key: String,
        model: Vec<i64>,
        checkpoint: Vec<i64>,
    },
    /// Same key and shape, another dtype.
    Dtype {
        key: String,
        model: Kind,
        checkpoint: Kind,
    },
}

impl fmt::Display for Difference {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Difference::Missing { key } => write!(f, "`{key}` is missing from the checkpoint"),
            Difference::Unexpected { key } => {
                write!(f, "`{key}` is in the checkpoint but not in the model")
            }
            Difference::Shape {
                key,
                model,
                checkpoint,
            } => write!(
                f,
                "`{key}` has shape {checkpoint:?} in the checkpoint but {model:?} in the model"
            ),
            Difference::Dtype {
                key,
                model,
                checkpoint,
            } => write!(
                f,
                "`{key}` has dtype {checkpoint:?} in the checkpoint but {model:?} in the model"
            ),
        }
    }
}

/// Why `--resume` refused a checkpoint.
#[derive(Debug)]
pub enum ResumeError {
    /// The file could not be read as safetensors.
    Read { path: PathBuf, cause: tch::TchError },
    /// It does not fit the model: every difference, in key order.
    Mismatch {
        path: PathBuf,
        differences: Vec<Difference>,
    },
}

impl fmt::Display for ResumeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ResumeError::Read { path, cause } => {
                write!(f, "--resume: cannot read {}: {cause}", path.display())
            }
            ResumeError::Mismatch { path, differences } => {
                write!(f, "--resume: {} does not fit the model: ", path.display())?;
                for (i, d) in differences.iter().enumerate() {
                    if i > 0 {
                        f.write_str("; ")?;
                    }
                    write!(f, "{d}")?;
                }
                Ok(())
            }
        }
    }
}

impl std::error::Error for ResumeError {}

/// Every difference between the model's variables and a checkpoint's tensors, in key order.
pub fn differences(model: &[(String, Tensor)], checkpoint: &[(String, Tensor)]) -> Vec<Difference> {
    let model: BTreeMap<&str, &Tensor> = model.iter().map(|(k, t)| (k.as_str(), t)).collect();
    let saved: BTreeMap<&str, &Tensor> = checkpoint.iter().map(|(k, t)| (k.as_str(), t)).collect();
    let mut keys: Vec<&str> = model.keys().chain(saved.keys()).copied().collect();
    keys.sort_unstable();
    keys.dedup();
    keys.into_iter()
        .filter_map(|key| {
            let (m, c) = match (model.get(key), saved.get(key)) {
                (Some(m), Some(c)) => (m, c),
                (Some(_), None) => return Some(Difference::Missing { key: key.into() }),
                (None, _) => return Some(Difference::Unexpected { key: key.into() }),
            };
            if m.size() != c.size() {
                Some(Difference::Shape {
                    key: key.into(),
                    model: m.size(),
                    checkpoint: c.size(),
                })
            } else if m.kind() != c.kind() {
                Some(Difference::Dtype {
                    key: key.into(),
                    model: m.kind(),
                    checkpoint: c.kind(),
                })
            } else {
                None
            }
        })
        .collect()
}

/// Loads `path` into `vs` if its keys, shapes and dtypes are exactly the model's; otherwise
/// changes nothing and names every difference.
pub fn load_exact(vs: &VarStore, path: &Path) -> Result<(), ResumeError> {
    let saved = Tensor::read_safetensors(path).map_err(|cause| ResumeError::Read {
        path: path.to_path_buf(),
        cause,
    })?;
    let model: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    let differences = differences(&model, &saved);
    if !differences.is_empty() {
        return Err(ResumeError::Mismatch {
            path: path.to_path_buf(),
            differences,
        });
    }
    let model: BTreeMap<String, Tensor> = model.into_iter().collect();
    tch::no_grad(|| {
        for (key, tensor) in &saved {
            model[key].shallow_clone().copy_(tensor);
        }
    });
    Ok(())
}
