"""When a run does not fit: the cheapest config changes that make it fit, each with its cost.

Each candidate is one change to the ds_config (checkpoint more activations, a smaller micro batch
with more accumulation for the same global batch, a higher ZeRO stage, optimizer offload, smaller
buckets or fewer live parameters); the memory model is re-run on the changed config, and the ones
that fit are ordered by their estimated step-time cost. When no single change fits, the cheapest
combination of two or three that fits is proposed.

The costs are rough on purpose -- the order is what matters. They assume a GPU computing at
:data:`COMPUTE_FLOPS` and links of :data:`LINK_BYTES_S` within a node and :data:`NET_BYTES_S`
between nodes, PCIe at :data:`PCIE_BYTES_S` and a CPU Adam at :data:`CPU_ADAM_PARAMS_S`.
"""
from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass

from raydeep.config import load_config
from raydeep.config.loading import apply_overrides
from raydeep.doctor.memory import MemoryPlan, plan_memory
from raydeep.doctor.shape import Cluster, ModelShape
from raydeep.doctor.traffic import predict_traffic
from raydeep.errors import ConfigError

COMPUTE_FLOPS = 150e12  # sustained bf16 FLOP/s of a data-centre GPU (about 40-50% of an A100/H100 peak)
LINK_BYTES_S = 100e9  # NVLink-class bandwidth per GPU within a node
NET_BYTES_S = 25e9  # network bandwidth per GPU between nodes
PCIE_BYTES_S = 20e9  # host <-> device copies
CPU_ADAM_PARAMS_S = 1e9  # parameters per second a rank's CPU Adam updates


@dataclass(frozen=True)
class Change:
    """One candidate change: what to set, what it costs, and the memory after it."""

    title: str
    settings: dict  # dotted key -> value, as `--set` takes them
    cost: float  # estimated step-time increase, as a fraction of the step
    cost_text: str
    plan: MemoryPlan

    def as_dict(self) -> dict:
        return {"title": self.title, "set": self.settings, "cost_fraction": round(self.cost, 4),
                "cost": self.cost_text, "device_total": self.plan.device_total, "host_total": self.plan.host_total,
                "fits": self.plan.fits}


def step_seconds(cfg, shape: ModelShape, cluster: Cluster) -> tuple[float, float]:
    """(compute, communication) seconds of one optimizer step under the assumed rates."""
    tokens = cfg.train_micro_batch_size_per_gpu * cfg.gradient_accumulation_steps * shape.seq
    flops = tokens * (6 * shape.params + 12 * shape.layers * shape.hidden * shape.seq)
    bandwidth = LINK_BYTES_S if cluster.nodes == 1 else NET_BYTES_S
    return flops / COMPUTE_FLOPS, predict_traffic(cfg, shape).ring_bytes / bandwidth


def apply_change(raw: dict, settings: dict) -> dict:
    """A copy of ``raw`` with the dotted ``settings`` set, as ``--set`` sets them."""
    return apply_overrides(copy.deepcopy(raw), settings)


def _attention_share(shape: ModelShape) -> float:
    """The attention's share of a block's forward FLOPs: what recomputing it adds to a step."""
    h, s = shape.hidden, shape.seq
    attention = 8 * h * h + 4 * s * h
    return attention / (3 * (24 * h * h + 4 * s * h))


def candidates(raw: dict, cfg, shape: ModelShape) -> list[tuple[str, dict, str]]:
    """(title, settings, kind) of every change worth trying for this config."""
    zero = cfg.zero_optimization
    out = []
    choice = "none" if cfg.activation_checkpointing is None else cfg.raydeep.checkpoint_modules
    if choice in ("none",):
        out.append(("checkpoint the attention", {"activation_checkpointing": {}, "raydeep.checkpoint_modules": "attention"}, "attention"))
    if choice in ("none", "attention"):
        section = {} if cfg.activation_checkpointing is not None else {"activation_checkpointing": {}}
        if (cfg.activation_checkpointing is not None and cfg.activation_checkpointing.number_checkpoints is not None
                and cfg.activation_checkpointing.number_checkpoints < shape.layers):
            # with blocks, number_checkpoints limits how many are checkpointed: every block, here
            section["activation_checkpointing.number_checkpoints"] = shape.layers
        out.append(("checkpoint whole blocks", {**section, "raydeep.checkpoint_modules": "block"}, "block"))
    if cfg.precision == "fp32":
        out.append(("train in bf16 (fp32 master weights kept)", {"bf16": {"enabled": True}}, "bf16"))
    micro = cfg.train_micro_batch_size_per_gpu
    for smaller in sorted({micro // 2, 1} - {0, micro}, reverse=True):
        if micro % smaller:
            continue
        out.append((f"micro batch {smaller} with {micro // smaller}x the accumulation (same global batch)",
                    {"train_micro_batch_size_per_gpu": smaller,
                     "gradient_accumulation_steps": cfg.gradient_accumulation_steps * micro // smaller,
                     "train_batch_size": cfg.train_batch_size}, "micro"))
    if zero.stage < 3:
        out.append((f"ZeRO stage {zero.stage + 1}", {"zero_optimization.stage": zero.stage + 1}, "stage"))
    if zero.stage >= 1 and (zero.offload_optimizer is None or zero.offload_optimizer.device == "none"):
        out.append(("offload the optimizer to CPU", {"zero_optimization.offload_optimizer": {"device": "cpu", "pin_memory": True}},
                    "offload"))
    if zero.stage == 3 and (zero.offload_param is None or zero.offload_param.device == "none"):
        out.append(("offload the parameters to CPU", {"zero_optimization.offload_param": {"device": "cpu", "pin_memory": True}},
                    "offload_param"))
    if zero.stage == 2 and zero.reduce_bucket_size > 50_000_000:
        out.append(("smaller reduce buckets", {"zero_optimization.reduce_bucket_size": zero.reduce_bucket_size // 4}, "bucket"))
    if zero.stage == 3 and zero.prefetch_bucket_size > 0:
        out.append(("no prefetching", {"zero_optimization.stage3_prefetch_bucket_size": 0}, "prefetch"))
    return out


def _cost(kind: str, before, after, shape: ModelShape, cluster: Cluster) -> tuple[float, str]:
    compute, comm = step_seconds(before, shape, cluster)
    step = max(compute + comm, 1e-9)
    if kind == "attention":
        share = _attention_share(shape)
        return share, f"recomputes the attention forward: about +{share:.0%} step time"
    if kind == "block":
        return 1 / 3, "recomputes each block's forward: about +33% step time"
    if kind == "bf16":
        return 0.0, "none in step time (bf16 matmuls are faster); check that the loss curve matches"
    if kind == "micro":
        extra = step_seconds(after, shape, cluster)[1] - comm
        shrink = before.train_micro_batch_size_per_gpu // after.train_micro_batch_size_per_gpu
        cost = 0.05 * shrink.bit_length() + extra / step
        text = f"smaller matrix multiplies (about +{0.05 * shrink.bit_length():.0%} step time)"
        return cost, text + (f", +{extra / step:.0%} communication" if extra > 0 else "")
    if kind in ("stage", "bucket", "prefetch"):
        new_comm = step_seconds(after, shape, cluster)[1]
        grow = predict_traffic(after, shape).ring_bytes - predict_traffic(before, shape).ring_bytes
        base = 0.01 if kind != "stage" else 0.0
        return base + max(0.0, new_comm - comm) / step, (
            f"{grow / 1e9:+.2f} GB sent per rank per step" if kind == "stage" else
            "more, smaller collectives (less overlap)")
    part = shape.params / before.world_size
    if kind == "offload":
        seconds = 6 * part / PCIE_BYTES_S + part / CPU_ADAM_PARAMS_S
        return seconds / step, f"the optimizer step runs on the CPU: about +{seconds:.1f} s per step"
    seconds = 2 * 2 * before.gradient_accumulation_steps * part / PCIE_BYTES_S
    return seconds / step, f"parameters cross PCIe every micro-step: about +{seconds:.1f} s per step"


def changes_that_fit(raw: dict, cfg, shape: ModelShape, cluster: Cluster, limit: int = 5) -> list[Change]:
    """Single changes that make the run fit, cheapest first; else the cheapest pair or triple
    (of different kinds: two micro batch sizes or two checkpointing choices do not combine)."""
    tried = []
    for title, settings, kind in candidates(raw, cfg, shape):
        change = _evaluate(raw, cfg, shape, cluster, [(title, settings, kind)])
        if change is not None:
            tried.append((change, (title, settings, kind)))
    tried.sort(key=lambda pair: pair[0].cost)
    fitting = [change for change, _ in tried if change.plan.fits]
    if fitting:
        return fitting[:limit]
    for size in (2, 3):
        combos = []
        for parts in itertools.combinations([part for _, part in tried], size):
            if len({kind for _, _, kind in parts}) == size:
                change = _evaluate(raw, cfg, shape, cluster, list(parts))
                if change is not None and change.plan.fits:
                    combos.append(change)
        if combos:
            return sorted(combos, key=lambda c: c.cost)[:1]
    return []


def _evaluate(raw: dict, cfg, shape: ModelShape, cluster: Cluster, parts: list) -> Change | None:
    """The memory and cost of applying every change in ``parts`` together (None: the config refuses it)."""
    settings: dict = {}
    for _, more, _ in parts:
        settings.update(more)
    try:
        after = load_config(apply_change(raw, settings), world_size=cluster.world_size)
    except ConfigError:
        return None  # a change this config cannot take (e.g. an optimizer ZeRO refuses)
    plan = plan_memory(after, shape, cluster.device_memory, cluster.host_memory, cluster.gpus_per_node)
    costs = [_cost(kind, cfg, after, shape, cluster) for _, _, kind in parts]
    return Change(" + ".join(title for title, _, _ in parts), settings, sum(c for c, _ in costs),
                  "; ".join(text for _, text in costs), plan)
