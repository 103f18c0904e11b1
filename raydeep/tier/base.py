"""The optimizer tier's interface: what the engine, checkpoints and schedulers may ask of it.

A tier owns everything of the update on one rank: the fp32 master of each FlatUnit's owned shard,
the optimizer states, and the optimizer itself. The engine hands it the owned gradient shards and
one multiplier; the tier updates its masters and writes the new parameters, in the model dtype,
into each ``unit.local``, from where the ZeRO strategy publishes them. Nothing else touches the
masters or the optimizer states: checkpoints go through ``state_dict``/``load_state_dict`` (element
ranges of each unit, so they are independent of where the tier keeps them), ``memory_breakdown``
through ``memory``, the LR schedulers through ``param_groups``.

Where the states live is the tier's choice: on the rank (``LocalTier``), and later in pinned host
memory or in Ray actors on CPU nodes. A compressed-communication optimizer is a tier too.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from raydeep.zero.flat import FlatUnit

# Param-group keys that pick an optimizer implementation rather than hold training state.
KERNEL_CHOICES = frozenset({"fused", "foreach", "capturable", "differentiable"})


@dataclass
class UnitRange:
    """Elements ``[start, end)`` of one unit's flat parameters (padding excluded): their fp32
    master values and each per-element optimizer state (``exp_avg``, ...) over the same range."""

    start: int
    end: int
    master: torch.Tensor
    states: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class TierState:
    """A tier's state over element ranges, one ``UnitRange`` per unit in unit order.

    ``scalars`` is ``None`` for masters only (loading one leaves the optimizer as it is); otherwise
    it holds, per param group, each scalar state (``step``) as a JSON-ready spec:
    ``{"value", "tensor": True, "dtype", "on_param_device"}`` or ``{"value", "tensor": False}``.
    ``param_groups`` are the hyperparameters per group (no ``params``; tuples as lists), or
    ``None`` to keep this run's. ``state_dtypes`` names each per-element state kind, in order.
    ``rank_local`` is what the checkpoint holds of this rank's ``rank_state`` (None: nothing for
    this rank, and ``rank_local_note`` says why when the checkpoint had some).
    """

    units: list[UnitRange]
    optimizer: str | None = None
    state_dtypes: dict[str, torch.dtype] = field(default_factory=dict)
    param_groups: list[dict] | None = None
    scalars: list[dict[str, dict]] | None = None
    rank_local: dict[str, torch.Tensor] | None = None
    rank_local_note: str = ""

    def masters_only(self) -> "TierState":
        return TierState([replace(u, states={}) for u in self.units])


class OptimizerTier(ABC):
    """Owns each rank's fp32 masters, optimizer states and the update (see the module docstring).

    Hyperparameters: ``param_groups`` is a list of dicts like a ``torch.optim.Optimizer``'s (``lr``,
    ``betas`` or ``momentum``, ``weight_decay``, ...; ``params`` lists the tier's masters); a value
    written there is what the next ``step`` uses, so DeepSpeed's LR schedulers drive a tier exactly
    as they drive a torch optimizer. ``defaults`` is the optimizer's defaults.

    >>> import torch
    >>> from raydeep.zero.flat import FlatUnit
    >>> from raydeep.tier import LocalTier
    >>> unit = FlatUnit("u", [("w", torch.nn.Parameter(torch.ones(3)))], 0, 1, 0, torch.float32, False)
    >>> tier = LocalTier([unit], [{}], lambda groups: torch.optim.SGD(groups, lr=0.5))
    >>> tier.step([torch.ones(3)], scale=2.0); unit.params[0].tolist()
    [0.0, 0.0, 0.0]
    """

    units: list["FlatUnit"]
    param_groups: list[dict]
    defaults: dict

    @property
    def optimizer_name(self) -> str:
        """The optimizer's class name, as checkpoints record it (``"AdamW"``)."""
        raise NotImplementedError

    @property
    def torch_optimizer(self) -> torch.optim.Optimizer | None:
        """A ``torch.optim.Optimizer`` sharing ``param_groups``, for ``torch.optim.lr_scheduler``
        classes and client scheduler factories (DeepSpeed hands those its basic optimizer); None
        when the tier has none on this rank."""
        return None

    @abstractmethod
    def step(self, grad_shards: list[torch.Tensor], scale: float) -> None:
        """One update: ``grad_shards[i]`` is unit ``i``'s owned gradient shard (grad dtype, not
        modified), multiplied by ``scale`` (unscale x clip) before the optimizer reads it. The
        updated parameters are in each ``unit.local`` when it returns."""

    # --- the delayed parameter update (``raydeep.delayed_update``); the offload tiers run it -------
    def submit(self, grad_shards: list[torch.Tensor], scale: float) -> None:
        """Start ``step``'s update without waiting for it: the gradients and hyperparameters are
        taken now, the new parameters reach ``unit.local`` at ``complete``. A tier that cannot
        run an update in the background steps at once."""
        self.step(grad_shards, scale)

    def release(self) -> None:
        """The parameters ``submit`` landed are published: start the submitted update's work. A
        tier whose update shares the rank's CPUs holds it until then, so that the parameters'
        all-gather, a chain of waits on every rank, does not wait on cores the update took.
        ``complete`` releases a held update itself."""

    def complete(self) -> None:
        """Wait for a submitted update and write its parameters into ``unit.local``."""

    @property
    def pending(self) -> bool:
        """Whether a submitted update has not been completed yet."""
        return False

    def state_dict(self, ranges: list[tuple[int, int]] | None = None, with_optimizer: bool = True) -> TierState:
        """The masters (and, ``with_optimizer``, the optimizer states, scalars and hyperparameters)
        over ``ranges[i]`` of unit ``i`` (default: each unit's ``held_range``). The tensors may be
        views of live state: copy them before the next ``step``."""
        flat, local = [], {}
        for i, unit in enumerate(self.units):
            start, end, base = unit.held_range()
            if ranges is not None:
                lo, hi = ranges[i]
                assert lo >= hi or start <= lo <= hi <= end, f"{unit.name}: {ranges[i]} is not held here"
                start, end = lo, hi
            flat.append((start, end))
            local[i] = (start - base, end - base)
        segments, dtypes, scalars = self._export(local, with_optimizer)
        joined = assemble(segments, local, len(self.units))
        pieces = [UnitRange(start, end, master, states) for (start, end), (master, states) in zip(flat, joined)]
        if not with_optimizer:
            return TierState(pieces)
        hyper = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items() if k != "params"}
                 for g in self.param_groups]
        return TierState(pieces, self.optimizer_name, dtypes, hyper,
                         [scalars.get(g, {}) for g in range(len(self.param_groups))])

    def load_state_dict(self, state: TierState) -> None:
        """Set the masters over the given ranges (and the optimizer, unless ``state.scalars`` is
        None), then write the parameters into each ``unit.local`` as ``step`` does. Per-element
        states are replaced whole: elements outside the ranges start from zero."""
        if state.param_groups and len(state.param_groups) != len(self.param_groups):
            raise ValueError(f"the state has {len(state.param_groups)} optimizer parameter groups, "
                             f"this optimizer has {len(self.param_groups)}")
        if state.scalars is not None:
            for group, saved in zip(self.param_groups, state.param_groups or [{}] * len(self.param_groups)):
                for key, value in saved.items():
                    if key not in KERNEL_CHOICES:  # how this run's optimizer executes is its own choice
                        group[key] = tuple(value) if isinstance(group.get(key), tuple) else value
        local = []
        for unit, piece in zip(self.units, state.units):
            base = unit.held_range()[2]
            local.append(replace(piece, start=piece.start - base, end=piece.end - base))
        self._import(local, state.scalars)

    # --- what each tier provides for the two above ------------------------------------------------
    @abstractmethod
    def _export(self, ranges: dict[int, tuple[int, int]], with_optimizer: bool) -> tuple:
        """``(segments, state dtypes, scalars by group index)`` over ``ranges[unit]`` (offsets
        into ``unit.local``), as ``MasterShards.export`` and ``MasterShards.scalars`` give them."""

    @abstractmethod
    def _import(self, pieces: list[UnitRange], scalars: list[dict] | None) -> None:
        """``MasterShards.load`` on wherever the masters live, then write every ``unit.local``."""

    @abstractmethod
    def reload_from_params(self, indices: list[int]) -> None:
        """The parameters of these units were overwritten outside ``step`` (a GatheredParameters
        write-back): take the masters from each ``unit.local``."""

    @abstractmethod
    def memory(self) -> dict[str, dict[str, int]]:
        """Bytes held, by kind (``master``, ``optimizer_states``, and ``step_buffers``: the most
        fp32 gradient and staging bytes held at once during the last step) and then by place: a
        device such as ``"cuda:0"`` or ``"cpu"`` in this process, or ``"actor:<node id>"``. A master
        that is the model's own storage counts zero."""

    # --- checkpoints written where the state lives; the actor tier provides it ---------------------
    #: ``remote_snapshot(ranges)``: like ``state_dict(ranges)``, but the copy is taken and kept by
    #: the processes that hold the state and written by them as this rank's part files, so a save
    #: moves no optimizer bytes through the rank. None: ``state_dict`` is used.
    remote_snapshot = None
    #: ``remote_load(source, kinds, pieces_in)``: the read phase of a load done by those
    #: processes, each reading its own ranges through ``source`` (a ``CheckpointReader``); the next
    #: ``load_state_dict`` loads what they read. None: the rank reads the ranges and
    #: ``load_state_dict`` sends them.
    remote_load = None

    # --- compressed communication (``raydeep.compression``); other tiers keep these defaults -------
    def communicates_gradients(self) -> bool:
        """True when the next ``step`` takes each rank's own, un-reduced gradients and averages
        what it needs itself: the stage-0 strategy then skips its all-reduce."""
        return False

    @property
    def phase(self) -> str | None:
        """The optimizer's phase (``warm-up`` or ``compressed``), None where it has none."""
        return None

    def rank_state(self) -> dict[str, torch.Tensor]:
        """State that belongs to this rank at this world size only (error feedback), by name:
        checkpoints keep it in the rank's own file. Views of live state."""
        return {}

    def load_rank_state(self, tensors: dict[str, torch.Tensor] | None, why_not: str = "") -> None:
        """Take back what ``rank_state`` gave, or None when the checkpoint has none for this
        rank (``why_not`` says why: another world size, say)."""

    def compression_report(self) -> dict | None:
        """What ``summary.json``'s ``compression`` section shows (None: no compression)."""
        return None

    def close(self) -> None:
        """Release what the tier holds outside this process (offload actors); idempotent."""

    def report(self) -> dict | None:
        """What ``summary.json``'s ``offload`` section shows for this rank (None: not offloaded)."""
        return None


def assemble(segments: list, ranges: dict[int, tuple[int, int]], units: int) -> list[tuple]:
    """Per unit, ``(master, states)`` over its range, joined from the segments that cover it
    (a view when one segment does). A segment has ``unit``, ``lo``, ``hi``, ``master``, ``states``."""
    by_unit: dict[int, list] = {}
    for s in sorted(segments, key=lambda s: (s.unit, s.lo)):
        by_unit.setdefault(s.unit, []).append(s)
    out = []
    for u in range(units):
        parts = by_unit.get(u, [])
        lo, hi = ranges.get(u, (0, 0))
        assert sum(p.hi - p.lo for p in parts) == max(hi - lo, 0), f"unit {u}: range {lo}..{hi} is not covered"
        if len(parts) == 1:
            out.append((parts[0].master, dict(parts[0].states)))
            continue
        empty = torch.zeros(0, dtype=torch.float32)
        master = torch.cat([p.master for p in parts]) if parts else empty
        kinds = parts[0].states.keys() if parts else ()
        out.append((master, {k: torch.cat([p.states[k] for p in parts]) for k in kinds}))
    return out
