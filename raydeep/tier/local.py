"""LocalTier: the fp32 masters and a ``torch.optim`` optimizer on the rank itself.

This is the tier every other one is measured against (the naive reference beside the optimized
paths): each unit's master is an ``nn.Parameter`` over the owned shard -- in fp32 training the
shard itself, so there is no copy -- and a plain torch optimizer updates them in place.

Note: ``step`` does exactly what the engine did before the tier existed, in the same order
(cast or copy the gradient to fp32, multiply by the one scale, ``optimizer.step()``, copy the
master into the model-dtype shard), so training is bitwise unchanged.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from raydeep.tier.base import KERNEL_CHOICES, OptimizerTier, TierState, UnitRange
from raydeep.zero.flat import FlatUnit


class LocalTier(OptimizerTier):
    """Masters and optimizer states on this rank; ``make_optimizer(param_groups)`` builds the torch
    optimizer over the masters, one group per entry of ``group_options`` (its hyperparameters)."""

    def __init__(self, units: list[FlatUnit], group_options: list[dict],
                 make_optimizer: Callable[[list[dict]], torch.optim.Optimizer]):
        self.units = units
        # In fp32 training the master *is* the shard (no copy); else an fp32 copy of it.
        self.masters = [nn.Parameter(u.local if u.dtype == torch.float32 else u.local.detach().float(),
                                     requires_grad=True) for u in units]
        groups = []
        for g, options in enumerate(group_options):
            masters = [m for m, u in zip(self.masters, units) if u.group_index == g]
            if masters:
                groups.append({**options, "params": masters})
        self.optimizer = make_optimizer(groups)
        self._unit_of_master = {id(m): i for i, m in enumerate(self.masters)}

    # --- DeepSpeed's optimizer surface: what user code reads from engine.optimizer ----------------
    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups  # the same dicts: a write reaches the next step

    @property
    def defaults(self) -> dict:
        return self.optimizer.defaults

    @property
    def state(self):
        """The torch optimizer's per-master state (DeepSpeed's ZeRO optimizers expose it too)."""
        return self.optimizer.state

    @property
    def optimizer_name(self) -> str:
        return type(self.optimizer).__name__

    @property
    def torch_optimizer(self) -> torch.optim.Optimizer:
        return self.optimizer

    # --- the update -------------------------------------------------------------------------------
    def step(self, grad_shards: list[torch.Tensor], scale: float) -> None:
        for master, shard in zip(self.masters, grad_shards):
            grad = shard.float() if shard.dtype != torch.float32 else shard.clone()
            master.grad = grad.mul_(scale)
        self.optimizer.step()
        for master in self.masters:
            master.grad = None
        self._write_params()

    def _write_params(self) -> None:
        """Copy each updated fp32 master into the model-dtype shard (nothing when they are one)."""
        for unit, master in zip(self.units, self.masters):
            if master.data.data_ptr() != unit.local.data_ptr():
                unit.local.copy_(master.data)

    def reload_from_params(self, indices: list[int]) -> None:
        for i in indices:
            master, unit = self.masters[i], self.units[i]
            if master.data.data_ptr() != unit.local.data_ptr():
                master.data.copy_(unit.local)

    # --- state over element ranges ------------------------------------------------------------------
    def state_dict(self, ranges: list[tuple[int, int]] | None = None, with_optimizer: bool = True) -> TierState:
        pieces = []
        for i, (unit, master) in enumerate(zip(self.units, self.masters)):
            start, end, base = unit.held_range()
            if ranges is not None:
                lo, hi = ranges[i]
                assert lo >= hi or start <= lo <= hi <= end, f"{unit.name}: {ranges[i]} is not held here"
                start, end = lo, hi
            state = self.optimizer.state.get(master, {}) if with_optimizer else {}
            per_element = {k: v[start - base:end - base] for k, v in state.items() if _per_element(v, master)}
            pieces.append(UnitRange(start, end, master.detach()[start - base:end - base], per_element))
        if not with_optimizer:
            return TierState(pieces)
        dtypes, scalars = {}, []
        for group in self.param_groups:
            group_scalars = {}
            for master in group["params"]:
                for key, value in self.optimizer.state.get(master, {}).items():
                    if _per_element(value, master):
                        dtypes.setdefault(key, value.dtype)
                    else:
                        group_scalars[key] = _scalar_spec(key, value, master)
            scalars.append(group_scalars)
        hyper = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items() if k != "params"}
                 for g in self.param_groups]
        return TierState(pieces, self.optimizer_name, dtypes, hyper, scalars)

    def load_state_dict(self, state: TierState) -> None:
        if state.param_groups and len(state.param_groups) != len(self.param_groups):
            raise ValueError(f"the state has {len(state.param_groups)} optimizer parameter groups, "
                             f"this optimizer has {len(self.param_groups)}")
        with torch.no_grad():
            for unit, master, piece in zip(self.units, self.masters, state.units):
                base = unit.held_range()[2]
                master.data[piece.start - base:piece.end - base].copy_(piece.master)
        if state.scalars is not None:
            self._load_optimizer(state)
        self._write_params()

    def _load_optimizer(self, state: TierState) -> None:
        """Hyperparameters per group, then each master's state: per-element tensors plus scalars."""
        for g, group in enumerate(self.param_groups):
            for key, value in (state.param_groups[g] if state.param_groups else {}).items():
                if key in KERNEL_CHOICES:
                    continue  # how this run's optimizer executes is its own choice, not the state's
                group[key] = tuple(value) if isinstance(group.get(key), tuple) else value
            group_scalars = state.scalars[g] if g < len(state.scalars) else {}
            for master in group["params"]:
                i = self._unit_of_master[id(master)]
                loaded = self._whole_states(i, state.units[i])
                for key, spec in group_scalars.items():
                    loaded[key] = _scalar_from_spec(spec, master)
                if loaded:
                    self.optimizer.state[master] = loaded

    def _whole_states(self, i: int, piece: UnitRange) -> dict[str, torch.Tensor]:
        """Per-element states the size of master ``i``, zero outside the piece's range."""
        master, base = self.masters[i], self.units[i].held_range()[2]
        whole = {}
        for kind, values in piece.states.items():
            whole[kind] = torch.zeros(master.shape, dtype=values.dtype, device=master.device)
            whole[kind][piece.start - base:piece.end - base].copy_(values)
        return whole

    # --- accounting ---------------------------------------------------------------------------------
    def memory(self) -> dict[str, dict[str, int]]:
        masters, states = {}, {}
        for unit, master in zip(self.units, self.masters):
            if master.data.data_ptr() != unit.local.data_ptr():
                place = str(master.device)
                masters[place] = masters.get(place, 0) + master.numel() * 4
        for state in self.optimizer.state.values():
            for t in state.values():
                if torch.is_tensor(t) and t.dim() > 0:  # scalars such as ``step`` are not counted
                    states[str(t.device)] = states.get(str(t.device), 0) + t.numel() * t.element_size()
        return {"master": masters, "optimizer_states": states}


def _per_element(value, master: torch.Tensor) -> bool:
    return torch.is_tensor(value) and value.shape == master.shape


def _scalar_spec(key: str, value, master: torch.Tensor) -> dict:
    if torch.is_tensor(value):
        if value.numel() != 1:
            raise TypeError(f"optimizer state {key!r} has shape {tuple(value.shape)}: raydeep checkpoints hold "
                            "per-element states (the shape of the parameter) and scalars")
        # Fused kernels keep ``step`` on the parameter's device, the others on the CPU.
        return {"value": value.item(), "dtype": _dtype_name(value.dtype), "tensor": True,
                "on_param_device": value.device == master.device}
    return {"value": value, "tensor": False}


def _scalar_from_spec(spec: dict, master: torch.Tensor):
    if not spec.get("tensor"):
        return spec["value"]
    dtype = getattr(torch, spec["dtype"], None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {spec['dtype']!r} for an optimizer scalar state")
    device = master.device if spec.get("on_param_device") else "cpu"
    return torch.tensor(spec["value"], dtype=dtype, device=device)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
