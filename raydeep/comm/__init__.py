"""Thin collectives over torch.distributed that count bytes and time per op.

Every collective the engine issues goes through here, so ``CommStats`` can prove ZeRO's
communication volume (bytes are the full logical tensor: the all-reduced tensor, the
reduce-scatter input, the all-gather output) and measure how much of it training waits for.
With one rank (or no process group) the ops are no-ops and move nothing, unless
``RAYDEEP_COLLECTIVES_AT_WORLD_1=1`` and a process group exists: then one rank runs every
collective for real, so a single GPU exercises the whole NCCL path (a one-rank NCCL group works;
two ranks cannot share a GPU). With the config's ``comms_logger`` enabled, each op is also
recorded for DeepSpeed's ``log_summary`` table (:mod:`raydeep.comm.comms_logging`, :func:`log_summary`).

>>> stats = CommStats()
>>> t = all_reduce(torch.ones(4), stats)
>>> stats.summary()
{}
"""
from __future__ import annotations

import logging
import os
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from raydeep.comm import exchange
from raydeep.comm.comms_logging import CommsLogger, deepspeed_name
from raydeep.comm.process_group import (  # noqa: F401  DeepSpeed's deepspeed.comm names for client scripts
    ReduceOp, barrier, destroy_process_group, get_backend, get_global_rank, get_local_rank, get_rank, get_world_size,
    init_distributed, is_initialized, new_group, rank_device)
from raydeep.console_lines import CONSOLE


# torch 2.13 renamed the single-tensor collectives; older releases only have the old names.
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _exchanging(group) -> bool:
    """Whether this collective runs as :mod:`raydeep.comm.exchange`'s point-to-point exchange: on gloo
    groups, unless ``RAYDEEP_GLOO_EXCHANGE=0`` (torch's own gloo collectives: how the tests run
    the branch NCCL takes on a CPU-only machine, and how a benchmark measures the difference)."""
    return dist.get_backend(group) == "gloo" and os.environ.get("RAYDEEP_GLOO_EXCHANGE", "1") != "0"


def _gloo_or(collective, exchanged):
    """``collective`` (a torch one), except on gloo, where ``exchanged`` (:mod:`raydeep.comm.exchange`)
    moves the same bytes in about half the time."""
    def launch(output, input, group=None, async_op=False):
        if not _exchanging(group):
            if _overlaps(input, output):  # a ZeRO shard inside its flat buffer: torch's take separate tensors
                input = input.clone()
            return collective(output, input, group=group, async_op=async_op)
        work = exchanged(output, input, group)
        return work if async_op else work.wait()
    return launch


_REDUCE_SCATTER = _gloo_or(_REDUCE_SCATTER, exchange.reduce_scatter)
_ALL_GATHER = _gloo_or(_ALL_GATHER, exchange.all_gather)


@dataclass
class OpStats:
    calls: int = 0
    bytes: int = 0
    # Seconds the caller was blocked: the whole op when synchronous, only the wait when async.
    blocked_s: float = 0.0


@dataclass
class CommStats:
    """Bytes, calls and blocked time per collective type since the last ``reset()``."""

    ops: dict[str, OpStats] = field(default_factory=lambda: defaultdict(OpStats))
    # How many times reset() ran: a reader of per-step deltas (raydeep.engine.metrics) can tell
    # a reset from an op that moved nothing.
    resets: int = 0

    def record(self, op: str, nbytes: int, seconds: float) -> None:
        entry = self.ops[op]
        entry.calls += 1
        entry.bytes += nbytes
        entry.blocked_s += seconds

    def reset(self) -> None:
        self.ops.clear()
        self.resets += 1

    def summary(self) -> dict[str, dict[str, float]]:
        return {op: {"calls": s.calls, "bytes": s.bytes, "blocked_s": s.blocked_s} for op, s in self.ops.items()}

    @property
    def total_bytes(self) -> int:
        return sum(s.bytes for s in self.ops.values())

    @property
    def total_blocked_s(self) -> float:
        return sum(s.blocked_s for s in self.ops.values())


class Pending:
    """An in-flight collective; ``wait()`` records the time spent blocked on it."""

    def __init__(self, work, stats: CommStats | None, op: str, profile: "_Profile | None" = None):
        self.work, self.stats, self.op, self.profile = work, stats, op, profile

    def wait(self) -> None:
        if self.work is None:
            return
        start = time.perf_counter()
        self.work.wait()
        if self.stats is not None:
            self.stats.ops[self.op].blocked_s += time.perf_counter() - start
        if self.profile is not None:
            self.profile.finish(start)
        self.work = None


class _Profile:
    """One collective the comms logger times: the seconds the caller spent in it, launch (and
    ``wait()``, for an asynchronous op) -- not the compute it overlapped in between."""

    __slots__ = ("logger", "record", "label", "nbytes", "device", "world", "spent_s")

    def __init__(self, logger: CommsLogger, label: str, tensor: torch.Tensor, group):
        self.logger, self.label, self.record = logger, label, logger.record_name(label)
        self.nbytes = tensor.numel() * tensor.element_size()  # what each rank hands in, as DeepSpeed counts
        self.device, self.world, self.spent_s = tensor.device, world_size(group), 0.0

    def finish(self, since: float) -> None:
        if self.device.type == "cuda":  # the op's completion, not its launch (DeepSpeed synchronises too)
            torch.cuda.synchronize(self.device)
        self.spent_s += time.perf_counter() - since
        self.logger.append(deepspeed_name(self.label), self.record, self.spent_s * 1000.0, self.nbytes, self.world)


world_size, rank = get_world_size, get_rank  # the names the engine uses (1 and 0 without a group)


def _skip(group) -> bool:
    """Nothing to move: one rank, and collectives are not forced at world size 1."""
    if world_size(group) > 1:
        return False
    return not (os.environ.get("RAYDEEP_COLLECTIVES_AT_WORLD_1") == "1" and dist.is_available()
                and dist.is_initialized())


# DeepSpeed's comms_logger while the config enables it; None costs each collective one test.
_comms_logger: CommsLogger | None = None


def configure_comms_logger(section) -> None:
    """Record every following collective for :func:`log_summary` as the config's ``comms_logger``
    section says (``verbose``, ``prof_all``, ``prof_ops``, ``debug``); None stops recording.
    Each call starts with no records, as a new DeepSpeed engine's logger would."""
    global _comms_logger
    _comms_logger = None if section is None else CommsLogger(
        verbose=section.verbose, prof_all=section.prof_all, prof_ops=section.prof_ops, debug=section.debug,
        rank=rank())


def log_summary(show_straggler: bool = False, return_dict: bool = False) -> dict | None:
    """Log DeepSpeed's comms table of this rank's collectives on rank 0, like
    ``deepspeed.comm.log_summary()``; with ``return_dict`` also return ``{"summary": ...}``. It
    reads only this rank's records, so unlike DeepSpeed's it issues no barrier (it may be called
    on one rank alone). None when the comms logger is off.

    >>> log_summary() is None  # no comms_logger section configured
    True
    """
    if show_straggler:
        raise NotImplementedError("log_summary(show_straggler=True) is not supported by raydeep")
    if _comms_logger is None:
        return None
    if rank() == 0:
        logging.getLogger("raydeep").info("%s", _comms_logger.table(), extra=CONSOLE)
    if return_dict:
        return {"summary": _comms_logger.summary(), "straggler_analysis": None,
                "metadata": {"world_size": world_size(), "rank": rank()}}
    return None


def reset_log() -> None:
    """Forget the comms logger's records (``deepspeed.comm.reset_log``)."""
    if _comms_logger is not None:
        _comms_logger.reset()


# The collective-order check (raydeep.comm.order), when on, and the last collective issued
# (op, shape, unit, wall time): what the step watchdog reports for a rank that hangs.
_order_checker = None
_last: tuple | None = None


def enable_order_check(timeout_s: float) -> None:
    """Check every following collective's order across ranks (collective: every rank calls it)."""
    global _order_checker
    from raydeep.comm.order import OrderChecker

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 and not _checking():
        _order_checker = OrderChecker(timeout_s)


def _checking() -> bool:
    """An order checker exists for the current default process group (one made for an earlier,
    destroyed group -- a process that trains twice -- does not count)."""
    return _order_checker is not None and _order_checker.world is dist.GroupMember.WORLD


def disable_order_check() -> None:
    global _order_checker
    if _order_checker is not None:
        _order_checker.close()
    _order_checker = None


def last_collective() -> str | None:
    """The last collective this process issued and how long ago, e.g.
    ``"all_gather (2048,) float32 of blocks.3, 12.5 s ago"`` (None before the first)."""
    if _last is None:
        return None
    op, shape, dtype, owner, at = _last
    dtype = str(dtype).removeprefix("torch.")
    return f"{op} {tuple(shape)} {dtype}{f' of {owner}' if owner else ''}, {time.time() - at:.1f} s ago"


def _run(op: str, nbytes: int, stats: CommStats | None, async_op: bool, launch, tensor=None, group=None,
         owner: str = "") -> Pending:
    global _last
    if tensor is not None:
        check_device(op, tensor, dist.get_backend(group))
        if _order_checker is not None and group is None and _checking():
            _order_checker.check(op, tensor, owner)
        _last = (op, tensor.shape, tensor.dtype, owner, time.time())  # formatted only when read
    start = time.perf_counter()
    work = launch(async_op)
    if stats is not None:
        stats.record(op, nbytes, 0.0 if async_op else time.perf_counter() - start)
    profile = None
    if _comms_logger is not None and tensor is not None and _comms_logger.profiles(op):
        profile = _Profile(_comms_logger, op, tensor, group)
        if async_op:
            profile.spent_s = time.perf_counter() - start  # the launch; wait() adds the rest
        else:
            profile.finish(start)
            profile = None
    return Pending(work if async_op else None, stats, op, profile)


def all_reduce(tensor: torch.Tensor, stats: CommStats | None = None, op=None, group=None,
               async_op: bool = False, owner: str = "") -> Pending:
    """Sum (or ``op``) ``tensor`` in place across ranks. ``owner`` (here and below) names what
    the tensor belongs to -- a unit, a bucket, the gradient norm -- for the order check."""
    if _skip(group):
        return Pending(None, None, "all_reduce")
    reduce_op = dist.ReduceOp.SUM if op is None else op
    return _run("all_reduce", tensor.numel() * tensor.element_size(), stats, async_op,
                lambda a: dist.all_reduce(tensor, op=reduce_op, group=group, async_op=a), tensor, group, owner)


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, stats: CommStats | None = None, group=None,
                   async_op: bool = False, owner: str = "") -> Pending:
    """Sum ``input`` across ranks and keep this rank's equal chunk in ``output``."""
    if _skip(group):
        output.copy_(input)
        return Pending(None, None, "reduce_scatter")
    return _run("reduce_scatter", input.numel() * input.element_size(), stats, async_op,
                lambda a: _REDUCE_SCATTER(output, input, group=group, async_op=a), input, group, owner)


def all_gather(output: torch.Tensor, input: torch.Tensor, stats: CommStats | None = None, group=None,
               async_op: bool = False, label: str = "all_gather", owner: str = "") -> Pending:
    """Concatenate every rank's equal-size ``input`` into ``output`` (counted under ``label``).
    ``input`` may be this rank's chunk of ``output`` (a ZeRO shard inside its flat buffer)."""
    if _skip(group):
        if output.data_ptr() != input.data_ptr():
            output.copy_(input)
        return Pending(None, None, label)
    return _run(label, output.numel() * output.element_size(), stats, async_op,
                lambda a: _ALL_GATHER(output, input, group=group, async_op=a), input, group, owner)


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def all_to_all(output: torch.Tensor, input: torch.Tensor, stats: CommStats | None = None, group=None,
               label: str = "all_to_all") -> None:
    """Send chunk ``j`` of ``input`` (split evenly along dim 0) to rank ``j``; chunk ``i`` of
    ``output`` is what rank ``i`` sent here. Counted as ``input``'s bytes."""
    if _skip(group):
        output.copy_(input)
        return
    _run(label, input.numel() * input.element_size(), stats, False,
         lambda a: dist.all_to_all_single(output, input, group=group, async_op=a), input, group)


def broadcast(tensor: torch.Tensor, src: int = 0, stats: CommStats | None = None, group=None,
              owner: str = "") -> None:
    """Overwrite ``tensor`` on every rank with rank ``src``'s copy."""
    if _skip(group):
        return
    _run("broadcast", tensor.numel() * tensor.element_size(), stats, False,
         lambda a: dist.broadcast(tensor, src=src, group=group, async_op=a), tensor, group, owner)


def all_reduce_value(value: torch.Tensor, op: str = "sum", stats: CommStats | None = None, group=None,
                     owner: str = "") -> float:
    """All-reduce one scalar tensor (a norm, an overflow flag) where it lives and read it: the
    step's host synchronization. It stays on its device because NCCL reduces CUDA tensors only.

    >>> all_reduce_value(torch.tensor(2.5, dtype=torch.float64), "max")
    2.5
    """
    t = value.reshape(1)
    all_reduce(t, stats, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op], group=group, owner=owner)
    return float(t.item())


def collective_device(group=None) -> torch.device:
    """Where a collective's tensors must live: this rank's CUDA device on an NCCL group, else the CPU.

    >>> collective_device()  # no process group here
    device(type='cpu')
    """
    if dist.is_available() and dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_device(op: str, tensor: torch.Tensor, backend: str) -> None:
    """NCCL moves CUDA tensors only: a CPU tensor there fails deep inside torch.distributed (or,
    with some builds, hangs), so name the op and the tensor's device instead. A gloo group's ranks
    run on the CPU (the engine's device follows the backend): gloo's point-to-point sends, which
    the exchanges use, refuse CUDA tensors, so a CUDA tensor there is a device-discipline bug."""
    expected = {"nccl": "cuda", "gloo": "cpu"}.get(backend)
    if expected is not None and tensor.device.type != expected:
        raise RuntimeError(f"raydeep: {op} of a {tensor.device.type} tensor {tuple(tensor.shape)} {tensor.dtype} on "
                           f"a {backend} process group, which takes {expected} tensors; collectives take tensors "
                           "on the engine's device, which follows the backend (NCCL: cuda:LOCAL_RANK, gloo: the CPU)")
