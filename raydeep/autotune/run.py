"""The autotuner's trials: every candidate the memory model kept is one Ray Tune trial running one
raydeep Train run (:func:`raydeep.ray.tune.make_driver`), scheduled by ASHA on throughput.

- Tune sees each run's checkpoint reports (``tokens_s``, ``loss``, ``step``...), so the run
  checkpoints every ``steps // REPORTS`` steps: ASHA needs several reports to stop a slow trial
  before its end (``time_attr="training_iteration"``: one per report).
- A failed trial (an out-of-memory error, a config the engine refuses) is a result: neither Tune
  (``FailureConfig(max_failures=0)``) nor Ray Train (the spec's ``max_failures=0``) retries it, and
  its error's first line goes to the table. An OOM is deterministic; retrying only costs time.
- As many trials run at once as the cluster holds: each needs ``num_workers x cpus_per_worker``
  CPUs for its workers plus :data:`DRIVER_CPU` for its Tune driver (a trial that did not fit
  would only wait, and on a fixed cluster a waiting Train worker group times out and retries).
- Placement groups: Tune removes its trials'; Ray Train's ``PlacementGroupCleaner`` removes the
  worker group's of a trial ASHA stopped (its controller dies without cleaning up), by polling.
  The run waits for that, and removes what this job still holds once every trial has ended, so
  a cluster is left as it was found (see ``reference/ray-conventions.md`` §1.8).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import sys
import time

from raydeep.autotune.space import Entry
from raydeep.errors import InputError
from raydeep.ray.spec import TrainSpec

DRIVER_CPU = 0.01  # a trial's Tune driver only waits on its Train controller
REPORTS = 4  # checkpoint reports per trial: ASHA's rungs
PG_WAIT_S = 10.0  # how long the PlacementGroupCleaner is given before the leftovers are removed


def concurrent_trials(resources: dict, spec: TrainSpec) -> int:
    """How many trials the cluster runs at once (at least one).

    >>> concurrent_trials({"CPU": 16.0}, TrainSpec(num_workers=2, storage_path="/tmp"))
    7
    >>> concurrent_trials({"CPU": 8.0, "GPU": 2.0}, TrainSpec(num_workers=2, use_gpu=True, storage_path="/tmp"))
    1
    """
    fits = math.floor(resources.get("CPU", 0) / (spec.max_workers * spec.cpus_per_worker + DRIVER_CPU))
    if spec.use_gpu:
        fits = min(fits, math.floor(resources.get("GPU", 0) / spec.max_workers))
    for name, amount in spec.resources_per_worker.items():
        fits = min(fits, math.floor(resources.get(name, 0) / (amount * spec.max_workers)))
    return max(1, fits)


def connect_for_trials(spec: TrainSpec, address: str | None) -> bool:
    """Connect to Ray as ``raydeep train`` does (:func:`raydeep.ray.trainer.connect`), except that a
    local cluster started here gets one CPU more than one trial's workers: room for the trial's
    driver. Returns whether this call connected (and so should disconnect: ``ray.shutdown()``
    stops a cluster started here and only leaves a joined one)."""
    import ray

    from raydeep.ray.trainer import LOCAL_CLUSTER_TUNING, RAY_TRAIN_TUNING, connect, running_local_cluster

    if ray.is_initialized():
        return False
    joining = address != "local" and (address or os.environ.get("RAY_ADDRESS") or running_local_cluster())
    if joining:
        connect(spec, address, log_to_driver=False)
        return True
    for key, value in {**RAY_TRAIN_TUNING, **LOCAL_CLUSTER_TUNING}.items():
        os.environ.setdefault(key, value)  # the trials' Train controllers read them
    cpus = max(os.cpu_count() or 1, math.ceil(spec.max_workers * spec.cpus_per_worker)) + 1
    ray.init(address="local", num_cpus=cpus, log_to_driver=False)
    return True


def run_trials(spec: TrainSpec, entries: list[Entry], *, storage_path: str, name: str, address: str | None = None,
               verbose: bool = False) -> list[Entry]:
    """Run every pending entry as a trial of ``spec`` (its overrides on top of ``spec``'s config)
    and fill in its status (finished / stopped early / failed), median ``tokens_s``, last ``loss``.
    The trials' runs are ``<spec.storage_path>/<spec.name>-<trial id>``; Tune's experiment is
    ``<storage_path>/<name>``. Without ``verbose`` Tune's own output (its tables, each failed
    trial's traceback) is left out: the table printed at the end says it all."""
    import ray
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler

    from raydeep.ray.tune import make_driver

    pending = {e.index: e for e in entries if e.status == "pending"}
    if not pending:
        return entries
    every = max(1, spec.steps // REPORTS)
    base = dataclasses.replace(spec, checkpoint_every=every, max_failures=0)
    reports = math.ceil(spec.steps / every)
    started = connect_for_trials(spec, address)
    try:
        need = spec.max_workers * spec.cpus_per_worker + DRIVER_CPU
        if ray.cluster_resources().get("CPU", 0) < need:  # the trial would wait for ever
            raise InputError("--num-workers", f"the Ray cluster has {ray.cluster_resources().get('CPU', 0):g} CPUs; "
                             f"one trial needs {need:g} ({spec.max_workers} worker(s) x {spec.cpus_per_worker:g} CPU "
                             f"+ {DRIVER_CPU} for its Tune driver)", value=spec.max_workers,
                             fix="use fewer workers or --cpus-per-worker, or a larger cluster (--address local "
                             "starts one sized for a trial)")
        before = _held_placement_groups()
        driver, sets = make_driver(base), {i: e.overrides for i, e in pending.items()}
        workers = spec.num_workers

        def autotune_trial(config: dict) -> None:
            driver({"set": sets[config["candidate"]], "num_workers": workers})

        concurrency = concurrent_trials(ray.cluster_resources(), spec)
        tuner = tune.Tuner(
            tune.with_resources(autotune_trial, {"CPU": DRIVER_CPU}),
            param_space={"candidate": tune.grid_search(sorted(pending))},
            tune_config=tune.TuneConfig(
                metric="tokens_s", mode="max", max_concurrent_trials=concurrency,
                scheduler=ASHAScheduler(time_attr="training_iteration", max_t=reports, grace_period=1,
                                        reduction_factor=2)),
            run_config=tune.RunConfig(storage_path=storage_path, name=name, verbose=1 if verbose else 0,
                                      failure_config=tune.FailureConfig(max_failures=0),
                                      callbacks=[] if verbose else [_trial_printer(pending)]))
        print(f"autotune: {len(pending)} trial(s), {concurrency} at a time, {spec.steps} steps each "
              f"(a report every {every})", file=sys.stderr, flush=True)
        with _quiet_tune(not verbose):
            results = tuner.fit()
        for result in results:
            _fill(pending[result.config["candidate"]], result, spec.steps)
        _release_placement_groups(before)
    finally:
        if started:
            ray.shutdown()
    return entries


@contextlib.contextmanager
def _quiet_tune(quiet: bool):
    """Tune's new console output prints its tables and every trial error even at ``verbose=0``;
    its legacy engine at verbosity 0 prints nothing. Its logger logs each failure's traceback."""
    if not quiet:
        yield
        return
    saved, tune_logger = os.environ.get("RAY_AIR_NEW_OUTPUT"), logging.getLogger("ray.tune")
    level = tune_logger.level
    tune_logger.setLevel(logging.CRITICAL)
    os.environ["RAY_AIR_NEW_OUTPUT"] = "0"
    try:
        yield
    finally:
        tune_logger.setLevel(level)
        if saved is None:
            os.environ.pop("RAY_AIR_NEW_OUTPUT", None)
        else:
            os.environ["RAY_AIR_NEW_OUTPUT"] = saved


def _fill(entry: Entry, result, steps: int) -> None:
    frame = result.metrics_dataframe
    rows = [] if frame is None or frame.empty else frame.to_dict("records")
    entry.metrics = [{k: row.get(k) for k in ("step", "tokens_s", "loss", "step_s")} for row in rows]
    entry.trial_id = (result.metrics or {}).get("trial_id")
    rates = sorted(r["tokens_s"] for r in entry.metrics if r.get("tokens_s") is not None)
    entry.tokens_s = rates[len(rates) // 2] if rates else None  # the median: one noisy step cannot win
    entry.loss = entry.metrics[-1]["loss"] if entry.metrics else None
    entry.steps = int(entry.metrics[-1]["step"]) if entry.metrics else 0
    if result.error is not None:
        entry.status, entry.error = "failed", error_line(result.error)
    else:
        entry.status = "finished" if entry.steps >= steps else "stopped early"


def error_line(error: BaseException) -> str:
    """The first line of what went wrong in a trial: the innermost cause Ray wrapped (a worker's
    ``torch.OutOfMemoryError`` inside Ray Train's failure inside Tune's task error), without the
    wrappers' own headers."""
    seen = set()
    while id(error) not in seen:
        seen.add(id(error))
        inner = getattr(error, "cause", None)  # RayTaskError
        failures = getattr(error, "worker_failures", None)  # Ray Train's WorkerGroupError
        if failures:
            inner = failures[min(failures)]
        inner = inner or getattr(error, "controller_failure", None) or error.__cause__
        if not isinstance(inner, BaseException):
            break
        error = inner
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


def _held_placement_groups() -> set[str] | None:
    """This job's placement groups not yet removed (None when the State API, which needs Ray's
    dashboard, cannot say: then nothing can be told apart from other jobs' groups)."""
    import ray
    from ray.util.state import list_placement_groups
    from ray.util.state.exception import RayStateApiException

    context = ray.get_runtime_context()
    try:  # this cluster's address: another one may run on this machine too
        groups = list_placement_groups(address=context.gcs_address, detail=True, raise_on_missing_output=False,
                                       filters=[("creator_job_id", "=", context.get_job_id())])
    except (RayStateApiException, ConnectionError):
        return None
    return {g.placement_group_id for g in groups if g.state != "REMOVED" and not g.is_detached}


def _release_placement_groups(before: set[str] | None) -> None:
    """Wait for the placement groups the trials left (ASHA-stopped runs) to be removed, then remove
    what this job created during the trials and still holds: every trial has ended, so nothing
    uses them."""
    import ray
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    deadline, left = time.monotonic() + PG_WAIT_S, set()
    while before is not None:
        held = _held_placement_groups()
        left = (held or set()) - before
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    for pg_id in sorted(left):
        remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(pg_id))))
    if left:
        print(f"autotune: removed {len(left)} placement group(s) that stopped trials left", file=sys.stderr)
    if before is None:
        print("autotune: Ray's State API is unavailable (install ray[default]): placement groups of trials ASHA "
              "stopped may stay until this driver exits", file=sys.stderr)


def _trial_printer(pending: dict[int, Entry]):
    """A Tune callback printing one stderr line per ended trial (Tune's own progress tables come
    with ``--verbose``). Made here so that importing this module does not import Tune."""
    from ray.tune import Callback

    class TrialPrinter(Callback):
        done = 0

        def _line(self, trial, what: str) -> None:
            self.done += 1
            entry, last = pending[trial.config["candidate"]], trial.last_result or {}
            rate = f", {last['tokens_s']:,.0f} tok/s at step {last.get('step')}" if last.get("tokens_s") else ""
            print(f"  trial {self.done}/{len(pending)}: #{entry.index} {entry.candidate.label}: {what}{rate}",
                  file=sys.stderr, flush=True)

        def on_trial_complete(self, iteration, trials, trial, **info):
            self._line(trial, "ended")

        def on_trial_error(self, iteration, trials, trial, **info):
            self._line(trial, "failed")

    return TrialPrinter()
