"""What the engine measures about each optimizer step: ``engine.step_metrics``, ``engine.step_loss``
and DeepSpeed's ``wall_clock_breakdown`` timer lines.

The measuring is cheap enough to leave on: two ``perf_counter`` reads per phase, the collective
counters the engine keeps anyway (``raydeep.comm.CommStats``), one in-place add of the loss on its
device per micro-step, and a few small dicts per optimizer step. Nothing here reads a device
value; with ``wall_clock_breakdown`` the CUDA device is synchronised at each timer boundary, as
DeepSpeed's ``SynchronizedWallClockTimer`` makes its timings mean the work and not its launch.

``engine.step_metrics`` after each optimizer step (rank-local)::

    step, samples            global_steps and global_samples after the step
    lr                       the first parameter group's learning rate after the step
    loss_scale               the scale the step used (1.0 without fp16)
    grad_norm                the global gradient norm (None when not computed; inf on overflow)
    skipped_steps            steps skipped for overflow so far
    forward_s, backward_s    seconds over the step's micro-steps (backward includes the
                             reductions its hooks launch and wait for; forward counts every
                             engine forward since the previous step, as DeepSpeed's timers do)
    forward_wait_s           the part of forward_s blocked on collectives (stage 3's gathers)
    backward_wait_s          the part of backward_s blocked on its reductions (DeepSpeed's bwd_allreduce)
    comm_wait_s              seconds blocked on collectives during the step (backward's and the step's)
    optimizer_s              seconds in the boundary's model step (norm, update, all-gather)
    comm                     {op: {"calls", "bytes", "blocked_s"}} of this step only
    model_state_bytes        engine.memory_breakdown()["total"]
    peak_memory_bytes        the CUDA allocator's peak so far in the process (None on CPU)

>>> meter = StepMeter(CommStats(), torch.device("cpu"), wall_clock_breakdown=False)
>>> meter.add_loss(torch.tensor(2.0)); meter.add_loss(torch.tensor(4.0)); meter.take_loss()
tensor(3.)
"""
from __future__ import annotations

import time
from typing import Callable

import torch

from raydeep.activation.timing import PROFILE_TOTALS

from raydeep.comm import CommStats

# DeepSpeed's timer names (deepspeed.utils.timer), in the order its engine logs them.
MICRO_TIMERS = ("fwd_microstep", "bwd_microstep", "bwd_inner_microstep", "bwd_allreduce_microstep", "step_microstep")
GLOBAL_TIMERS = ("fwd", "bwd", "bwd_inner", "bwd_allreduce", "step")


class PhaseTimes:
    """Seconds in forward, backward (and the part of it blocked on reductions) and engine.step()."""

    __slots__ = ("forward", "forward_blocked", "backward", "backward_blocked", "step")

    def __init__(self):
        self.clear()

    def clear(self) -> None:
        self.forward = self.forward_blocked = self.backward = self.backward_blocked = self.step = 0.0

    def milliseconds(self) -> tuple[float, ...]:
        """DeepSpeed's five timers: forward, backward, backward_inner, backward_allreduce, step."""
        inner = self.backward - self.backward_blocked
        return tuple(1000.0 * s for s in (self.forward, self.backward, inner, self.backward_blocked, self.step))


def timer_line(names: tuple[str, ...], times: PhaseTimes) -> str:
    """``SynchronizedWallClockTimer.log``'s text: ``time (ms) | fwd: 12.34 | bwd: ...``."""
    return "time (ms)" + "".join(f" | {name}: {ms:.2f}" for name, ms in zip(names, times.milliseconds()))


def _checkpoint_profile() -> dict:
    """The profiled checkpoint regions' seconds in this step (``activation_checkpointing.profile``),
    None when none was profiled."""
    totals = PROFILE_TOTALS.take()
    profiled = totals.pop("checkpoint_calls") > 0
    return {name: seconds if profiled else None for name, seconds in totals.items()}


class StepMeter:
    """Times the phases of the step in progress and assembles ``step_metrics`` at its end.

    ``micro`` holds the current micro-step (DeepSpeed's ``*_microstep`` timers), ``total`` the
    optimizer step so far; :meth:`finish` moves ``total`` to ``step_times`` (DeepSpeed's global
    timers of the step just taken) and restarts it.
    """

    def __init__(self, stats: CommStats, device: torch.device, wall_clock_breakdown: bool,
                 model_state_bytes: Callable[[], int] | None = None):
        self.stats, self.device = stats, device
        self.sync = wall_clock_breakdown and device.type == "cuda"
        self.micro, self.total, self.step_times = PhaseTimes(), PhaseTimes(), PhaseTimes()
        self.optimizer_s = 0.0
        self._model_state_bytes = model_state_bytes
        self._state_bytes: int | None = None  # cached once the optimizer states exist
        self._settled = False
        self._comm_before: tuple[int, dict] = (stats.resets, self._comm_now())
        self._loss_sum: torch.Tensor | None = None
        self._losses = 0

    # --- the phases ---------------------------------------------------------------------------
    def now(self) -> float:
        if self.sync:
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def begin(self) -> tuple[float, float]:
        """The start of a forward or backward: the time, and the seconds blocked on collectives so far."""
        return self.now(), self.stats.total_blocked_s

    def forward_done(self, began: tuple[float, float]) -> None:
        elapsed, blocked = self._since(began)
        self.micro.forward += elapsed
        self.total.forward += elapsed
        self.total.forward_blocked += blocked  # stage 3 waits for its gathers

    def backward_done(self, began: tuple[float, float]) -> None:
        elapsed, blocked = self._since(began)
        self.micro.backward += elapsed
        self.total.backward += elapsed
        # Reductions run from the hooks: the time blocked on them is DeepSpeed's backward_allreduce.
        self.micro.backward_blocked += blocked
        self.total.backward_blocked += blocked

    def _since(self, began: tuple[float, float]) -> tuple[float, float]:
        start, blocked = began
        return self.now() - start, self.stats.total_blocked_s - blocked

    def step_done(self, since: float) -> None:
        elapsed = self.now() - since
        self.micro.step += elapsed
        self.total.step += elapsed

    def add_loss(self, loss: torch.Tensor) -> None:
        """Add a micro-step's loss where it lives: the mean is read only when someone asks."""
        value = loss.detach()
        if self._loss_sum is None or self._loss_sum.device != value.device:
            self._loss_sum = torch.zeros((), dtype=torch.float32, device=value.device)
        self._loss_sum.add_(value)
        self._losses += 1

    def take_loss(self) -> torch.Tensor | None:
        """The mean loss of the step's micro-steps, a device tensor (None if backward never ran)."""
        if not self._losses:
            return None
        mean = self._loss_sum / self._losses
        self._loss_sum.zero_()
        self._losses = 0
        return mean

    def micro_line(self) -> str:
        line = timer_line(MICRO_TIMERS, self.micro)
        self.micro.clear()
        return line

    def forget_state_bytes(self) -> None:
        """The layout changed (a checkpoint was loaded): measure model_state_bytes again."""
        self._state_bytes, self._settled = None, False

    # --- the end of an optimizer step ---------------------------------------------------------
    def finish(self, step: int, samples: int, lr: float, loss_scale: float, grad_norm: float | None,
               skipped_steps: int, applied: bool) -> dict:
        """``step_metrics`` for the step just taken; the step's times move to ``step_times``."""
        comm = self._comm_delta()
        metrics = {"step": step, "samples": samples, "lr": lr, "loss_scale": loss_scale, "grad_norm": grad_norm,
                   "skipped_steps": skipped_steps, "forward_s": self.total.forward, "backward_s": self.total.backward,
                   "forward_wait_s": self.total.forward_blocked, "backward_wait_s": self.total.backward_blocked,
                   "comm_wait_s": sum((op["blocked_s"] for op in comm.values()), 0.0), "optimizer_s": self.optimizer_s,
                   "comm": comm, "model_state_bytes": self._state_total(applied),
                   "peak_memory_bytes": self._peak_memory(), **_checkpoint_profile()}
        self.optimizer_s = 0.0
        # DeepSpeed restarts its global timers when it logs them, once per optimizer step.
        self.step_times, self.total = self.total, self.step_times
        self.total.clear()
        return metrics

    def skip_comm(self) -> None:
        """Count the collectives issued so far in no step (a checkpoint load's, between steps)."""
        self._comm_before = (self.stats.resets, self._comm_now())

    def _comm_now(self) -> dict[str, tuple]:
        return {op: (s.calls, s.bytes, s.blocked_s) for op, s in self.stats.ops.items()}

    def _comm_delta(self) -> dict[str, dict]:
        """This step's share of the engine's cumulative counters (which stay as they are:
        ``engine.comm_stats()`` reports since the last ``reset_comm_stats()``)."""
        resets, before = self._comm_before
        if resets != self.stats.resets:  # reset during the step: count from zero
            before = {}
        now = self._comm_now()
        delta = {}
        for op, (calls, nbytes, blocked) in now.items():
            calls0, bytes0, blocked0 = before.get(op, (0, 0, 0.0))
            if calls != calls0 or blocked != blocked0:
                delta[op] = {"calls": calls - calls0, "bytes": nbytes - bytes0, "blocked_s": blocked - blocked0}
        self._comm_before = (self.stats.resets, now)
        return delta

    def _state_total(self, applied: bool) -> int | None:
        # The layout is fixed at build; the optimizer states appear with the first applied step.
        # memory_breakdown() may ask offload actors, so it runs until then and not after.
        if self._model_state_bytes is None:
            return None
        if self._state_bytes is None or not self._settled:
            self._state_bytes, self._settled = self._model_state_bytes(), applied
        return self._state_bytes

    def _peak_memory(self) -> int | None:
        # The allocator's peak so far. Not reset here: the peak counters are the process's, and
        # code around the engine (a benchmark, the user's own probes) may be reading them too.
        if self.device.type != "cuda":
            return None
        return torch.cuda.max_memory_allocated(self.device)
