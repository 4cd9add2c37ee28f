//! `DistributedSampler` against PyTorch's own (`torch.utils.data.distributed`, the `.venv`'s
//! torch 2.11.0): for a grid of lengths, world sizes, seeds, epochs, with and without
//! shuffling and `drop_last`, every rank's indices are PyTorch's, element for element.

use std::path::Path;
use std::process::Command;

use tch_dist::data::{DistributedSampler, SamplerOptions};

/// The grid: (len, num_replicas, shuffle, drop_last, seed, epoch).
const CASES: &[(usize, usize, bool, bool, u64, u64)] = &[
    (10, 3, false, false, 0, 0),
    (10, 3, false, true, 0, 0),
    (10, 3, true, false, 0, 0),
    (10, 3, true, true, 0, 0),
    (10, 3, true, false, 0, 1),
    (10, 3, true, false, 42, 7),
    (1000, 4, true, false, 0, 0),
    (1001, 4, true, true, 5, 3),
    (1001, 4, true, false, 5, 3),
    (2, 5, true, false, 1, 0),
    (2, 5, true, true, 1, 0),
    (7, 1, true, false, 123456789, 2),
    (0, 2, true, false, 0, 0),
];

/// PyTorch's indices for every case and rank: one line per (case, rank), comma-separated.
const PYTHON: &str = r#"
import sys
from torch.utils.data.distributed import DistributedSampler
for line in sys.stdin:
    n, r, shuffle, drop_last, seed, epoch = line.split()
    for rank in range(int(r)):
        s = DistributedSampler(range(int(n)), num_replicas=int(r), rank=rank,
                               shuffle=shuffle == "1", seed=int(seed), drop_last=drop_last == "1")
        s.set_epoch(int(epoch))
        print(",".join(map(str, list(s))))
"#;

#[test]
fn indices_equal_pytorchs() {
    let python = Path::new(env!("CARGO_MANIFEST_DIR")).join(".venv/bin/python");
    assert!(python.exists(), "the .venv's python (run `make setup`)");
    let input: String = CASES
        .iter()
        .map(|&(n, r, sh, dl, seed, epoch)| {
            format!("{n} {r} {} {} {seed} {epoch}\n", sh as u8, dl as u8)
        })
        .collect();
    let mut child = Command::new(python)
        .args(["-c", PYTHON])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "python failed");
    let text = String::from_utf8(out.stdout).unwrap();
    let mut expected = text.lines();
    for &(len, replicas, shuffle, drop_last, seed, epoch) in CASES {
        for rank in 0..replicas {
            let mut s = DistributedSampler::new(
                len,
                SamplerOptions {
                    num_replicas: Some(replicas),
                    rank: Some(rank),
                    shuffle,
                    seed,
                    drop_last,
                },
            )
            .unwrap();
            s.set_epoch(epoch);
            let mine = s.indices().unwrap();
            let theirs: Vec<i64> = match expected.next().expect("a line per case and rank") {
                "" => Vec::new(),
                l => l.split(',').map(|v| v.parse().unwrap()).collect(),
            };
            assert_eq!(
                mine, theirs,
                "len {len}, {replicas} replicas, rank {rank}, shuffle {shuffle}, drop_last \
                 {drop_last}, seed {seed}, epoch {epoch}"
            );
            assert_eq!(s.len(), theirs.len());
        }
    }
    assert_eq!(expected.next(), None);
}
