//! The text `train_lm` learns: scikit-learn's dataset descriptions (its
//! `sklearn/datasets/descr/*.rst`, about 43 KB of English), which `make setup` concatenates
//! in sorted file order into `data/lm_text.txt`. Tokens are the text's bytes, numbered in
//! byte order over the distinct bytes that occur (93 of them: an odd vocabulary, so the
//! vocab-parallel embedding and the column-parallel output are split unevenly over tp 2).
//! tests/examples/pytorch_load_lm.py reads the file the same way.

use std::path::{Path, PathBuf};

use tch::Tensor;

/// Where `make setup` puts the text, relative to the working directory (the repository's
/// root, where `make demo` runs); `--data` names another file.
pub fn default_path() -> PathBuf {
    PathBuf::from("data/lm_text.txt")
}

/// The tokenized text, split 90/10 by position (the test split is the text's end, never
/// seen in training).
pub struct Corpus {
    /// Token id -> byte: the distinct bytes of the text, ascending.
    pub vocab: Vec<u8>,
    /// Token ids (int64) of the first 90%.
    pub train: Tensor,
    /// Token ids of the last 10%.
    pub test: Tensor,
}

/// Reads and tokenizes `path`.
pub fn load(path: &Path) -> Result<Corpus, String> {
    let text = std::fs::read(path).map_err(|e| {
        format!(
            "{}: {e} (run `make setup` in the repository's root, or pass --data)",
            path.display()
        )
    })?;
    let mut seen = [false; 256];
    for &b in &text {
        seen[b as usize] = true;
    }
    let vocab: Vec<u8> = (0..=255u8).filter(|&b| seen[b as usize]).collect();
    let mut id = [0i64; 256];
    for (i, &b) in vocab.iter().enumerate() {
        id[b as usize] = i as i64;
    }
    let ids: Vec<i64> = text.iter().map(|&b| id[b as usize]).collect();
    let n = ids.len() as i64;
    let n_train = n * 9 / 10;
    // At least one sequence of two tokens on each side, whatever the sequence length.
    if n_train < 2 || n - n_train < 2 {
        return Err(format!("{}: {n} bytes is too short a text", path.display()));
    }
    let ids = Tensor::from_slice(&ids);
    Ok(Corpus {
        vocab,
        train: ids.narrow(0, 0, n_train),
        test: ids.narrow(0, n_train, n - n_train),
    })
}

/// `ids` cut into consecutive, non-overlapping sequences of `seq` tokens, each with its
/// next-token targets (the same sequence shifted by one): `([n, seq], [n, seq])`, the tail
/// that does not fill a sequence dropped.
pub fn sequences(ids: &Tensor, seq: i64) -> (Tensor, Tensor) {
    let n = (ids.size()[0] - 1) / seq;
    (
        ids.narrow(0, 0, n * seq).view([n, seq]),
        ids.narrow(0, 1, n * seq).view([n, seq]),
    )
}
