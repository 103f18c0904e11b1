"""The per-worker training loop, independent of Ray: it needs only an initialised process group
and a *session* that knows where checkpoints live and who is watching.

One attempt of a run, on every rank:

1. build the model (fixed seed) and the engine with this world size's batch plan;
2. restore the session's checkpoint, if any: weights, optimizer, scheduler, loss scaler, step and
   sample counters, RNG, and (in ``client_state``) the sample ledger and the run's attempt history;
3. train to ``spec.steps``: each step reads the samples at global positions
   ``[global_samples, global_samples + train_batch_size)`` of the run's sample order, records
   them in the ledger, and every ``checkpoint_every`` steps (and at the end) saves through the
   session (and every ``raydeep.memory_snapshot_every`` steps in between snapshots into memory);
   the session hears when each step starts and ends (its step watchdog reports a rank stuck in
   one) and gets each step's loss, tokens/s and MFU once the step's snapshot, when one is due, is
   whole (a step reported done is never run again); rank 0 writes the step's row of
   ``<run>/metrics/`` (:mod:`raydeep.ray.step_metrics`), flushed before every checkpoint so
   each checkpointed step's row is on disk before the checkpoint can be resumed from;
4. consolidate the fp32 parameters and return what the run's summary needs.

The session is the only thing that knows about Ray (:class:`raydeep.ray.worker.RaySession`), so
the loop runs the same in any process group a session is written for.
"""
from __future__ import annotations

import logging
import time
from typing import Protocol

import numpy as np
import torch
import torch.distributed as dist

from raydeep.config.sections import RaydeepSection
from raydeep.errors import CheckpointError
from raydeep.ray.batch_plan import BatchSchedule
from raydeep.ray.ledger import SampleLedger, SampleOrder, micro_positions, step_ids_in_position_order
from raydeep.ray.snapshot_cadence import SnapshotCadence
from raydeep.ray.spec import TrainSpec
from raydeep.ray.step_metrics import StepMetrics, flops_per_token, throughput_of
from raydeep.ray.weights import consolidated_fp32, param_sha256, save_fp32
from raydeep.ray.workload import build_model, collate, open_dataset, sequence_shape

logger = logging.getLogger("raydeep")


class Session(Protocol):
    """Where one attempt's checkpoints come from and go to, and who hears about progress."""

    driver_id: str

    skipped: list  # [(tag, reason)] of damaged checkpoints the last restore passed over

    def restore(self, engine) -> dict | None:
        """Load the checkpoint to resume from into ``engine``; its client_state, or None to start fresh."""

    def save(self, engine, tag: str, client_state: dict, metrics: dict) -> None:
        """Checkpoint ``engine`` (collective: every rank calls it)."""

    def snapshot(self, engine, tag: str, client_state: dict) -> None:
        """Checkpoint ``engine`` into memory, if the session keeps snapshots (collective)."""

    def snapshot_room(self) -> str | None:
        """Why the snapshot store cannot keep snapshots of the size just taken (None: it can, or
        this rank does not check; asked after an ``"auto"`` cadence's first snapshot)."""

    def drop_snapshots(self) -> None:
        """Free the snapshots held and take no more (collective)."""

    def preemption_notice(self) -> dict | None:
        """``{"ranks", "nodes", "deadline_s"}`` (the deadline in epoch seconds, or None) of a
        coming preemption, once Ray Train knows of a drain; else None (collective: every rank
        calls it once a step and gets the same answer)."""

    def attempt_started(self, record: dict) -> None:
        """The attempt begins; ``record["attempt"]`` is its index in the run's attempt history."""

    def step_started(self, step: int) -> None:
        """Step ``step`` begins on this rank (the step watchdog times it from here)."""

    def step_finished(self, seconds: float) -> None:
        """The running step ended after ``seconds``."""

    def step_done(self, event: dict) -> None: ...

    def close(self) -> None:
        """The attempt is over on this rank (normally or not): stop watching it."""


def run_training(spec: TrainSpec, ds_config: dict, schedule: BatchSchedule, session: Session) -> dict:
    """One attempt of the run on this rank (see the module docstring); returns the rank's result."""
    import raydeep

    rank, world = dist.get_rank(), dist.get_world_size()
    plan = schedule.for_world_size(world)
    options = RaydeepSection.model_validate(ds_config.get("raydeep") or {})
    model = build_model(spec.model, spec.seed)
    block_size, vocab_size = sequence_shape(model)
    dataset = open_dataset(spec.data, block_size, vocab_size, spec.seed)
    tokens_per_sample = int(getattr(dataset, "block_size", block_size))
    model_flops = flops_per_token(model, tokens_per_sample)  # before ZeRO-3 leaves each rank its slices only
    engine, *_ = raydeep.initialize(model=model, config=schedule.engine_config(ds_config, world))
    built_at = time.time()
    throughput = throughput_of(options, engine, tokens_per_sample, model_flops)
    order = SampleOrder(len(dataset), spec.seed)

    source = {"data": spec.data, "num_samples": len(dataset), "seed": spec.seed}
    state, ledger = _resume(session, engine, source)
    attempt = {"driver": session.driver_id, "world_size": world, "micro_batch": plan.micro_batch,
               "grad_accum": plan.grad_accum, "resumed_from_step": engine.global_steps, "built_at": built_at, "started_at": time.time(),
               "restored_from": getattr(session, "restored_from", None),
               "skipped_checkpoints": [list(entry) for entry in session.skipped]}
    attempts = list(state.get("attempts", [])) + [attempt]
    restarts = len(attempts) - 1  # this attempt's index in the run's history
    session.attempt_started({**attempt, "attempt": restarts})
    metrics = StepMetrics.start(options, spec.run_uri, engine, restarts)  # does nothing with raydeep.metrics off
    first_loss, last_loss = state.get("first_loss"), state.get("last_loss")
    preempted = None  # the notice, once a node of this attempt is being drained: snapshot every step
    cadence = SnapshotCadence(options.memory_snapshot_every)

    while engine.global_steps < spec.steps:
        started = time.time()
        session.step_started(engine.global_steps + 1)
        last_loss, my_ids = _train_step(engine, dataset, order, rank, world, plan.micro_batch)
        ledger.record(_gather_step_ids(my_ids, world, plan.micro_batch, engine.device))
        seconds = time.time() - started
        session.step_finished(seconds)
        cadence.step_done(seconds)
        first_loss = last_loss if first_loss is None else first_loss
        step, rates = engine.global_steps, throughput.of(seconds)
        saving = step == spec.steps or bool(spec.checkpoint_every and step % spec.checkpoint_every == 0)
        if preempted is None and step < spec.steps:
            preempted = _preemption_notice(session, rank)
        # A step that checkpoints snapshots too when one is due: its checkpoint may still be on its
        # way to storage when a worker dies, and the snapshot (taken first: it is quick) holds it.
        snapshot_due = step < spec.steps and (preempted is not None or cadence.due(step))
        metrics.record(engine.step_metrics, loss=last_loss, step_s=seconds, rates=rates, phase=engine.tier.phase,
                       saving=saving or snapshot_due)
        if saving or snapshot_due:
            client_state = {"ledger": ledger.state_dict(), "attempts": attempts, "first_loss": first_loss,
                            "last_loss": last_loss, "source": source}
        snapshot_s = 0.0
        if snapshot_due:
            snapshot_s = _snapshot(session, engine, metrics, f"global_step{step}", client_state)
            _pace_snapshots(cadence, session, engine, snapshot_s, world)
        # Reported done once its snapshot is whole: a step the driver has seen done is never run
        # again (a kill during the snapshot costs the step, as a kill during its backward would).
        session.step_done(_step_event(engine, last_loss, seconds, rates, restarts))
        if saving:
            _checkpoint(session, engine, metrics, _tag(step, session.skipped, len(attempts)), client_state,
                        checkpoint_report(step, last_loss, seconds, rates, engine.global_samples, ledger.digest),
                        snapshot_s)
            cadence.saved()
        elif snapshot_due:
            metrics.checkpoint_saved(snapshot_s)
        if preempted is not None and step < spec.steps:
            _wait_out_a_close_deadline(preempted["deadline_s"], time.time() - started)

    metrics.close()
    params = consolidated_fp32(engine)
    result = {"first_loss": first_loss, "final_loss": last_loss, "global_steps": engine.global_steps,
              "global_samples": engine.global_samples, "param_sha256": param_sha256(params),
              "samples_sha256": ledger.digest, "attempts": attempts, "train_batch_size": plan.train_batch_size,
              "zero_stage": engine.zero_optimization_stage(), "num_parameters": sum(t.numel() for t in params.values()),
              "memory": engine.memory_breakdown(), "offload": _offload_section(engine, world),
              "compression": engine.tier.compression_report()}
    if spec.export_fp32 and rank == 0:
        save_fp32(params, f"{spec.run_uri}/model_fp32.safetensors")
    engine.destroy()  # releases the offload actors now rather than when the worker exits
    return result


def _checkpoint(session: Session, engine, metrics: StepMetrics, tag: str, client_state: dict, report: dict,
                snapshot_s: float = 0.0) -> None:
    """Save through the session; the step's metrics row is written first. Its ``checkpoint_s``
    adds the seconds of the step's memory snapshot (``snapshot_s``), taken just before.

    Note: the flush comes before the save so that a checkpoint a later attempt may resume from
    never holds a step whose row is not on disk. The save's seconds reach the row at the next
    flush (null on disk until then).
    """
    metrics.before_checkpoint()
    started = time.time()
    session.save(engine, tag, client_state, report)
    metrics.checkpoint_saved(snapshot_s + time.time() - started)


def _snapshot(session: Session, engine, metrics: StepMetrics, tag: str, client_state: dict) -> float:
    """A memory snapshot through the session (the metrics rows are flushed first: a snapshot
    resumed from has its steps' rows on disk too); returns its seconds, the flush's included:
    "auto" paces what the snapshot costs the run. The caller puts them in the step's
    ``checkpoint_s``, with the save's when the step also checkpoints: recorded here, they would
    change a flushed row and make the save's flush rewrite the file once more."""
    started = time.time()
    metrics.before_checkpoint()
    session.snapshot(engine, tag, client_state)
    return time.time() - started


def _pace_snapshots(cadence: SnapshotCadence, session: Session, engine, snapshot_s: float, world: int) -> None:
    """``"auto"``: every rank agrees on the snapshot's cost and the step's (the slowest rank's)
    and so on the gap to the next snapshot; a store whose node cannot keep snapshots this size
    turns them off (:mod:`raydeep.ray.snapshot_cadence`)."""
    if not cadence.auto:
        cadence.measured(snapshot_s, 0.0)
        return
    no_room = session.snapshot_room() if cadence.gap is None else None
    agreed = torch.tensor([snapshot_s, cadence.typical_step_s(), float(no_room is not None)], dtype=torch.float64,
                          device=engine.device)
    if world > 1:
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)  # on the engine's device: NCCL reduces CUDA tensors only
    snapshot_s, step_s, dropped = agreed.tolist()
    if dropped:
        if no_room is not None:
            logger.warning("raydeep.memory_snapshot_every='auto': %s; memory snapshots are off (set "
                           "raydeep.memory_snapshot_every to N to keep one every N steps anyway)", no_room)
        session.drop_snapshots()
        cadence.off()
        return
    cadence.measured(snapshot_s, step_s)


def _preemption_notice(session: Session, rank: int) -> dict | None:
    """The session's preemption notice (every rank asks, every rank gets the same), reported once."""
    notice = session.preemption_notice()
    if notice is not None and rank == 0:
        left = notice["deadline_s"]
        logger.warning("ranks %s are about to be preempted (%s): a memory snapshot every step until the run moves "
                       "off their nodes", notice["ranks"], "no deadline given" if left is None else
                       f"in {left - time.time():.0f} s")
    return notice


def _wait_out_a_close_deadline(deadline_s: float | None, step_and_snapshot_s: float, grace_s: float = 60.0) -> None:
    """Start no step that the preemption could cut short in its snapshot: when the deadline is
    closer than three steps with their snapshots, wait here (every step so far is in memory) for
    Ray Train to end the worker group at the deadline and restart it off the drained node. If it
    has not ended it ``grace_s`` past the deadline (a drain called off), training goes on."""
    if deadline_s is None or deadline_s - time.time() > 3 * step_and_snapshot_s:
        return
    logger.info("the preemption deadline is %.1f s away: waiting for the restart", deadline_s - time.time())
    while time.time() < deadline_s + grace_s:
        time.sleep(0.2)


def _step_event(engine, loss: float, seconds: float, rates: dict, restarts: int) -> dict:
    """What the session hears of a finished step (the driver's progress bar shows it)."""
    return {"step": engine.global_steps, "loss": loss, "samples": engine.global_samples, "seconds": seconds,
            "time": time.time(), "phase": engine.tier.phase, "tokens_s": rates["tokens_per_s"], "mfu": rates["mfu"],
            "loss_scale": engine.cur_scale if engine.fp16_enabled() else None, "restarts": restarts}


def checkpoint_report(step: int, loss: float, step_s: float, rates: dict, samples: int, samples_sha256: str) -> dict:
    """The metrics reported to Ray Train with a checkpoint: its result, its dashboard, and a Tune
    trial's results. The rates come first: Tune's table shows the first few numbers it finds."""
    return {"loss": loss, "tokens_s": rates["tokens_per_s"], "mfu": rates["mfu"], "samples_s": rates["samples_per_s"],
            "step_s": step_s, "step": step, "samples": samples, "samples_sha256": samples_sha256}


def _offload_section(engine, world: int) -> dict | None:
    """summary.json's ``offload``: every rank's tier report (None when nothing is offloaded)."""
    mine = engine.tier.report()
    reports = [mine] * world
    if world > 1:
        reports = [None] * world
        dist.all_gather_object(reports, mine)
    if mine is None:
        return None
    return {"tier": mine["tier"], "actors": sum(r.get("actors", 0) for r in reports),
            "node_ids": sorted({n for r in reports for n in r.get("node_ids", [])}),
            "bytes_held": sum(r["bytes_held"] for r in reports), "ranks": reports}


def _tag(step: int, skipped: list, attempt: int) -> str:
    """DeepSpeed's ``global_step{N}``, or a new name where a damaged checkpoint of that step lies:
    Ray Train still tracks the damaged one's directory and deletes it when it rotates it out, so
    a save must not reuse that directory (and the damaged files stay for inspection until then)."""
    tag = f"global_step{step}"
    return f"{tag}-attempt{attempt}" if tag in {name for name, _ in skipped} else tag


def _resume(session: Session, engine, source: dict) -> tuple[dict, SampleLedger]:
    """The checkpoint's client_state (empty for a fresh run) and its sample ledger."""
    state = session.restore(engine) or {}
    if state.get("source", source) != source:
        # The sample order is a function of these: positions already consumed map to other samples now.
        logger.warning("resuming with different data: the checkpoint was trained on %s, this attempt reads %s; "
                       "exactly-once holds only for an unchanged dataset and seed", state["source"], source)
    ledger = SampleLedger.from_state(state["ledger"]) if "ledger" in state else SampleLedger()
    if ledger.samples != engine.global_samples:
        raise CheckpointError(f"checkpoint is inconsistent: the engine consumed {engine.global_samples} samples, "
                              f"the sample ledger {ledger.samples}")
    return state, ledger


def _train_step(engine, dataset, order: SampleOrder, rank: int, world: int, micro: int) -> tuple[float, np.ndarray]:
    """One optimizer step: this rank's micro batches of the step's global batch; returns the loss
    averaged over every micro batch of every rank (the global batch's mean) and this rank's ids."""
    step_start, grad_accum = engine.global_samples, engine.gradient_accumulation_steps()
    # The losses add up on the device: reading each one would stall the host every micro-step.
    ids, loss_sum = [], torch.zeros(1, dtype=torch.float64, device=engine.device)
    for k in range(grad_accum):
        positions = micro_positions(step_start, k, rank, world, micro)
        batch_ids = order.ids(positions.start, len(positions))
        x, y = collate(dataset, batch_ids)
        loss = engine(x.to(engine.device), y.to(engine.device))
        engine.backward(loss)
        engine.step()
        loss_sum += loss.detach().double()
        ids.append(batch_ids)
    if world > 1:
        dist.all_reduce(loss_sum)  # on the engine's device: NCCL reduces only CUDA tensors
    return float(loss_sum) / (grad_accum * world), np.concatenate(ids)


def _gather_step_ids(my_ids: np.ndarray, world: int, micro: int, device: torch.device) -> np.ndarray:
    """Every rank's ids of this step, in global position order: the ids actually trained on."""
    if world == 1:
        return my_ids
    mine = torch.from_numpy(my_ids).to(device)
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine)
    return step_ids_in_position_order([t.cpu().numpy() for t in everyone], world, micro)
