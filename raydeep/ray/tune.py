"""Ray Tune sweeps over raydeep runs: one Ray Train run per trial, driven by a Tune function.

Ray 2.60's Train V2 trainers are not Tune trainables (``Tuner(trainer)`` is gone); Tune runs a
*driver function* per trial instead, which here is :func:`raydeep.ray.fit` on the trial's spec:

>>> from ray import tune  # doctest: +SKIP
>>> from raydeep.ray import TrainSpec  # doctest: +SKIP
>>> from raydeep.ray.tune import make_driver  # doctest: +SKIP
>>> tuner = tune.Tuner(  # doctest: +SKIP
...     tune.with_resources(make_driver(TrainSpec(steps=200, storage_path="s3://b/runs", name="lr")), {"CPU": 0.01}),
...     param_space={"set": {"scheduler.params.warmup_max_lr": tune.grid_search([1e-4, 3e-4, 1e-3])}, "num_workers": 2},
...     tune_config=tune.TuneConfig(metric="loss", mode="min", max_concurrent_trials=1),
...     run_config=tune.RunConfig(storage_path="s3://b/tune", name="lr"))
>>> tuner.fit().get_best_result().metrics["loss"]  # doctest: +SKIP

A trial's config may hold ``"set"`` (dotted ds_config keys to values, like ``raydeep train --set``)
and ``"num_workers"`` (a count or ``(min, max)``). Each trial is its own run,
``<spec.name>-<trial id>``: Tune sees every checkpoint's ``ray.train.report`` metrics (``loss``,
``tokens_s``, ``mfu`` (None without a known peak: see ``raydeep.peak_tflops``), ``samples_s``,
``step_s``, ``step``, ``samples``, plus ``checkpoint_path``; Tune's results table shows the first
few numbers, so the loss and the rates come first), and a trial that Tune restarts resumes its
run from its last checkpoint, because the trial id, and so the run name, stays the same. Each
run also writes its per-step rows under ``<run>/metrics/`` (:func:`raydeep.metrics.read_metrics`).
"""
from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable

from raydeep.ray.spec import TrainSpec, parse_num_workers

logger = logging.getLogger("raydeep")


def trial_spec(base: TrainSpec, config: dict, trial_id: str) -> TrainSpec:
    """``base`` with the trial's overrides and worker count, named after the trial. A trial that
    sets ``optimizer.params.lr`` under a scheduler that sets the LR itself logs a warning: the
    sweep would change nothing (the doctor's ``lr-swept-under-scheduler`` rule)."""
    overrides = [*base.overrides, *(f"{key}={json.dumps(value)}" for key, value in config.get("set", {}).items())]
    num_workers = parse_num_workers(config["num_workers"]) if "num_workers" in config else base.num_workers
    spec = dataclasses.replace(base, name=f"{base.name}-{trial_id}", overrides=overrides, num_workers=num_workers)
    if "optimizer.params.lr" in config.get("set", {}):
        _warn_if_lr_is_overwritten(spec)
    return spec


def _warn_if_lr_is_overwritten(spec: TrainSpec) -> None:
    from raydeep.doctor.lint import lr_sweep_finding

    scheduler = spec.resolved_ds_config().get("scheduler") or {}
    finding = lr_sweep_finding(scheduler.get("type"), scheduler.get("params"))
    if finding is not None:
        logger.warning("%s [%s]. Fix: %s", finding.message, finding.rule, finding.fix)


def make_driver(base: TrainSpec) -> Callable[[dict], None]:
    """A Tune function training one run per trial (see the module docstring). Its results are the
    run's checkpoint reports; the run's summary.json is written as for ``raydeep train``."""

    def raydeep_trial(config: dict) -> None:
        from ray import tune
        from ray.tune.integration.ray_train import TuneReportCallback

        from raydeep.ray.trainer import fit

        spec = trial_spec(base, config, tune.get_context().get_trial_id())
        fit(spec, log_to_driver=False, callbacks=[TuneReportCallback()])

    return raydeep_trial
