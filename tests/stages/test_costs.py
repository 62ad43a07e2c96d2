"""Task costs: measured from the pipeline's own programs; the full backward priced as itself."""

import jax
import numpy as np
import pytest
from flax import nnx

from mpmd import models
import mpmd
from mpmd.schedules import core as schedules
from mpmd.stages.costs import measure
from mpmd.schedules.cli import main
from mpmd.schedules.simulate import simulate


@pytest.fixture(scope="module")
def measured():
    model = models.GPT(64, 32, 2, 2, 16, rngs=nnx.Rngs(0))
    pipe = mpmd.Pipeline(mpmd.split(model, num_stages=2), models.lm_loss)
    tokens = jax.ShapeDtypeStruct((2, 16), np.int32)
    return measure(pipe, tokens, tokens)


def test_measure_prices_each_program(measured):
    assert len(measured) == 2
    for k, c in enumerate(measured):
        assert set(c) == {"F", "B", "W", "BW"}
        assert c["F"] > 0 and c["W"] > 0 and c["BW"] > 0
        # A backward costs at least its weight-gradient part.
        assert c["BW"] >= c["W"] * 0.99
    assert measured[0]["B"] == 0.0  # the first stage's input is data: no input gradient
    assert measured[1]["B"] > 0


def test_simulator_prices_the_full_backward_as_measured(measured):
    m = 4
    one_f_one_b = simulate(schedules.make("1f1b", 2, m), measured)
    zb = simulate(schedules.make("zb-h1", 2, m), measured)
    busy = lambda sim: [sum(e - s for _, s, e in row) for row in sim.spans]
    # Without split backward a B task costs BW, not B + W; with it, B and W each.
    assert busy(one_f_one_b) == pytest.approx([m * (c["F"] + c["BW"]) for c in measured])
    assert busy(zb) == pytest.approx([m * (c["F"] + c["B"] + c["W"]) for c in measured])


def test_bw_key_overrides_b_plus_w():
    schedule = schedules.make("gpipe", 2, 2)
    assert (
        simulate(schedule, {"F": 1, "B": 1, "W": 1}).makespan
        == simulate(schedule, {"F": 1, "B": 1, "W": 1, "BW": 2}).makespan
    )
    assert (
        simulate(schedule, {"F": 1, "B": 1, "W": 1, "BW": 1}).makespan
        < simulate(schedule, {"F": 1, "B": 1, "W": 1}).makespan
    )
    with pytest.raises(ValueError, match=r"costs\[1\]\['BW'\] must be a number >= 0"):
        simulate(schedule, [{"F": 1, "B": 1, "W": 1}, {"F": 1, "B": 1, "W": 1, "BW": -1}])


def test_schedule_cli_takes_bw_and_says_what_zb_assumes(tmp_path, capsys):
    out = tmp_path / "zb.svg"
    assert main(["zb-h1", "--stages", "2", "--microbatches", "4", "-o", str(out)]) == 0
    assert "assumes B + W = one full backward" in capsys.readouterr().out
    assert main(["zb-h1", "--stages", "2", "--microbatches", "4", "--costs", "1,0.5,1,1", "-o", str(out)]) == 0
    assert "assumes" not in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["1f1b", "--stages", "2", "--microbatches", "4", "--costs", "1,1"])


@pytest.mark.parametrize("config_file", ["configs/gpt_tiny.yaml", "configs/gemma3_tiny.yaml", "configs/moe_tiny.yaml"])
def test_repeated_layers_are_priced_once_each_as_alone(config_file, monkeypatch):
    """layer_costs prices a layer whose graphdef, parameters and input another layer had
    already (repeated blocks) without lowering it again, and gets what pricing it alone
    does: Gemma 3's local and global blocks (other graphdefs) apart, GPT's and MoE's alike."""
    from mpmd.recipes import config
    from mpmd.recipes.run import build
    from mpmd.stages import costs

    model, _ = build.built_model(config.load(config_file), abstract=False)
    layers = list(getattr(model, "all_layers", model.layers)())  # Gemma 3's: tied, not cut by layers()
    tokens = np.zeros((2, 16), np.int32)
    lowered = []
    cost = costs._cost
    monkeypatch.setattr(costs, "_cost", lambda low, *a: lowered.append(low) or cost(low, *a))
    shared, unit = costs.layer_costs(layers, tokens)
    alone = costs.fn_costs([costs.stage_fn(l) for l in layers], tokens)
    assert unit == "flops" and shared == alone
    kinds = len({nnx.graphdef(l) for l in layers})
    assert len(lowered) == kinds + len(layers) < 2 * len(layers), (len(lowered), kinds, len(layers))
