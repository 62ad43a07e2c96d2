"""FSDP weights gathered once a step (mesh.fsdp_gather per_step, mpmd/stages/gather.py):
all-gathers counted in the compiled programs of one step's plan, the stream's gather{k} and
pg{k}, the memory the dry run counts, and what is refused.

Equivalence with unpipelined JAX (in-process and on worker processes) is
tests/runtime/test_mesh_slices.py's, with the other mesh runs."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import mpmd
from mpmd import models
from mpmd.recipes import config
from mpmd.recipes.run import plan
from mpmd.recipes.config import ConfigError
from mpmd.runtime.worker.instructions import Delete, Run
from mpmd.runtime.worker.mesh import bind
from mpmd.stages import gather, names
from mpmd.stages.sharding import LayoutError, SliceMesh
from tests.runtime.test_mesh_slices import make_gpt, sgd
from tests.support import reference
from tests.support.collectives import GATHERS, step_collectives

M = 4


def _gathers(mode: str):
    """Per slice: (all-gathered arrays per program kind in one step, the number of parameter
    leaves on fsdp, the training stream) of the small GPT on fsdp=2 slices under 1F1B."""
    pipe = mpmd.Pipeline(mpmd.split(make_gpt(), num_stages=2), models.lm_loss)
    with mpmd.Trainer(
        pipe,
        sgd(),
        schedule="1f1b",
        num_microbatches=M,
        max_grad_norm=1.0,
        mesh=mpmd.Mesh({"fsdp": 2}, fsdp_gather=mode),
        cluster=mpmd.InProcessCluster(),
    ) as trainer:
        trainer.step(*reference.batches()[0])
        lowered, layout = trainer.lowered, trainer.programs.layout
        devices = bind(tuple(SliceMesh(fsdp=2)), jax.devices()[:2])
        return [
            (
                step_collectives(lowered, r, devices, GATHERS),
                sum(map(gather.sharded, layout.params[r])),
                list(lowered.train[r]),
            )
            for r in range(2)
        ]


def test_per_step_gathers_each_sharded_weight_once_a_step_not_in_every_program():
    for r, (counts, on_fsdp, stream) in enumerate(_gathers("per_step")):
        assert on_fsdp > 1
        # gather{k} all-gathers the parameters on fsdp once, as one buffer (all are f32 and
        # split over fsdp alone); no forward or backward gathers.
        assert counts == {"gather": 1}, counts
        runs = [i for i in stream if isinstance(i, Run)]
        kinds = [names.parse_program(i.program).kind for i in runs]
        assert kinds.count("gather") == 1 and kinds.index("gather") < kinds.index("fwd")
        # The training programs take pg{k}; it is deleted after the stage's last backward.
        pg = names.gathered(r)
        assert all(
            pg in i.inputs and names.params(r) not in i.inputs
            for i in runs
            if names.parse_program(i.program).kind in ("fwd", "bwd_first", "bwd_acc")
        )
        last_use = max(n for n, i in enumerate(stream) if isinstance(i, Run) and pg in i.inputs)
        assert names.parse_program(stream[last_use].program).kind == "bwd_acc"
        deleted = [n for n, i in enumerate(stream) if isinstance(i, Delete) and i.buffer == pg]
        assert len(deleted) == 1 and deleted[0] > last_use


def test_per_microbatch_gathers_in_every_forward_and_backward():
    for counts, on_fsdp, _ in _gathers("per_microbatch"):
        # Each of the M forwards gathers every weight on fsdp; every backward gathers again.
        assert counts["fwd"] == M * on_fsdp
        assert counts.get("bwd_first", 0) > 0 and counts.get("bwd_acc", 0) > 0
        assert "gather" not in counts


@pytest.mark.parametrize("mesh", [{"fsdp": 2}, {"fsdp": 2, "tensor": 2}])
def test_packed_gather_equals_each_leaf_gathered_bitwise(mesh):
    """gather.gathered packs the leaves split over fsdp alone (along any dim) by dtype; leaves
    split two ways, over tensor, or not at all are left to out_shardings: every leaf comes
    out in its gathered layout with the same bits as gathered on its own."""
    from jax.sharding import NamedSharding

    sm = SliceMesh(**mesh)
    devices = bind(tuple(sm), jax.devices()[: sm.size])
    tensor = "tensor" if sm.tensor > 1 else None
    leaves = [
        ((12, 8), "float32", P("fsdp")),
        ((8, 12), "float32", P(None, "fsdp")),
        ((4, 8, 6), "float32", P(None, "fsdp", None)),
        ((6, 4), "bfloat16", P("fsdp")),
        ((4, 6), "bfloat16", P(None, "fsdp")),
        ((8, 8), "float32", P("fsdp", tensor)),
        ((8,), "float32", P(tensor)),
        ((5,), "float32", P()),
    ]
    layouts = [lay for _, _, lay in leaves]
    rng = np.random.default_rng(0)
    args = [
        jax.device_put(rng.normal(size=shape).astype(dtype), NamedSharding(devices, lay))
        for shape, dtype, lay in leaves
    ]
    outs = tuple(NamedSharding(devices, gather.gathered_layout(lay)) for lay in layouts)
    packed = jax.jit(lambda p: gather.gathered(p, layouts, devices), out_shardings=outs)(args)
    for p, a, o in zip(packed, args, outs):
        assert p.sharding.spec == o.spec and p.dtype == a.dtype
        np.testing.assert_array_equal(np.asarray(p), np.asarray(a))


def test_gathered_layout_takes_only_fsdp_out():
    assert gather.gathered_layout(P("fsdp", "tensor")) == P(None, "tensor")
    assert gather.gathered_layout(P(("fsdp", "tensor"), None)) == P("tensor", None)
    assert gather.gathered_layout(P("expert", None)) == P("expert", None)
    assert gather.sharded(P(None, ("fsdp", "tensor"))) and not gather.sharded(P("tensor"))


def test_bad_fsdp_gather_is_refused_naming_what_is_allowed():
    pipe = mpmd.Pipeline(mpmd.split(make_gpt(), num_stages=2), models.lm_loss)
    with pytest.raises(ValueError, match=r"fsdp_gather must be one of \['per_microbatch', 'per_step'\], got 'once'"):
        mpmd.Trainer(
            pipe, sgd(), num_microbatches=M, cluster=mpmd.InProcessCluster(), mesh=mpmd.Mesh(fsdp_gather="once")
        )
    # per_step without a slice that has fsdp > 1 would do nothing: refused, before any worker.
    with pytest.raises(LayoutError, match="no slice has fsdp > 1"):
        mpmd.Trainer(
            pipe,
            sgd(),
            num_microbatches=M,
            mesh=mpmd.Mesh({"data": 2}, fsdp_gather="per_step"),
            cluster=mpmd.InProcessCluster(),
        )
    # fsdp > 1, but the rules put no parameter on it.
    with pytest.raises(LayoutError, match="no parameter lies on fsdp"):
        mpmd.Trainer(
            pipe,
            sgd(),
            num_microbatches=M,
            mesh=mpmd.Mesh({"fsdp": 2}, rules={"embed": None}, fsdp_gather="per_step"),
            cluster=mpmd.InProcessCluster(),
        )


def _dry_run(*overrides):
    return plan.dry_run(
        config.load(
            "configs/gpt_tiny.yaml",
            ["mesh.fsdp=2", "cluster.devices_per_worker=2", "pipeline.num_microbatches=2", *overrides],
        )
    )


def test_config_refuses_unknown_mode_and_per_step_without_fsdp():
    with pytest.raises(ConfigError, match="mesh.fsdp_gather must be one of 'per_microbatch' or 'per_step'"):
        config.load("configs/gpt_tiny.yaml", ["mesh.fsdp_gather=once"])
    with pytest.raises(ConfigError, match="no slice has fsdp > 1"):
        plan.dry_run(config.load("configs/gpt_tiny.yaml", ["mesh.fsdp_gather=per_step"]))


def test_dry_run_memory_grows_by_the_gathered_weights():
    before, after = _dry_run(), _dry_run("mesh.fsdp_gather=per_step")
    for s, (b, a) in enumerate(zip(before["slices"], after["slices"])):
        # 1F1B, one stage a slice: pg{k} lives from the first forward to the last backward,
        # so the whole of it adds to the peak: fsdp x the bytes of the leaves on fsdp.
        gathered = after["stages"][s]["gathered"]
        assert before["stages"][s]["gathered"] == 0 and 0 < gathered <= 2 * a["params"]
        assert a["gathered"] == gathered and b["gathered"] == 0
        assert a["total"] == b["total"] + gathered
        # The gradients accumulate unreduced (whole per fsdp device) until reduce{k}.
        assert b["grads"] > b["params"]
    text = plan.describe(after)
    assert "gathered weights" in text and "gathered weights" not in plan.describe(before)


def test_simulator_holds_gathered_weights_from_first_forward_to_last_backward():
    from mpmd.schedules import core as schedules
    from mpmd.schedules.simulate import peak_saved_bytes

    schedule = schedules.make("1f1b", 2, 4)
    plain = peak_saved_bytes(schedule, [1.0, 1.0])
    held = peak_saved_bytes(schedule, [1.0, 1.0], gathered_bytes=[100.0, 10.0])
    assert np.allclose(np.subtract(held, plain), [100.0, 10.0])
