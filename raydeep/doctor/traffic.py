"""Communication per optimizer step, predicted from the config and the model's shape.

Bytes are counted as ``raydeep.comm.CommStats`` counts them (the all-reduced tensor, the
reduce-scatter input, the all-gather output, the all-to-all input), so a prediction can be checked
against ``engine.comm_stats()``; ``ring_bytes`` is what each rank sends: ``2(N-1)/N`` of an
all-reduce, ``(N-1)/N`` of a reduce-scatter or all-gather over a ring, ``(N-1)/N`` of an all-to-all.

Per optimizer step of ``G`` micro-steps, Psi elements of communication dtype:

* stage 0: one all-reduce of the gradients (Psi) at the boundary;
* stage 1: one reduce-scatter (Psi) at the boundary, one all-gather of the updated weights (Psi);
* stage 2: a reduce-scatter (Psi) every micro-step, one all-gather (Psi);
* stage 3: every micro-step gathers the partitioned weights for forward and again for backward,
  less what stays gathered in between (the blocks whose reuse distance, the elements fetched
  between their forward and their backward, is within ``stage3_max_reuse_distance``, and the root
  unit, used last in forward and first in backward), and reduce-scatters the gradients (Psi); the
  persistent parameters are re-gathered after the step.

ZeRO++ at stage 3 (the engine's ``raydeep.zero.hierarchy``) changes where those bytes go:

* hpZ (``zero_hpz_partition_size`` H > 1): the first gather of a unit after an optimizer step is a
  primary one over every rank and leaves each rank ``1/H`` of the unit; every later gather until the
  next step (backward, and the forward and backward of the step's later micro-batches: the shards
  change only at the step) is an all-gather inside the block of H ranks (``all_gather_secondary``);
* qwZ (``zero_quantized_weights``): primary gathers move int8 values plus one fp32 scale per group
  of about 4k-8k values (``raydeep.zero.quantize.weight_groups``, DeepSpeed's ``CUDAQuantizer``):
  about half the bytes of fp16 weights (``all_gather_quantized``);
* qgZ (``zero_quantized_gradients``): DeepSpeed's hierarchical all-to-all: int4 values plus fp32
  scales to the node's ranks first, then each rank's 1/L of the node's partial sums to the same
  local index on every node (both counted as ``quantized_reduce_scatter``, as the engine counts
  them; ``links_by_op`` keeps the ``/local`` and ``/global`` phases apart): across nodes about a
  quarter of an fp16 reduce-scatter. The persistent parameters (the small biases and norms
  stage 3 keeps gathered) keep the plain reduce-scatter, as the engine sends them.

``calls_by_op`` counts the collectives launched per step (stage 3: one per unit gathered or
reduce-scattered, two per quantized gather, four per qgZ reduce-scatter; one scalar all-reduce of
the gradient norm), which :mod:`raydeep.doctor.network` multiplies by a per-collective latency.

Where bytes go (``gpus_per_node`` L ranks on each node, ranks numbered node-major): over a ring of
ranks spanning nodes, each node sends one rank's ring volume to the next node, so a rank's share of
what crosses between nodes is ``ring / L`` (``cross_node_bytes``) and the rest stays in the node
(``intra_node_bytes``); an all-to-all sends each peer its slice directly. Those two are what
:mod:`raydeep.doctor.network` divides by the network's and the node's bandwidth.

>>> from raydeep.config import load_config
>>> from raydeep.doctor.shape import ModelShape
>>> cfg = load_config({"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
...                    "zero_optimization": {"stage": 2}}, world_size=4)
>>> t = predict_traffic(cfg, ModelShape.from_counts(10**6, 2, 64, 16, 100))
>>> t.by_op["reduce_scatter"], t.by_op["all_gather"]
(8000000, 4000000)
>>> t = predict_traffic(cfg, ModelShape.from_counts(10**6, 2, 64, 16, 100), gpus_per_node=2)
>>> t.cross_node_bytes, t.intra_node_bytes, t.cross_node_bytes + t.intra_node_bytes == t.ring_bytes
(4500000, 4500000, True)
"""
from __future__ import annotations

from dataclasses import dataclass, field

from raydeep.config.model import RaydeepConfig
from raydeep.doctor.stage3 import block_partitioned, kept_between_passes, persistent_params, root_partitioned
from raydeep.doctor.shape import ModelShape
from raydeep.estimate import PRECISION_BYTES

SCALE_BYTES = 4  # every quantizer here (qwZ, qgZ, 1-bit) sends its scales as fp32


@dataclass(frozen=True)
class Traffic:
    by_op: dict[str, int]  # logical bytes per step, as CommStats counts them
    ring_bytes: int  # bytes each rank sends per step
    intra_node_bytes: int = 0  # of ring_bytes: the rank's share that stays inside its node
    cross_node_bytes: int = 0  # of ring_bytes: the rank's share of what its node sends to other nodes
    # elements each rank quantizes or dequantizes per step, by codec ("int8", "int4", "1bit"):
    # what the (de)quantization compute costs, one pass over one element each
    codec_passes: dict[str, int] = field(default_factory=dict)
    # per op: (intra-node, cross-node) bytes of this rank's sends, the split of ring_bytes
    links_by_op: dict[str, tuple[int, int]] = field(default_factory=dict)
    # collectives launched per step, by op label as CommStats counts its calls (the gradient norm's
    # scalar all-reduce included): what a per-collective latency multiplies
    calls_by_op: dict[str, int] = field(default_factory=dict)
    in_node_calls: int = 0  # of those, the collectives over ranks of one node (hpZ's, qgZ's first phase)

    @property
    def total(self) -> int:
        return sum(self.by_op.values())


class _Ledger:
    """Bytes per op label (as CommStats counts them) and where each rank's sends go."""

    def __init__(self, world: int, per_node: int):
        self.world, self.per_node = world, per_node
        self.by_op: dict[str, int] = {}
        self.ring = self.intra = self.cross = 0
        self.passes: dict[str, int] = {}
        self.links: dict[str, tuple[int, int]] = {}
        self.calls: dict[str, int] = {}
        self.in_node_calls = 0

    def launch(self, label: str, calls: int, in_node: bool | None = None) -> None:
        """``calls`` collectives of ``label``; ``in_node``: over ranks of one node (by default,
        when every rank shares one)."""
        if calls > 0:
            self.calls[label] = self.calls.get(label, 0) + int(calls)
            if self.world <= self.per_node if in_node is None else in_node:
                self.in_node_calls += int(calls)

    def _add(self, label: str, logical: int, sent: int, cross: int, phase: str = "", calls: int = 1) -> None:
        if logical <= 0:
            return
        self.launch(label, calls, in_node=cross == 0)
        self.by_op[label] = self.by_op.get(label, 0) + logical
        key = f"{label}/{phase}" if phase else label  # phases of one op run one after the other
        intra, crossing = self.links.get(key, (0, 0))
        self.links[key] = (intra + sent - cross, crossing + cross)
        self.ring += sent
        self.cross += cross
        self.intra += sent - cross

    def ring_op(self, label: str, logical: float, group: int | None = None, times: int = 1, calls: int = 1) -> None:
        """``calls`` ring collectives over ``group`` consecutive ranks (the world by default),
        ``logical`` bytes in all: an all-gather or reduce-scatter sends ``(g-1)/g`` of them, an
        all-reduce twice that."""
        g = group or self.world
        logical = int(logical)
        sent = int(times * (g - 1) / g * logical)
        local = min(g, self.per_node)
        cross = sent // local if g > local else 0  # one ring link per node crosses to the next
        self._add(label, logical, sent, cross, calls=calls)

    def all_to_all(self, label: str, logical: float, group: int, local: int, phase: str = "", calls: int = 1) -> None:
        """``calls`` all-to-alls over ``group`` ranks of which ``local`` share this rank's node:
        each peer gets ``1/group`` of ``logical`` directly."""
        logical = int(logical)
        sent = int((group - 1) / group * logical)
        cross = int((group - local) / group * logical)
        self._add(label, logical, sent, cross, phase, calls)

    def codec(self, kind: str, elements: float) -> None:
        if elements > 0:
            self.passes[kind] = self.passes.get(kind, 0) + int(elements)

    def traffic(self) -> Traffic:
        return Traffic(self.by_op, self.ring, self.intra, self.cross, self.passes, self.links, self.calls,
                       self.in_node_calls)


def predict_traffic(cfg: RaydeepConfig, shape: ModelShape, gpus_per_node: int | None = None) -> Traffic:
    """Bytes per optimizer step on each rank (see the module docstring); ``gpus_per_node``: ranks
    per node (default: every rank on one node, so nothing crosses between nodes)."""
    zero, n, gas = cfg.zero_optimization, cfg.world_size, cfg.gradient_accumulation_steps
    weights = PRECISION_BYTES[cfg.precision]
    grads = PRECISION_BYTES[cfg.communication_data_type or cfg.precision]
    psi = shape.params
    if n == 1:
        return Traffic({}, 0)
    ledger = _Ledger(n, max(1, min(gpus_per_node or n, n)))
    if zero.stage == 0:
        ledger.ring_op("all_reduce", grads * psi, times=2, calls=_buckets(shape, zero.reduce_bucket_size))
        return ledger.traffic()  # every rank holds the reduced gradients: the norm needs no collective
    if zero.stage in (1, 2):
        buckets = _buckets(shape, zero.reduce_bucket_size)
        ledger.ring_op("reduce_scatter", grads * psi * (gas if zero.stage == 2 else 1),
                       calls=buckets * (gas if zero.stage == 2 else 1))
        ledger.ring_op("all_gather", weights * psi, calls=buckets)
    else:
        _stage3(ledger, cfg, shape, weights, grads)
    ledger.launch("all_reduce", 1)  # the gradient norm over the shards (a scalar: no bytes counted)
    return ledger.traffic()


def _buckets(shape: ModelShape, bucket_numel: int) -> int:
    """The engine's gradient buckets below stage 3 (``raydeep.zero.layout.plan_buckets`` over the
    parameters in reverse order); by size alone for a model known by its sizes."""
    from raydeep.zero.layout import plan_buckets

    sizes = list(shape.tensors.values())[::-1] or [shape.params]
    return len(plan_buckets(sizes, bucket_numel)) if shape.tensors else max(1, -(-shape.params // bucket_numel))


def _stage3(ledger: _Ledger, cfg: RaydeepConfig, shape: ModelShape, weights: int, grads: int) -> None:
    zero, n, gas, psi = cfg.zero_optimization, cfg.world_size, cfg.gradient_accumulation_steps, shape.params
    persistent = persistent_params(cfg, shape)
    partitioned = psi - persistent
    block, root = block_partitioned(cfg, shape), root_partitioned(cfg, shape)
    units = shape.layers + (1 if root else 0)  # a unit per block and the root's, one collective each
    regathered = shape.layers - kept_between_passes(cfg, shape)  # blocks gathered again for backward
    backward = min(partitioned - root, regathered * block)
    gathered = gas * (partitioned + backward)  # elements gathered per step, every pass
    gathers = gas * (units + regathered)
    hpz = zero.zero_hpz_partition_size if 1 < zero.zero_hpz_partition_size <= n else 0
    primary = min(partitioned, gathered) if hpz else gathered  # hpZ: only the step's first gather
    primaries = units if hpz else gathers
    if hpz:
        ledger.ring_op("all_gather_secondary", weights * (gathered - primary), group=hpz, calls=gathers - primaries)
    if zero.zero_quantized_weights:  # int8 values and their scales: two collectives a gather
        ledger.ring_op("all_gather_quantized", primary * quantized_weight_bytes(block or shape.block_params, n),
                       calls=2 * primaries)
        ledger.codec("int8", primary * (1 + 1 / n))  # quantize the shard, dequantize the whole unit
    else:
        ledger.ring_op("all_gather", weights * primary, calls=primaries)
    ledger.ring_op("all_gather", weights * persistent)  # re-gathered exactly after the step
    if zero.zero_quantized_gradients:  # the persistent unit keeps the plain reduce-scatter
        ledger.ring_op("reduce_scatter", grads * persistent * gas, calls=gas)
        _qgz(ledger, partitioned * gas, gas, shape.hidden, calls=gas * units)
    else:
        ledger.ring_op("reduce_scatter", grads * psi * gas, calls=gas * (units + (1 if persistent else 0)))


def _qgz(ledger: _Ledger, elements: int, gas: int, hidden: int, calls: int) -> None:
    """DeepSpeed's ``all_to_all_quant_reduce`` for ``elements`` gradient values per step in
    ``calls`` reduce-scatters: groups of ``max(rows, cols, world)`` per 2-D gradient, about
    ``hidden`` values each for a transformer; values and scales are two all-to-alls a phase."""
    n, per_node = ledger.world, ledger.per_node
    nodes = max(1, n // per_node)
    groups = max(elements / max(1, hidden), gas * n)
    message = elements / 2 + SCALE_BYTES * groups
    if per_node > 1:  # a phase over a group of one rank moves nothing (the engine skips it)
        ledger.all_to_all("quantized_reduce_scatter", message, per_node, per_node, phase="local", calls=2 * calls)
    if nodes > 1:
        ledger.all_to_all("quantized_reduce_scatter", message / per_node, nodes, 1, phase="global", calls=2 * calls)
    # quantize, dequantize the node's pieces and re-quantize the sum, dequantize the nodes' pieces
    ledger.codec("int4", 2 * elements * (1 + 1 / per_node))


def quantized_weight_bytes(unit: int, world: int) -> float:
    """Bytes per weight qwZ gathers for a unit of ``unit`` elements: int8 values and an fp32 scale
    per group of the rank's shard (padded to a multiple of 8, as the engine pads it). The adaptive
    grouping looks for a group count that splits the shard evenly, so an awkward shard size gets
    small groups and more scales: a 175B block's shard over 512 ranks, groups of 168 values;
    2**20 values, groups of 4096.

    >>> round(quantized_weight_bytes(1_812_099_072, 512), 5), quantized_weight_bytes(2**20 * 512, 512)
    (1.02381, 1.0009765625)
    """
    shard = max(1, -(-unit // world))
    padded = -(-shard // 8) * 8
    return (padded + SCALE_BYTES * _weight_groups(padded)) / shard


def _weight_groups(numel: int) -> int:
    """The engine's group count (DeepSpeed's ``CUDAQuantizer`` rule); its arithmetic alone where a
    size has no valid grouping (the engine would then refuse that unit)."""
    try:
        from raydeep.zero.quantize import weight_groups
    except ImportError:  # the engine's quantizer is not there: DeepSpeed's target of 8000 values
        return -(-numel // 8000)
    try:
        return weight_groups(numel)
    except ValueError:
        return -(-numel // 8000)


def predict_compressed_traffic(cfg: RaydeepConfig, shape: ModelShape, gpus_per_node: int | None = None) -> Traffic:
    """1-bit Adam / 0/1 Adam after their warm-up (stage 0): one compressed all-reduce per step,
    DeepSpeed's (``raydeep.compression.allreduce``): 1 bit a value plus one fp32 scale per rank,
    out in an all-to-all and back in an all-gather.

    >>> from raydeep.config import load_config
    >>> cfg = load_config({"train_micro_batch_size_per_gpu": 1}, world_size=8)
    >>> t = predict_compressed_traffic(cfg, ModelShape.from_counts(8 * 10**6, 2, 64, 16, 100))
    >>> t.by_op
    {'compressed_all_to_all': 1000032, 'compressed_all_gather': 1000032}
    """
    from raydeep.compression.bits import padded_size

    n = cfg.world_size
    if n == 1:
        return Traffic({}, 0)
    ledger = _Ledger(n, max(1, min(gpus_per_node or n, n)))
    padded = padded_size(shape.params, n)
    message = padded // 8 + SCALE_BYTES * n
    ledger.all_to_all("compressed_all_to_all", message, n, ledger.per_node)
    ledger.ring_op("compressed_all_gather", message)
    # compress (signs, scale, error feedback) and decode on the worker side, and the same for the
    # rank's server chunk: about three passes over the gradient
    ledger.codec("1bit", 3 * padded + padded / n)
    ledger.launch("all_reduce", 1)  # the largest rank's gradient norm (each rank clips its own)
    return ledger.traffic()
