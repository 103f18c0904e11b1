"""DeepSpeed's ``deepspeed.checkpointing``: activation checkpointing called from model code.

    import raydeep as deepspeed
    deepspeed.checkpointing.configure(None, deepspeed_config="ds_config.json")
    x = deepspeed.checkpointing.checkpoint(block, x)      # block's activations recomputed in backward

``checkpoint`` is PyTorch's non-reentrant ``torch.utils.checkpoint`` (:mod:`raydeep.activation.region`):
the CPU and device random states are restored for the recomputation (so dropout matches), as are
the states of ``get_cuda_rng_tracker()``, and keyword arguments and non-tensor outputs work. Regions
nest: inside a checkpointed region further ``checkpoint`` calls -- the model's own, or the modules
the engine wraps (``raydeep.activation.wrap``) -- run plainly.

``configure`` honours DeepSpeed's options: ``checkpoint_in_cpu`` (saved inputs in pinned host
memory), ``contiguous_checkpointing`` with ``num_checkpoints`` (saved inputs in preallocated
buffers), ``synchronize`` and ``profile``. ``partition_activations`` is accepted and warned about:
it splits saved inputs across tensor-parallel ranks, and raydeep runs data parallel only.

>>> import torch
>>> layer = torch.nn.Linear(4, 4)
>>> x = torch.ones(2, 4, requires_grad=True)
>>> checkpoint(layer, x).sum().backward()
>>> x.grad.shape
torch.Size([2, 4])
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch

from raydeep.activation.options import CheckpointOptions
from raydeep.activation.region import Checkpointer

logger = logging.getLogger("raydeep")

# What each unimplemented option would have done, for the warning.
UNIMPLEMENTED = {
    "partition_activations": "it splits saved activations across tensor-parallel ranks, and raydeep runs "
                             "data parallel only",
}
# configure()'s keyword arguments -> the config keys they override.
_KWARG_KEYS = {"partition_activations": "partition_activations",
               "contiguous_checkpointing": "contiguous_memory_optimization", "num_checkpoints": "number_checkpoints",
               "checkpoint_in_cpu": "cpu_checkpointing", "synchronize": "synchronize_checkpoint_boundary",
               "profile": "profile"}

_configured = False
_options: dict[str, Any] = {}
_num_layers: int | None = None


def checkpointer_for(options: CheckpointOptions, **parts) -> Checkpointer:
    """A :class:`~raydeep.activation.region.Checkpointer` that also replays the RNG tracker's states."""
    return Checkpointer(options, contexts=_rng_tracker_contexts, **parts)


_checkpointer: Checkpointer | None = None  # configure()'s; built on first use


def checkpoint(function, *args, **kwargs):
    """Run ``function(*args, **kwargs)`` keeping none of its activations; recompute them in backward."""
    global _checkpointer
    if _checkpointer is None:
        _checkpointer = checkpointer_for(CheckpointOptions())
    return _checkpointer(function, *args, **kwargs)


non_reentrant_checkpoint = checkpoint


def unimplemented_options(section: Any) -> list[str]:
    """Warnings for the enabled ``activation_checkpointing`` options raydeep does not implement."""
    get = section.get if isinstance(section, dict) else lambda key, default=None: getattr(section, key, default)
    return [f"activation_checkpointing.{key} has no effect: {why}"
            for key, why in UNIMPLEMENTED.items() if get(key, False)]


def configure(mpu_, deepspeed_config=None, partition_activations=None, contiguous_checkpointing=None,
              num_checkpoints=None, checkpoint_in_cpu=None, synchronize=None, profile=None) -> None:
    """DeepSpeed's ``configure``: read the ``activation_checkpointing`` section of ``deepspeed_config``
    (dict, path, JSON or base64); keyword arguments override it."""
    global _configured, _options, _num_layers
    if mpu_ is not None and _model_parallel_size(mpu_) > 1:
        raise NotImplementedError("activation checkpointing with model parallelism (mpu) is not supported by raydeep")
    options: dict[str, Any] = {}
    if deepspeed_config is not None:
        from raydeep.config import read_config
        from raydeep.config.sections import ActivationCheckpointingConfig

        section = read_config(deepspeed_config).get("activation_checkpointing") or {}
        options = ActivationCheckpointingConfig.model_validate(section).model_dump()
    given = dict(partition_activations=partition_activations, contiguous_checkpointing=contiguous_checkpointing,
                 num_checkpoints=num_checkpoints, checkpoint_in_cpu=checkpoint_in_cpu, synchronize=synchronize,
                 profile=profile)
    options.update({_KWARG_KEYS[k]: v for k, v in given.items() if v is not None})
    for text in unimplemented_options(options):
        logger.warning(text)
    _options, _num_layers = options, options.get("number_checkpoints")
    _rebuild()
    _configured = True


def _rebuild() -> None:
    global _checkpointer
    options = CheckpointOptions.from_section({**_options, "number_checkpoints": _num_layers})
    if options.contiguous_memory_optimization and options.number_checkpoints is None:
        raise ValueError("contiguous_checkpointing needs num_checkpoints (activation_checkpointing."
                         "number_checkpoints): the number of checkpointed layers each buffer holds")
    _checkpointer = checkpointer_for(options)


def _model_parallel_size(mpu) -> int:
    for name in ("get_tensor_model_parallel_world_size", "get_model_parallel_world_size"):
        if hasattr(mpu, name):
            return int(getattr(mpu, name)())
    return 1


def is_configured() -> bool:
    """True once ``configure`` has been called, as in DeepSpeed."""
    return _configured


def reset() -> None:
    """Free the contiguous checkpoint buffers, for forwards that ran without a backward (as DeepSpeed)."""
    if _checkpointer is not None:
        _checkpointer.reset()


def set_num_layers(nlayers: int) -> None:
    """The number of checkpointed layers the contiguous buffers hold (``num_checkpoints``)."""
    global _num_layers
    _num_layers = nlayers
    _rebuild()


# --- random-state tracker (Megatron's API; one tensor-parallel rank, so no per-rank offsets) -----------
def _rng_get():
    return torch.cuda.get_rng_state() if torch.cuda.is_available() else torch.get_rng_state()


def _rng_set(state) -> None:
    if torch.cuda.is_available():
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


def _rng_seed(seed: int) -> None:
    if torch.cuda.is_available():
        torch.cuda.manual_seed(seed)
    else:
        torch.manual_seed(seed)


class CudaRNGStatesTracker:
    """Named random states of the device generator (the CPU one without a GPU); ``fork(name)`` runs a
    block on that state, e.g. dropout inside tensor-parallel regions in Megatron-style code."""

    def __init__(self):
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def reset(self) -> None:
        self.states_, self.seeds_ = {}, set()

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        if name in self.states_:
            raise Exception(f"cuda rng state {name} already exists")
        self.seeds_.add(seed)
        original = _rng_get()
        _rng_seed(seed)
        self.states_[name] = _rng_get()
        _rng_set(original)

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        if name not in self.states_:
            raise Exception(f"cuda rng state {name} is not added")
        original = _rng_get()
        _rng_set(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = _rng_get()
            _rng_set(original)


_TRACKER = CudaRNGStatesTracker()


def get_cuda_rng_tracker() -> CudaRNGStatesTracker:
    return _TRACKER


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """DeepSpeed's seeding with one tensor-parallel rank: the device generator gets ``seed`` and the
    tracker's ``model-parallel-rng`` state gets ``seed + 2718``."""
    _TRACKER.reset()
    _rng_seed(seed)
    _TRACKER.add("model-parallel-rng", seed + 2718)


def _rng_tracker_contexts():
    """Recompute with the tracker states the forward started from, as DeepSpeed's CheckpointFunction does."""
    saved = _TRACKER.get_states()
    if not saved:
        return contextlib.nullcontext(), contextlib.nullcontext()

    @contextlib.contextmanager
    def recompute():
        current = _TRACKER.get_states()
        _TRACKER.set_states(saved)
        try:
            yield
        finally:
            _TRACKER.set_states(current)
    return contextlib.nullcontext(), recompute()
