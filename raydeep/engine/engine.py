"""The Engine: DeepSpeed's training API over a ZeRO strategy. The training step reads top-down.

    loss = engine(x, y)          # forward (stage 3 gathers each block just in time)
    engine.backward(loss)        # loss / GAS (x loss scale); gradients reduced per bucket
    engine.step()                # every micro-batch; the optimizer runs only at the boundary

At the boundary, ``_take_model_step`` does, in order: global gradient norm (one all-reduce) ->
overflow decision -> loss scaler update -> one scale (unscale x clip) -> the optimizer tier's step
on this rank's shards (``raydeep.tier``: fp32 masters, optimizer states, the update) -> publish the
updated parameters (all-gather for stages 1-3) -> scheduler (not on a skipped step). Then the
step's measurements (``raydeep.engine.metrics``) become ``engine.step_metrics`` and go to the
monitors (``raydeep.monitor``) and, with ``wall_clock_breakdown``, to DeepSpeed's timer lines.
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
from dataclasses import dataclass

import torch
from torch import nn

from raydeep import comm
from raydeep.console_lines import CONSOLE
from raydeep.engine.accessors import DeepSpeedAccessors
from raydeep.engine.client_optimizer import ClientOptimizer
from raydeep.engine.metrics import GLOBAL_TIMERS, StepMeter, timer_line
from raydeep.monitor import step_events
from raydeep.optim.clip import clip_coefficient
from raydeep.precision.diagnosis import LossScaleCollapse, OverflowWatch
from raydeep.precision.loss_scaler import MIN_SCALE_ERROR, overflow_flag
from raydeep.train_state import TrainState

logger = logging.getLogger("raydeep")


def _no_diagnosis(phase: str, seq: int | None):
    return contextlib.nullcontext()


def _counter(name: str) -> property:
    """An engine attribute that reads and writes ``engine.state.<name>``."""
    return property(lambda self: getattr(self.state, name), lambda self, value: setattr(self.state, name, value))


@dataclass(frozen=True)
class EngineSettings:
    """What the step needs from the config, resolved once by the builder."""

    train_batch_size: int
    micro_batch: int
    grad_accum: int
    gradient_clipping: float
    precision: str
    stage: int
    steps_per_print: int | None = None
    skip_nonfinite: bool = True
    compute_grad_norm: bool = True
    auto_cast: bool = False
    comms_logger: bool = False
    wall_clock_breakdown: bool = False
    empty_cache_every: int = 0
    overflow_diagnosis_after: int = 5
    gather_16bit_weights_on_model_save: bool = False
    # The delayed parameter update from this many completed steps on (None: never).
    delayed_update_after: int | None = None


class Engine(DeepSpeedAccessors, nn.Module):
    """A model wrapped for ZeRO training; build it with :func:`raydeep.initialize`.

    >>> import raydeep, torch
    >>> model = torch.nn.Linear(4, 1)
    >>> engine, *_ = raydeep.initialize(model=model, config={"train_batch_size": 2,
    ...     "optimizer": {"type": "AdamW", "params": {"lr": 0.1}}, "zero_optimization": {"stage": 2}})
    >>> loss = engine(torch.ones(2, 4)).pow(2).mean()
    >>> _ = engine.backward(loss); engine.step(); engine.global_steps
    1
    """

    def __init__(self, module, strategy, tier, lr_scheduler, scaler, stats, settings: EngineSettings,
                 device: torch.device, rank: int, world_size: int, checkpointer, state: TrainState | None = None,
                 oom=None, overflow_watch: OverflowWatch | None = None, monitors=None, config=None):
        """The builder (``raydeep.engine.builder``) makes every part and hands it over here; the
        engine only drives them. ``checkpointer`` saves and loads the stateful parts
        (``raydeep.checkpoint``); ``oom`` wraps forward, backward and the step to explain an
        out-of-memory error (``raydeep.doctor.oom``); ``config`` is what the caller passed to
        ``initialize``, kept as DeepSpeed keeps it, never read here."""
        super().__init__()
        self.module = module
        self.strategy, self.tier, self.lr_scheduler, self.loss_scaler = strategy, tier, lr_scheduler, scaler
        self.stats, self.settings, self.device = stats, settings, device
        self.rank, self.world_size = rank, world_size
        # DeepSpeed's: the launcher's LOCAL_RANK (torchrun, Ray Train), on the CPU too
        self.local_rank = int(os.environ.get("LOCAL_RANK", device.index or 0))
        self.state = state if state is not None else TrainState()
        self.training_dataloader = None
        self.config = config
        self.checkpointer = checkpointer
        self._oom_watch = oom.watch if oom is not None else _no_diagnosis
        self._global_grad_norm: float | None = None
        self._step_applied = False
        self.overflow_watch = overflow_watch or OverflowWatch(settings.overflow_diagnosis_after)
        self._seq: int | None = None  # the last forward's sequence length
        self.monitors = monitors  # rank 0's tensorboard / csv_monitor, or None
        self.meter = StepMeter(stats, device, settings.wall_clock_breakdown,
                               model_state_bytes=lambda: self.memory_breakdown()["total"])
        self.step_metrics: dict | None = None  # the last optimizer step's (raydeep.engine.metrics)
        self.step_loss: torch.Tensor | None = None  # its mean loss, on the device: read it if you need it
        self._step_scale = scaler.loss_scale
        self._boundary_override: bool | None = None  # set_gradient_accumulation_boundary's
        self.inside_no_sync_ctxt = False  # no_sync's: backward keeps gradients local
        self._client_optimizer = ClientOptimizer(self)

    # --- forward / backward / step ------------------------------------------------------------------
    def forward(self, *inputs, **kwargs):
        if self.settings.auto_cast:
            inputs = tuple(t.half() if torch.is_tensor(t) and t.is_floating_point() else t for t in inputs)
        if inputs and torch.is_tensor(inputs[0]) and inputs[0].dim() >= 2:
            self._seq = inputs[0].shape[1]  # (batch, seq, ...): what an out-of-memory diagnosis sizes
        began = self.meter.begin()
        with self._oom_watch("forward", self._seq):
            out = self.module(*inputs, **kwargs)
        self.meter.forward_done(began)
        return out

    # DeepSpeed's counters, kept in the TrainState that checkpoints save.
    micro_steps = _counter("micro_steps")
    global_steps = _counter("global_steps")
    global_samples = _counter("global_samples")
    skipped_steps = _counter("skipped_steps")

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Divide by GAS, apply the loss scale, backpropagate, reduce gradients; returns loss / GAS."""
        assert loss.dim() == 0, "engine.backward expects a scalar loss"
        self.meter.add_loss(loss)  # before the division by GAS: step_loss is the loss the model gave
        began = self.meter.begin()
        if scale_wrt_gas and self.settings.grad_accum > 1:
            loss = loss / self.settings.grad_accum
        boundary = self.is_gradient_accumulation_boundary() and not self.inside_no_sync_ctxt
        scaled = loss * self.loss_scaler.loss_scale if self.loss_scaler.loss_scale != 1.0 else loss
        with self._oom_watch("backward", self._seq):
            self.strategy.begin_backward(boundary)
            scaled.backward(retain_graph=retain_graph)
            self.strategy.end_backward(boundary)
        self.meter.backward_done(began)
        return loss

    def is_gradient_accumulation_boundary(self) -> bool:
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.micro_steps + 1) % self.settings.grad_accum == 0

    def step(self, lr_kwargs: dict | None = None) -> None:
        """Call after every micro-batch; applies the update only at the accumulation boundary."""
        boundary = self.is_gradient_accumulation_boundary()
        start = self.meter.now()
        if boundary:
            with self._oom_watch("optimizer step", self._seq):
                self._take_model_step(lr_kwargs)
            self.meter.optimizer_s = self.meter.now() - start
        self.meter.step_done(start)
        if self.settings.wall_clock_breakdown:  # DeepSpeed logs the micro timers every micro-step
            line = self.meter.micro_line()
            if self.rank == 0:
                logger.info("%s", line, extra=CONSOLE)
        if boundary:
            self._record_step()
        self.micro_steps += 1

    def _record_step(self) -> None:
        """``step_metrics``, ``step_loss``, the monitors' events and the per-step timer line."""
        self.step_loss = self.meter.take_loss()
        self.step_metrics = self.meter.finish(
            step=self.global_steps, samples=self.global_samples, lr=self.get_lr()[0], loss_scale=self._step_scale,
            grad_norm=self._global_grad_norm, skipped_steps=self.skipped_steps, applied=self._step_applied)
        timer_ms = self.meter.step_times.milliseconds() if self.settings.wall_clock_breakdown else None
        if self.monitors is not None:  # rank 0 only; the one host read of the loss per step
            loss = None if self.step_loss is None else float(self.step_loss)
            scale = self.loss_scaler.loss_scale if self.fp16_enabled() else None
            self.monitors.write_events(step_events(self.step_metrics, loss, scale, timer_ms))
        if timer_ms is not None and self.rank == 0:
            logger.info("%s", timer_line(GLOBAL_TIMERS, self.meter.step_times), extra=CONSOLE)

    def _take_model_step(self, lr_kwargs: dict | None) -> None:
        overflow, self._global_grad_norm = self.apply_update(clip=True)
        self._step_applied = not overflow
        if overflow:
            self.skipped_steps += 1
        elif self.lr_scheduler is not None:
            self.lr_scheduler.step(**(lr_kwargs or {}))
        self.strategy.zero_grad()
        self.global_steps += 1
        if self.settings.empty_cache_every and self.global_steps % self.settings.empty_cache_every == 0 \
                and self.device.type == "cuda":
            torch.cuda.empty_cache()  # the field report's cure for fragmentation in long runs
        self.global_samples += self.settings.train_batch_size
        self._report_progress()

    def apply_update(self, clip: bool) -> tuple[bool, float | None]:
        """The optimizer's part of a step, what DeepSpeed's ZeRO optimizer does in its ``step()``
        (and so what the returned optimizer's ``step()`` runs, :class:`ClientOptimizer`): the
        global norm, the overflow decision, the loss scale's update, then (unless it overflowed)
        the tier's update, unscaled and, with ``clip``, clipped, and the parameters published.
        Counters, the scheduler and clearing the gradients are the caller's. Returns whether the
        step overflowed, and the gradient norm (unscaled; ``inf`` on overflow, None if not computed)."""
        self.checkpointer.fence()  # an asynchronous save copies the states before they change
        scale = self._step_scale = self.loss_scaler.loss_scale
        # The decisions below must be the same on every rank (a rank that skips would leave the
        # others waiting in the optimizer's collectives), so they are taken from one number
        # combined as the strategy says (``norm_reduction``), even where each rank holds its own
        # gradients (a compressed stage).
        if self.settings.compute_grad_norm:
            total_norm = global_grad_norm(self.strategy, self.stats)
            overflow = self.settings.skip_nonfinite and not math.isfinite(total_norm)
        else:  # no norm to read the overflow from: scan the gradients, as DeepSpeed does
            total_norm = None
            overflow = self.settings.skip_nonfinite and any_rank_overflowed(self.strategy, self.stats)
        if self.settings.precision == "fp16":
            self.overflow_watch.observe(self.global_steps + 1, overflow, scale)
        # The scaler first, as in DeepSpeed: at the minimum scale it raises before any counter moves.
        try:
            self.loss_scaler.update_scale(overflow)
        except Exception as err:  # DeepSpeed's type (a plain Exception): its message tells it apart
            if str(err) != MIN_SCALE_ERROR:
                raise
            raise LossScaleCollapse(f"{MIN_SCALE_ERROR}\n{self.overflow_watch.describe()}") from None
        if overflow:
            self.complete_update()  # a pending update still lands
            return True, float("inf")
        combined = clip_coefficient(total_norm or 0.0, scale, self.settings.gradient_clipping if clip else 0.0)
        after = self.settings.delayed_update_after
        if after is not None and self.global_steps >= after:
            # ZeRO-Offload's delayed parameter update: the previous step's update lands now and
            # this one runs while the next forward and backward do, with everything it decides
            # (skip, clip, learning rate) fixed here.
            self.tier.submit(self.strategy.grad_shards(), 1.0 / combined)
        else:
            self.tier.step(self.strategy.grad_shards(), 1.0 / combined)
        self.strategy.publish()
        self.tier.release()  # a submitted update's CPU work starts once the all-gather is done
        return False, None if total_norm is None else total_norm / scale

    def complete_update(self) -> None:
        """Land a delayed update still running (``raydeep.delayed_update``) and publish it: before
        a save, a load, an overflowed step, or the end of training."""
        if self.tier.pending:
            self.tier.complete()
            self.strategy.publish()

    def train_batch(self, data_iter) -> torch.Tensor:
        """Run one full optimizer step (GAS micro-batches from ``data_iter``); returns the mean loss."""
        total = torch.zeros((), device=self.device)  # on the device: no host sync per micro-batch
        for _ in range(self.settings.grad_accum):
            batch = next(data_iter)
            loss = self(*batch) if isinstance(batch, (tuple, list)) else self(batch)
            self.backward(loss)
            self.step()
            total += loss.detach().float()
        return total / self.settings.grad_accum

    def zero_grad(self) -> None:
        self.strategy.zero_grad()

    def _report_progress(self) -> None:
        every = self.settings.steps_per_print
        if every and self.global_steps % every == 0 and self.rank == 0:
            logger.info("step=%d, skipped=%d, lr=%s, mom=%s", self.global_steps, self.skipped_steps,
                        self.get_lr(), self.get_mom(), extra=CONSOLE)
            if self.settings.comms_logger:
                comm.log_summary()  # DeepSpeed's comms table, since the engine was built

    # --- checkpoints (see raydeep.checkpoint) ----------------------------------------------------
    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest: bool = True,
                        exclude_frozen_parameters: bool = False, async_save: bool | None = None,
                        keep_last_k: int | None = None) -> bool:
        """Collective: every rank writes the ranges it owns into ``<save_dir>/<tag>/``; rank 0
        commits the manifest, then ``latest``. ``save_dir`` is a path or a pyarrow URI (s3://...).

        ``async_save`` and ``keep_last_k`` default to the config's ``raydeep.checkpoint_async``
        and ``raydeep.checkpoint_keep_last_k``.
        """
        if exclude_frozen_parameters:
            logger.warning("exclude_frozen_parameters is ignored: frozen parameters are small and always saved")
        self.complete_update()
        return self.checkpointer.save(save_dir, tag, client_state, save_latest, async_save, keep_last_k)

    def load_checkpoint(self, load_dir, tag=None, load_module_strict: bool = True, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True, load_module_only: bool = False, custom_load_fn=None):
        """Collective: restore from ``<load_dir>/<tag or latest>`` at any world size and stage.
        Returns ``(load_path, client_state)``, or ``(None, None)`` when there is no ``latest``."""
        if custom_load_fn is not None:
            raise NotImplementedError("custom_load_fn is not supported by raydeep")
        self.complete_update()
        with self._loading():
            return self.checkpointer.load(load_dir, tag, load_module_strict, load_optimizer_states,
                                          load_lr_scheduler_states, load_module_only)

    def load_first_intact(self, load_dir, tags: list[str], skipped: list[tuple[str, str]] = ()):
        """Load the first of ``tags`` that is intact (see ``Checkpointer.load_first_intact``)."""
        self.complete_update()
        with self._loading():
            return self.checkpointer.load_first_intact(load_dir, tags, skipped)

    @contextlib.contextmanager
    def _loading(self):
        self.meter.forget_state_bytes()
        try:
            yield
        finally:
            self.meter.skip_comm()  # the load's collectives belong to no step's bytes

    def wait_for_checkpoint(self) -> None:
        """Block until an asynchronous save is committed (the next save and ``destroy()`` also wait)."""
        self.checkpointer.wait()

    def destroy(self) -> None:
        """Wait for an asynchronous save, release the optimizer tier's offload actors and close
        the monitors' files."""
        self.checkpointer.wait()
        self.complete_update()
        self.tier.close()
        comm.disable_order_check()
        if self.monitors is not None:
            self.monitors.close()

    # --- DeepSpeed's accessors (the rest: raydeep.engine.accessors) ---------------------------------
    @property
    def optimizer(self) -> ClientOptimizer:
        """What ``initialize`` returns as the optimizer: DeepSpeed's ZeRO optimizer contract over
        the optimizer tier (a client may call its ``step()`` and ``zero_grad()`` itself)."""
        return self._client_optimizer

    def train(self, mode: bool = True):
        self.module.train(mode)
        return self

    def eval(self):
        return self.train(False)

    # --- self-measurement --------------------------------------------------------------------------
    def memory_breakdown(self) -> dict[str, int]:
        """Bytes this rank holds on its device: parameters, gradients, fp32 master, optimizer states,
        buffers and their ``total``. Not in the total: ``offloaded`` (masters and optimizer states
        the tier keeps in host memory away from the device or in offload actors, and stage-3
        parameter partitions ``offload_param`` keeps in host memory) and
        ``step_buffers`` (the most fp32 gradient and staging bytes the last step held at once on
        the device, which ``sub_group_size`` bounds). On CUDA also the allocator's
        ``cuda_allocated`` and ``cuda_reserved`` bytes (reserved minus allocated is fragmentation)."""
        out = dict(self.strategy.memory_breakdown())
        offloaded_params = out.pop("offloaded", 0)  # offload_param: partitions in host memory
        held, here = self.tier.memory(), str(self.device)
        for kind in ("master", "optimizer_states"):
            out[kind] = held[kind].get(here, 0)
        out["buffers"] = sum(b.numel() * b.element_size() for b in self.module.buffers())
        out["total"] = sum(out.values())
        out["offloaded"] = offloaded_params + sum(n for kind in ("master", "optimizer_states")
                                                  for place, n in held[kind].items() if place != here)
        out["step_buffers"] = held.get("step_buffers", {}).get(here, 0)
        if self.device.type == "cuda":
            out["cuda_allocated"] = torch.cuda.memory_allocated(self.device)
            out["cuda_reserved"] = torch.cuda.memory_reserved(self.device)
        return out

    def comm_stats(self) -> dict[str, dict[str, float]]:
        """Bytes, calls and blocked seconds per collective since the last ``reset_comm_stats()``."""
        return self.stats.summary()

    def reset_comm_stats(self) -> None:
        self.stats.reset()


def global_grad_norm(strategy, stats: comm.CommStats) -> float:
    """The gradient norm every rank clips with, combined as the strategy's ``norm_reduction``
    says (a sum of the shards' squares, the largest rank's, or this rank's own); NaN if not finite."""
    sq = strategy.grad_sq_norm()  # on the device; read once, below
    reduction = strategy.norm_reduction()
    if reduction == "max":  # non-finite as +inf: a NaN may lose a MAX comparison
        sq = torch.where(sq.isfinite(), sq, math.inf)
    total = float(sq) if reduction is None else comm.all_reduce_value(sq, reduction, stats, owner="gradient norm")
    return math.sqrt(total) if math.isfinite(total) else float("nan")


def any_rank_overflowed(strategy, stats: comm.CommStats) -> bool:
    """Whether any rank's gradients hold an inf or NaN (with ``compute_grad_norm`` off there is no
    norm to read it from: DeepSpeed scans the gradients)."""
    flag = overflow_flag(strategy.grad_shards())
    if flag is None:
        return False
    if strategy.norm_reduction() is not None:  # shards, or each rank's own gradients
        return comm.all_reduce_value(flag.to(torch.float64), "max", stats, owner="overflow flag") > 0
    return bool(flag)
