"""The autotuner's grid, its memory pruning and the best config it writes (no Ray)."""
from __future__ import annotations

import copy

import pytest

from raydeep.autotune.space import (Entry, best_config, best_entry, candidate_overrides, enumerate_candidates,
                                    format_table, plan_candidates, write_best_config)
from raydeep.cli import build_parser
from raydeep.config import load_config
from raydeep.doctor.shape import ModelShape
from raydeep.errors import ConfigError

# The tiny GPT's README config, its schedule resolved: global batch 16, micro 8, ZeRO-3.
CONFIG = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 8, "gradient_clipping": 1.0,
          "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "torch_adam": True}},
          "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 2, "total_num_steps": 20}},
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 1000}}


@pytest.fixture(scope="module")
def shape():
    return ModelShape.from_gpt("gpt-tiny")


def test_every_candidate_keeps_the_global_batch_and_loads(shape):
    entries = plan_candidates(CONFIG, shape, world_size=2)
    # micro batches 8, 4, 2, 1 x stages 0-3 x 3 checkpointing choices x 2 buckets, offload from stage 1 on.
    assert len(entries) == 4 * (1 + 3 * 2) * 3 * 2
    assert len({e.candidate for e in entries}) == len(entries)
    for entry in entries:
        cfg = load_config(copy.deepcopy(CONFIG), world_size=2, overrides=entry.overrides)
        assert cfg.train_batch_size == 16
        assert cfg.train_micro_batch_size_per_gpu * cfg.gradient_accumulation_steps * 2 == 16
        assert cfg.zero_optimization.stage == entry.candidate.stage
        assert entry.status == "pending" and entry.estimate > 0


def test_the_order_is_deterministic_and_nearest_first():
    cfg = load_config(copy.deepcopy(CONFIG), world_size=2)
    grid = enumerate_candidates(cfg)
    assert grid == enumerate_candidates(load_config(copy.deepcopy(CONFIG), world_size=2))
    assert [c.label for c in grid[:11]] == [
        "z3 mb8x1 rb5e8",  # the config itself, then each setting changed alone: micro batch first
        "z3 mb4x2 rb5e8", "z3 mb2x4 rb5e8", "z3 mb1x8 rb5e8",
        "z0 mb8x1 rb5e8", "z1 mb8x1 rb5e8", "z2 mb8x1 rb5e8",
        "z3 mb8x1 rb5e8 ckpt=attention", "z3 mb8x1 rb5e8 ckpt=block",
        "z3 mb8x1 rb5e8 offload", "z3 mb8x1 rb5e7"]
    assert enumerate_candidates(cfg, max_candidates=5) == grid[:5]


def test_overrides_touch_checkpointing_and_offload_only_to_change_them():
    cfg = load_config(copy.deepcopy(CONFIG), world_size=2)
    grid = enumerate_candidates(cfg)
    plain, attention, block, offload = grid[0], grid[7], grid[8], grid[9]
    batch = {"zero_optimization.stage": 3, "train_batch_size": 16, "train_micro_batch_size_per_gpu": 8,
             "gradient_accumulation_steps": 1, "zero_optimization.reduce_bucket_size": 500_000_000}
    assert candidate_overrides(plain, CONFIG, 2) == batch
    # The section turns checkpointing on; "attention" is what raydeep.checkpoint_modules defaults to.
    assert candidate_overrides(attention, CONFIG, 2) == {**batch, "activation_checkpointing": {}}
    assert candidate_overrides(block, CONFIG, 2)["raydeep.checkpoint_modules"] == "block"
    assert candidate_overrides(offload, CONFIG, 2)["zero_optimization.offload_optimizer.device"] == "cpu"
    # A user config that offloads: the candidates without offload turn it off.
    offloading = {**CONFIG, "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}
    base = enumerate_candidates(load_config(copy.deepcopy(offloading), world_size=2))[0]
    assert base.offload and "zero_optimization.offload_optimizer.device" not in candidate_overrides(base, offloading, 2)
    stage0 = next(c for c in enumerate_candidates(load_config(copy.deepcopy(offloading), world_size=2)) if c.stage == 0)
    assert candidate_overrides(stage0, offloading, 2)["zero_optimization.offload_optimizer.device"] == "none"


def test_a_budget_prunes_what_the_doctor_says_does_not_fit(shape):
    entries = plan_candidates(CONFIG, shape, world_size=2, max_candidates=5)
    small = next(e for e in entries if e.candidate.micro == 1)   # the least activation memory
    big = next(e for e in entries if e.candidate.stage == 0)    # every state whole, micro 8
    budget = (small.estimate + big.estimate) // 2
    planned = plan_candidates(CONFIG, shape, world_size=2, memory_budget=budget, max_candidates=5)
    pruned = {e.candidate: e for e in planned}
    assert pruned[big.candidate].status == "pruned" and pruned[big.candidate].estimate == big.estimate
    assert "> budget" in pruned[big.candidate].error
    assert pruned[small.candidate].status == "pending" and pruned[small.candidate].error is None
    # The caching allocator's margin (a GPU run) only makes the estimate larger.
    on_device = plan_candidates(CONFIG, shape, world_size=2, on_device=True, max_candidates=5)
    assert all(d.estimate > e.estimate for d, e in zip(on_device, entries))
    assert "pruned" in format_table(list(pruned.values()))


def test_the_best_config_is_a_full_config_the_loader_accepts(tmp_path, shape):
    entries = plan_candidates(CONFIG, shape, world_size=2, max_candidates=8)
    for entry, (status, rate) in zip(entries, [("finished", 900.0), ("finished", 1200.0), ("failed", None),
                                                ("stopped early", 5000.0)]):
        entry.status, entry.tokens_s, entry.loss = status, rate, 4.0
    best = best_entry(entries)
    assert best is entries[1]  # the fastest finished trial: one stopped early lost to it
    path = tmp_path / "out" / "best_ds_config.json"
    write_best_config(str(path), best_config(CONFIG, best))
    cfg = load_config(str(path), world_size=2)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (16, 4, 2)
    assert cfg.gradient_clipping == 1.0 and cfg.optimizer.type == "AdamW"  # the user's other settings kept
    assert "1*" in format_table(entries, best)
    assert best_entry([Entry(0, best.candidate, {}, status="failed")]) is None


def test_bad_inputs_are_refused():
    with pytest.raises(ConfigError, match="elasticity"):
        plan_candidates({**CONFIG, "elasticity": {"enabled": True, "max_train_batch_size": 16,
                                                   "micro_batch_sizes": [8]}}, None, world_size=2)
    with pytest.raises(ConfigError, match="train_batch_size"):
        plan_candidates(CONFIG, None, world_size=3)  # 16 samples cannot be split over 3 workers
    with pytest.raises(SystemExit):
        build_parser().parse_args(["autotune", "ds.json", "--num-workers", "0"])
    args = build_parser().parse_args(["autotune", "ds.json", "--max-candidates", "3"])
    assert (args.num_workers, args.max_candidates, args.steps, args.func.__module__) == (2, 3, 20, "raydeep.autotune")
