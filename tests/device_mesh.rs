//! `init_device_mesh` and `DeviceMesh` at 4 ranks as real processes over 127.0.0.1: each
//! dim's groups hold PyTorch's ranks and carry PyTorch's names (created in its order), the
//! collectives on each dim sum what they should, slicing creates no group and flattening one,
//! every refusal is an error on every rank that creates nothing; and a PyTorch rank running
//! PyTorch's own `init_device_mesh` among Rust ranks meets them on every dim's group.

use std::path::PathBuf;
use std::time::Duration;

use tch::Tensor;
use tch_dist::device_mesh::{init_device_mesh, MeshError, MeshProblem};
use tch_dist::testing::{describe, run_ranks, worker, Launch};
use tch_dist::{Backend, ProcessGroup, ReduceOp};

/// `x` summed over `group` (as float32, the dtype peer.py's tensors have).
fn summed(group: &ProcessGroup, x: f64) -> f64 {
    let t = Tensor::from_slice(&[x as f32]);
    group.all_reduce(&t, ReduceOp::Sum).unwrap();
    t.double_value(&[0])
}

/// The name the next group created on `world` gets (PyTorch numbers groups in creation
/// order): a probe that every rank makes, so that the count stays in step.
fn next_group_name(world: &ProcessGroup) -> String {
    let all: Vec<usize> = (0..world.world_size()).collect();
    let g = world.new_group(&all, Backend::Gloo).unwrap().unwrap();
    g.group_name().to_string()
}

#[test]
fn a_2x2_mesh_has_pytorchs_groups_at_4_ranks() {
    run_ranks("a_2x2_mesh_has_pytorchs_groups_at_4_ranks", 4, |world| {
        let rank = world.rank();
        let (row, col) = (rank / 2, rank % 2);
        let mesh = init_device_mesh("cpu", &[2, 2], &["dp", "tp"]).unwrap();
        assert_eq!(mesh.to_string(), "DeviceMesh((dp=2, tp=2), 'cpu')");
        assert_eq!(mesh.shape(), [2, 2]);
        assert_eq!(mesh.get_coordinate(), [row, col]);
        assert_eq!(mesh.ranks(), [0, 1, 2, 3]);
        // PyTorch's order: dp's subgroups [0, 2], [1, 3] (groups "1", "2"), then tp's [0, 1],
        // [2, 3] ("3", "4").
        let dp = mesh.get_group("dp").unwrap();
        let tp = mesh.get_group("tp").unwrap();
        assert_eq!(dp.global_ranks(), [col, col + 2]);
        assert_eq!(tp.global_ranks(), [2 * row, 2 * row + 1]);
        assert_eq!(dp.group_name(), (1 + col).to_string());
        assert_eq!(tp.group_name(), (3 + row).to_string());
        assert_eq!(mesh.get_local_rank("tp").unwrap(), col);
        assert_eq!(mesh.get_local_rank("dp").unwrap(), row);
        assert_eq!(mesh.size("tp").unwrap(), 2);
        let r = rank as f64;
        assert_eq!(summed(tp, r + 1.0), (4 * row + 3) as f64);
        assert_eq!(summed(dp, r + 1.0), (2 * col + 4) as f64);

        // Slices create no group: the same groups, and the next group is "5".
        let tp_mesh = mesh.dim("tp").unwrap();
        assert_eq!(tp_mesh.ranks(), [2 * row, 2 * row + 1]);
        assert_eq!(
            tp_mesh.get_group("tp").unwrap().group_name(),
            tp.group_name()
        );
        let both = mesh.slice(&["dp", "tp"]).unwrap();
        assert_eq!(both.dim_names(), ["dp", "tp"]);
        // Flattening the whole world reuses the default group (as PyTorch does).
        let flat = mesh.flatten(None).unwrap();
        assert_eq!(flat.dim_names(), ["dp_tp"]);
        assert_eq!(
            flat.get_group("dp_tp").unwrap().group_name(),
            world.group_name()
        );
        assert_eq!(mesh.dim("dp_tp").unwrap().size("dp_tp").unwrap(), 4);
        assert_eq!(next_group_name(&world), "5");

        // A 4 x 1 mesh: dp spans the world (the default group), tp takes one group per rank
        // ("6" to "9").
        let mesh = init_device_mesh("cpu", &[4, 1], &["dp", "tp"]).unwrap();
        assert_eq!(
            mesh.get_group("dp").unwrap().group_name(),
            world.group_name()
        );
        let tp = mesh.get_group("tp").unwrap();
        assert_eq!(
            (tp.global_ranks(), tp.group_name()),
            (&[rank][..], &*(6 + rank).to_string())
        );

        // Flattening creates one group per subgroup: (2, 2, 1) as ("dp", "cp", "tp"),
        // dp x tp flattened: [0, 2] and [1, 3] ("10" to "17" are the mesh's own groups: cp's
        // two and tp's four, after dp's two).
        let mesh = init_device_mesh("cpu", &[2, 2, 1], &["dp", "cp", "tp"]).unwrap();
        let dp_tp = mesh.slice(&["dp", "tp"]).unwrap().flatten(None).unwrap();
        let g = dp_tp.get_group("dp_tp").unwrap();
        assert_eq!(g.global_ranks(), [col, col + 2]);
        assert_eq!(g.group_name(), (18 + col).to_string());
        assert_eq!(summed(g, r), (2 * col + 2) as f64);
        // Flattened again under the same name: the same mesh, no group.
        let again = mesh.slice(&["dp", "tp"]).unwrap().flatten(None).unwrap();
        assert_eq!(
            again.get_group("dp_tp").unwrap().group_name(),
            g.group_name()
        );
        assert_eq!(next_group_name(&world), "20");
    });
}

#[test]
fn mesh_refusals_are_errors_on_every_rank_that_create_nothing() {
    run_ranks(
        "mesh_refusals_are_errors_on_every_rank_that_create_nothing",
        4,
        |world| {
            let rank = world.rank();
            let problem = |e: MeshError| match e {
                MeshError {
                    rank: r, problem, ..
                } if r == rank => problem,
                e => panic!("{e:?}"),
            };
            let refused = |shape: &[usize], names: &[&str]| {
                problem(init_device_mesh("cpu", shape, names).unwrap_err())
            };
            assert_eq!(
                refused(&[3], &["dp"]),
                MeshProblem::WorldMismatch {
                    shape: vec![3],
                    world_size: 4
                }
            );
            let e = init_device_mesh("cpu", &[2, 4], &["dp", "tp"]).unwrap_err();
            assert_eq!(
                e.to_string(),
                format!(
                    "rank {rank}: init_device_mesh: a mesh of shape [2, 4] holds 8 ranks, the \
                     world has 4"
                )
            );
            assert_eq!(
                refused(&[2, 2], &["dp"]),
                MeshProblem::NamesLength { names: 1, dims: 2 }
            );
            assert_eq!(
                refused(&[2, 2], &["dp", "dp"]),
                MeshProblem::RepeatedName { name: "dp".into() }
            );
            // A shape whose product overflows (issue 41, item 8): wrapped, (2^62+1)*4 is 4,
            // the world's size; every rank panicked ("capacity overflow").
            let huge = (1usize << 62) + 1;
            let e = init_device_mesh("cpu", &[huge, 4], &[]).unwrap_err();
            assert_eq!(
                e.to_string(),
                format!(
                    "rank {rank}: init_device_mesh: a mesh of shape [{huge}, 4] holds more ranks \
                     than a usize counts, the world has 4"
                )
            );
            assert_eq!(
                problem(e),
                MeshProblem::WorldMismatch {
                    shape: vec![huge, 4],
                    world_size: 4
                }
            );
            assert!(tch_dist::device_mesh::subgroups(&[huge, 4], &[0]).is_empty());
            assert_eq!(refused(&[], &[]), MeshProblem::EmptyShape);
            assert_eq!(refused(&[4, 0], &[]), MeshProblem::ZeroSize { dim: 1 });
            assert_eq!(
                problem(init_device_mesh("cuda:0", &[4], &["dp"]).unwrap_err()),
                MeshProblem::DeviceType {
                    given: "cuda:0".into()
                }
            );
            // None of these made a group: the next one is "1".
            assert_eq!(next_group_name(&world), "1");

            let mesh = init_device_mesh("cpu", &[2, 2], &["dp", "tp"]).unwrap();
            let e = mesh.get_group("pp").unwrap_err();
            assert_eq!(
                e.to_string(),
                format!(
                    "rank {rank}: DeviceMesh::get_group: the mesh has no dim named `pp` (its \
                     dims: `dp`, `tp`)"
                )
            );
            assert!(matches!(
                problem(mesh.dim("pp").unwrap_err()),
                MeshProblem::UnknownDim { name, .. } if name == "pp"
            ));
            assert_eq!(
                problem(mesh.slice(&["tp", "dp"]).unwrap_err()),
                MeshProblem::SliceOrder {
                    names: vec!["tp".into(), "dp".into()]
                }
            );
            assert_eq!(
                problem(mesh.flatten(Some("tp")).unwrap_err()),
                MeshProblem::FlattenName { name: "tp".into() }
            );
            let unnamed = init_device_mesh("cpu", &[2, 2], &[]).unwrap();
            assert_eq!(unnamed.dim_names(), ["dim_0", "dim_1"]);
            assert_eq!(
                problem(unnamed.dim("dim_0").unwrap_err()),
                MeshProblem::NoNames
            );
            // The two meshes made 4 groups each ("2" to "9"), the refusals none.
            assert_eq!(next_group_name(&world), "10");
        },
    );
}

/// Ranks that disagree on a mesh (issue 41, items 2 and 11): dims named in another order on
/// half the ranks (every collective returned Ok, rank 0's `dp` meeting rank 2's `tp`), a
/// rank given another shape (it got Ok while the others waited out the rendezvous, "rank 3
/// never joined"), a rank whose own check refuses, a flattening under another name: an
/// error on every rank, naming both calls, before any group is made.
#[test]
fn ranks_that_disagree_on_a_mesh_fail_on_every_rank_before_any_group() {
    run_ranks(
        "ranks_that_disagree_on_a_mesh_fail_on_every_rank_before_any_group",
        4,
        |world| {
            let rank = world.rank();
            let problem = |e: MeshError| match e {
                MeshError {
                    rank: r, problem, ..
                } if r == rank => problem,
                e => panic!("{e:?}"),
            };
            let request = |shape: &str, names: &str| {
                format!("a mesh of shape {shape} with dims {names} on cpu")
            };
            let (dp_tp, tp_dp) = (
                request("[2, 2]", "`dp`, `tp`"),
                request("[2, 2]", "`tp`, `dp`"),
            );

            // Names in another order on ranks 2 and 3.
            let names: &[&str] = if rank < 2 {
                &["dp", "tp"]
            } else {
                &["tp", "dp"]
            };
            let e = init_device_mesh("cpu", &[2, 2], names).unwrap_err();
            let (mine, theirs, other_rank) = if rank < 2 {
                (&dp_tp, &tp_dp, 2)
            } else {
                (&tp_dp, &dp_tp, 0)
            };
            assert_eq!(
                e.to_string(),
                format!(
                    "rank {rank}: init_device_mesh: rank {other_rank} asked for {theirs}, this \
                     rank for {mine} (every rank must make the same call, in the same order)"
                )
            );

            // Another shape on rank 3 (as valid on its own).
            let shape: &[usize] = if rank == 3 { &[4, 1] } else { &[2, 2] };
            let four_one = request("[4, 1]", "`dp`, `tp`");
            let expected = if rank == 3 {
                MeshProblem::Disagree {
                    other_rank: 0,
                    this: four_one,
                    other: dp_tp.clone(),
                }
            } else {
                MeshProblem::Disagree {
                    other_rank: 3,
                    this: dp_tp.clone(),
                    other: four_one,
                }
            };
            assert_eq!(
                problem(init_device_mesh("cpu", shape, &["dp", "tp"]).unwrap_err()),
                expected
            );

            // Rank 1's own check refuses: it says why, the others that it refused.
            let shape: &[usize] = if rank == 1 { &[3] } else { &[4] };
            let names: &[&str] = &["dp"];
            let expected = if rank == 1 {
                MeshProblem::WorldMismatch {
                    shape: vec![3],
                    world_size: 4,
                }
            } else {
                MeshProblem::PeerRefused { peer: 1 }
            };
            assert_eq!(
                problem(init_device_mesh("cpu", shape, names).unwrap_err()),
                expected
            );
            // None of these made a group.
            assert_eq!(next_group_name(&world), "1");

            // A flattening under another name on rank 0.
            let mesh = init_device_mesh("cpu", &[2, 1, 2], &["dp", "cp", "tp"]).unwrap();
            let name = if rank == 0 { "x" } else { "dp_cp" };
            let dp_cp = mesh.slice(&["dp", "cp"]).unwrap();
            let e = problem(dp_cp.flatten(Some(name)).unwrap_err());
            let flattening = |n: &str| format!("a flattening of dims `dp`, `cp` as `{n}`");
            let expected = if rank == 0 {
                MeshProblem::Disagree {
                    other_rank: 1,
                    this: flattening("x"),
                    other: flattening("dp_cp"),
                }
            } else {
                MeshProblem::Disagree {
                    other_rank: 0,
                    this: flattening("dp_cp"),
                    other: flattening("x"),
                }
            };
            assert_eq!(e, expected);
            // The same flattening everywhere still works afterwards.
            let flat = dp_cp.flatten(None).unwrap();
            assert_eq!(flat.dim_names(), ["dp_cp"]);
            assert_eq!(summed(flat.get_group("dp_cp").unwrap(), 1.0), 2.0);
        },
    );
}

/// PyTorch ranks take seconds to import torch.
const MIXED_DEADLINE: Duration = Duration::from_secs(150);

fn python() -> String {
    if let Ok(p) = std::env::var("TCH_DIST_PYTHON") {
        return p;
    }
    let venv = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".venv/bin/python");
    assert!(
        venv.exists(),
        "no Python with torch: run `make setup` (the .venv) or set TCH_DIST_PYTHON"
    );
    venv.to_string_lossy().into_owned()
}

/// What a Rust rank of the mixed job does: peer.py's calls, in its order.
fn mixed_rust_rank() {
    let world = tch_dist::init_process_group(Backend::Gloo).unwrap();
    let rank = world.rank();
    let (row, col) = (rank / 2, rank % 2);
    let mesh = init_device_mesh("cpu", &[2, 2], &["dp", "tp"]).unwrap();
    let dp = mesh.get_group("dp").unwrap();
    let tp = mesh.get_group("tp").unwrap();
    assert_eq!(summed(tp, rank as f64 + 1.0), (4 * row + 3) as f64);
    assert_eq!(
        summed(dp, 10.0 * (rank as f64 + 1.0)),
        (20 * col + 40) as f64
    );
    assert_eq!(summed(&world, 1.0), 4.0);
    println!(
        "mesh ok rank {rank} {} {}",
        dp.group_name(),
        tp.group_name()
    );
    tch_dist::destroy_process_group();
}

#[test]
fn a_pytorch_rank_builds_the_same_mesh_among_rust_ranks() {
    const TEST: &str = "a_pytorch_rank_builds_the_same_mesh_among_rust_ranks";
    if worker().as_deref() == Some(TEST) {
        return mixed_rust_rank();
    }
    let peer = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/device_mesh/peer.py");
    let out = Launch::new(TEST, 4)
        .timeout(MIXED_DEADLINE)
        .rank_program(1, vec![python(), peer.to_string_lossy().into_owned()])
        .run();
    let desc = describe(&out);
    for o in &out {
        assert!(o.success(), "rank {} failed:\n{desc}", o.rank);
        // Every rank, Python's too, names its dp group "1" + col and its tp group "3" + row.
        let (row, col) = (o.rank / 2, o.rank % 2);
        let verdict = format!("mesh ok rank {} {} {}", o.rank, 1 + col, 3 + row);
        assert!(
            o.stdout.lines().any(|l| l.trim_end().ends_with(&verdict)),
            "rank {} did not print {verdict:?}:\n{desc}",
            o.rank
        );
    }
}
