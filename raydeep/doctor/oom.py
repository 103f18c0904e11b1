"""An out-of-memory error inside the engine, told in the doctor's terms: what this configuration
needs per rank, item by item, and the knob to turn.

The engine catches CUDA's ``torch.OutOfMemoryError`` and the CPU allocator's "can't allocate
memory" around forward, backward and the optimizer step, and adds this diagnosis to the error as
a note: the exception keeps its type (code that catches ``torch.OutOfMemoryError`` to retry with
a smaller batch still works) and its traceback.
"""
from __future__ import annotations

import contextlib
import os

import torch

from raydeep.estimate import GB


def is_out_of_memory(err: BaseException) -> bool:
    """CUDA's OOM, the CPU allocator's, or Python's MemoryError."""
    if isinstance(err, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(err, RuntimeError) and ("can't allocate memory" in str(err) or "out of memory" in str(err))


def device_capacity(device: torch.device) -> int | None:
    """Bytes of memory on ``device`` (the host's physical memory for the CPU)."""
    try:
        if device.type == "cuda":
            return torch.cuda.get_device_properties(device).total_memory
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, RuntimeError, AttributeError):
        return None


def _size(nbytes: int) -> str:
    return f"{nbytes / GB:.2f} GB" if nbytes >= 0.1 * GB else f"{nbytes / 1e6:.1f} MB"


def diagnose_oom(cfg, model, seq: int | None, device: torch.device, phase: str) -> str:
    """The note an OOM in ``phase`` ("forward", "backward", "optimizer step") gets."""
    from raydeep.doctor.fit import changes_that_fit
    from raydeep.doctor.memory import plan_memory
    from raydeep.doctor.shape import Cluster, ModelShape

    capacity = device_capacity(device)
    seq = seq or getattr(getattr(model, "config", None), "block_size", None) or 1
    shape = ModelShape.from_module(model, seq, persistence_threshold=cfg.zero_optimization.param_persistence_threshold)
    on_device = device.type == "cuda"
    plan = plan_memory(cfg, shape, capacity, on_device=on_device)
    items = ", ".join(f"{row.name} {_size(row.bytes)}" for row in plan.device_rows if row.bytes)
    lines = [f"raydeep: out of memory in the {phase} on {device}. The doctor's estimate for this config per rank: "
             f"{items}; {_size(plan.allocated)} at the peak ({plan.peak_phase})"
             + (f" of {_size(capacity)}" if capacity else "") + "."]
    cluster = Cluster(world_size=cfg.world_size, device_memory=int(0.9 * capacity) if capacity else None)
    fixes = changes_that_fit(cfg.to_ds_dict(), cfg, shape, cluster, limit=3) if capacity else []
    if fixes:
        lines.append("What to turn, cheapest first: " + "; ".join(
            f"{c.title} ({', '.join(f'{k}={v}' for k, v in c.settings.items())}; {c.cost_text})" for c in fixes) + ".")
    else:
        lines.append("Turn down train_micro_batch_size_per_gpu (raise gradient_accumulation_steps to keep the global "
                     "batch), add an activation_checkpointing section, or raise the ZeRO stage.")
    lines.append("`raydeep doctor CONFIG --model ... --world-size N --gpu-memory SIZE` prints the whole table.")
    return "\n".join(lines)


class OomDiagnosis:
    """What the engine wraps its forward, backward and optimizer step in (the builder makes one
    from the resolved config): an out-of-memory error there gets :func:`diagnose_oom`'s note,
    once; its type and traceback stay."""

    def __init__(self, cfg, model, device: torch.device):
        self.cfg, self.model, self.device = cfg, model, device

    @contextlib.contextmanager
    def watch(self, phase: str, seq: int | None):
        try:
            yield
        except (RuntimeError, MemoryError) as err:
            if not is_out_of_memory(err) or getattr(err, "raydeep_diagnosed", False):
                raise
            try:
                note = diagnose_oom(self.cfg, self.model, seq, self.device, phase)
            except Exception as failure:  # the diagnosis must never hide the error itself
                note = f"raydeep: out of memory in the {phase} (no estimate: {type(failure).__name__}: {failure})"
            err.add_note(note)
            err.raydeep_diagnosed = True
            raise
