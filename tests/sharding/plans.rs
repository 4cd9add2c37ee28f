//! Plans and sharded tensors: every plan error reported before anything changes, plans
//! through JSON and TOML, `ShardedTensor` scatter, gather and reshard.

use super::*;

#[test]
fn every_plan_error_is_reported_before_anything_changes() {
    run_ranks(
        "plans::every_plan_error_is_reported_before_anything_changes",
        2,
        |pg| {
            let vs = nn::VarStore::new(Device::Cpu);
            let mut model = mlp(&vs, 6, 8, 5);
            let cpu = |r| Placement::new(r, Device::Cpu);
            let ok = ChunkShardingSpec::new(0, vec![cpu(0), cpu(1)]);
            let cases: Vec<(ShardingPlan, &str)> = vec![
                (
                    ShardingPlan::builder()
                        .shard_param("fc3.weight", ok.clone())
                        .build(),
                    "`fc3.weight`: is not a parameter of the model",
                ),
                (
                    ShardingPlan::builder()
                        .shard_param(
                            Mlp::path().fc1().weight(),
                            ChunkShardingSpec::new(2, vec![cpu(0), cpu(1)]),
                        )
                        .build(),
                    "dim 2",
                ),
                (
                    ShardingPlan::builder()
                        .shard_param(
                            Mlp::path().fc1().weight(),
                            ChunkShardingSpec::new(0, vec![cpu(0), cpu(2)]),
                        )
                        .build(),
                    "placements do not match the group",
                ),
                (
                    ShardingPlan::builder()
                        .shard_module(Mlp::path().fc1(), ColwiseLinear::default())
                        .shard_param(Mlp::path().fc1().weight(), ok.clone())
                        .build(),
                    "`fc1.weight`: a parameter spec inside `fc1`",
                ),
                (
                    ShardingPlan::builder()
                        .shard_param("fc1", ok.clone())
                        .build(),
                    "`fc1`: names a module",
                ),
                (
                    ShardingPlan::builder()
                        .shard_module("fc2.bias", RowwiseLinear)
                        .build(),
                    "`fc2.bias`: names a parameter",
                ),
                (
                    ShardingPlan::builder()
                        .shard_param(
                            Mlp::path().fc1().bias(),
                            ChunkShardingSpec::new(0, vec![cpu(0), cpu(1)]),
                        )
                        .build(),
                    "only a linear layer's `weight`",
                ),
                (
                    ShardingPlan::builder()
                        .shard_module(Mlp::path().fc1(), ColwiseLinear::default())
                        .output("fc9", ok.clone())
                        .build(),
                    "`fc9`: output_plan names a module that is not in the model",
                ),
                (
                    ShardingPlan::builder()
                        .shard_module(Mlp::path().fc2(), RowwiseLinear)
                        .return_local_tensor(Mlp::path().fc2())
                        .build(),
                    "`fc2`: return_local_tensor: this module's output is not split",
                ),
                (
                    ShardingPlan::builder()
                        .shard_module(Mlp::path().fc1(), ColwiseLinear { fused: 3 })
                        .build(),
                    "not divisible into fused=3 parts",
                ),
            ];
            for (plan, expected) in cases {
                let err = tch_dist::report(&shard_module(&mut model, &plan, 0, &pg).unwrap_err());
                assert!(err.contains(expected), "expected `{expected}` in: {err}");
                assert!(
                    err.starts_with(&format!("rank {}: shard_module", pg.rank())),
                    "{err}"
                );
                // Named once: no doubled `rank R:` prefix.
                assert_eq!(
                    err.matches(&format!("rank {}:", pg.rank())).count(),
                    1,
                    "{err}"
                );
                assert_eq!(err.matches("shard_module").count(), 1, "{err}");
            }
            // The errors are typed.
            let plan = ShardingPlan::builder()
                .shard_module("fc2.bias", RowwiseLinear)
                .build();
            let err = shard_module(&mut model, &plan, 0, &pg).unwrap_err();
            assert!(
                matches!(err.problem(), Some(ShardProblem::Plan { fqn, problem: PlanProblem::SharderOnParameter })
                    if err.rank() == Some(pg.rank()) && fqn == "fc2.bias"),
                "{err:?}"
            );
            let err = shard_module(&mut model, &ShardingPlan::default(), 2, &pg).unwrap_err();
            assert!(tch_dist::report(&err).contains("src_rank 2"), "{err}");
            assert!(
                matches!(err.problem(), Some(ShardProblem::InvalidArgument { .. })),
                "{err:?}"
            );
            // Ranks with different plans fail together, naming the entry and each rank's
            // value (before, each rank sharded its own way and they hung or computed garbage).
            let plan = if pg.rank() == 0 {
                ShardingPlan::builder().shard_module(Mlp::path().fc1(), ColwiseLinear::default())
            } else {
                ShardingPlan::builder().shard_module(Mlp::path().fc1(), RowwiseLinear)
            }
            .build();
            let err = shard_module(&mut model, &plan, 0, &pg).unwrap_err();
            assert_eq!(
                err.to_string(),
                format!(
                    "rank {}: shard_module: option `plan[\"fc1\"]` differs across ranks: rank 0 \
                     has Sharder(\"colwise_linear\"), rank 1 has Sharder(\"rowwise_linear\")",
                    pg.rank()
                )
            );
            // A different source rank is a difference too.
            let err = shard_module(&mut model, &ShardingPlan::default(), pg.rank(), &pg)
                .unwrap_err()
                .to_string();
            assert!(
                err.ends_with("option `src_rank` differs across ranks: rank 0 has 0, rank 1 has 1"),
                "{err}"
            );
            // Nothing changed: whole parameters, no hooks, no registration.
            assert_eq!(model.fc1.ws.size(), [8, 6]);
            assert_eq!(num_forward_hooks(&model.fc1), (0, 0));
            assert!(registry(&model).is_empty());
            // And the module can still be sharded, once.
            let plan = ShardingPlan::builder()
                .shard_param(Mlp::path().fc1().weight(), ok)
                .build();
            shard_module(&mut model, &plan, 0, &pg).unwrap();
            assert_eq!(registry(&model), ["shard_module"]);
            let again = shard_module(&mut model, &plan, 0, &pg).unwrap_err();
            assert!(
                again
                    .to_string()
                    .contains("can only be applied to a module once"),
                "{again}"
            );
        },
    );
}

#[test]
fn plans_round_trip_through_json_and_toml() {
    let cpu = |r| Placement::new(r, Device::Cpu);
    let plan = ShardingPlan::builder()
        .shard_param(
            Mlp::path().fc1().weight(),
            ChunkShardingSpec::new(0, vec![cpu(0), cpu(1)]),
        )
        .shard_module(Mlp::path().fc2(), RowwiseLinear)
        .shard_module("blocks.0.qkv", ColwiseLinear { fused: 3 })
        .output(
            Mlp::path().fc2(),
            ChunkShardingSpec::new(0, vec![cpu(0), cpu(1)]),
        )
        .return_local_tensor(Mlp::path().fc2())
        .build();
    let json = serde_json::to_string_pretty(&plan).unwrap();
    assert!(json.contains("\"rank:1/cpu\""), "{json}");
    assert_eq!(serde_json::from_str::<ShardingPlan>(&json).unwrap(), plan);
    let text = toml::to_string(&plan).unwrap();
    assert_eq!(toml::from_str::<ShardingPlan>(&text).unwrap(), plan);
    let bad = r#"{"plan": {"fc1": {"sharder": "diagonal_linear"}}}"#;
    let err = serde_json::from_str::<ShardingPlan>(bad)
        .unwrap_err()
        .to_string();
    assert!(err.contains("unknown sharder `diagonal_linear`"), "{err}");
}

#[test]
fn sharded_tensors_scatter_gather_and_reshard() {
    run_ranks(
        "plans::sharded_tensors_scatter_gather_and_reshard",
        3,
        |pg| {
            let cpu = |r| Placement::new(r, Device::Cpu);
            let full = Tensor::arange(20, (Kind::Float, Device::Cpu)).view([10, 2]);
            // Every rank but the source passes other values: the source's win.
            let mine = if pg.rank() == 1 {
                full.copy()
            } else {
                full.zeros_like()
            };
            let rows: ShardingSpec = ChunkShardingSpec::new(0, vec![cpu(0), cpu(1), cpu(2)]).into();
            let st = ShardedTensor::scatter(&mine, &rows, 1, &pg).unwrap();
            let expected_rows = [4, 4, 2][pg.rank()];
            assert_eq!(st.local_tensor().unwrap().size(), [expected_rows, 2]);
            assert!(st
                .local_tensor()
                .unwrap()
                .equal(&chunk(&full, 0, 3, pg.rank())));
            assert!(st.all_gather().unwrap().equal(&full));
            let gathered = st.gather(2).unwrap();
            assert_eq!(gathered.is_some(), pg.rank() == 2);
            if let Some(g) = gathered {
                assert!(g.equal(&full));
            }
            // More ranks than rows: empty shards.
            let two = Tensor::from_slice(&[1.0f32, 2.0]).view([2, 1]);
            let st2 = ShardedTensor::scatter(&two, &rows, 0, &pg).unwrap();
            assert_eq!(st2.local_tensor().unwrap().size()[0], [1, 1, 0][pg.rank()]);
            assert!(st2.all_gather().unwrap().equal(&two));
            // Reshard rows -> columns, and to an explicit layout with two shards on rank 0.
            let cols: ShardingSpec = ChunkShardingSpec::new(1, vec![cpu(2), cpu(0), cpu(1)]).into();
            let by_col = st.reshard(&cols).unwrap();
            let col_of = |r: usize| [1, 2, 0][r]; // rank 2 holds chunk 0
            let expect = chunk(&full, 1, 3, col_of(pg.rank()));
            assert!(by_col.local_tensor().unwrap().equal(&expect));
            let shard = |off: i64, rows: i64, rank| ShardMetadata {
                shard_offsets: vec![off, 0],
                shard_sizes: vec![rows, 2],
                placement: cpu(rank),
            };
            let explicit: ShardingSpec =
                EnumerableShardingSpec::new(vec![shard(0, 3, 0), shard(3, 5, 1), shard(8, 2, 0)])
                    .unwrap()
                    .into();
            let ex = by_col.reshard(&explicit).unwrap();
            assert_eq!(ex.local_shards().len(), [2, 1, 0][pg.rank()]);
            if pg.rank() == 0 {
                assert!(
                    ex.local_tensor().is_err(),
                    "two shards: no single local tensor"
                );
                assert!(ex.local_shards()[1].tensor.equal(&full.narrow(0, 8, 2)));
            }
            assert!(ex.all_gather().unwrap().equal(&full));
            // A shape mismatch fails on every rank, naming both shapes.
            let wrong = if pg.rank() == 2 {
                Tensor::zeros([9, 2], (Kind::Float, Device::Cpu))
            } else {
                full.copy()
            };
            let err = ShardedTensor::scatter(&wrong, &rows, 0, &pg)
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("[10, 2]") && err.contains("rank 2 passed [9, 2]"),
                "{err}"
            );
        },
    );
}

/// `parallelize_module` on a 1-D mesh (PyTorch's API): ColwiseParallel then RowwiseParallel
/// (Megatron's MLP) trains like the unsharded model (SGD with momentum, 3 steps, every rank
/// on the whole batch); ColwiseParallel with a replicated output feeds a replicated input;
/// layouts tch-dist does not build, a 2-D mesh and a module the model does not have are
/// refused on every rank, the model unchanged.
#[test]
fn parallelize_module_styles_on_a_mesh() {
    run_ranks("plans::parallelize_module_styles_on_a_mesh", 2, |pg| {
        use tch_dist::device_mesh::init_device_mesh;
        use tch_dist::sharding::{
            parallelize_module, ColwiseParallel, Layout, ParallelizePlan, RowwiseParallel,
        };
        let rank = pg.rank();
        let mesh = init_device_mesh("cpu", &[2], &["tp"]).unwrap();
        let sgd = nn::Sgd {
            momentum: 0.9,
            ..Default::default()
        };
        for gathered in [false, true] {
            let (ref_vs, reference, vs, mut model) = twin_models(&pg, |vs| mlp(vs, 6, 8, 5));
            let colwise = ColwiseParallel {
                output_layouts: if gathered {
                    Layout::Replicate
                } else {
                    Layout::Shard(-1)
                },
                ..Default::default()
            };
            let rowwise = RowwiseParallel {
                input_layouts: if gathered {
                    Layout::Replicate
                } else {
                    Layout::Shard(-1)
                },
                ..Default::default()
            };
            let plan = ParallelizePlan::new()
                .style(Mlp::path().fc1(), colwise)
                .style(Mlp::path().fc2(), rowwise);
            parallelize_module(&mut model, &mesh, &plan).unwrap();
            assert_eq!(model.fc1.ws.size(), [4, 6]);
            // The placement record: fc1's rows, fc2's columns; fc2's bias whole.
            use tch_dist::state_dict::{placements, Placement};
            let record = placements(&model);
            let place = |t: &Tensor| record.get(t).map(|p| (p.placements(), p.offsets.clone()));
            let r = pg.rank() as i64;
            assert_eq!(
                place(&model.fc1.ws),
                Some((vec![Placement::Shard(0)], vec![4 * r, 0]))
            );
            assert_eq!(
                place(&model.fc2.ws),
                Some((vec![Placement::Shard(1)], vec![0, 4 * r]))
            );
            assert_eq!(place(model.fc2.bs.as_ref().unwrap()), None);
            assert_eq!(model.fc2.ws.size(), [5, 4]);
            let mut opt = sgd.build(&vs, 0.02).unwrap();
            let mut ref_opt = sgd.build(&ref_vs, 0.02).unwrap();
            for step in 0..3 {
                let x = input(&[4, 6]) * (1.0 + step as f64 / 4.0);
                opt.backward_step(&model.call(&x).sin().sum(Kind::Float));
                ref_opt.backward_step(&reference.forward(&x).sin().sum(Kind::Float));
            }
            let values = shard_check(&pg, 1e-5, false);
            values("fc1.weight", &model.fc1.ws, &reference.fc1.ws, Some(0));
            values("fc2.weight", &model.fc2.ws, &reference.fc2.ws, Some(1));
            let (b, b_ref) = (
                model.fc2.bs.as_ref().unwrap(),
                reference.fc2.bs.as_ref().unwrap(),
            );
            values("fc2.bias", b, b_ref, None);
        }
        let vs = nn::VarStore::new(Device::Cpu);
        let mut model = mlp(&vs, 6, 8, 5);
        let before = model.fc1.ws.copy();
        let refused = |mesh, plan: ParallelizePlan, model: &mut Mlp| {
            parallelize_module(model, mesh, &plan)
                .unwrap_err()
                .to_string()
        };
        let rows = ColwiseParallel {
            output_layouts: Layout::Shard(0),
            ..Default::default()
        };
        assert_eq!(
            tch_dist::report(
                &parallelize_module(
                    &mut model,
                    &mesh,
                    &ParallelizePlan::new().style(Mlp::path().fc1(), rows)
                )
                .unwrap_err()
            ),
            format!(
                "rank {rank}: parallelize_module: `fc1`: ColwiseParallel with output_layouts = \
                 Shard(0) is not supported (ColwiseParallel: input Replicate or, on a linear \
                 layer, Shard(d); output Shard(-1) or Replicate)"
            )
        );
        let mesh_2d = init_device_mesh("cpu", &[2, 1], &["dp", "tp"]).unwrap();
        let plan = ParallelizePlan::new().style(Mlp::path().fc1(), ColwiseParallel::default());
        assert_eq!(
            refused(&mesh_2d, plan, &mut model),
            format!("rank {rank}: parallelize_module: the root module")
        );
        let plan = ParallelizePlan::new().style("fc9", RowwiseParallel::default());
        assert_eq!(
            refused(&mesh, plan, &mut model),
            format!("rank {rank}: shard_module: `fc9`")
        );
        assert!(
            model.fc1.ws.equal(&before),
            "nothing changed on rank {rank}"
        );
        assert!(shard_module_state(&model).is_none());
    });
}

/// [`TinyLm`] whose forward looks its table up with `forward`, bypassing its hooks.
#[derive(Debug, Shardable)]
struct BypassLm {
    emb: nn::Embedding,
    head: nn::Linear,
}

impl Module for BypassLm {
    fn forward(&self, ids: &Tensor) -> Tensor {
        self.head.call(&self.emb.forward(ids).tanh())
    }
}

/// A token embedding and a head: `head(emb(ids))`.
#[derive(Debug, Shardable)]
struct TinyLm {
    emb: nn::Embedding,
    head: nn::Linear,
}

impl Module for TinyLm {
    fn forward(&self, ids: &Tensor) -> Tensor {
        self.head.call(&self.emb.call(ids).tanh())
    }
}

/// `parallelize_module` on `nn::Embedding` as PyTorch shards an `nn.Embedding`: rowwise
/// (vocab-parallel, 11 rows over 2 ranks: 6 and 5) and colwise (embedding dim), the colwise
/// output gathered or handed on local to a rowwise head; each trains like the unsharded
/// model (SGD with momentum, 3 steps, 1e-5), with the placement record of its table. Ids
/// outside the table, float input and a linear style's layout on an embedding are refused.
#[test]
fn parallelize_module_shards_embeddings() {
    run_ranks("plans::parallelize_module_shards_embeddings", 2, |pg| {
        use tch_dist::device_mesh::init_device_mesh;
        use tch_dist::sharding::{
            parallelize_module, ColwiseParallel, Layout, ParallelizePlan, RowwiseParallel,
        };
        use tch_dist::state_dict::{placements, Placement};
        let (rank, r) = (pg.rank(), pg.rank() as i64);
        let mesh = init_device_mesh("cpu", &[2], &["tp"]).unwrap();
        let build = |vs: &nn::VarStore| TinyLm {
            emb: nn::embedding(vs.root() / "emb", 11, 8, Default::default()),
            head: nn::linear(vs.root() / "head", 8, 5, Default::default()),
        };
        let sgd = nn::Sgd {
            momentum: 0.9,
            ..Default::default()
        };
        let rowwise_emb = RowwiseParallel {
            input_layouts: Layout::Replicate,
            ..Default::default()
        };
        let gathered = ColwiseParallel {
            output_layouts: Layout::Replicate,
            ..Default::default()
        };
        // (plan, the table's placement and offsets, the head's weight chunk dim)
        let cases = [
            (
                ParallelizePlan::new().style("emb", rowwise_emb),
                (Placement::Shard(0), vec![6 * r, 0]),
                None,
            ),
            (
                ParallelizePlan::new().style("emb", gathered),
                (Placement::Shard(1), vec![0, 4 * r]),
                None,
            ),
            (
                ParallelizePlan::new()
                    .style("emb", ColwiseParallel::default())
                    .style("head", RowwiseParallel::default()),
                (Placement::Shard(1), vec![0, 4 * r]),
                Some(1),
            ),
        ];
        for (i, (plan, (placement, offsets), head_dim)) in cases.into_iter().enumerate() {
            let (ref_vs, reference, mut vs, mut model) = twin_models(&pg, build);
            // Every rank starts from the reference's values (a layer left whole is not
            // broadcast: the ranks must agree on it, as replicas do).
            vs.copy(&ref_vs).unwrap();
            parallelize_module(&mut model, &mesh, &plan).unwrap();
            let record = placements(&model);
            let p = record.get(&model.emb.ws).expect("the table is sharded");
            assert_eq!(
                (p.placements(), p.offsets.clone()),
                (vec![placement], offsets)
            );
            assert_eq!(p.global_shape, [11, 8]);
            let mut opt = sgd.build(&vs, 0.05).unwrap();
            let mut ref_opt = sgd.build(&ref_vs, 0.05).unwrap();
            for step in 0..3 {
                tch::manual_seed(40 + step);
                let ids = Tensor::randint(11, [4, 3], (Kind::Int64, Device::Cpu));
                let loss = |out: Tensor| out.sin().sum(Kind::Float);
                opt.backward_step(&loss(model.f_call(&ids).unwrap()));
                ref_opt.backward_step(&loss(reference.forward(&ids)));
            }
            let values = shard_check(&pg, 1e-5, false);
            let table_dim = match placement {
                Placement::Shard(d) => d as i64,
                Placement::Replicate => unreachable!(),
            };
            let case = format!("case {i}: emb.weight");
            if table_dim == 0 {
                // 11 rows: 6 on rank 0, 5 on rank 1 (chunk's sizes).
                let mine = reference
                    .emb
                    .ws
                    .narrow(0, 6 * r, if rank == 0 { 6 } else { 5 });
                let d = (&model.emb.ws - &mine).abs().max().double_value(&[]);
                assert!(d < 1e-5, "rank {rank}: {case}: max diff {d}");
            } else {
                values(&case, &model.emb.ws, &reference.emb.ws, Some(table_dim));
            }
            values(
                &format!("case {i}: head.weight"),
                &model.head.ws,
                &reference.head.ws,
                head_dim,
            );
        }
        // Refusals: ids outside the table, float input, a feature slice into a table.
        let (_rvs, _reference, _vs, mut model) = twin_models(&pg, build);
        parallelize_module(
            &mut model,
            &mesh,
            &ParallelizePlan::new().style("emb", rowwise_emb),
        )
        .unwrap();
        let bad = Tensor::from_slice(&[1i64, 11]);
        assert_eq!(
            tch_dist::report(&model.f_call(&bad).unwrap_err()),
            format!(
                "shard_module: vocab-parallel `emb` on rank {rank}: id 11 is outside the table \
                 of 11 embeddings"
            )
        );
        let floats = Tensor::from_slice(&[1f32, 2.0]);
        let e = tch_dist::report(&model.f_call(&floats).unwrap_err());
        assert!(
            e.contains("expects integer ids (Int64 or Int), got Float"),
            "{e}"
        );
        let (_rvs, _reference, _vs, mut model) = twin_models(&pg, build);
        let before = model.emb.ws.copy();
        let e = tch_dist::report(
            &parallelize_module(
                &mut model,
                &mesh,
                &ParallelizePlan::new().style("emb", RowwiseParallel::default()),
            )
            .unwrap_err(),
        );
        assert!(
            e.contains("input_layouts = Shard(-1) is not supported"),
            "{e}"
        );
        assert!(model.emb.ws.equal(&before), "nothing changed");
    });
}
