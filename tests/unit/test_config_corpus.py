"""Every ds_config in ``jobs/configs/`` loads with the world size and ``--set`` overrides it needs.

``CORPUS`` is the table: one entry per file, with the world size, the overrides (the values the
Hugging Face integration would fill in for ``"auto"``) and the resolved values to check. A file
added to ``jobs/configs/`` without an entry here fails ``test_every_corpus_file_has_an_entry``.

Files that use a feature raydeep refuses stay as users
have them: without ``fixes`` they must be refused naming that key, and with ``fixes`` (the change the
refusal's fix asks for) they load.
"""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from raydeep.config import ConfigError, RaydeepConfig, load_config
from raydeep.config.loading import find_auto

REPO = Path(__file__).resolve().parents[2]
CONFIG_DIR = REPO / "jobs" / "configs"

# What Hugging Face's Trainer fills into the optimizer/scheduler "auto" slots (§1.4 of the spec).
HF_OPTIMIZER = (
    "optimizer.params.lr=3e-5",
    "optimizer.params.betas=[0.9, 0.999]",
    "optimizer.params.eps=1e-8",
    "optimizer.params.weight_decay=0.0",
    "gradient_clipping=1.0",
    "scheduler.params.warmup_min_lr=0",
    "scheduler.params.warmup_max_lr=3e-5",
    "scheduler.params.warmup_num_steps=500",
)


@dataclass(frozen=True)
class Entry:
    """How to load one corpus file, and what it must resolve to."""

    world_size: int
    sets: tuple[str, ...] = ()
    batch: tuple[int, int, int] = (0, 0, 0)  # train_batch_size, micro batch, accumulation steps
    stage: int = 0
    precision: str = "fp32"
    optimizer: str | None = None
    scheduler: str | None = None
    extra: dict = field(default_factory=dict)  # dotted attribute path -> expected value

    @property
    def overrides(self) -> list[str]:
        return list(self.sets)


CORPUS: dict[str, Entry] = {
    "ds_config_zero2.json": Entry(
        8, ("train_micro_batch_size_per_gpu=4", "gradient_accumulation_steps=1", "fp16.enabled=true",
            "bf16.enabled=false", *HF_OPTIMIZER),
        batch=(32, 4, 1), stage=2, precision="fp16", optimizer="AdamW", scheduler="WarmupLR",
        # reduce_bucket_size stays "auto": DeepSpeed drops it to the 5e8 default.
        extra={"zero_optimization.reduce_bucket_size": 500_000_000,
               "zero_optimization.allgather_bucket_size": 200_000_000,
               "zero_optimization.offload_optimizer.device": "cpu",
               "optimizer.params.betas": [0.9, 0.999]}),
    "ds_config_zero3.json": Entry(
        16, ("train_micro_batch_size_per_gpu=2", "gradient_accumulation_steps=4", "bf16.enabled=true",
             "fp16.enabled=false", *HF_OPTIMIZER, "scheduler.params.total_num_steps=10000",
             "zero_optimization.reduce_bucket_size=16777216",
             "zero_optimization.stage3_prefetch_bucket_size=15099494",
             "zero_optimization.stage3_param_persistence_threshold=40960"),
        batch=(128, 2, 4), stage=3, precision="bf16", optimizer="AdamW", scheduler="WarmupDecayLR",
        extra={"zero_optimization.prefetch_bucket_size": 15_099_494,
               "zero_optimization.param_persistence_threshold": 40_960,
               "zero_optimization.max_live_parameters": 1_000_000_000,
               "zero_optimization.gather_16bit_weights_on_model_save": True,
               "zero_optimization.offload_param.device": "cpu",
               "zero_optimization.offload_optimizer.device": "cpu",
               "scheduler.params.total_num_steps": 10_000}),
    "megatron_gpt_bf16_zero1.json": Entry(
        32, batch=(512, 4, 4), stage=1, precision="bf16",
        extra={"grad_accum_dtype": "fp32", "steps_per_print": 10, "wall_clock_breakdown": False}),
    # 1-bit Adam, 0/1 Adam and 1-bit LAMB (compressed communication) load as written.
    "bert_onebit_adam.json": Entry(
        64, batch=(4096, 16, 4), stage=0, precision="fp16", optimizer="OneBitAdam",
        extra={"optimizer.params.lr": 4e-4, "optimizer.params.freeze_step": 23000, "fp16.loss_scale_window": 1000}),
    "bert_zero_one_adam.json": Entry(
        32, batch=(4096, 16, 8), stage=0, precision="fp16", optimizer="ZeroOneAdam", scheduler="WarmupLR",
        extra={"optimizer.params.lr": 1e-3, "optimizer.params.var_freeze_step": 23000}),
    "bert_onebit_lamb.json": Entry(
        64, batch=(65536, 64, 16), stage=0, precision="fp16", optimizer="OneBitLamb",
        extra={"optimizer.params.freeze_step": 1000, "optimizer.params.max_coeff": 0.3,
               "optimizer.params.factor_threshold": 0.1}),
    "seed_175b_zero3_offload.json": Entry(
        1, batch=(1024, 8, 128), stage=3, precision="fp32", optimizer="AdamW", scheduler="WarmupLR",
        extra={"zero_optimization.offload_optimizer.device": "cpu",
               "zero_optimization.allgather_bucket_size": 500_000_000,
               "zero_optimization.overlap_comm": True,
               "activation_checkpointing.partition_activations": True,
               "activation_checkpointing.contiguous_memory_optimization": True,
               "activation_checkpointing.number_checkpoints": 12,
               "gradient_clipping": 1.0}),
    # DeepSpeed's ZeRO++ tutorial: its zero_optimization section as written; the launch line's
    # --batch-size 1 --fp16 become the two keys Megatron-DeepSpeed adds. 4 nodes x 16 GPUs.
    "deepspeed_zeropp_tutorial.json": Entry(
        64, ("train_micro_batch_size_per_gpu=1", "fp16.enabled=true"), batch=(64, 1, 1), stage=3, precision="fp16",
        extra={"zero_optimization.zero_hpz_partition_size": 16, "zero_optimization.zero_quantized_weights": True,
               "zero_optimization.zero_quantized_gradients": True, "zero_optimization.reduce_bucket_size": 10_000_000}),
    "zero2_offload_fp16.json": Entry(
        16, batch=(16, 1, 1), stage=2, precision="fp16", optimizer="Adam",
        extra={"zero_optimization.offload_optimizer.device": "cpu",
               "zero_optimization.reduce_bucket_size": 50_000_000,
               "wall_clock_breakdown": True, "fp16.hysteresis": 2}),
    "chat_zero3_prefetch.json": Entry(
        8, batch=(256, 8, 4), stage=3, precision="fp16", optimizer="AdamW",
        extra={"zero_optimization.prefetch_bucket_size": 30_000_000,
               "zero_optimization.max_live_parameters": 30_000_000,
               "zero_optimization.param_persistence_threshold": 10_000,
               "zero_optimization.memory_efficient_linear": False,
               "zero_optimization.offload_param.device": "none",
               "fp16.loss_scale_window": 100}),
    # Elasticity picks the batch: 1680 for micro batches [2, 4, 6] up to 2000 (v0.1); 84 per rank at 20.
    "elasticity_v01.json": Entry(
        20, batch=(1680, 6, 14), stage=2, precision="fp16", optimizer="Adam",
        extra={"elasticity.enabled": True, "elasticity.version": 0.1}),
    # v0.2 is node-granular (8 GPUs a node): 768 at 16 workers; the given micro batch is ignored.
    "elasticity_v02.json": Entry(
        16, batch=(768, 16, 3), stage=1, precision="bf16", optimizer="AdamW",
        extra={"elasticity.version": 0.2, "elasticity.num_gpus_per_node": 8}),
    "bert_lamb_64k.json": Entry(
        64, batch=(65536, 64, 16), stage=0, precision="fp16", optimizer="Lamb",
        extra={"optimizer.params.max_coeff": 0.3, "fp16.loss_scale": 0.0}),
    "onecycle_adam.json": Entry(
        4, batch=(512, 32, 4), stage=1, precision="fp16", optimizer="Adam", scheduler="OneCycle",
        extra={"scheduler.params.cycle_first_stair_count": 500, "scheduler.params.cycle_max_mom": 0.99}),
    "warmup_cosine_bf16_zero2.json": Entry(
        8, batch=(256, 2, 16), stage=2, precision="bf16", optimizer="AdamW", scheduler="WarmupCosineLR",
        extra={"scheduler.params.cos_min_ratio": 0.1, "zero_optimization.overlap_comm": True}),
    "cifar_sgd_fp32.json": Entry(
        4, batch=(256, 64, 1), stage=0, precision="fp32", optimizer="SGD", scheduler="MultiStepLR",
        extra={"gradient_clipping": 0.0, "optimizer.params.nesterov": True}),
    "commented.hjson": Entry(
        8, batch=(256, 4, 8), stage=3, precision="bf16", optimizer="AdamW", scheduler="WarmupDecayLR",
        extra={"zero_optimization.reduce_bucket_size": 16_777_216,
               "zero_optimization.gather_16bit_weights_on_model_save": True,
               "zero_optimization.overlap_comm": True}),
    "monitored_bf16_zero2.json": Entry(
        32, batch=(1024, 8, 4), stage=2, precision="bf16", optimizer="AdamW", scheduler="WarmupDecayLR",
        extra={"communication_data_type": "fp32", "tensorboard.enabled": True,
               "tensorboard.job_name": "gpt2_medium_pretrain", "checkpoint.tag_validation": "Warn"}),
}


def corpus_files() -> list[str]:
    """Every file in jobs/configs/ but its README: each must have a CORPUS entry."""
    return sorted(p.name for p in CONFIG_DIR.iterdir() if p.is_file() and p.name != "README.md")


def load_entry(name: str) -> RaydeepConfig:
    entry = CORPUS[name]
    return load_config(CONFIG_DIR / name, world_size=entry.world_size, overrides=entry.overrides)


def _get(obj, dotted: str):
    for part in dotted.split("."):
        obj = obj[part] if isinstance(obj, dict) else getattr(obj, part)
    return obj


def test_corpus_is_large_enough():
    assert len(corpus_files()) >= 14


def test_every_corpus_file_has_an_entry():
    files = set(corpus_files())
    assert files - set(CORPUS) == set(), "add a CORPUS entry (world size, --set overrides) for each new config"
    assert set(CORPUS) - files == set(), "CORPUS lists a file that is not in jobs/configs/"


@pytest.mark.parametrize("name", corpus_files())
def test_corpus_config_loads(name):
    assert name in CORPUS, f"{name} has no entry in CORPUS"
    entry = CORPUS[name]
    cfg = load_entry(name)
    assert isinstance(cfg, RaydeepConfig)
    assert cfg.world_size == entry.world_size
    batch = (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps)
    assert batch == entry.batch
    assert cfg.train_batch_size == (cfg.train_micro_batch_size_per_gpu * cfg.gradient_accumulation_steps
                                    * entry.world_size)
    assert cfg.zero_optimization.stage == entry.stage
    assert cfg.precision == entry.precision
    assert (cfg.optimizer.type if cfg.optimizer else None) == entry.optimizer
    assert (cfg.scheduler.type if cfg.scheduler else None) == entry.scheduler
    for dotted, expected in entry.extra.items():
        assert _get(cfg, dotted) == expected, dotted


# Fields whose own default is the string "auto" (not a Hugging Face placeholder).
AUTO_DEFAULTS = {"data_types.keep_in_fp32_modules", "raydeep.partition_units", "raydeep.offload_target",
                 "raydeep.memory_snapshot_every"}


@pytest.mark.parametrize("name", corpus_files())
def test_corpus_config_has_no_auto_left(name):
    assert set(find_auto(load_entry(name).to_ds_dict())) <= AUTO_DEFAULTS


@pytest.mark.parametrize("name", [n for n, e in CORPUS.items() if e.sets and '"auto"' in (CONFIG_DIR / n).read_text()])
def test_auto_configs_need_their_overrides(name):
    """Without the --set values, the top-level "auto" keys are refused, naming each one."""
    with pytest.raises(ConfigError) as info:
        load_config(CONFIG_DIR / name, world_size=CORPUS[name].world_size)
    assert "train_micro_batch_size_per_gpu" in str(info.value)
    assert "optimizer.params.lr" in str(info.value)


def test_seed_report_config_keeps_its_verbatim_sections():
    """The 175B config is the field report's §6 example plus its §2.2 batch keys, unchanged."""
    raw = json.loads((CONFIG_DIR / "seed_175b_zero3_offload.json").read_text())
    assert raw["activation_checkpointing"] == {
        "partition_activations": True, "contiguous_memory_optimization": True, "number_checkpoints": 12,
        "synchronize_checkpoint_boundary": True, "profile": False}
    assert {k: raw[k] for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                "gradient_accumulation_steps")} == {
        "train_batch_size": 1024, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 128}


CLI_FILES = ("ds_config_zero3.json", "megatron_gpt_bf16_zero1.json", "commented.hjson")


@pytest.fixture(scope="module")
def cli_runs() -> dict[str, tuple[int, str, str]]:
    """``python -m raydeep config check --json`` on each of CLI_FILES, run side by side."""
    procs = {}
    for name in CLI_FILES:
        entry = CORPUS[name]
        cmd = [sys.executable, "-m", "raydeep", "config", "check", str(CONFIG_DIR / name),
               "--world-size", str(entry.world_size), "--json"]
        for item in entry.overrides:
            cmd += ["--set", item]
        procs[name] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    results = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=180)
        results[name] = (proc.returncode, out, err)
    return results


@pytest.mark.parametrize("name", CLI_FILES)
def test_cli_config_check_json(cli_runs, name):
    returncode, out, err = cli_runs[name]
    entry = CORPUS[name]
    assert returncode == 0, err
    assert "Traceback" not in err
    resolved = json.loads(out)
    batch = tuple(resolved[k] for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                        "gradient_accumulation_steps"))
    assert all(type(v) is int for v in batch), batch
    assert batch == entry.batch
    assert resolved["zero_optimization"]["stage"] == entry.stage
