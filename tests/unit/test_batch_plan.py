"""The driver's batch plan: one global batch at every world size of a run, or a fast failure that
lists the valid sizes."""
from __future__ import annotations

import itertools

import pytest

from raydeep.config import load_config
from raydeep.config.batch import elastic_plan
from raydeep.config.sections import ElasticityConfig
from raydeep.errors import ConfigError, ElasticityError
from raydeep.ray.batch_plan import plan_batches

OPTIMIZER = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}


def table(schedule) -> dict[int, tuple[int, int]]:
    return {w: (p.micro_batch, p.grad_accum) for w, p in schedule.plans.items()}


def test_fewer_workers_accumulate_more_with_the_same_micro_batch():
    schedule = plan_batches({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4}, 1, 2)
    assert schedule.train_batch_size == 16
    assert table(schedule) == {1: (4, 4), 2: (4, 2)}
    assert table(plan_batches({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4}, 4, 4)) == {4: (4, 1)}


def test_world_size_without_a_plan_fails_fast_listing_valid_sizes():
    with pytest.raises(ElasticityError) as info:
        plan_batches({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4}, 1, 3)
    message = str(info.value)
    assert "world size 3" in message and "16" in message
    assert "[1, 2, 4, 8, 16]" in message


def test_micro_batch_falls_back_to_a_divisor_when_it_does_not_fit():
    schedule = plan_batches({"train_batch_size": 12, "train_micro_batch_size_per_gpu": 4}, 1, 3)
    assert table(schedule) == {1: (4, 3), 2: (2, 3), 3: (4, 1)}


def test_nominal_size_is_the_largest_of_the_range():
    # Only the global batch: DeepSpeed's derivation at the largest size (g=1) sets the micro batch.
    assert table(plan_batches({"train_batch_size": 16}, 1, 2)) == {1: (8, 2), 2: (8, 1)}
    # Only the micro batch (and accumulation): the global batch is m * g * max.
    schedule = plan_batches({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3}, 1, 2)
    assert schedule.train_batch_size == 12 and table(schedule) == {1: (2, 6), 2: (2, 3)}


@pytest.mark.parametrize("batch, micro, low, high", [
    (b, m, lo, hi) for b, m, (lo, hi) in itertools.product([8, 12, 16, 24, 48], [1, 2, 3, 4, 8], [(1, 2), (2, 4), (1, 1)])
    if b % m == 0])
def test_every_plan_keeps_the_global_batch_within_the_micro_budget(batch, micro, low, high):
    config = {"train_batch_size": batch, "train_micro_batch_size_per_gpu": micro}
    try:
        schedule = plan_batches(config, low, high)
    except ElasticityError:
        assert any(batch % w for w in range(low, high + 1))  # only refused when some size cannot divide it
        return
    assert sorted(schedule.plans) == list(range(low, high + 1))
    for world, plan in schedule.plans.items():
        assert plan.micro_batch * plan.grad_accum * world == batch
        assert micro % plan.micro_batch == 0  # never more memory per rank than the user's micro batch


def test_engine_config_writes_the_plan_and_loads():
    ds = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, **OPTIMIZER}
    schedule = plan_batches(ds, 1, 2)
    config = schedule.engine_config(ds, 1)
    cfg = load_config(config, world_size=1)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (16, 4, 4)
    assert ds["gradient_accumulation_steps"] == 2  # the user's dict is not modified


ELASTIC = {"elasticity": {"enabled": True, "max_train_batch_size": 64, "micro_batch_sizes": [2, 4],
                          "version": 0.1}, **OPTIMIZER}


def test_elasticity_section_uses_deepspeeds_rules():
    schedule = plan_batches(ELASTIC, 1, 4)
    section = ElasticityConfig.model_validate(ELASTIC["elasticity"])
    for world, plan in schedule.plans.items():
        assert plan == elastic_plan(section, world)
        assert plan.train_batch_size == schedule.train_batch_size
    config = schedule.engine_config(ELASTIC, 3)
    assert "elasticity" not in config and load_config(config, world_size=3).train_batch_size == schedule.train_batch_size


def test_elasticity_refuses_a_size_outside_its_list():
    config = {**ELASTIC, "elasticity": {**ELASTIC["elasticity"], "max_gpus": 4}}
    with pytest.raises(ElasticityError) as info:
        plan_batches(config, 1, 5)
    assert "world size 5" in str(info.value) and "valid world sizes: [1, 2, 3, 4]" in str(info.value)


def test_elasticity_with_batch_keys_is_refused_as_deepspeed_does():
    with pytest.raises(ConfigError, match="will not be used"):
        plan_batches({**ELASTIC, "train_batch_size": 8}, 1, 2)


@pytest.mark.parametrize("config, key", [
    ({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2}, "train_batch_size"),
    ({"train_batch_size": 0, "train_micro_batch_size_per_gpu": 2}, "train_batch_size"),
    ({"train_batch_size": 8, "train_micro_batch_size_per_gpu": -1}, "train_micro_batch_size_per_gpu"),
])
def test_bad_batch_keys_name_the_key(config, key):
    with pytest.raises(ConfigError) as info:
        plan_batches(config, 1, 2)
    assert info.value.key == key


def test_rest_of_the_config_is_checked_on_the_driver():
    with pytest.raises(ConfigError, match="gradient_clip"):
        plan_batches({"train_batch_size": 8, "gradient_clip": 1.0}, 1, 2)


def test_range_must_be_ordered():
    with pytest.raises(ConfigError, match="num_workers"):
        plan_batches({"train_batch_size": 8}, 3, 2)
