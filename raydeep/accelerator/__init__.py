"""DeepSpeed's accelerator object: ``from raydeep.accelerator import get_accelerator``.

Client scripts ask it for their device (``get_accelerator().device_name(local_rank)``), seed
it, synchronize it and read its memory. raydeep has two, chosen as raydeep places a rank
(``raydeep.comm.rank_device``): CUDA for an NCCL process group, the CPU for a gloo one;
with no process group, CUDA where available unless ``DS_ACCELERATOR=cpu`` (DeepSpeed's override).
DeepSpeed's other accelerators (XPU, NPU, HPU, MPS, ...) are refused by ``DS_ACCELERATOR``.

The CPU accelerator reports host memory as DeepSpeed's does: ``memory_allocated`` is the
process's resident set, ``total_memory`` the machine's. Op builders (DeepSpeed's JIT-compiled
kernels) do not exist here: ``create_op_builder`` and ``get_op_builder`` raise and say what to use.

>>> import os
>>> os.environ["DS_ACCELERATOR"] = "cpu"
>>> get_accelerator().device_name(0), get_accelerator().communication_backend_name()
('cpu', 'gloo')
"""
from __future__ import annotations

import os

from raydeep.accelerator.devices import Accelerator, CpuAccelerator, CudaAccelerator
from raydeep.comm.process_group import get_backend, wants_cuda

__all__ = ["Accelerator", "CpuAccelerator", "CudaAccelerator", "get_accelerator", "is_current_accelerator_supported",
           "set_accelerator"]

_KNOWN = ("cpu", "cuda")
_chosen: Accelerator | None = None  # set_accelerator's, which wins over the rule below
_made: dict[str, Accelerator] = {}


def _name_from_environment() -> str:
    requested = os.environ.get("DS_ACCELERATOR", "").strip().lower()
    if requested and requested not in _KNOWN:
        raise ValueError(f"DS_ACCELERATOR={requested!r}: raydeep runs on {' or '.join(_KNOWN)}; unset it to choose "
                         "by the process group's backend (NCCL: cuda, gloo: cpu)")
    return "cuda" if wants_cuda(get_backend()) else "cpu"


def get_accelerator() -> Accelerator:
    """This process's accelerator (the same object on every call for the same choice)."""
    if _chosen is not None:
        return _chosen
    name = _name_from_environment()
    if name not in _made:
        _made[name] = CudaAccelerator() if name == "cuda" else CpuAccelerator()
    return _made[name]


def set_accelerator(accelerator: Accelerator) -> None:
    """Use ``accelerator`` from now on (DeepSpeed's override for tests and custom devices)."""
    global _chosen
    _chosen = accelerator


def is_current_accelerator_supported() -> bool:
    return get_accelerator().name() in _KNOWN
