"""What the doctor knows about a run without building it: the model's shape, the cluster, and
the findings it reports.

A :class:`ModelShape` comes from a built-in GPT name, from a ``pkg:fn`` model (built once on the
CPU to read its parameters), or from the counts a user gives (``--params --layers --hidden
--seq --vocab``). Everything the memory model needs is here: the parameter count, the largest
ZeRO-3 unit (one transformer block), the small parameters that stay gathered at stage 3, and the
activation shape (layers, hidden, heads, sequence, vocabulary).

>>> shape = ModelShape.from_gpt("gpt-tiny")
>>> shape.params, shape.layers, shape.hidden, shape.block_params
(842496, 4, 128, 198272)
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

__all__ = ["Cluster", "Finding", "ModelShape", "parse_bytes"]

Severity = Literal["error", "warning", "info"]


@dataclass(frozen=True)
class Finding:
    """One thing the doctor found: what, why it matters, and what to change.

    ``rule`` is a stable identifier (``--json`` consumers and the docs use it); ``key`` is the
    dotted ds_config key it is about, when there is one.
    """

    rule: str
    severity: Severity
    message: str
    reason: str
    fix: str
    key: str | None = None

    def as_dict(self) -> dict:
        return {"rule": self.rule, "severity": self.severity, "key": self.key, "message": self.message,
                "reason": self.reason, "fix": self.fix}


@dataclass(frozen=True)
class ModelShape:
    """A transformer's sizes, as the memory model needs them.

    ``block_params`` is the largest transformer block (ZeRO-3's unit of gathering); ``small_params``
    counts the parameters at or below DeepSpeed's default persistence threshold (biases and
    LayerNorms), which stage 3 keeps gathered. ``tied`` says whether the output layer reuses
    the token embedding.
    """

    params: int
    layers: int
    hidden: int
    seq: int
    vocab: int
    heads: int = 0
    block_params: int = 0
    small_params: int = 0
    ffn_mult: int = 4
    name: str = "model"
    tied: bool = True
    # Per-parameter element counts (name -> numel), when the model was built; lint rules that need
    # the largest single tensor use it, else it is derived from the sizes.
    tensors: dict[str, int] = field(default_factory=dict, compare=False, repr=False)
    # The largest block's parameter sizes, when the model was built: what stage 3 partitions of a
    # block (and so its unit's exact size) follows from them.
    block_tensors: tuple[int, ...] = field(default=(), compare=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("params", "layers", "hidden", "seq", "vocab"):
            if getattr(self, name) <= 0:
                raise ValueError(f"the model's {name} must be positive, got {getattr(self, name)}")

    @property
    def largest_tensor(self) -> int:
        """Elements of the largest single parameter (the embedding or the 4h x h projection)."""
        if self.tensors:
            return max(self.tensors.values())
        return max(self.vocab * self.hidden, self.ffn_mult * self.hidden * self.hidden)

    @staticmethod
    def from_counts(params: int, layers: int, hidden: int, seq: int, vocab: int, heads: int = 0,
                    name: str = "a GPT-like model") -> "ModelShape":
        """A GPT-like model known only by its sizes: a block is ``12 h^2 + 13 h`` parameters
        (QKV, projection, two MLP matrices, their biases and two LayerNorms)."""
        block = 12 * hidden * hidden + 13 * hidden
        return ModelShape(params=int(params), layers=layers, hidden=hidden, seq=seq, vocab=vocab,
                          heads=heads or max(1, hidden // 128), block_params=block,
                          small_params=layers * 13 * hidden + 2 * hidden, name=name)

    @staticmethod
    def from_gpt(name: str, seq: int | None = None) -> "ModelShape":
        """A built-in GPT size (``raydeep.models.GPT_SIZES``), built on the meta device (no memory)."""
        import torch

        from raydeep.models.gpt import GPT, gpt_config

        cfg = gpt_config(name)
        with torch.device("meta"):
            model = GPT(cfg)
        return ModelShape.from_module(model, seq or cfg.block_size, name=name)

    @staticmethod
    def from_module(model, seq: int, name: str = "model", persistence_threshold: int = 100_000) -> "ModelShape":
        """Read the sizes of a built ``nn.Module`` (a GPT-like model: blocks in
        ``transformer_blocks()`` or the longest ``nn.ModuleList``; ``config`` if it has one)."""
        from torch import nn

        params = {n: p.numel() for n, p in model.named_parameters()}
        blocks = model.transformer_blocks() if hasattr(model, "transformer_blocks") else max(
            (m for m in model.modules() if isinstance(m, nn.ModuleList)), key=len, default=[])
        largest = max(blocks, key=lambda b: sum(p.numel() for p in b.parameters()), default=None)
        block_tensors = tuple(p.numel() for p in largest.parameters()) if largest is not None else ()
        block = sum(block_tensors) if block_tensors else sum(params.values())
        cfg = getattr(model, "config", None)
        hidden = getattr(cfg, "n_embd", None) or _guess_hidden(params)
        vocab = getattr(cfg, "vocab_size", None) or max(params.values()) // hidden
        return ModelShape(params=sum(params.values()), layers=max(1, len(blocks)), hidden=hidden, seq=seq,
                          vocab=vocab, heads=getattr(cfg, "n_head", 0) or max(1, hidden // 64),
                          block_params=block,
                          small_params=sum(n for n in params.values() if n <= persistence_threshold),
                          name=name, tied=getattr(cfg, "tie_weights", True), tensors=params,
                          block_tensors=block_tensors)


def _guess_hidden(params: dict[str, int]) -> int:
    # The most common size of a 1-D parameter (LayerNorm weights and biases) is the model width.
    from collections import Counter

    ones = Counter(n for n in params.values() if n > 1)
    return ones.most_common(1)[0][0] if ones else 1


@dataclass(frozen=True)
class Cluster:
    """The hardware a run is planned for: ``world_size`` ranks, ``gpus_per_node`` per node, and
    bytes of device memory per rank and host memory per node (None: unknown, no fit verdict)."""

    world_size: int
    gpus_per_node: int = 1
    device_memory: int | None = None
    host_memory: int | None = None

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.gpus_per_node < 1:
            raise ValueError("world size and GPUs per node must be at least 1")

    @property
    def nodes(self) -> int:
        return -(-self.world_size // self.gpus_per_node)


_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9, "t": 1e12, "tb": 1e12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """``"80GB"`` -> 80e9 bytes (decimal, as GPU makers count), ``"64GiB"`` -> 64 * 2**30.

    >>> parse_bytes("80GB"), parse_bytes("1.5 TiB"), parse_bytes("512")
    (80000000000, 1649267441664, 512)
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"{text!r} is not a memory size; write e.g. 80GB, 64GiB or 512MB")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])
