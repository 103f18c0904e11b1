"""MasterShards: fp32 masters over chunks of the owned shards, a torch optimizer, the tiled update.

Every tier keeps its masters in one of these, wherever it runs: the local and host tiers in the
rank's own process, the actor tier inside each offload actor. What differs between tiers is only
where the masters live and how gradients reach them.

``sub_group_size`` tiles the update, as DeepSpeed's ZeRO-3 sub-groups do: the owned shards are cut
into chunks and the chunks packed, in unit order, into sub-groups of at most ``sub_group_size``
elements (at least ``ALIGN``). The optimizer steps one sub-group at a time, so at most one sub-group of fp32 gradients
exists at once. Each chunk is one optimizer parameter (a view of its unit's master, when the
master is one tensor per unit); a unit smaller than the sub-group size is one chunk, so with the
default (1e9) there is one sub-group, one parameter per unit and one ``optimizer.step()``.

Note: stepping a sub-group calls ``optimizer.step()`` with only that sub-group's parameters
holding a ``.grad``. Torch optimizers skip parameters without one and keep ``step`` per parameter,
so an elementwise optimizer (Adam, AdamW, SGD, Adagrad, Lion) computes the same bits whatever the
tiling (cuts are aligned: ``plan_sub_groups``). A norm-based one (Lamb) sees each chunk as one tensor.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from raydeep.tier.base import KERNEL_CHOICES, UnitRange
from raydeep.tier.pieces import PieceAdam, piecewise_adam
from raydeep.tier.lookahead import Lookahead


# Cuts inside a unit fall on multiples of this many elements: a multiple of every CPU vector width
# (AVX2: 8 fp32, AVX-512: 16) and of its unrolling.
ALIGN = 64


@dataclass(frozen=True)
class Chunk:
    """Elements ``[lo, hi)`` of unit ``unit``'s owned shard (offsets into ``unit.local``)."""

    unit: int
    group: int
    lo: int
    hi: int

    @property
    def numel(self) -> int:
        return self.hi - self.lo


def plan_sub_groups(shard_sizes: list[int], groups: list[int], sub_group_size: int) -> list[list[Chunk]]:
    """Cut the shards into chunks and pack them, in unit order, into sub-groups of at most
    ``max(sub_group_size, ALIGN)`` elements (0 or less: one sub-group per unit).

    A unit is cut only ``ALIGN`` elements apart from its start, so every element keeps its place in
    the optimizer kernel's vector loop, whatever the tiling: fused CPU Adam rounds ``exp_avg_sq``
    differently in its vector loop and in its scalar tail, so a cut anywhere else would change bits.

    >>> [[(c.unit, c.lo, c.hi) for c in sg] for sg in plan_sub_groups([160, 40], [0, 0], 128)]
    [[(0, 0, 128)], [(0, 128, 160), (1, 0, 40)]]
    """
    if sub_group_size <= 0:
        return [[Chunk(u, g, 0, n)] for u, (n, g) in enumerate(zip(shard_sizes, groups))]
    capacity = max(sub_group_size, ALIGN)
    sub_groups, current, filled = [], [], 0
    for u, (n, g) in enumerate(zip(shard_sizes, groups)):
        lo = 0
        while lo < n:
            room = capacity - filled
            take = n - lo if n - lo <= room else room // ALIGN * ALIGN
            if take == 0:  # the rest does not fit and no aligned cut does: start the next sub-group
                sub_groups.append(current)
                current, filled = [], 0
                continue
            current.append(Chunk(u, g, lo, lo + take))
            filled, lo = filled + take, lo + take
            if filled == capacity:
                sub_groups.append(current)
                current, filled = [], 0
    if current:
        sub_groups.append(current)
    return sub_groups


@dataclass
class Segment:
    """One chunk's part of a requested range: its masters and per-element states."""

    unit: int
    lo: int
    hi: int
    master: torch.Tensor
    states: dict[str, torch.Tensor]


class MasterShards:
    """fp32 masters of ``sub_groups``' chunks and a torch optimizer over them (see the module
    docstring). ``masters[i]`` is chunk ``i``'s fp32 tensor (in the flat chunk order of
    ``sub_groups``); ``make_optimizer(param_groups)`` builds the optimizer, one group per entry of
    ``group_options`` that has chunks here."""

    def __init__(self, sub_groups: list[list[Chunk]], masters: list[torch.Tensor], group_options: list[dict],
                 make_optimizer: Callable[[list[dict]], torch.optim.Optimizer], threads: int | None = None):
        self.sub_groups = sub_groups
        self.chunks = [c for sg in sub_groups for c in sg]
        assert len(masters) == len(self.chunks)
        self.params = [nn.Parameter(m, requires_grad=True) for m in masters]
        self.group_ids = sorted({c.group for c in self.chunks})  # option index of each optimizer group
        groups = [{**group_options[g], "params": [p for p, c in zip(self.params, self.chunks) if c.group == g]}
                  for g in self.group_ids]
        self.optimizer = make_optimizer(groups)
        first = 0
        self._first_chunk = []  # index of each sub-group's first chunk
        for sg in sub_groups:
            self._first_chunk.append(first)
            first += len(sg)
        self.peak_grad_bytes: dict[str, int] = {}  # fp32 gradient bytes held at once, by device
        self._grad_buffer: torch.Tensor | None = None
        self._buffer_offsets = {}  # each chunk's place in the gradient buffer: its offset in its sub-group
        for sg, first in zip(sub_groups, self._first_chunk):
            offset = 0
            for param, c in zip(self.params[first:first + len(sg)], sg):
                self._buffer_offsets[id(param)] = offset
                offset += c.numel
        self._lookahead: Lookahead | None = None  # the delayed update's terms where pieces do not write them
        # Adam/AdamW (torch's fused kernel): updated piece by piece, in one pass on the CPU.
        self.pieces = PieceAdam(self.optimizer, self.params, threads) if piecewise_adam(self.optimizer) else None

    # --- the update -------------------------------------------------------------------------------
    def step_sub_group(self, k: int, grads: list[torch.Tensor], scale: float, writable: bool = True,
                       outs: list[torch.Tensor | None] | None = None,
                       terms: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> list[nn.Parameter]:
        """Update sub-group ``k`` from its chunks' gradients (any dtype and device), each
        multiplied by ``scale``, and write each chunk's new values into ``outs[i]`` (the model-dtype
        parameter, or None); returns the chunks' updated masters. With ``writable``, a gradient
        already fp32 and on its master's device may be scaled in place and read where it is (its
        owner discards it after the step: the engine zeroes its gradients); any other, and every
        one when not ``writable`` (an object store's immutable buffer), is copied first. ``terms``:
        each chunk's delayed-update lookahead ``(base, rate)`` (``raydeep.tier.lookahead``; Adam and
        AdamW only), written with ``outs``."""
        first = self._first_chunk[k]
        params = self.params[first:first + len(self.sub_groups[k])]
        outs = outs or [None] * len(params)
        if self.pieces is not None:
            self.begin(k)
            for j, (param, grad, out) in enumerate(zip(params, grads, outs)):
                self.update_piece(first + j, 0, param.numel(), grad, scale, out, terms[j] if terms else None)
            return params
        held: dict[str, int] = {}
        for param, grad in zip(params, grads):
            param.grad = self._fp32_grad(param, grad, scale, writable)
            if param.grad is not grad:  # a copy: a step buffer
                held[str(param.device)] = held.get(str(param.device), 0) + param.grad.numel() * 4
        self._count(held)
        self.optimizer.step()
        for param, out in zip(params, outs):
            param.grad = None
            if out is not None:
                out.copy_(param.detach(), non_blocking=param.is_pinned())
        if terms:
            if self._lookahead is None:
                self._lookahead = Lookahead(self.optimizer)
            for param, (base, rate) in zip(params, terms):
                self._lookahead.terms(param, base, rate)
        return params

    # Piece by piece (Adam/AdamW only, ``self.pieces``): a pipeline's finer tiling of a sub-group.
    def begin(self, k: int) -> None:
        """Sub-group ``k``'s step starts: its chunks' step counters move (once per step)."""
        first = self._first_chunk[k]
        self.pieces.begin(list(range(first, first + len(self.sub_groups[k]))))

    def update_piece(self, i: int, lo: int, hi: int, grad: torch.Tensor, scale: float,
                     out: torch.Tensor | None, terms: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Elements ``[lo, hi)`` of chunk ``i`` (flat chunk order) after ``begin`` of its sub-group."""
        nbytes = self.pieces.update(i, lo, hi, grad, scale, out, terms)
        if nbytes:
            self._count({str(self.params[i].device): nbytes})

    def _count(self, held: dict[str, int]) -> None:
        for place, nbytes in held.items():
            self.peak_grad_bytes[place] = max(self.peak_grad_bytes.get(place, 0), nbytes)

    def _fp32_grad(self, param: nn.Parameter, grad: torch.Tensor, scale: float, writable: bool) -> torch.Tensor:
        """``grad`` x ``scale`` in fp32 on the master's device: ``grad`` itself when it is that
        already (scaled in place), otherwise a copy.

        On the CPU a copy goes into one reused buffer of the largest sub-group: a fresh allocation of
        that size would be new pages from the OS every step, whose faults cost more than the
        update itself. Widening copy, then an fp32 multiply in place: torch's mixed-dtype multiply
        (16-bit tensor times fp32) gives the same bits but runs several times slower.
        """
        if grad.dtype == torch.float32 and grad.device == param.device and grad.is_contiguous():
            if scale == 1.0:
                return grad  # read, never written
            if writable:
                return grad.mul_(scale)
        if param.device.type != "cpu":
            return grad.to(param.device, torch.float32, copy=True).mul_(scale)
        size = max(sum(c.numel for c in sg) for sg in self.sub_groups)
        if self._grad_buffer is None or self._grad_buffer.numel() < size:
            self._grad_buffer = torch.empty(size, dtype=torch.float32)
        start = self._buffer_offsets[id(param)]
        out = self._grad_buffer[start:start + param.numel()].copy_(grad)
        return out if scale == 1.0 else out.mul_(scale)  # x * 1.0 is x

    def set_hyperparameters(self, groups: list[dict]) -> None:
        """Write the rank's current hyperparameters (one dict per option group, as the LR
        schedulers left them) into this optimizer's groups."""
        for g, group in zip(self.group_ids, self.optimizer.param_groups):
            for key, value in groups[g].items():
                if key != "params" and key not in KERNEL_CHOICES:
                    group[key] = value

    # --- state over ranges ------------------------------------------------------------------------
    def export(self, ranges: dict[int, tuple[int, int]], with_optimizer: bool) -> list[Segment]:
        """The masters (and per-element states) of every chunk part inside ``ranges[unit]``
        (``unit.local`` offsets), in chunk order. Views of live state: copy before the next step."""
        out = []
        for param, c in zip(self.params, self.chunks):
            lo, hi = ranges.get(c.unit, (0, 0))
            lo, hi = max(lo, c.lo), min(hi, c.hi)
            if lo >= hi:
                continue
            state = self.optimizer.state.get(param, {}) if with_optimizer else {}
            per_element = {k: v[lo - c.lo:hi - c.lo] for k, v in state.items() if _per_element(v, param)}
            out.append(Segment(c.unit, lo, hi, param.detach()[lo - c.lo:hi - c.lo], per_element))
        return out

    def scalars(self) -> tuple[dict[str, torch.dtype], dict[int, dict[str, dict]]]:
        """The dtype of each per-element state kind, and each option group's scalar states
        (``step``) as JSON-ready specs."""
        dtypes, scalars = {}, {}
        for g, group in zip(self.group_ids, self.optimizer.param_groups):
            found = scalars.setdefault(g, {})
            for param in group["params"]:
                for key, value in self.optimizer.state.get(param, {}).items():
                    if _per_element(value, param):
                        dtypes.setdefault(key, value.dtype)
                    else:
                        found[key] = _scalar_spec(key, value, param)
        return dtypes, scalars

    def load(self, pieces: list[UnitRange], scalars: list[dict[str, dict]] | None) -> None:
        """Set the masters from ``pieces`` (one per unit, ``unit.local`` offsets), and unless
        ``scalars`` is None each chunk's optimizer state: per-element states where the pieces
        cover the chunk, zeros elsewhere, plus its group's scalars."""
        with torch.no_grad():
            for param, c in zip(self.params, self.chunks):
                piece = pieces[c.unit]
                lo, hi = max(piece.start, c.lo), min(piece.end, c.hi)
                if lo < hi:
                    param.data[lo - c.lo:hi - c.lo].copy_(piece.master[lo - piece.start:hi - piece.start])
                if scalars is None:
                    continue
                loaded = {}
                for kind, values in piece.states.items():
                    loaded[kind] = torch.zeros(param.shape, dtype=values.dtype, device=param.device)
                    if lo < hi:
                        loaded[kind][lo - c.lo:hi - c.lo].copy_(values[lo - piece.start:hi - piece.start])
                for key, spec in (scalars[c.group] if c.group < len(scalars) else {}).items():
                    loaded[key] = _scalar_from_spec(spec, param)
                if loaded:
                    self.optimizer.state[param] = loaded

    def memory(self) -> dict[str, int]:
        """Optimizer-state bytes by device (scalars such as ``step`` are not counted)."""
        states = {}
        for state in self.optimizer.state.values():
            for t in state.values():
                if torch.is_tensor(t) and t.dim() > 0:
                    states[str(t.device)] = states.get(str(t.device), 0) + t.numel() * t.element_size()
        return states


def _per_element(value, param: torch.Tensor) -> bool:
    return torch.is_tensor(value) and value.shape == param.shape


def _scalar_spec(key: str, value, param: torch.Tensor) -> dict:
    if torch.is_tensor(value):
        if value.numel() != 1:
            raise TypeError(f"optimizer state {key!r} has shape {tuple(value.shape)}: raydeep checkpoints hold "
                            "per-element states (the shape of the parameter) and scalars")
        # Fused kernels keep ``step`` on the parameter's device, the others on the CPU.
        return {"value": value.item(), "dtype": str(value.dtype).removeprefix("torch."), "tensor": True,
                "on_param_device": value.device == param.device}
    return {"value": value, "tensor": False}


def _scalar_from_spec(spec: dict, param: torch.Tensor):
    if not spec.get("tensor"):
        return spec["value"]
    dtype = getattr(torch, spec["dtype"], None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {spec['dtype']!r} for an optimizer scalar state")
    device = param.device if spec.get("on_param_device") else "cpu"
    return torch.tensor(spec["value"], dtype=dtype, device=device)
