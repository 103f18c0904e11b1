"""A Ray Tune sweep over raydeep runs: one Ray Train run per trial (raydeep.ray.tune)."""
from __future__ import annotations

import json

import pytest
from ray import tune

from raydeep.ray import TrainSpec
from raydeep.ray.tune import make_driver, trial_spec

pytestmark = pytest.mark.slow


def test_trial_spec_applies_the_trial_config(tmp_path):
    base = TrainSpec(num_workers=2, steps=4, storage_path=str(tmp_path), name="sweep", overrides=["gradient_clipping=1.0"])
    spec = trial_spec(base, {"set": {"scheduler.params.warmup_max_lr": 0.003}, "num_workers": "1:2"}, "abc_00001")
    assert (spec.name, spec.num_workers) == ("sweep-abc_00001", (1, 2))
    assert spec.overrides == ["gradient_clipping=1.0", "scheduler.params.warmup_max_lr=0.003"]
    assert spec.resolved_ds_config()["scheduler"]["params"]["warmup_max_lr"] == 0.003


def test_a_grid_of_two_learning_rates(connected, tmp_path):
    """On the package's shared cluster (tests/ray/conftest.py). Two trials at once: each needs a
    sliver of a CPU for its driver and 1 CPU for its worker."""
    base = TrainSpec(num_workers=1, steps=4, checkpoint_every=2, storage_path=str(tmp_path / "runs"), name="lr")
    lrs = [1e-4, 3e-3]
    tuner = tune.Tuner(
        tune.with_resources(make_driver(base), {"CPU": 0.01}),  # the trial driver: a sliver of a CPU
        param_space={"set": {"scheduler.params.warmup_max_lr": tune.grid_search(lrs)}},
        tune_config=tune.TuneConfig(metric="loss", mode="min", max_concurrent_trials=2),
        run_config=tune.RunConfig(storage_path=str(tmp_path / "tune"), name="lr"))
    results = tuner.fit()
    assert not results.errors, results.errors
    losses = {}
    for result in results:
        lr = result.config["set"]["scheduler.params.warmup_max_lr"]
        # Tune saw every checkpoint report of the trial's run: steps 2 and 4.
        assert list(result.metrics_dataframe["step"]) == [2, 4]
        summary = json.loads((tmp_path / "runs" / f"lr-{result.metrics['trial_id']}" / "summary.json").read_text())
        assert summary["global_steps"] == 4 and summary["final_loss"] == pytest.approx(result.metrics["loss"])
        losses[lr] = summary["final_loss"]
    assert sorted(losses) == lrs and losses[1e-4] != losses[3e-3]
    assert results.get_best_result().config["set"]["scheduler.params.warmup_max_lr"] == min(losses, key=losses.get)
