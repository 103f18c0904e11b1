"""DeepSpeed itself as a peer: ``train_engine`` with ``deepspeed.initialize`` in place of raydeep.

Runs inside ``run_ranks`` ranks. DeepSpeed's CPU accelerator (``DS_ACCELERATOR=cpu``) talks
gloo when oneCCL's PyTorch bindings are not installed, and ``deepspeed.initialize`` reuses the
process group the harness already initialised (RANK, LOCAL_RANK, WORLD_SIZE and MASTER_* are
set by the harness). fp32 only: the comparison is between fp32 AdamW runs.

DeepSpeed's CPU communication backend JIT-compiles a shared-memory all-reduce kernel when it
starts (minutes of C++ build on a small machine, and a compiler on the path). Only
``inference_all_reduce`` uses that kernel; training collectives go through torch.distributed,
so the peer skips the build.
"""
from __future__ import annotations

import copy
import importlib
import os
import warnings


from tests.dist.workloads import run_steps, tiny_gpt


def _import_deepspeed():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    # DeepSpeed calls torch.distributed.reduce_scatter_tensor / all_gather_into_tensor, which
    # torch deprecates with a FutureWarning on every call.
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)

    # importlib, not ``import deepspeed.comm.torch as m``: ``deepspeed.comm`` has an attribute
    # ``torch`` (the torch package) that shadows its submodule in that form.
    backend = importlib.import_module("deepspeed.comm.torch")
    backend.build_shm_op = lambda: None  # inference-only kernel; see the module docstring
    return deepspeed


def train_deepspeed(cfg: dict, steps: int, global_batch: int) -> dict:
    """Train with DeepSpeed on this rank exactly as ``train_engine`` trains with raydeep: same
    model init, same slicing of each global batch, same config; per-step losses averaged over
    the ranks, and the full fp32 parameters after the last step."""

    deepspeed = _import_deepspeed()
    model = tiny_gpt()
    # DeepSpeed pops keys (torch_adam, ...) from the optimizer params: give it its own copy.
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=copy.deepcopy(cfg))
    losses = run_steps(engine, steps, global_batch)
    params = list(model.parameters())
    if engine.zero_optimization_stage() == 3:
        with deepspeed.zero.GatheredParameters(params):
            full = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    else:
        full = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    optimizer = engine.optimizer
    inner = getattr(optimizer, "optimizer", optimizer)
    out = {"losses": losses, "params": full, "optimizer": type(inner).__name__,
           "zero_optimizer": type(optimizer).__name__}
    engine.destroy()
    return out


def stage_sweep(trainer: str, stages: list[int], steps: int, micro: int, gas: int, clip: float) -> dict:
    """``train_engine`` (trainer ``"raydeep"``) or ``train_deepspeed`` (``"deepspeed"``) for each
    ZeRO stage on this rank, in one process group; keyed by stage."""
    import torch.distributed as dist

    from tests.dist.workloads import config, train_engine

    train = {"raydeep": train_engine, "deepspeed": train_deepspeed}[trainer]
    global_batch = micro * gas * dist.get_world_size()
    return {stage: train(config(stage, gas, micro, clip), steps, global_batch) for stage in stages}


# --- counting the collectives DeepSpeed issues ----------------------------------------------------
def _nbytes(tensors) -> int:
    tensors = tensors if isinstance(tensors, (list, tuple)) else [tensors]
    return sum(_nbytes(t) if isinstance(t, (list, tuple)) else t.numel() * t.element_size() for t in tensors)


# torch.distributed function -> (kind, argument whose bytes count). Bytes follow raydeep's
# CommStats convention: the all-reduced/reduced/broadcast tensor, the reduce-scatter input,
# the all-gather output. Anything else is recorded under its own name with no size, so a test
# sees it rather than silently missing traffic.
_COUNTED = {
    "all_reduce": ("all_reduce", "tensor"), "all_reduce_coalesced": ("all_reduce", "tensors"),
    "reduce": ("reduce", "tensor"), "broadcast": ("broadcast", "tensor"),
    "reduce_scatter": ("reduce_scatter", "input_list"), "reduce_scatter_tensor": ("reduce_scatter", "input"),
    "reduce_scatter_single": ("reduce_scatter", "input"), "_reduce_scatter_base": ("reduce_scatter", "input"),
    "all_gather": ("all_gather", "tensor_list"), "all_gather_into_tensor": ("all_gather", "output_tensor"),
    "all_gather_single": ("all_gather", "output_tensor"), "_all_gather_base": ("all_gather", "output_tensor"),
    "all_gather_coalesced": ("all_gather", "output_tensor_lists"),
    # Point-to-point: the bytes sent (raydeep's gloo exchange, raydeep.comm.exchange, is made of these).
    "send": ("send", "tensor"), "isend": ("send", "tensor"),
}
_OTHER = ("all_to_all", "all_to_all_single", "gather", "scatter", "recv", "irecv", "batch_isend_irecv")


class CollectiveRecorder:
    """Wraps torch.distributed's collectives in this process and counts calls and bytes per kind.

    Both ``torch.distributed`` and ``distributed_c10d`` are patched, because DeepSpeed's comm
    backend reaches some functions through each, and it must be installed before DeepSpeed
    builds that backend (it keeps references to the functions). torch implements some
    collectives with others (``reduce_scatter_tensor`` calls ``reduce_scatter_single``), so only
    the outermost call is counted.
    """

    def __init__(self):
        import threading

        self.counts: dict[str, dict[str, int]] = {}
        self._local = threading.local()

    def install(self) -> "CollectiveRecorder":
        import inspect

        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        for name in list(_COUNTED) + list(_OTHER):
            original = getattr(c10d, name, None) or getattr(dist, name, None)
            if original is None or getattr(original, "_recorded", False):
                continue
            kind, arg = _COUNTED.get(name, (name, None))
            wrapper = self._wrap(original, kind, arg, inspect.signature(original))
            for module in (dist, c10d):
                if getattr(module, name, None) is original:
                    setattr(module, name, wrapper)
        return self

    def _wrap(self, original, kind, arg, signature):
        import functools

        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            depth = getattr(self._local, "depth", 0)
            if depth == 0:
                nbytes = _nbytes(signature.bind(*args, **kwargs).arguments[arg]) if arg else 0
                entry = self.counts.setdefault(kind, {"calls": 0, "bytes": 0})
                entry["calls"] += 1
                entry["bytes"] += nbytes
            self._local.depth = depth + 1
            try:
                return original(*args, **kwargs)
            finally:
                self._local.depth = depth
        wrapper._recorded = True
        return wrapper

    def reset(self) -> None:
        self.counts.clear()


_RECORDER: CollectiveRecorder | None = None


def deepspeed_comm_sweep(stages: list[int], steps: int, warmup_steps: int, micro: int, gas: int,
                         clip: float) -> dict:
    """Collectives DeepSpeed issues on this rank during the last ``steps - warmup_steps`` optimizer
    steps of ``train_deepspeed``'s loop, for each ZeRO stage: {stage: {kind: {calls, bytes}}}."""
    import torch.distributed as dist

    from tests.dist.workloads import config

    global _RECORDER
    if _RECORDER is None:
        _RECORDER = CollectiveRecorder().install()  # before deepspeed builds its comm backend
    deepspeed = _import_deepspeed()
    global_batch = micro * gas * dist.get_world_size()
    out = {}
    for stage in stages:
        engine, *_ = deepspeed.initialize(model=tiny_gpt(), config=copy.deepcopy(config(stage, gas, micro, clip)))
        # run_steps calls reset_comm_stats() once the warm-up steps are done: point it at the recorder.
        engine.reset_comm_stats = _RECORDER.reset
        _RECORDER.reset()
        run_steps(engine, steps, global_batch, warmup_steps)
        counts = copy.deepcopy(_RECORDER.counts)
        # run_steps averages each step's loss over the ranks with one float64 all-reduce of its
        # own; that is the test loop's traffic, not DeepSpeed's.
        loop = counts["all_reduce"]
        loop["calls"] -= steps - warmup_steps
        loop["bytes"] -= 8 * (steps - warmup_steps)
        engine.destroy()
        out[stage] = counts
    return out


# --- checkpoints written by DeepSpeed (the import test) --------------------------------------------
def _gpt(width: int):
    """The tiny GPT (``width`` 64), or the same with another width and 3 heads: an odd width
    (e.g. 33) gives odd-sized parameters, so DeepSpeed pads its partitions."""
    if width == 64:
        return tiny_gpt()
    import torch

    from raydeep.models import build_gpt
    from tests.dist.workloads import SEQ

    torch.manual_seed(0)
    return build_gpt("gpt-tiny", block_size=SEQ, n_layer=2, n_embd=width, n_head=3)


def deepspeed_save_and_continue(directory: str, cfg: dict, global_batch: int, before: int, after: int,
                                width: int = 64) -> dict:
    """Train ``before`` steps with DeepSpeed, ``engine.save_checkpoint(directory)``, then train
    ``after`` more on the batches that follow: the continuation's per-step losses, learning
    rate and full fp32 parameters."""
    deepspeed = _import_deepspeed()
    model = _gpt(width)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=copy.deepcopy(cfg))
    run_steps(engine, before, global_batch)
    engine.save_checkpoint(directory, client_state={"note": "from deepspeed"})
    losses = run_steps(engine, before + after, global_batch, skip=before)
    params = list(model.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=engine.zero_optimization_stage() == 3):
        full = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    out = {"losses": losses, "lr": engine.get_lr(), "params": full, "steps": engine.global_steps}
    engine.destroy()
    return out


def deepspeed_import_continuation(directory: str, cases: list[tuple[int, dict, int, bool]], before: int,
                                  after: int) -> dict:
    """Per case (ZeRO stage, extra config, model width, control): DeepSpeed trains ``before``
    steps, saves and continues ``after`` steps; rank 0 imports its checkpoint with ``raydeep
    convert import-deepspeed``; a raydeep engine of the same stage and config loads the import and
    continues ``after`` steps on the same data. With ``control``, a second raydeep engine loads
    only the weights (no optimizer state) and continues too: the comparison must tell them apart."""
    import torch.distributed as dist

    import raydeep
    from raydeep.checkpoint.convert import main as convert
    from tests.dist.checkpoint_workloads import GLOBAL_BATCH, continue_training, layout_config

    out = {}
    for i, (stage, extra, width, control) in enumerate(cases):
        source, target = f"{directory}/deepspeed{i}", f"{directory}/raydeep{i}"
        cfg = layout_config(stage, dist.get_world_size(), **extra)
        ds = deepspeed_save_and_continue(source, cfg, GLOBAL_BATCH, before, after, width)
        dist.barrier()  # every rank's files are written
        status = convert(["import-deepspeed", source, target]) if dist.get_rank() == 0 else 0
        dist.barrier()
        engine, *_ = raydeep.initialize(model=_gpt(width), config=cfg)
        _, client = engine.load_checkpoint(target)
        result = {"deepspeed": ds, "raydeep": continue_training(engine, after), "status": status, "client": client}
        if control:
            engine, *_ = raydeep.initialize(model=_gpt(width), config=cfg)
            engine.load_checkpoint(target, load_optimizer_states=False)
            result["weights_only"] = continue_training(engine, after)
        out[i] = result
    return out
