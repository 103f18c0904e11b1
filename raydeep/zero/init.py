"""``raydeep.zero.Init``: build a model for ZeRO stage 3 without materialising it on every rank.

    with raydeep.zero.Init(config_dict_or_path=ds_config):
        model = MyModel()                 # each module's parameters are partitioned as it is built
    engine, *_ = raydeep.initialize(model=model, config=ds_config)

How it works:

- While the context is active, the ``__init__`` of every ``nn.Module`` subclass is wrapped (and a
  subclass defined inside the context is wrapped when it is created). When a module's outermost
  ``__init__`` returns, each of its parameters not yet partitioned is broadcast from rank 0 (so the
  result equals the model rank 0 would build alone) and replaced by this rank's slice
  (``raydeep.zero.partitioned``). At most one module's own parameters are full at any time.
- Init code that later touches an already partitioned parameter -- a parent's
  ``reset_parameters()`` re-initialising its children, ``weight.data.normal_()`` -- is intercepted by
  a ``TorchFunctionMode``: the parameter is gathered, the operation runs on the full values, and an
  in-place change is broadcast from rank 0 and re-partitioned. Every rank consumes its random
  generator exactly as without Init, so seeded models come out identical.
- ``Init(module=model)`` partitions an already built model.
- ``model.to()``, ``.half()``, ``.cuda()`` on a partitioned model convert the slices, not the
  placeholders (``partitioned.guard_conversions``).

The engine (stage 3) re-cuts the per-parameter slices into its FlatUnits one unit at a time
(``FlatUnit``); at stages 0-2, which keep full parameters on every rank, it gathers them instead.

Differences from DeepSpeed: partitioned parameters keep their shape (DeepSpeed's become 1-D and
empty), and reading one outside ``GatheredParameters`` gives NaN; tensor-parallel (``mpu``) and
quantised or NVMe partitions are not supported. In-place updates through a *view* of a partitioned
parameter inside the context are not seen: use ``GatheredParameters(params, modifier_rank=0)``.

>>> import torch
>>> with Init():
...     layer = torch.nn.Linear(4, 2)
>>> layer.weight.shape, layer.weight.ds_numel, layer.weight.ds_status
(torch.Size([2, 4]), 8, 'NOT_AVAILABLE')
"""
from __future__ import annotations

import contextlib
import functools
import logging

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from raydeep import comm
from raydeep.zero import partitioned

logger = logging.getLogger("raydeep")

# Calls that read only metadata (shape, dtype, the ``.data`` alias, ...) never need the values.
_METADATA = frozenset({
    "__get__", "__set__", "__delete__", "size", "dim", "ndimension", "numel", "nelement", "is_floating_point",
    "is_complex", "is_signed", "element_size", "stride", "storage_offset", "is_contiguous", "requires_grad_",
    "untyped_storage", "data_ptr", "__hash__", "get_device", "_is_view", "is_pinned", "is_shared"})
_INPLACE_DUNDERS = frozenset({
    "__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__", "__ipow__",
    "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__imatmul__"})

_active: list["Init"] = []  # the Init contexts entered, outermost first
_patched: dict[type, object] = {}  # class -> its original __init__, while a context is active
_init_depth: dict[int, int] = {}  # id(module) -> nesting of its class chain's __init__ calls


class Init:
    """DeepSpeed's ``deepspeed.zero.Init`` (see the module docstring).

    Accepted and ignored, as they have no meaning here: ``mem_efficient_linear``,
    ``zero_quantized_nontrainable_weights`` (when false), ``sequence_data_parallel_group``,
    ``tensor_overrides``. ``remote_device="cpu"`` keeps the slices in host memory; ``"nvme"``,
    ``param_swapper`` and quantised weights are not implemented and warn. ``dtype`` (else the
    config's bf16/fp16 precision, else the parameter's own dtype) is the dtype of the slices.
    """

    def __init__(self, module: nn.Module | None = None, data_parallel_group=None, mem_efficient_linear: bool = True,
                 remote_device=None, pin_memory: bool = False, config_dict_or_path=None, config=None,
                 enabled: bool = True, dtype: torch.dtype | None = None, mpu=None, zero_param_parallel_group=None,
                 zero_quantized_weights: bool = False, zero_quantized_nontrainable_weights: bool = False,
                 sequence_data_parallel_group=None, param_swapper=None, tensor_overrides=None, **unknown):
        self.enabled = enabled
        if unknown:
            logger.warning("zero.Init: ignoring unknown arguments %s", sorted(unknown))
        if not enabled:
            return
        if mpu is not None:
            raise NotImplementedError("zero.Init(mpu=...): model parallelism is not supported by raydeep")
        for name, group in (("data_parallel_group", data_parallel_group),
                            ("zero_param_parallel_group", zero_param_parallel_group)):
            if group is not None and comm.world_size(group) != comm.world_size():
                raise NotImplementedError(f"zero.Init({name}=...): raydeep partitions over all ranks; "
                                          "a group smaller than the world is not supported")
        if zero_quantized_weights or zero_quantized_nontrainable_weights or param_swapper is not None:
            logger.warning("zero.Init: quantised weights and param_swapper are not implemented; "
                           "partitions are kept unquantised in memory")
        if remote_device == "nvme":
            logger.warning("zero.Init(remote_device='nvme') is not implemented; partitions stay in host memory")
        self.shard_device = torch.device("cpu") if remote_device in ("cpu", "nvme") else None
        self.pin_memory = pin_memory
        self.dtype = dtype if dtype is not None else _config_dtype(config_dict_or_path or config)
        self.stats = comm.CommStats()
        self._mode: _InitMode | None = None
        if module is not None:
            self.partition_module(module)

    # --- the context -------------------------------------------------------------------------------
    def __enter__(self):
        if not self.enabled:
            return self
        _active.append(self)
        if len(_active) == 1:  # nested contexts share the outermost one's patches and settings
            _patch_module_classes()
            self._mode = _InitMode()
            self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        if not self.enabled:
            return
        assert _active and _active[-1] is self, "zero.Init contexts must exit in reverse order of entry"
        _active.pop()
        if self._mode is not None:
            self._mode.__exit__(*exc)
            self._mode = None
            _unpatch_module_classes()

    # --- partitioning ------------------------------------------------------------------------------
    def partition_module(self, module: nn.Module) -> None:
        """Partition every parameter of ``module`` not partitioned yet; collective (same order everywhere)."""
        seen = set()
        for p in module.parameters():
            if id(p) in seen or partitioned.is_partitioned(p) or getattr(p, "ds_status", None) == "AVAILABLE":
                continue
            seen.add(id(p))
            partitioned.partition(p, self.dtype, self.shard_device, self.pin_memory, self.stats)
        for m in module.modules():
            if any(p is not None and partitioned.is_partitioned(p) for p in m._parameters.values()):
                partitioned.guard_conversions(m)


def _config_dtype(source) -> torch.dtype | None:
    """DeepSpeed's rule: bf16 if enabled in the config, else fp16 if enabled; otherwise keep the dtype."""
    if source is None:
        return None
    from raydeep.config import read_config

    data = read_config(source)
    for key, dtype in (("bf16", torch.bfloat16), ("bfloat16", torch.bfloat16), ("fp16", torch.float16)):
        section = data.get(key)
        if isinstance(section, dict) and section.get("enabled") is True:
            return dtype
    return None


# --- wrapping module constructors ---------------------------------------------------------------------
def _wrap_init(original):
    @functools.wraps(original)
    def init(module, *args, **kwargs):
        key = id(module)
        depth = _init_depth.get(key, 0)
        _init_depth[key] = depth + 1  # subclass __init__ calling super().__init__: partition once, at the end
        try:
            original(module, *args, **kwargs)
        finally:
            if depth:
                _init_depth[key] = depth
            else:
                del _init_depth[key]
        if depth == 0 and _active:
            with _active[0]._mode.bypass():
                _active[0].partition_module(module)
    init._raydeep_original = original
    return init


def _wrap_class(cls: type) -> None:
    if "__init__" in cls.__dict__ and cls not in _patched and cls is not nn.Module:
        _patched[cls] = cls.__dict__["__init__"]
        cls.__init__ = _wrap_init(cls.__dict__["__init__"])


_NO_OWN_HOOK = object()
_saved_subclass_hook = _NO_OWN_HOOK


def _subclass_hook(cls, **kwargs):
    if _saved_subclass_hook is _NO_OWN_HOOK:
        super(nn.Module, cls).__init_subclass__(**kwargs)
    else:
        _saved_subclass_hook.__get__(None, cls)(**kwargs)
    _wrap_class(cls)  # a model class defined inside the context


def _patch_module_classes() -> None:
    global _saved_subclass_hook
    seen, stack = set(), [nn.Module]
    while stack:
        for sub in stack.pop().__subclasses__():
            if sub not in seen:
                seen.add(sub)
                _wrap_class(sub)
                stack.append(sub)
    _saved_subclass_hook = nn.Module.__dict__.get("__init_subclass__", _NO_OWN_HOOK)
    nn.Module.__init_subclass__ = classmethod(_subclass_hook)


def _unpatch_module_classes() -> None:
    if _saved_subclass_hook is _NO_OWN_HOOK:
        del nn.Module.__init_subclass__
    else:
        nn.Module.__init_subclass__ = _saved_subclass_hook
    for cls, original in _patched.items():
        cls.__init__ = original
    _patched.clear()


# --- intercepting use of partitioned parameters inside the context --------------------------------------
class _InitMode(TorchFunctionMode):
    """Gathers a partitioned parameter around any operation that needs its values; see the module docstring.

    Note: every rank runs the same construction code, so the collectives issued here match.
    """

    def __init__(self):
        super().__init__()
        self._bypass = 0

    @contextlib.contextmanager
    def bypass(self):
        """Let raydeep's own partitioning code through untouched."""
        self._bypass += 1
        try:
            yield
        finally:
            self._bypass -= 1

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if self._bypass or name in _METADATA:
            return func(*args, **kwargs)
        owners = {}
        for leaf in tree_flatten((args, kwargs))[0]:
            if isinstance(leaf, torch.Tensor):
                p = partitioned.owner_of(leaf)
                if p is not None:
                    if leaf.shape != p.shape:
                        raise RuntimeError(f"a view of a zero.Init-partitioned parameter (shape {tuple(p.shape)}) is "
                                           f"used by {name}; gather it first with zero.GatheredParameters")
                    owners[id(p)] = p
        if not owners:
            return func(*args, **kwargs)
        params = sorted(owners.values(), key=lambda p: p.ds_id)
        for p in params:
            partitioned.materialize(p)
        # An alias such as ``param.data`` still points at the placeholder: hand the op the gathered values.
        swap = {id(p): p for p in params}
        args, kwargs = tree_map(lambda t: _gathered_alias(t, swap), (args, kwargs))
        try:
            out = func(*args, **kwargs)
            if name in _INPLACE_DUNDERS or (name.endswith("_") and not name.startswith("__")) or "out" in kwargs:
                for p in params:
                    partitioned.write_back(p, 0)
        finally:
            for p in params:
                partitioned.restore(p)
        return out


def _gathered_alias(t, swap: dict):
    if not isinstance(t, torch.Tensor) or id(t) in swap:
        return t
    p = partitioned.placeholder_owner(t)
    return p.data if p is not None and id(p) in swap else t
