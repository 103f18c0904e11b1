"""The driver's batch plan: one global batch for every world size a run may be given.

Ray Train restarts the worker group with whatever number of workers fits (``num_workers=(min,
max)``), so the batch keys cannot be fixed in the ds_config: ``train_batch_size`` must stay the
same (the optimizer sees the same batches, the learning-rate schedule keeps its meaning) while
the micro batch and the accumulation steps follow the world size. The driver computes the plan
for every size in the range before any worker starts, so a size without a valid plan fails
fast, with the list of valid sizes, instead of after a restart hours into the run.

Two sources, as in DeepSpeed:

- the ``elasticity`` section: DeepSpeed's elasticity rules choose one batch valid for many world
  sizes (``micro_batch_sizes``, ``max_train_batch_size``, ``prefer_larger_batch``, v0.1/v0.2);
- otherwise the batch keys, resolved at the largest size of the range (the run's nominal size):
  the micro batch given there is the per-rank memory budget, so at a smaller size the plan
  keeps it (or the largest divisor of it that fits) and accumulates more.

>>> schedule = plan_batches({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4}, 1, 2)
>>> schedule.for_world_size(2), schedule.for_world_size(1)
(BatchPlan(train_batch_size=16, micro_batch=4, grad_accum=2, world_size=2), \
BatchPlan(train_batch_size=16, micro_batch=4, grad_accum=4, world_size=1))
"""
from __future__ import annotations

from dataclasses import dataclass

from raydeep.config.batch import BatchPlan, compatible_batch, derive_batch, elastic_plan, valid_world_sizes
from raydeep.config import load_config
from raydeep.config.loading import read_config
from raydeep.config.sections import ElasticityConfig
from raydeep.errors import ConfigError, ElasticityError

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


@dataclass(frozen=True)
class BatchSchedule:
    """The plan of every world size in ``[min_workers, max_workers]``; one global batch for all."""

    train_batch_size: int
    plans: dict[int, BatchPlan]

    def for_world_size(self, world_size: int) -> BatchPlan:
        if world_size not in self.plans:
            raise ElasticityError("num_workers", f"no batch plan for world size {world_size}; planned sizes: "
                                  f"{sorted(self.plans)}", value=world_size,
                                  fix="run with a number of workers inside the planned range")
        return self.plans[world_size]

    def engine_config(self, ds_config: dict, world_size: int) -> dict:
        """``ds_config`` with the batch keys of this world size written in and ``elasticity`` removed
        (it has been applied: the engine must not re-derive the batch)."""
        plan = self.for_world_size(world_size)
        config = {k: v for k, v in ds_config.items() if k != "elasticity"}
        config.update(train_batch_size=plan.train_batch_size, train_micro_batch_size_per_gpu=plan.micro_batch,
                      gradient_accumulation_steps=plan.grad_accum)
        return config


def plan_batches(ds_config, min_workers: int, max_workers: int) -> BatchSchedule:
    """Plan every world size from ``min_workers`` to ``max_workers`` (see the module docstring).

    Raises :class:`~raydeep.errors.ElasticityError` listing the valid world sizes when any size in
    the range has no plan that keeps the global batch.
    """
    if not 1 <= min_workers <= max_workers:
        raise ConfigError("num_workers", f"needs 1 <= min <= max, got ({min_workers}, {max_workers})",
                          value=(min_workers, max_workers), fix="e.g. --num-workers 2 or --num-workers 1:2")
    data = read_config(ds_config)
    section = data.get("elasticity") or {}
    if isinstance(section, dict) and section.get("enabled"):
        batch, plans, valid = _elastic_plans(data, ElasticityConfig.model_validate(section), min_workers, max_workers)
    else:
        batch, plans, valid = _fixed_batch_plans(data, min_workers, max_workers)
    missing = [w for w in range(min_workers, max_workers + 1) if w not in plans]
    if missing:
        raise ElasticityError(
            "num_workers", f"world size {missing[0]} cannot keep the global batch of {batch} samples "
            f"(no valid micro batch x accumulation split); valid world sizes: {valid}",
            value=(min_workers, max_workers), fix=f"choose num_workers (or its min:max range) among {valid}, "
            "or change train_batch_size / micro batch")
    schedule = BatchSchedule(batch, plans)
    for world in {min_workers, max_workers}:  # the rest of the config, checked before any worker starts
        load_config(schedule.engine_config(data, world), world_size=world)
    return schedule


def _fixed_batch_plans(data: dict, lo: int, hi: int) -> tuple[int, dict[int, BatchPlan], list[int]]:
    keys = dict(zip(BATCH_KEYS, (data.get(k) for k in BATCH_KEYS)))
    for key, value in keys.items():
        if value == "auto":
            raise ConfigError(key, '"auto" is not resolved', fix=f"set it with --set {key}=VALUE")
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise ConfigError(key, "must be a positive integer", value=value, fix=f"set {key} to a positive integer")
    batch, micro, accum = keys.values()
    if micro is None or batch is None:
        # DeepSpeed's derivation at the nominal (largest) size fills in the missing key; the
        # micro batch found there is the per-rank budget for every smaller size.
        nominal = derive_batch(batch, micro, accum, hi)
        batch, micro = nominal.train_batch_size, nominal.micro_batch
    # Given accumulation steps describe the nominal size only: the plan decides them per size.
    micros = [d for d in range(micro, 0, -1) if micro % d == 0]  # the user's budget, then its divisors
    plans = {}
    for world in range(lo, hi + 1):
        fitting = next((m for m in micros if batch % (m * world) == 0), None)
        if fitting is not None:
            plans[world] = BatchPlan(batch, fitting, batch // (fitting * world), world)
    return batch, plans, valid_world_sizes(batch, micros, 1, batch)


def _elastic_plans(data: dict, section: ElasticityConfig, lo: int, hi: int) -> tuple[int, dict[int, BatchPlan], list[int]]:
    if section.model_parallel_size > 1:
        elastic_plan(section, lo)  # raises raydeep's message for model parallelism
    given = [k for k in BATCH_KEYS if data.get(k) is not None]
    if given and not section.ignore_non_elastic_batch_info:
        load_config(data, world_size=lo)  # DeepSpeed's refusal of batch keys beside elasticity
    # Sizes outside DeepSpeed's list would get a batch of their own, so they are not planned.
    batch, valid = compatible_batch(section)
    plans = {w: elastic_plan(section, w) for w in range(lo, hi + 1) if w in valid}
    return batch, plans, valid
