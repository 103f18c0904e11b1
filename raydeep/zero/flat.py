"""FlatUnit: a group of parameters living in one flat, padded buffer, partitioned across ranks.

Every ZeRO stage is built from FlatUnits; stages differ only in what each unit keeps resident:

- ``full``:   the whole flat buffer in the model dtype; every parameter's ``.data`` is a view into it.
              Stage 3 frees its storage between uses (the views survive and refill on gather):
              ``state`` says which (:class:`ShardState`), and ``unshard``/``wait``/``reshard``
              move between the states, each idempotent.
- ``local``:  this rank's shard of the parameters. A view into ``full`` for stages 0-2; separate
              storage for stage 3, because ``full`` is freed.
- ``grad``:   this rank's gradient shard (``grad_accum_dtype``), which clipping and the optimizer read.

The fp32 masters are not the unit's: the optimizer tier (``raydeep.tier``) owns them, updates
them from ``grad`` and writes the result into ``local``.

Parameters partitioned by ``zero.Init`` arrive as per-parameter slices; the unit re-cuts them into
its own layout with one all-gather (``partitioned.fill_unit``) and, when ``local`` has storage of
its own, frees ``full`` at once, so building all units never holds more than one unit in full.
"""
from __future__ import annotations

import enum

import torch
from torch import nn

from raydeep import comm
from raydeep.zero import partitioned
from raydeep.zero import quantize
from raydeep.zero.hierarchy import Block
from raydeep.zero.layout import UnitLayout


class ShardState(enum.Enum):
    """Where a unit's parameters are: only this rank's shard (``full`` has no storage), on their
    way (an all-gather into ``full`` in flight), or whole in ``full``."""

    SHARDED = "sharded"
    UNSHARDING = "unsharding"
    UNSHARDED = "unsharded"


class FlatUnit:
    """Parameters of one unit, flattened and partitioned; see the module docstring."""

    def __init__(self, name: str, params: list[tuple[str, nn.Parameter]], rank: int, partitions: int,
                 group_index: int, grad_dtype: torch.dtype, separate_local: bool, host_local: bool = False,
                 pin_memory: bool = False):
        # With one partition (stage 0) every rank owns the whole buffer.
        self.name, self.rank, self.group_index = name, rank if partitions > 1 else 0, group_index
        self.params = [p for _, p in params]
        self.param_names = [n for n, _ in params]
        self.layout = UnitLayout.build([(n, tuple(p.shape)) for n, p in params], partitions)
        dtype, device = self.params[0].dtype, self.params[0].device
        self.full = torch.zeros(self.layout.padded_numel, dtype=dtype, device=device)
        for slot, p in zip(self.layout.slots, self.params):
            if not partitioned.is_partitioned(p):
                self.full[slot.offset:slot.offset + slot.numel].copy_(p.data.reshape(-1))
        from_partitions = partitioned.fill_unit(self.full, self.layout.slots, self.params)
        for slot, p in zip(self.layout.slots, self.params):
            partitioned.release(p)
            p.data = self._view(slot)
        lo, hi = self.layout.shard_range(self.rank)
        if separate_local and host_local:  # offload_param: the partition lives in (pinned) host memory
            pin = pin_memory and torch.cuda.is_available()
            self.local = torch.empty(hi - lo, dtype=dtype, pin_memory=pin).copy_(self.full[lo:hi])
        else:
            self.local = self.full[lo:hi].clone() if separate_local else self.full[lo:hi]
        self.grad = torch.zeros(self.layout.shard_numel, dtype=grad_dtype, device=device)
        self.state = ShardState.UNSHARDED
        self._gathering: comm.Pending | None = None  # the all-gather while UNSHARDING
        # ZeRO++ (stage 3; see ``use_zero_plus_plus``): off until the strategy switches it on.
        self.hpz: Block | None = None
        self.secondary: torch.Tensor | None = None  # hpZ: this rank's 1/hpz.size of the gathered unit
        self.secondary_valid = self.secondary_exact = False
        self.quantized_gather = False
        self.exact = True  # ``full`` holds the exact parameters (not dequantized int8 ones)
        self._keep_secondary = False
        if from_partitions and separate_local:
            self.reshard()

    def _view(self, slot) -> torch.Tensor:
        return self.full[slot.offset:slot.offset + slot.numel].view(slot.shape)

    @property
    def numel(self) -> int:
        return self.layout.numel

    @property
    def dtype(self) -> torch.dtype:
        return self.full.dtype

    # --- parameter storage (stage 3) -----------------------------------------------------------
    def use_zero_plus_plus(self, hpz: Block | None, quantized: bool) -> None:
        """Stage 3 with ZeRO++: ``hpz``, the block of ranks sharing a secondary partition (the
        node); ``quantized``, all-gather int8 block-quantized shards (qwZ)."""
        self.hpz, self.quantized_gather = hpz, quantized

    def invalidate_secondary(self) -> None:
        """The shards changed (an optimizer step, a load, a write-back): the next gather is a
        primary one, which refreshes the secondary partition."""
        self.secondary_valid = False

    def unshard(self, stats: comm.CommStats | None = None, async_op: bool = False, exact: bool = False) -> None:
        """Gather the whole unit into ``full``: start the all-gather when SHARDED (and wait for it
        unless ``async_op``); when UNSHARDING, wait unless ``async_op``; when UNSHARDED, nothing.

        With ZeRO++, from where: the node's secondary partition when it is up to date (hpZ: the
        gather stays inside the node); else every rank's shard, int8-quantized with qwZ. ``exact``
        (``GatheredParameters``: a user reads or writes the weights) gathers the shards as they are."""
        if self.state is not ShardState.SHARDED and exact and not self.exact:
            self.wait()
            self.reshard()  # the dequantized weights a module computes with are not the weights
        if self.state is ShardState.SHARDED:
            self.full.untyped_storage().resize_(self.layout.padded_numel * self.full.element_size())
            self._keep_secondary = False
            if self.hpz is not None and self.secondary_valid and not exact:
                self._gathering = comm.all_gather(self.full, self.secondary, stats, group=self.hpz.group,
                                                  async_op=async_op, label="all_gather_secondary", owner=self.name)
                self.exact = self.secondary_exact
            elif self.quantized_gather and not exact:
                self._gathering = _QuantizedGather(self, stats, async_op)
                self.exact, self._keep_secondary = False, self.hpz is not None
            else:
                # offload_param: the partition comes from pinned host memory first (DeepSpeed's ZeRO-3 Offload).
                self._gathering = comm.all_gather(self.full, self.local_on_device(), stats, async_op=async_op,
                                                  owner=self.name)
                self.exact, self._keep_secondary = True, self.hpz is not None and not exact
            self.state = ShardState.UNSHARDING
        if not async_op:
            self.wait()

    def wait(self) -> None:
        """Finish an all-gather in flight (UNSHARDING -> UNSHARDED); otherwise nothing."""
        if self.state is ShardState.UNSHARDING:
            self._gathering.wait()
            self._gathering, self.state = None, ShardState.UNSHARDED
            if self._keep_secondary and not self.secondary_valid:
                self._fill_secondary()

    def _fill_secondary(self) -> None:
        """hpZ: keep this rank's ``1/hpz.size`` of what the primary all-gather brought, so the next
        gathers (backward, and the forward of the step's next micro-batches: the shards do not
        change until the step) are all-gathers inside the node from these copies."""
        piece = self.layout.padded_numel // self.hpz.size
        if self.secondary is None:
            self.secondary = torch.empty(piece, dtype=self.full.dtype, device=self.full.device)
        self.secondary.copy_(self.full[self.hpz.index * piece:(self.hpz.index + 1) * piece])
        self.secondary_valid, self.secondary_exact = True, self.exact

    def reshard(self) -> None:
        """Drop the gathered parameters (UNSHARDED -> SHARDED; the per-parameter views stay valid
        for the next gather); SHARDED stays so. Freeing under an all-gather in flight would be a
        use-after-free, so UNSHARDING is refused: wait for it first."""
        assert self.state is not ShardState.UNSHARDING, f"{self.name}: reshard while its all-gather is in flight"
        if self.state is ShardState.UNSHARDED:
            self.full.untyped_storage().resize_(0)
            self.state = ShardState.SHARDED

    # --- gradients ------------------------------------------------------------------------------
    def flat_grads(self, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
        """This unit's full gradients as one padded flat tensor (zeros where a param got none and
        in the padding), written into ``out`` (``padded_numel`` elements of ``dtype``) when given."""
        if out is None:
            out = torch.empty(self.layout.padded_numel, dtype=dtype, device=self.full.device)
        for slot, p in zip(self.layout.slots, self.params):
            piece = out[slot.offset:slot.offset + slot.numel]
            if p.grad is None:
                piece.zero_()
            else:
                piece.copy_(p.grad.reshape(-1))
        out[self.layout.numel:].zero_()  # the slots are contiguous from 0: the rest is padding
        return out

    def drop_param_grads(self) -> None:
        for p in self.params:
            p.grad = None

    def held_range(self) -> tuple[int, int, int]:
        """(start, end, base): the flat elements ``local`` holds -- the shard, or the whole unit at
        stage 0 -- padding excluded, and the flat offset of ``local``'s element 0."""
        if self.layout.world_size > 1:
            lo, hi = self.layout.shard_range(self.rank)
            return lo, min(hi, self.layout.numel), lo
        return 0, self.layout.numel, 0

    # --- accounting -----------------------------------------------------------------------------
    def local_on_device(self) -> torch.Tensor:
        """``local`` on the device of ``full`` (a host-to-device copy when it is offloaded)."""
        if self.local.device == self.full.device:
            return self.local
        return self.local.to(self.full.device, non_blocking=self.local.is_pinned())

    def memory(self) -> dict[str, int]:
        """Bytes this unit holds resident on this rank, by kind; ``offloaded``: a partition kept in
        host memory away from the device."""
        full_bytes = self.full.untyped_storage().nbytes()
        if self.secondary is not None:
            full_bytes += self.secondary.numel() * self.secondary.element_size()
        separate_local = self.local.untyped_storage().data_ptr() != self.full.untyped_storage().data_ptr()
        local_bytes = self.local.numel() * self.local.element_size() if separate_local else 0
        away = self.local.device != self.full.device
        return {"params": full_bytes + (0 if away else local_bytes), "grads": self.grad.numel() * self.grad.element_size(),
                "offloaded": local_bytes if away else 0}


class _QuantizedGather:
    """qwZ's all-gather in flight: every rank's shard as int8 values and fp32 group scales
    (DeepSpeed's ``CUDAQuantizer``), dequantized into the unit's ``full`` buffer on ``wait``.
    A shard whose length is not a multiple of 8 is padded for the quantizer; the padding is
    dropped again row by row."""

    def __init__(self, unit: FlatUnit, stats: comm.CommStats | None, async_op: bool):
        self.unit = unit
        values, scales = quantize.quantize_weights(unit.local_on_device())
        scales = scales.reshape(-1)
        world = unit.layout.world_size
        self.values = torch.empty(world * values.numel(), dtype=values.dtype, device=values.device)
        self.scales = torch.empty(world * scales.numel(), dtype=scales.dtype, device=scales.device)
        self.pending = [comm.all_gather(self.values, values, stats, async_op=async_op, label="all_gather_quantized",
                                        owner=unit.name),
                        comm.all_gather(self.scales, scales, stats, async_op=async_op, label="all_gather_quantized",
                                        owner=unit.name + ".scales")]

    def wait(self) -> None:
        for pending in self.pending:
            pending.wait()
        unit, world = self.unit, self.unit.layout.world_size
        shard = unit.layout.shard_numel
        weights = quantize.dequantize_weights(self.values, self.scales, unit.dtype).view(world, -1)[:, :shard]
        unit.full.view(world, shard).copy_(weights)

