"""Per-parameter partitions made by ``raydeep.zero.Init``.

A partitioned parameter keeps its shape, dtype and device but owns no full storage: its data is a
*placeholder* (one element broadcast to the full shape with stride 0) and this rank's equal slice
of the flattened, padded parameter lives in ``param.ds_tensor``. The engine later re-cuts these
per-parameter slices into its FlatUnits (``fill_unit``), one unit at a time.

Why a placeholder instead of a zero-byte storage (what FlatUnit uses between gathers): reading a
tensor whose storage was resized to zero crashes the process, while the placeholder reads as NaN,
which makes a forgotten ``GatheredParameters`` visible in the loss instead of in a core dump.
Shape queries keep working, so init code that computes fan-in from ``weight.shape`` still runs.

Attributes (DeepSpeed's names): ``ds_id``, ``ds_shape``, ``ds_numel``, ``ds_tensor`` (this rank's
slice), ``ds_status`` ("NOT_AVAILABLE" while partitioned, "AVAILABLE" while gathered).

>>> import torch
>>> p = torch.nn.Parameter(torch.arange(5.0))
>>> partition(p)                                   # one process: the slice is the whole parameter
>>> p.shape, p.ds_numel, is_partitioned(p), p.ds_tensor.tolist()
(torch.Size([5]), 5, True, [0.0, 1.0, 2.0, 3.0, 4.0])
>>> with PARTITIONS.gathered([p]):
...     p.data.tolist()
[0.0, 1.0, 2.0, 3.0, 4.0]
"""
from __future__ import annotations

import itertools
import math
import weakref

import torch
from torch import nn

from raydeep import comm
from raydeep.zero import owners

_ids = itertools.count()
# Placeholder storage address -> parameter: lets an alias such as ``param.data`` (a new tensor
# object sharing the placeholder's storage) be traced back to its parameter.
_by_storage: "weakref.WeakValueDictionary[int, nn.Parameter]" = weakref.WeakValueDictionary()
_ATTRS = ("ds_id", "ds_shape", "ds_numel", "ds_tensor", "ds_status", "ds_placeholder")


def slice_numel(numel: int, world: int) -> int:
    """Elements of each rank's slice: the parameter padded to a multiple of ``world``."""
    return math.ceil(numel / world)


def placeholder(shape, dtype: torch.dtype, device) -> torch.Tensor:
    fill = float("nan") if dtype.is_floating_point or dtype.is_complex else 0
    return torch.full((), fill, dtype=dtype, device=device).expand(shape)


def _storage_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def is_partitioned(p: torch.Tensor) -> bool:
    """True while ``p`` holds only its placeholder (not while it is gathered)."""
    ph = getattr(p, "ds_placeholder", None)
    return ph is not None and _storage_ptr(p) == _storage_ptr(ph)


def placeholder_owner(t: torch.Tensor) -> nn.Parameter | None:
    """The parameter whose placeholder storage ``t`` uses (it may be gathered right now), if any."""
    if not _by_storage:
        return None
    try:
        return _by_storage.get(_storage_ptr(t))
    except (RuntimeError, NotImplementedError):  # sparse, meta, or other storage-less tensors
        return None


def owner_of(t: torch.Tensor) -> nn.Parameter | None:
    """The partitioned parameter whose placeholder ``t`` is (or aliases), if any."""
    p = placeholder_owner(t)
    return p if p is not None and is_partitioned(p) else None


def _cut(flat: torch.Tensor, rank: int, world: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's padded slice of a flattened parameter."""
    size = slice_numel(flat.numel(), world)
    piece = flat[rank * size:(rank + 1) * size]
    if out is None:
        out = torch.zeros(size, dtype=flat.dtype, device=flat.device)
    else:
        out.zero_()
    out[:piece.numel()].copy_(piece)
    return out


def _set_placeholder(p: nn.Parameter, ph: torch.Tensor) -> None:
    p.ds_placeholder = ph
    p.data = ph
    p.ds_status = "NOT_AVAILABLE"
    _by_storage[_storage_ptr(ph)] = p


def partition(p: nn.Parameter, dtype: torch.dtype | None = None, shard_device=None, pin_memory: bool = False,
              stats: comm.CommStats | None = None) -> None:
    """Make every rank hold rank 0's values (as DeepSpeed's Init does), keep this rank's slice, and
    replace the parameter's data by a placeholder. Collective: call on every rank in the same order."""
    data = p.data if dtype is None or not p.is_floating_point() else p.data.to(dtype)
    # A parameter built on the CPU meets NCCL on this rank's GPU (NCCL moves CUDA tensors only).
    data = data.to(comm.collective_device()).contiguous()
    comm.broadcast(data, 0, stats)
    shard = _cut(data.reshape(-1), comm.rank(), comm.world_size())
    if shard_device is not None:
        shard = shard.to(shard_device)
    if pin_memory and shard.device.type == "cpu" and torch.cuda.is_available():
        shard = shard.pin_memory()
    p.ds_id = next(_ids)
    p.ds_shape, p.ds_numel = tuple(p.shape), p.numel()
    p.ds_tensor = shard
    owners.register([p], PARTITIONS)  # lets zero.GatheredParameters find who can gather it
    _set_placeholder(p, placeholder(p.shape, data.dtype, p.data.device))


def gather(p: nn.Parameter) -> torch.Tensor:
    """The full parameter from every rank's slice (one all-gather); collective."""
    world, device = comm.world_size(), comm.collective_device()
    # Slices kept in host memory (remote_device="cpu") travel through the collective's device.
    out = torch.empty(world * p.ds_tensor.numel(), dtype=p.ds_tensor.dtype, device=device)
    comm.all_gather(out, p.ds_tensor.to(device).contiguous())
    return out[:p.ds_numel].view(p.ds_shape).to(p.ds_placeholder.device)


def materialize(p: nn.Parameter) -> None:
    """Give ``p`` its full values until ``restore``; collective."""
    p.data = gather(p)
    p.ds_status = "AVAILABLE"


def write_back(p: nn.Parameter, src: int = 0) -> None:
    """Broadcast the gathered ``p`` from ``src`` and keep this rank's slice of it; collective."""
    full = p.data.to(comm.collective_device()).contiguous()
    comm.broadcast(full, src)
    _cut(full.reshape(-1).to(p.ds_tensor.device, p.ds_tensor.dtype), comm.rank(), comm.world_size(), out=p.ds_tensor)


def restore(p: nn.Parameter) -> None:
    """Drop the gathered values again (without writing them back)."""
    _set_placeholder(p, p.ds_placeholder)


def move(p: nn.Parameter, device, dtype: torch.dtype | None) -> None:
    """Place a partitioned parameter's slice (and placeholder) on ``device`` in ``dtype`` without
    ever making the full parameter (converting the placeholder itself would expand it)."""
    dtype = dtype if dtype is not None and p.is_floating_point() else p.dtype
    device = torch.device(device)
    if p.ds_tensor.dtype == dtype and p.device == device:
        return
    p.ds_tensor = p.ds_tensor.to(device=device, dtype=dtype)
    _set_placeholder(p, placeholder(p.ds_shape, dtype, device))


def guard_conversions(module: nn.Module) -> None:
    """Make ``module.to()``, ``.half()``, ``.cuda()`` ... convert the slices of its partitioned
    parameters instead of their placeholders (idempotent): the conversion is worked out on an empty
    tensor of the parameter's dtype and device, then applied with ``move``."""
    if "_apply" not in module.__dict__:
        module._apply = _partition_aware_apply.__get__(module)


def _partition_aware_apply(module: nn.Module, fn, recurse: bool = True):
    own = module.__dict__["_parameters"]
    split = {name for name, p in own.items() if p is not None and is_partitioned(p)}
    for name in split:
        p = own[name]
        probe = fn(torch.empty(0, dtype=p.dtype, device=p.device))
        move(p, probe.device, probe.dtype)
    module.__dict__["_parameters"] = {k: v for k, v in own.items() if k not in split}  # hidden from nn.Module
    try:
        return nn.Module._apply(module, fn, recurse)
    finally:
        module.__dict__["_parameters"] = own


def release(p: nn.Parameter) -> None:
    """Forget the per-parameter partition once the engine owns the values (frees the slice)."""
    for name in _ATTRS:
        if hasattr(p, name):
            delattr(p, name)
    owners.forget(p, PARTITIONS)


def fill_unit(full: torch.Tensor, slots, params: list[nn.Parameter]) -> bool:
    """Write the values of the partitioned ``params`` into their ``slots`` of a unit's ``full``
    buffer, with one all-gather of this rank's slices of all of them. Memory: about twice the unit.
    Returns whether any parameter was partitioned. Collective: every rank builds units in the same order.
    """
    parts = [(slot, p) for slot, p in zip(slots, params) if is_partitioned(p)]
    if not parts:
        return False
    send = torch.cat([p.ds_tensor.to(full.device, full.dtype) for _, p in parts])
    table = torch.empty(comm.world_size() * send.numel(), dtype=full.dtype, device=full.device)
    comm.all_gather(table, send)
    table = table.view(comm.world_size(), -1)  # row r: rank r's slices, parameter after parameter
    column = 0
    for slot, p in parts:
        size = p.ds_tensor.numel()
        values = table[:, column:column + size].reshape(-1)[:slot.numel]
        full[slot.offset:slot.offset + slot.numel].copy_(values)
        column += size
    return True


class _Partitions:
    """Gathers Init-partitioned parameters for ``zero.GatheredParameters`` before an engine owns them
    (the engine's stage-3 strategy takes over this role once built)."""

    def gathered(self, params):
        return _Gathered(sorted((p for p in params if is_partitioned(p)), key=lambda p: p.ds_id))


class _Gathered:
    def __init__(self, params: list[nn.Parameter]):
        self.params = params  # Note: sorted by ds_id, so every rank gathers in the same order

    def __enter__(self):
        for p in self.params:
            materialize(p)
        return self

    def write_back(self, src_rank: int) -> None:
        for p in self.params:
            write_back(p, src_rank)

    def __exit__(self, *exc):
        for p in self.params:
            restore(p)


PARTITIONS = _Partitions()
