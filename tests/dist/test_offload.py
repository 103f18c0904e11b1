"""ZeRO-Offload to host memory on 2 gloo ranks: the same training, bit for bit, as without it.

Why bitwise: on a CPU rank the host tier runs the same torch kernel on the same fp32 values as
the local tier -- only where the masters live differs -- and ``sub_group_size`` cuts the update
only at element offsets that keep each element in the same lane of the kernel's vector loop
(``raydeep.tier.masters.plan_sub_groups``). ``offload_param`` (stage 3) keeps the parameter
partitions in host memory, which on a CPU rank changes copies, not arithmetic.

The actor tier is checked against the same baseline in ``tests/ray/test_offload_actors.py``.
"""
from __future__ import annotations

import pytest
import torch

from tests.dist.harness import run_ranks
from tests.dist.workloads import config, train_engine

STEPS, GAS, MICRO = 3, 2, 2
HOST = {"offload_optimizer": {"device": "cpu", "pin_memory": True}}
VARIANTS = {
    "host": (HOST, {}),
    "host, sub-groups of 4096": ({**HOST, "sub_group_size": 4096}, {}),
    "local, sub-groups of 4096": ({"sub_group_size": 4096}, {}),
}
STAGE3_VARIANTS = {"host + offload_param": ({**HOST, "offload_param": {"device": "cpu"}}, {})}


def _config(stage: int, precision: str, zero_extra: dict) -> dict:
    cfg = config(stage, GAS, MICRO, 1.0, raydeep={"offload_target": "host"})
    cfg["zero_optimization"].update(zero_extra)
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def _sweep(stages: list[int], precisions: list[str]) -> dict:
    out = {}
    for stage in stages:
        variants = {"none": ({}, {}), **VARIANTS, **(STAGE3_VARIANTS if stage == 3 else {})}
        for precision in precisions:
            for name, (zero_extra, _) in variants.items():
                result = train_engine(_config(stage, precision, zero_extra), STEPS, MICRO * GAS * 2)
                out[(stage, precision, name)] = result
    return out


@pytest.fixture(scope="module")
def sweep() -> dict:
    return run_ranks(_sweep, 2, [1, 2, 3], ["fp32", "bf16"])[0]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offloaded_training_equals_training_without_offload(sweep, stage, precision):
    base = sweep[(stage, precision, "none")]
    names = [n for (s, p, n) in sweep if (s, p) == (stage, precision) and n != "none"]
    assert len(names) == len(VARIANTS) + (len(STAGE3_VARIANTS) if stage == 3 else 0)
    for name in names:
        run = sweep[(stage, precision, name)]
        assert run["losses"] == base["losses"], name
        for key, value in base["params"].items():
            assert torch.equal(run["params"][key], value), (name, key)


def test_host_tier_memory_report_and_sub_group_bound(sweep):
    """On a CPU rank the host is the device: the masters and states still count in its total. The
    one-pass CPU update reads the bf16 gradients where they are (``step_buffers`` 0); torch's four
    passes (where the extension is unavailable) widen them, at most 4096 fp32 elements at once in
    sub-groups of 4096."""
    from raydeep.tier import cpu_update

    whole = sweep[(2, "bf16", "host")]["memory"]
    tiled = sweep[(2, "bf16", "host, sub-groups of 4096")]["memory"]
    shard = sweep[(2, "bf16", "host")]["numel"] / 2
    assert whole["master"] == tiled["master"] >= 4 * shard
    assert whole["optimizer_states"] == tiled["optimizer_states"] >= 8 * shard
    if cpu_update.available():
        assert whole["step_buffers"] == tiled["step_buffers"] == 0
    else:
        assert 4 * 4096 >= tiled["step_buffers"] > 0 and whole["step_buffers"] > 4 * 4096
    assert whole["offloaded"] == 0


def _checkpoint_cross_load(directory: str, save: bool) -> dict:
    """World 2 saves with and without host offload; world 1 loads each into the other config."""
    import raydeep
    from raydeep import comm
    from tests.dist.checkpoint_workloads import continue_training, layout_config
    from tests.dist.workloads import tiny_gpt

    def build(zero_extra: dict):
        cfg = layout_config(2, comm.world_size(), raydeep={"offload_target": "host"})
        cfg["zero_optimization"].update(zero_extra)
        engine, *_ = raydeep.initialize(model=tiny_gpt(), config=cfg)
        return engine

    out = {}
    if save:
        for name, extra in (("host", HOST), ("none", {})):
            engine = build(extra)
            continue_training(engine, 2)
            engine.save_checkpoint(f"{directory}/{name}")
        return out
    for saved, loader in (("host", "none"), ("none", "host"), ("none", "none")):
        engine = build(HOST if loader == "host" else {})
        engine.load_checkpoint(f"{directory}/{saved}")
        out[(saved, loader)] = continue_training(engine, 1)
    return out


def test_checkpoints_cross_load_between_offload_and_none_at_another_world_size(tmp_path):
    run_ranks(_checkpoint_cross_load, 2, str(tmp_path), True)
    results = run_ranks(_checkpoint_cross_load, 1, str(tmp_path), False)[0]
    reference = results[("none", "none")]
    for pair in (("host", "none"), ("none", "host")):
        assert results[pair]["losses"] == reference["losses"], pair
        assert all(torch.equal(results[pair]["params"][k], v) for k, v in reference["params"].items()), pair
