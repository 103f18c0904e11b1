"""The autotuner's search space, its memory pruning, its results table and the best config: pure
functions of the user's ds_config, the model's shape and the worker count (no Ray).

A candidate is one point of DeepSpeed's autotuning grid: the ZeRO stage, the micro batch per
worker (the global ``train_batch_size`` stays fixed, gradient accumulation makes up the rest, so
every candidate trains on the same batches as the user's config), ``reduce_bucket_size``, what
activation checkpointing wraps (``raydeep.checkpoint_modules``) and CPU optimizer offload. The
grid is ordered by how many settings differ from the user's own config, then by the grid's order
(larger micro batches first, as DeepSpeed's autotuner tries them), so a ``--max-candidates`` cap
keeps the user's config and its nearest neighbours: every setting varied alone before any pair.

>>> from raydeep.doctor.shape import ModelShape
>>> planned = plan_candidates({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 8},
...                           ModelShape.from_gpt("gpt-tiny"), world_size=2, max_candidates=3)
>>> [entry.candidate.label for entry in planned]
['z0 mb8x1 rb5e8', 'z0 mb4x2 rb5e8', 'z0 mb2x4 rb5e8']
"""
from __future__ import annotations

import copy
import itertools
import json
import os
from dataclasses import dataclass, field

from raydeep.config import load_config, read_config
from raydeep.config.loading import apply_overrides, find_auto
from raydeep.config.sections import RaydeepSection
from raydeep.errors import ConfigError, InputError

STAGES = (0, 1, 2, 3)
CHECKPOINTING = ("none", "attention", "block")  # raydeep.checkpoint_modules (raydeep.doctor.memory's choices)
# DeepSpeed's autotuner tries these reduce buckets; the grid holds the user's value and one other.
BUCKET_CHOICES = (500_000_000, 50_000_000)


@dataclass(frozen=True)
class Candidate:
    """One point of the grid (see the module docstring)."""

    stage: int
    micro: int
    grad_accum: int
    bucket: int
    checkpointing: str = "none"
    offload: bool = False

    @property
    def label(self) -> str:
        """Short and stable: ``z3 mb4x2 rb5e7 ckpt=attention offload``."""
        parts = [f"z{self.stage}", f"mb{self.micro}x{self.grad_accum}", f"rb{_sci(self.bucket)}"]
        parts += [f"ckpt={self.checkpointing}"] if self.checkpointing != "none" else []
        return " ".join(parts + (["offload"] if self.offload else []))

    def nearness(self, other: "Candidate") -> tuple:
        """The grid's sort key from the user's config ``self``: how many settings ``other`` changes,
        then which (a change of the micro batch first, then of the stage, checkpointing, offload,
        bucket: the order DeepSpeed's autotuner weighs them in)."""
        changed = [a != b for a, b in zip(self._values(), other._values())]
        return sum(changed), tuple(not c for c in changed)

    def _values(self) -> tuple:
        return self.micro, self.stage, self.checkpointing, self.offload, self.bucket


@dataclass
class Entry:
    """A candidate, its overrides and its fate: the estimate (bytes per rank), then the trial's result."""

    index: int
    candidate: Candidate
    overrides: dict
    estimate: int | None = None
    status: str = "pending"
    error: str | None = None
    tokens_s: float | None = None
    loss: float | None = None
    steps: int | None = None
    trial_id: str | None = None
    metrics: list[dict] = field(default_factory=list, repr=False)


def baseline(cfg) -> Candidate:
    """The user's own config (loaded for the world size) as a point of the grid."""
    from raydeep.doctor.memory import checkpointing_of

    zero = cfg.zero_optimization
    offload = zero.offload_optimizer is not None and zero.offload_optimizer.device != "none" and zero.stage >= 1
    return Candidate(zero.stage, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps,
                     int(zero.reduce_bucket_size), checkpointing_of(cfg), offload)


def enumerate_candidates(cfg, max_candidates: int | None = None) -> list[Candidate]:
    """Every candidate for ``cfg`` (a loaded config: its world size and global batch are kept),
    nearest to it first (see the module docstring), at most ``max_candidates``."""
    base, world, batch = baseline(cfg), cfg.world_size, cfg.train_batch_size
    per_rank = batch // world
    micros = [m for m in range(per_rank, 0, -1) if per_rank % m == 0]
    buckets = [base.bucket, next(b for b in BUCKET_CHOICES if b != base.bucket)]
    grid = []
    for micro, stage, ckpt, offload, bucket in itertools.product(micros, STAGES, CHECKPOINTING, (False, True), buckets):
        if offload and stage == 0:
            continue  # DeepSpeed offloads from stage 1 on; raydeep warns and ignores it at 0
        grid.append(Candidate(stage, micro, per_rank // micro, bucket, ckpt, offload))
    grid.sort(key=base.nearness)  # stable: the grid's order among equals
    return grid[:max_candidates] if max_candidates else grid


def candidate_overrides(candidate: Candidate, raw: dict, world_size: int) -> dict:
    """The dotted ds_config keys that make ``raw`` (the user's config) train ``candidate``.
    The three batch keys are all written, so the triangle holds as written for this world size;
    checkpointing and offload keys only where they change something, so the best config stays close
    to the user's file."""
    zero = raw.get("zero_optimization") if isinstance(raw.get("zero_optimization"), dict) else {}
    out = {"zero_optimization.stage": candidate.stage,
           "train_batch_size": candidate.micro * candidate.grad_accum * world_size,
           "train_micro_batch_size_per_gpu": candidate.micro, "gradient_accumulation_steps": candidate.grad_accum,
           "zero_optimization.reduce_bucket_size": candidate.bucket}
    # The section's presence turns checkpointing on; raydeep.checkpoint_modules says what it wraps.
    section = raw.get("activation_checkpointing")
    default = RaydeepSection.model_fields["checkpoint_modules"].default
    modules = (raw.get("raydeep") or {}).get("checkpoint_modules", default)
    if candidate.checkpointing != "none":
        if not isinstance(section, dict):
            out["activation_checkpointing"] = {}
        if modules != candidate.checkpointing:
            out["raydeep.checkpoint_modules"] = candidate.checkpointing
    elif section is not None and modules != "none":
        out["raydeep.checkpoint_modules"] = "none"
    user_offload = ((zero.get("offload_optimizer") or {}).get("device") or "none") != "none"
    if candidate.offload != user_offload:
        out["zero_optimization.offload_optimizer.device"] = "cpu" if candidate.offload else "none"
    return out


def plan_candidates(config, shape, world_size: int, memory_budget: int | None = None, on_device: bool = False,
                    max_candidates: int | None = None) -> list[Entry]:
    """The candidates of ``config`` (dict or path, its ``"auto"`` values resolved) for ``world_size``
    workers, each with the doctor's per-rank estimate, those above ``memory_budget`` marked pruned
    (and a candidate the config loader refuses marked invalid, with its message): neither is run.

    ``on_device`` adds the CUDA caching allocator's margin to the estimate, as the doctor does."""
    from raydeep.doctor.memory import plan_memory

    raw = read_config(config)
    if isinstance(raw.get("elasticity"), dict) and raw["elasticity"].get("enabled"):
        raise ConfigError("elasticity.enabled", "the autotuner keeps the global batch of a fixed world size; an "
                          "elastic config chooses its own", value=True,
                          fix="tune with elasticity disabled, then enable it")
    cfg = load_config(copy.deepcopy(raw), world_size=world_size)
    entries = []
    for index, candidate in enumerate(enumerate_candidates(cfg, max_candidates)):
        overrides = candidate_overrides(candidate, raw, world_size)
        entry = Entry(index, candidate, overrides)
        try:
            loaded = load_config(copy.deepcopy(raw), world_size=world_size, overrides=overrides)
        except ConfigError as err:
            entry.status, entry.error = "invalid", str(err).splitlines()[0]
        else:
            entry.estimate = plan_memory(loaded, shape, memory_budget, on_device=on_device).device_total
            if memory_budget is not None and entry.estimate > memory_budget:
                entry.status = "pruned"
                entry.error = f"estimate {_size(entry.estimate)} > budget {_size(memory_budget)}"
        entries.append(entry)
    return entries


def model_shape(model: str, seq: int | None = None):
    """The doctor's :class:`~raydeep.doctor.shape.ModelShape` of ``--model`` (a GPT size, or
    ``package.module:function`` built on the meta device: no memory)."""
    from raydeep.doctor.shape import ModelShape
    from raydeep.models.gpt import GPT_SIZES

    if model in GPT_SIZES:
        return ModelShape.from_gpt(model, seq=seq)
    if ":" not in model:
        raise InputError("--model", "is neither a built-in GPT size nor package.module:function", value=model,
                         fix=f"use one of {', '.join(GPT_SIZES)} or pkg.module:fn")
    import torch

    from raydeep.ray.workload import build_model, sequence_shape

    with torch.device("meta"):
        built = build_model(model, 0)
    return ModelShape.from_module(built, seq or sequence_shape(built)[0], name=model)


def best_entry(entries: list[Entry]) -> Entry | None:
    """The finished trial with the highest throughput (a trial stopped early lost to one that was not)."""
    finished = [e for e in entries if e.status == "finished" and e.tokens_s is not None]
    return max(finished, key=lambda e: e.tokens_s, default=None)


def best_config(config, entry: Entry) -> dict:
    """The user's config with the winning settings applied: a full ds_config."""
    return apply_overrides(copy.deepcopy(read_config(config)), copy.deepcopy(entry.overrides))


def write_best_config(path: str, data: dict) -> None:
    """Write ``data`` as JSON, creating its directory (local paths: the run's storage is local or a URI)."""
    if "://" in path:
        from raydeep.ray.summary import write_json

        write_json(path, data)
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")


def unresolved_auto(config) -> list[str]:
    """The keys still "auto" in ``config`` (the autotuner fills the schedule's from ``--steps``)."""
    return find_auto(read_config(config))


def _sci(n: int) -> str:
    """``500000000`` -> ``5e8`` (``123`` stays ``123``)."""
    mantissa, exponent = f"{n:.0e}".split("e")
    return f"{mantissa}e{int(exponent)}" if float(f"{mantissa}e{exponent}") == n and n >= 1000 else str(n)


def _size(nbytes: int | None) -> str:
    if nbytes is None:
        return "-"
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.1f} MB"


def format_table(entries: list[Entry], best: Entry | None = None) -> str:
    """The results table: one row per candidate, in the grid's order; the best marked with ``*``."""
    header = ("#", "stage", "micro x accum", "bucket", "checkpointing", "offload", "est. memory", "status",
              "tokens/s", "loss", "note")
    rows = [header]
    for e in entries:
        c = e.candidate
        rows.append((f"{e.index}{'*' if e is best else ''}", str(c.stage), f"{c.micro} x {c.grad_accum}",
                     _sci(c.bucket), c.checkpointing, "cpu" if c.offload else "-", _size(e.estimate), e.status,
                     f"{e.tokens_s:,.0f}" if e.tokens_s is not None else "-",
                     f"{e.loss:.4f}" if e.loss is not None else "-", (e.error or "")[:100]))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
