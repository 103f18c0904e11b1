"""The field report's 175B config, activation_checkpointing section as written: the config check
and the doctor warn only about ``partition_activations`` (tensor parallelism, which raydeep lacks);
every other key of the section takes effect."""
from __future__ import annotations

import logging
from pathlib import Path

from raydeep.config import load_config

REPO = Path(__file__).resolve().parents[2]
SEED_175B = REPO / "jobs" / "configs" / "seed_175b_zero3_offload.json"


def test_config_check_warns_only_about_partition_activations(caplog):
    with caplog.at_level(logging.WARNING):
        cfg = load_config(SEED_175B, world_size=1)
    about = [r.getMessage() for r in caplog.records if "activation_checkpointing" in r.getMessage()]
    assert len(about) == 1 and about[0].startswith("activation_checkpointing.partition_activations"), about
    assert cfg.activation_checkpointing.number_checkpoints == 12


def test_the_doctor_says_partition_activations_has_no_effect():
    from raydeep.doctor import Cluster, diagnose
    from raydeep.doctor.shape import ModelShape
    from raydeep.doctor.shape import parse_bytes

    shape = ModelShape.from_counts(175_000_000_000, 96, 12288, 2048, 50257)
    report = diagnose(str(SEED_175B), shape, Cluster(world_size=1024, gpus_per_node=8,
                                                     device_memory=parse_bytes("80GB")))
    keys = [f.key for f in report.findings if f.rule == "no-effect" and "activation_checkpointing" in (f.key or "")]
    assert keys == ["activation_checkpointing.partition_activations"], keys


def test_number_checkpoints_without_block_or_contiguous_buffers_is_warned(caplog):
    with caplog.at_level(logging.WARNING):
        load_config({"train_batch_size": 1, "activation_checkpointing": {"number_checkpoints": 4}})
    assert any(r.getMessage().startswith("activation_checkpointing.number_checkpoints = 4 has no effect")
               for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        load_config({"train_batch_size": 1, "activation_checkpointing": {"number_checkpoints": 4},
                     "raydeep": {"checkpoint_modules": "block"}})
    assert not [r for r in caplog.records if "number_checkpoints" in r.getMessage()]
