"""The batch-size triangle, derived exactly as DeepSpeed does, and elastic batch plans.

``train_batch_size = train_micro_batch_size_per_gpu * gradient_accumulation_steps * world_size``.
Missing keys are derived with floor division in DeepSpeed's order, then DeepSpeed's four checks
run in DeepSpeed's order with its messages, each followed by a one-line fix.

The ``elasticity`` section follows the last DeepSpeed releases that had it (v0.1 and v0.2
algorithms): it picks one global batch that stays valid across a range of world sizes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from raydeep.errors import ConfigError, ElasticityError

# The 38 highly composite numbers DeepSpeed's elasticity scales candidate batches by.
HCN_LIST = [1, 2, 4, 6, 12, 24, 36, 48, 60, 120, 180, 240, 360, 720, 840, 1260, 1680, 2520, 5040,
            7560, 10080, 15120, 20160, 25200, 27720, 45360, 50400, 55440, 83160, 110880, 166320,
            221760, 277200, 332640, 498960, 554400, 665280, 720720]


@dataclass(frozen=True)
class BatchPlan:
    """Resolved batch keys for one world size."""

    train_batch_size: int
    micro_batch: int
    grad_accum: int
    world_size: int


TRAIN, MICRO, GRAD_ACC = "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"
_LABELS = {MICRO: "Micro batch size per gpu", GRAD_ACC: "Gradient accumulation steps"}


def derive_batch(train_batch: int | None, micro: int | None, grad_acc: int | None, world_size: int) -> BatchPlan:
    """DeepSpeed's ``_set_batch_related_parameters`` followed by ``_batch_assertion``.

    Every error names a key the user gave; a value raydeep derived is described as derived, with
    the arithmetic that produced it.

    >>> derive_batch(32, 4, None, 2)
    BatchPlan(train_batch_size=32, micro_batch=4, grad_accum=4, world_size=2)
    """
    B, m, g, W = train_batch, micro, grad_acc, world_size
    given = {key for key, v in ((TRAIN, B), (MICRO, m), (GRAD_ACC, g)) if v is not None}
    if B is not None and m is not None and g is not None:
        pass
    elif B is not None and m is not None:
        _refuse_zero_divisor(B, MICRO, m)
        g = (B // m) // W
    elif B is not None and g is not None:
        _refuse_zero_divisor(B, GRAD_ACC, g)
        m = (B // W) // g
    elif m is not None and g is not None:
        B = m * g * W
    elif B is not None:
        g, m = 1, B // W
    elif m is not None:
        B, g = m * W, 1
    else:
        raise ConfigError(TRAIN, "Either train_batch_size or train_micro_batch_size_per_gpu needs to be provided",
                          fix="set train_micro_batch_size_per_gpu (and optionally gradient_accumulation_steps)")
    _assert_batch(B, m, g, W, given)
    return BatchPlan(B, m, g, W)


def _refuse_zero_divisor(B: int, key: str, value: int) -> None:
    # DeepSpeed divides by the given key before its checks and dies with ZeroDivisionError on a
    # zero; fail the check it would have reached instead, batch size first as in its order.
    if value == 0:
        _check_train_batch(B, fix="make every batch key a positive integer")
        _check_given(key, 0)


def _check_train_batch(B: int, fix: str) -> None:
    if B <= 0:
        raise ConfigError(TRAIN, f"Train batch size: {B} has to be greater than 0", value=B, fix=fix)


def _check_given(key: str, value: int) -> None:
    if value <= 0:
        raise ConfigError(key, f"{_LABELS[key]}: {value} has to be greater than 0", value=value,
                          fix=f"set {key} to a positive integer")


def _check_derived(key: str, value: int, arithmetic: str, B: int, fix: str) -> None:
    # A derived value comes from train_batch_size (the only key both derivations divide), so the
    # error names that key and shows how the value was derived.
    if value <= 0:
        raise ConfigError(TRAIN, f"{_LABELS[key]}: {value} has to be greater than 0 ({key} is derived as "
                          f"{arithmetic})", value=B, fix=fix)


def _assert_batch(B: int, m: int, g: int, W: int, given: set[str] | frozenset[str] = frozenset()) -> None:
    """DeepSpeed's four checks in its order, the keys the user gave before the values derived from
    them. A derived train_batch_size (m * g * W, or m * W) is positive exactly when the keys it came
    from are, so those keys are checked instead."""
    if TRAIN in given:
        _check_train_batch(B, fix=f"use at least micro_batch * world_size = {m * W} for world size {W}"
                           if m > 0 and g > 0 else "make every batch key a positive integer")
    for key, value in ((MICRO, m), (GRAD_ACC, g)):
        if key in given:
            _check_given(key, value)
    if MICRO not in given:
        _check_derived(MICRO, m, "train_batch_size // world_size // gradient_accumulation_steps = "
                       f"{B} // {W} // {g}", B,
                       fix=f"set train_batch_size to at least gradient_accumulation_steps * world_size = {g * W}")
    if GRAD_ACC not in given:
        _check_derived(GRAD_ACC, g, "train_batch_size // train_micro_batch_size_per_gpu // world_size = "
                       f"{B} // {m} // {W}", B,
                       fix=f"set train_batch_size to at least micro_batch * world_size = {m * W}")
    if B != m * g * W:
        raise ConfigError(
            TRAIN,
            "Check batch related parameters. train_batch_size is not equal to micro_batch_per_gpu * "
            f"gradient_acc_step * world_size {B} != {m} * {g} * {W}", value=B,
            fix=f"set train_batch_size to {m * g * W}, or remove one of the three keys so it is derived for world size {W}")


# --- elasticity (DeepSpeed releases before 0.19.8) -----------------------------------------

def _candidate_batch_sizes(bases: list[int], max_batch: int) -> list[int]:
    candidates = set()
    for base in bases:
        if base >= max_batch:
            candidates.add(base)
        else:
            limit = max_batch // base
            hcn = max(h for h in HCN_LIST if h <= limit)
            candidates.add(hcn * base)
    return sorted(candidates)


def valid_world_sizes(batch: int, micro_batches: list[int], min_gpus: int, max_gpus: int) -> list[int]:
    """World sizes at which ``batch`` splits evenly into one of ``micro_batches`` per rank."""
    valid = set()
    for mb in micro_batches:
        if batch % mb:
            continue
        gpus = batch // mb
        if min_gpus <= gpus <= max_gpus:
            valid.add(gpus)
        for i in range(max(1, min_gpus), min(gpus // 2, max_gpus) + 1):
            if gpus % i == 0:
                valid.add(i)
    return sorted(valid)


def _compatible_v01(micro_batches: list[int], max_batch: int, min_gpus: int, max_gpus: int,
                    prefer_larger: bool) -> tuple[int, list[int]]:
    min_gpus = min_gpus or 1
    max_gpus = max_gpus or max_batch // min(micro_batches)
    if any(mb > max_batch for mb in micro_batches):
        raise ElasticityError("elasticity.micro_batch_sizes",
                              f"All micro batches must be less than or equal to max_acceptable_batch_size: {max_batch}",
                              value=micro_batches, fix="lower the micro batch sizes or raise max_train_batch_size")
    bases = list(micro_batches) + [math.lcm(*micro_batches)]
    best_batch, best_valid = int(min(micro_batches)), []
    for batch in _candidate_batch_sizes(bases, max_batch):
        valid = valid_world_sizes(batch, micro_batches, min_gpus, max_gpus)
        better_tie = (prefer_larger and batch > best_batch) or (not prefer_larger and batch < best_batch)
        if len(valid) > len(best_valid) or (len(valid) == len(best_valid) and better_tie):
            best_batch, best_valid = batch, valid
    return best_batch, best_valid


def compatible_batch(section) -> tuple[int, list[int]]:
    """DeepSpeed's candidate search: the one global batch valid for the most world sizes, and
    those sizes (v0.2 searches per node, then scales by ``num_gpus_per_node``)."""
    per_node = section.num_gpus_per_node if section.version > 0.1 else 1
    batch, valid_nodes = _compatible_v01(list(section.micro_batch_sizes), int(section.max_train_batch_size / per_node),
                                         int(section.min_gpus / per_node), int(section.max_gpus / per_node),
                                         section.prefer_larger_batch)
    return batch * per_node, [n * per_node for n in valid_nodes]


def elastic_plan(section, world_size: int) -> BatchPlan:
    """The batch plan the ``elasticity`` section gives at ``world_size`` (v0.1 or v0.2 rules).

    >>> from raydeep.config.sections import ElasticityConfig
    >>> cfg = ElasticityConfig(enabled=True, max_train_batch_size=64, micro_batch_sizes=[2, 4], version=0.1)
    >>> elastic_plan(cfg, 2).train_batch_size
    48
    """
    mbs = list(section.micro_batch_sizes)
    if section.version <= 0.1:
        batch, valid = compatible_batch(section)
    else:
        batch, valid = _compatible_v02(section, world_size)
    if world_size not in valid:
        raise ElasticityError("elasticity", f"World size ({world_size}) is not valid with the current list of valid "
                              f"GPU counts: {valid}", value=world_size,
                              fix=f"run with one of {valid} workers, or widen micro_batch_sizes/max_train_batch_size")
    micro = next((mb for mb in sorted(set(mbs), reverse=True) if (batch // world_size) % mb == 0), None)
    if micro is None:
        raise ElasticityError("elasticity.micro_batch_sizes", f"no micro batch divides {batch // world_size} samples per rank",
                              value=mbs, fix="add a micro batch size that divides the per-rank batch")
    return BatchPlan(batch, micro, batch // (micro * world_size), world_size)


def _compatible_v02(section, world_size: int) -> tuple[int, list[int]]:
    mp = section.model_parallel_size
    if mp > 1:
        # v0.2 counts data-parallel ranks as GPUs / model_parallel_size; raydeep has no model
        # parallelism, so every worker is a data-parallel rank and only 1 describes it.
        raise ConfigError("elasticity.model_parallel_size", "model parallelism is not supported by raydeep "
                          "(every worker is a data-parallel rank)", value=mp, fix="set it to 1 or remove it")
    batch, valid = compatible_batch(section)
    if world_size in valid:
        return batch, valid
    # The current size is not in the list: DeepSpeed falls back to the largest (or smallest)
    # batch the current size can run, valid for this size only. Its data-parallel size,
    # (W / per_node) * (per_node / mp), is W itself once mp is 1; using W directly also avoids the
    # float product truncating to W - 1 (1 / 49 * 49 < 1) and so dividing by zero below.
    dp = world_size
    options = [math.floor(section.max_train_batch_size / float(mb * dp)) * mb * dp for mb in section.micro_batch_sizes]
    batch = int(max(options) if section.prefer_larger_batch else min(options))
    if batch <= 0:
        raise ElasticityError("elasticity.max_train_batch_size", f"no batch fits at world size {world_size}: the "
                              f"smallest is {min(section.micro_batch_sizes) * dp} (micro batch * world size)",
                              value=section.max_train_batch_size,
                              fix=f"raise it to at least {min(section.micro_batch_sizes) * dp} or run with fewer workers")
    return batch, [dp]
