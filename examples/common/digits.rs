//! scikit-learn's handwritten digits (8x8 images, 1797 samples) for the examples: `make
//! setup` copies scikit-learn's `digits.csv.gz` to `data/digits.csv.gz`.

use std::io::Read;
use std::path::{Path, PathBuf};

use tch::{Device, Kind, Tensor};

/// Where `make setup` puts the dataset, relative to the working directory (the repository's
/// root, where `make demo` runs); the examples' `--data` names another place.
pub fn default_path() -> PathBuf {
    PathBuf::from("data/digits.csv.gz")
}

/// The digits as (images [n, 64] scaled to [0, 1], labels [n]).
pub fn load_digits(path: &Path) -> Result<(Tensor, Tensor), String> {
    let file = std::fs::File::open(path).map_err(|e| {
        format!(
            "{}: {e} (run `make setup` in the repository's root, or pass --data)",
            path.display()
        )
    })?;
    let mut text = String::new();
    flate2::read::GzDecoder::new(file)
        .read_to_string(&mut text)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    let (mut xs, mut ys) = (Vec::new(), Vec::new());
    for (i, line) in text.lines().filter(|l| !l.trim().is_empty()).enumerate() {
        let v: Vec<f32> = line
            .split(',')
            .map(|f| f.trim().parse::<f32>())
            .collect::<Result<_, _>>()
            .map_err(|e| format!("line {}: {e}", i + 1))?;
        if v.len() != 65 {
            return Err(format!(
                "line {}: expected 65 values, got {}",
                i + 1,
                v.len()
            ));
        }
        xs.extend(v[..64].iter().map(|p| p / 16.0));
        ys.push(v[64] as i64);
    }
    let n = ys.len() as i64;
    Ok((
        Tensor::from_slice(&xs).view([n, 64]),
        Tensor::from_slice(&ys),
    ))
}

/// The same shuffle and 80/20 split on every rank: (x_train, y_train, x_test, y_test).
/// The dataset at `path`, split as [`train_test_split`] does: `(x_train, y_train, x_test,
/// y_test)`.
pub fn load_split(path: &Path) -> Result<(Tensor, Tensor, Tensor, Tensor), String> {
    let (x, y) = load_digits(path)?;
    Ok(train_test_split(&x, &y))
}

pub fn train_test_split(x: &Tensor, y: &Tensor) -> (Tensor, Tensor, Tensor, Tensor) {
    tch::manual_seed(0);
    let perm = Tensor::randperm(x.size()[0], (Kind::Int64, Device::Cpu));
    let (x, y) = (x.index_select(0, &perm), y.index_select(0, &perm));
    let n_train = x.size()[0] * 4 / 5;
    let n_test = x.size()[0] - n_train;
    (
        x.narrow(0, 0, n_train),
        y.narrow(0, 0, n_train),
        x.narrow(0, n_train, n_test),
        y.narrow(0, n_train, n_test),
    )
}
