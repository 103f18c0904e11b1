"""The doctor's lint rules: each one fires on a config that has its problem and stays quiet on a
close config that does not; the rule table, the single-source clipping advice, the LR-sweep rule
against the schedulers themselves, and its Ray Tune hook."""
from __future__ import annotations

import logging

import pytest
import torch

from raydeep.config import load_config
from raydeep.config.rules import Advice
from raydeep.doctor.lint import RULES, lint, lr_sweep_finding, rules_markdown
from raydeep.doctor.shape import Cluster, ModelShape
from raydeep.optim.schedulers import build_scheduler

GB = 10**9
# 7e9 parameters, 32 blocks of 201,379,840 (the ZeRO-3 unit).
BIG = ModelShape.from_counts(params=7 * GB, layers=32, hidden=4096, seq=2048, vocab=32000)
MID = ModelShape.from_counts(params=2 * GB, layers=24, hidden=2560, seq=2048, vocab=50304)
SMALL = ModelShape.from_counts(params=3 * 10**8, layers=24, hidden=1024, seq=2048, vocab=50304)
TINY = ModelShape(params=842496, layers=4, hidden=128, seq=256, vocab=512, block_params=198272)
H100 = Cluster(world_size=8, gpus_per_node=8, device_memory=80 * GB)
GPU16 = Cluster(world_size=8, gpus_per_node=8, device_memory=16 * GB)
NO_MEMORY = Cluster(world_size=8)
LR = {"optimizer.params.lr"}


def _findings(ds: dict, shape: ModelShape = BIG, cluster: Cluster = NO_MEMORY, swept=()):
    cfg = load_config({"train_micro_batch_size_per_gpu": 1, **ds}, world_size=cluster.world_size)
    return lint(cfg, shape, cluster, swept)


def _z(stage: int, **keys) -> dict:
    return {"zero_optimization": {"stage": stage, **keys}}


def _bucket(stage: int, size: float | None = None, communication_data_type: str | None = None, **zero) -> dict:
    """A bf16 config at ``stage`` with ``reduce_bucket_size`` ``size`` (None: the default)."""
    zero.update({} if size is None else {"reduce_bucket_size": size})
    comm = {} if communication_data_type is None else {"communication_data_type": communication_data_type}
    return {"bf16": {"enabled": True}, **_z(stage, **zero), **comm}


def _case(ds: dict, shape: ModelShape = BIG, cluster: Cluster = NO_MEMORY, swept=()) -> tuple:
    return ds, shape, cluster, swept


_ACCUM = {"gradient_accumulation_steps": 64, "gradient_clipping": 0}
_FP16 = {"fp16": {"enabled": True, "hysteresis": 1}, **_z(1)}
_4B = ModelShape.from_counts(4 * GB, 32, 3072, 2048, 50304)
_OFFLOAD = _z(2, offload_optimizer={"device": "cpu", "pin_memory": False})
_BF16 = {"bf16": {"enabled": True}, "gradient_accumulation_steps": 8, **_z(2)}
_WARMUP = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 3e-4}}}
_ONEBIT = {"optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3}}}

# rule id -> (severity, the config that triggers it, close configs that do not).
CASES = {
    "accumulation-without-clipping": [
        ("warning", _case(_ACCUM), [_case({**_ACCUM, "gradient_accumulation_steps": 32}),
                                    _case({**_ACCUM, "gradient_clipping": 1.0})])],
    "fp16-without-hysteresis": [
        ("warning", _case(_FP16), [_case({**_FP16, "fp16": {"enabled": True, "hysteresis": 2}}),
                                   _case(_FP16, shape=SMALL),
                                   _case({**_FP16, "fp16": {"enabled": True, "hysteresis": 1, "loss_scale": 128}})]),
        # Stage 0's non-ZeRO scaler has no hysteresis at all.
        ("warning", _case({"fp16": {"enabled": True}}), [_case({"fp16": {"enabled": True}, **_z(1)})]),
    ],
    "bucket-size": [
        # 11 GB of stage-1 bf16 states + two 3 GB buckets > 16 GB; one bucket (no overlap) fits.
        ("error", _case(_bucket(1, 1.5e9, overlap_comm=True), MID, GPU16),
         [_case(_bucket(1, 1.5e9, overlap_comm=False), MID, GPU16),
          _case(_bucket(1, 1.5e9, overlap_comm=True), MID, NO_MEMORY)]),
        # The element size is the communication dtype's: fp32 doubles the bucket.
        ("error", _case(_bucket(1, 1.2e9, overlap_comm=True, communication_data_type="fp32"), MID, GPU16),
         [_case(_bucket(1, 1.2e9, overlap_comm=True), MID, GPU16)]),
        # One bucket of more than half the device memory (16 GB of fp32 elements).
        ("error", _case(_bucket(2, 4e9, communication_data_type="fp32"), _4B, Cluster(64, 8, 16 * GB)),
         [_case(_bucket(2, 1e9, communication_data_type="fp32"), _4B, Cluster(64, 8, 16 * GB))]),
        # DeepSpeed's default 5e8 bf16 elements (1 GB) is 10x below 80 GB / 8; 2.5e9 (5 GB) is within 4x.
        ("info", _case(_bucket(2), BIG, H100),
         [_case(_bucket(2, 2.5e9), BIG, H100),
          _case(_bucket(2), TINY, H100),  # the bucket already holds every gradient
          _case(_bucket(3), BIG, H100)]),  # stage 3 reduces per unit
    ],
    "live-parameters-below-layer": [
        ("warning", _case(_z(3, stage3_max_live_parameters=1e8)),
         [_case(_z(3, stage3_max_live_parameters=3e8)), _case(_z(3, stage3_max_live_parameters=1e8), TINY)]),
        # Under partition_units "param" the unit is the largest tensor (the 4096 x 32000 embedding).
        ("warning", _case({**_z(3, max_live_parameters=1e8), "raydeep": {"partition_units": "param"}}),
         [_case({**_z(3, max_live_parameters=2e8), "raydeep": {"partition_units": "param"}})]),
    ],
    "prefetch-below-layer": [
        ("info", _case(_z(3, stage3_prefetch_bucket_size=1e8)),
         [_case(_z(3, stage3_prefetch_bucket_size=3e8)), _case(_z(3, stage3_prefetch_bucket_size=0))]),
    ],
    "offload-without-pin-memory": [
        ("warning", _case(_OFFLOAD), [_case(_z(2, offload_optimizer={"device": "cpu"})),
                                      _case({**_OFFLOAD, "raydeep": {"offload_target": "actors"}})]),
        ("warning", _case(_z(3, offload_param={"device": "cpu", "pin_memory": False})),
         [_case(_z(3, offload_param={"device": "cpu", "pin_memory": True}))]),
    ],
    "bf16-accumulation": [
        ("warning", _case(_BF16), [_case({**_BF16, "gradient_accumulation_steps": 4}),
                                   _case({**_BF16, "data_types": {"grad_accum_dtype": "fp32"}})]),
        # Stage 1 sums the micro-batches in bf16 whatever grad_accum_dtype says.
        ("warning", _case({**_BF16, **_z(1), "data_types": {"grad_accum_dtype": "fp32"}}),
         [_case({**_BF16, **_z(2), "data_types": {"grad_accum_dtype": "fp32"}})]),
    ],
    "lr-swept-under-scheduler": [
        ("warning", _case(_WARMUP, swept=LR),
         [_case(_WARMUP), _case({**_WARMUP, "scheduler": {"type": "WarmupLR", "params": {}}}, swept=LR),
          _case({**_WARMUP, "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 100}}}, swept=LR)]),
    ],
    "no-effect": [
        # A load-time warning (config/rules.py) ...
        ("warning", _case(_z(0, offload_optimizer={"device": "cpu"})),
         [_case(_z(1, offload_optimizer={"device": "cpu"}))]),
        # ... and combinations it does not cover.
        ("warning", _case(_z(2, stage3_max_live_parameters=1e8)), [_case(_z(3, stage3_max_live_parameters=3e8))]),
        ("info", _case(_z(3, reduce_bucket_size=5e8)), [_case(_z(2, reduce_bucket_size=5e8))]),
        ("warning", _case({"fp16": {"enabled": False, "loss_scale_window": 100}}),
         [_case({"fp16": {"enabled": True, "loss_scale_window": 100}, **_z(1)})]),
        ("warning", _case({"fp16": {"enabled": True, "loss_scale": 128, "hysteresis": 4}, **_z(1)}),
         [_case({"fp16": {"enabled": True, "hysteresis": 4}, **_z(1)})]),
        ("warning", _case({"gradient_allreduce_op": "sum", "gradient_predivide_factor": 2.0}),
         [_case({"gradient_predivide_factor": 2.0})]),
    ],
    "deprecated-key": [
        ("warning", _case(_z(2, cpu_offload=True)), [_case(_z(2, offload_optimizer={"device": "cpu"}))]),
    ],
    "load-warning": [
        ("warning", _case({**_ONEBIT, "bf16": {"enabled": True}}), [_case({**_ONEBIT, "fp16": {"enabled": True}})]),
    ],
}
PAIRS = [pytest.param(rule, severity, fires, quiet, id=f"{rule}-{i}")
         for rule, cases in CASES.items() for i, (severity, fires, quiet) in enumerate(cases)]


def test_every_rule_has_cases():
    assert set(CASES) == set(RULES)


@pytest.mark.parametrize("rule,severity,fires,quiet", PAIRS)
def test_rule_fires_and_stays_quiet(rule, severity, fires, quiet):
    found = [(f.rule, f.severity) for f in _findings(*fires)]
    assert (rule, severity) in found, found
    for near in quiet:
        found = [f for f in _findings(*near) if f.rule == rule]
        assert found == [], found


def test_findings_use_the_registered_severities_and_texts():
    for _, cases in CASES.items():
        for _, fires, _ in cases:
            for f in _findings(*fires):
                assert f.severity in RULES[f.rule].severities
                assert f.message and f.reason and f.fix


def test_keys_are_named_as_written():
    rule = "live-parameters-below-layer"
    (prefixed,) = [f for f in _findings(_z(3, stage3_max_live_parameters=1e8)) if f.rule == rule]
    (plain,) = [f for f in _findings(_z(3, max_live_parameters=1e8)) if f.rule == rule]
    assert prefixed.key == "zero_optimization.stage3_max_live_parameters" and "100,000,000" in prefixed.message
    assert plain.key == "zero_optimization.max_live_parameters"


def test_bucket_suggestion_is_an_element_count_near_an_eighth_of_memory():
    (f,) = [f for f in _findings(_bucket(2), BIG, H100) if f.rule == "bucket-size"]
    assert f.fix == "set zero_optimization.reduce_bucket_size to about 5,000,000,000 elements"  # 10 GB / 2 B


def test_a_written_default_without_effect_is_info_a_changed_value_a_warning():
    severities = {f.key: f.severity for f in _findings({"fp16": {"enabled": False, "loss_scale": 0,
                                                                  "loss_scale_window": 100}}) if f.rule == "no-effect"}
    assert severities == {"fp16.loss_scale": "info", "fp16.loss_scale_window": "warning"}


def test_accumulation_advice_is_reported_once_with_the_load_time_text():
    cfg = load_config({"train_micro_batch_size_per_gpu": 1, **_ACCUM})
    findings = lint(cfg, BIG, NO_MEMORY)
    about_it = [f for f in findings if "gradient_accumulation_steps is 64" in f.message]
    assert [f.rule for f in about_it] == ["accumulation-without-clipping"]
    (f,) = about_it
    assert str(Advice(f.message, f.reason, f.fix)) in cfg.warnings  # one text, two places


def test_no_finding_is_reported_twice():
    ds = {**_ACCUM, "fp16": {"enabled": False, "hysteresis": 1},
          **_z(0, reduce_scatter=False, offload_optimizer={"device": "cpu"})}
    found = _findings(ds)
    assert len(found) == len({(f.rule, f.key, f.message) for f in found})
    # reduce_scatter false is load_config's warning; the stage-0 rule must not repeat it.
    assert [f.rule for f in found if f.key == "zero_optimization.reduce_scatter"] == ["no-effect"]


def test_rules_markdown_lists_every_rule_once():
    table = rules_markdown().splitlines()
    assert len(table) == 2 + len(RULES)
    for rule in RULES:
        assert sum(line.startswith(f"| `{rule}` |") for line in table) == 1


SCHEDULERS = [
    ("WarmupLR", {}), ("WarmupLR", {"warmup_max_lr": 0.5}), ("WarmupDecayLR", {"total_num_steps": 10}),
    ("WarmupDecayLR", {"total_num_steps": 10, "warmup_max_lr": None}),
    ("WarmupCosineLR", {"total_num_steps": 10, "warmup_num_steps": 2}),
    ("OneCycle", {"cycle_min_lr": 0.1, "cycle_max_lr": 0.5}), ("LRRangeTest", {}),
    ("StepLR", {"step_size": 2}), ("OneCycleLR", {"max_lr": 0.5, "total_steps": 10}),
    ("CyclicLR", {"base_lr": 0.01, "max_lr": 0.1}),
]


def _lrs(name: str, params: dict, lr: float) -> list[float]:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    scheduler = build_scheduler(name, dict(params), opt)
    out = []
    for _ in range(5):
        opt.step()
        scheduler.step()
        out.append(opt.param_groups[0]["lr"])
    return out


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("name,params", SCHEDULERS, ids=[f"{n}-{sorted(p)}" for n, p in SCHEDULERS])
def test_lr_rule_matches_what_the_scheduler_does(name, params):
    # The oracle: a scheduler overwrites the optimizer's lr exactly when two lrs give one schedule.
    overwrites = _lrs(name, params, 0.3) == _lrs(name, params, 0.7)
    assert (lr_sweep_finding(name, params) is not None) == overwrites


def test_lr_rule_names_the_key_to_sweep():
    f = lr_sweep_finding("OneCycle", {"cycle_min_lr": 0.1, "cycle_max_lr": 0.5})
    assert f.key == "optimizer.params.lr"
    assert f.fix == "sweep scheduler.params.cycle_max_lr instead of optimizer.params.lr"


def test_tune_trial_sweeping_the_optimizer_lr_warns(tmp_path, caplog):
    from raydeep.ray import TrainSpec
    from raydeep.ray.tune import trial_spec

    base = TrainSpec(num_workers=1, steps=4, storage_path=str(tmp_path), name="lr")  # WarmupDecayLR, warmup_max_lr
    with caplog.at_level(logging.WARNING, logger="raydeep"):
        trial_spec(base, {"set": {"scheduler.params.warmup_max_lr": 1e-3}}, "t1")
    assert "lr-swept-under-scheduler" not in caplog.text
    with caplog.at_level(logging.WARNING, logger="raydeep"):
        trial_spec(base, {"set": {"optimizer.params.lr": 1e-3}}, "t2")
    assert "[lr-swept-under-scheduler]" in caplog.text and "scheduler.params.warmup_max_lr" in caplog.text
