"""raydeep on Ray Train, on one simulated cluster (``ray.cluster_utils.Cluster``: a head for the
drivers and two 1-CPU worker nodes): parity with plain processes, exactly-once data, a SIGKILLed
worker, a driver restart, and finally the loss of a node under an elastic run.

Every run is checked against one uninterrupted run: the tiny GPT, ZeRO-3, 2 workers, 16 steps of
16 samples, a checkpoint every 4 steps. Equal ``param_sha256`` means bitwise-equal consolidated
fp32 parameters; equal ``samples_sha256`` means the same sample ids in the same order (see
raydeep.ray.ledger). The tests run in file order and share the cluster; the node-loss test, which
removes a node, comes last.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import ray

from raydeep.data import builtin_dataset
from raydeep.ray import TrainSpec, fit
from raydeep.ray.ledger import SampleOrder, expected_digest
from raydeep.ray.trainer import LOCAL_CLUSTER_TUNING
from raydeep.ray.weights import load_fp32, max_abs_difference, param_sha256
from tests.dist.harness import run_ranks
from tests.ray.plain import train_plain

pytestmark = pytest.mark.slow

STEPS, EVERY, BATCH = 16, 4, 16
# The schedule's length is part of the run: fixed here (instead of "auto", i.e. --steps), so a
# run continued past its first --steps keeps the learning rates it started with.
SCHEDULE = [f"scheduler.params.total_num_steps={2 * STEPS}", "scheduler.params.warmup_num_steps=2"]


START_TIMEOUT = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"


@pytest.fixture(scope="module")
def cluster():
    """Yields (cluster, worker nodes). The GCS declares a silent node dead after three missed 1 s
    health checks, as a cluster tuned for fast failover would; a worker group that cannot be
    placed is retried at the size that fits after 10 s. The simulated nodes share one machine
    and are never drained, so, as on the local cluster raydeep starts itself, Ray Train's
    preemption watcher is off (its actor would take CPU from every restart)."""
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()  # a connection left by an earlier module
    fast_failover = {"health_check_period_ms": 1000, "health_check_failure_threshold": 3}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "_system_config": fast_failover})
    nodes = [cluster.add_node(num_cpus=1) for _ in range(2)]
    cluster.wait_for_nodes()
    tuning = {START_TIMEOUT: "10", **LOCAL_CLUSTER_TUNING}  # read by Ray Train's controller, started in fit()
    previous = {key: os.environ.get(key) for key in tuning}
    os.environ.update(tuning)
    ray.init(address=cluster.address)
    try:
        yield cluster, nodes
    finally:
        ray.shutdown()
        cluster.shutdown()
        for key, value in previous.items():
            if value is None:
                os.environ.pop(key)
            else:
                os.environ[key] = value


@pytest.fixture(scope="module")
def storage(tmp_path_factory):
    return tmp_path_factory.mktemp("runs")


def spec_for(storage, name: str, **changes) -> TrainSpec:
    return TrainSpec(**{"num_workers": 2, "steps": STEPS, "checkpoint_every": EVERY, "storage_path": str(storage),
                        "name": name, "overrides": SCHEDULE, **changes})


def expected_samples_sha256(steps: int = STEPS) -> str:
    """What an exactly-once run must consume, computed from the sample order alone."""
    return expected_digest(SampleOrder(len(builtin_dataset(128)), seed=0), steps, BATCH)


@pytest.fixture(scope="module")
def uninterrupted(cluster, storage):
    return fit(spec_for(storage, "uninterrupted", export_fp32=True))


def test_run_directory_layout(uninterrupted, storage):
    run = storage / "uninterrupted"
    assert (run / "summary.json").is_file() and (run / "model_fp32.safetensors").is_file()
    # Ray Train's retention (num_to_keep=2) deleted the older raydeep checkpoint directories.
    kept = sorted(p.name for p in (run / "checkpoints").iterdir() if p.is_dir())
    assert kept == ["global_step12", "global_step16"]
    assert (run / "checkpoints" / "latest").read_text().strip() == "global_step16"


def test_summary_reports_an_exactly_once_run(uninterrupted, storage):
    summary = uninterrupted
    assert (summary["global_steps"], summary["global_samples"]) == (STEPS, STEPS * BATCH)
    assert summary["world_sizes"] == [2] and summary["restarts"] == 0
    assert summary["samples_sha256"] == expected_samples_sha256()
    assert summary["final_loss"] < 4.5  # it learns: ln(256) = 5.55 at the start
    assert summary["samples_per_s"] > 0
    on_disk = json.loads((storage / "uninterrupted" / "summary.json").read_text())
    assert on_disk == json.loads(json.dumps(summary))


def test_two_ray_workers_equal_two_plain_processes(uninterrupted, storage):
    """fp32 parameters of the Ray run (consolidated, exported) against the same training in two
    plain gloo processes: max |difference| <= 1e-6; the digests say whether they are bitwise equal."""
    ray_params = load_fp32(str(storage / "uninterrupted" / "model_fp32.safetensors"))
    assert param_sha256(ray_params) == uninterrupted["param_sha256"]
    plain = run_ranks(train_plain, 2, spec_for(storage, "plain"), STEPS)[0]
    difference = max_abs_difference(ray_params, plain["params"])
    bitwise = param_sha256(plain["params"]) == uninterrupted["param_sha256"]
    print(f"\nRay 2 workers vs 2 plain processes: max |dtheta| = {difference:.3g}, bitwise equal: {bitwise}")
    assert difference <= 1e-6


class KillRankOne:
    """on_progress callback: SIGKILL rank 1 once the run is past its first checkpoint."""

    def __init__(self, after_step: int):
        self.after_step, self.killed_at, self.step, self.attempts = after_step, None, None, []

    def __call__(self, snapshot: dict) -> None:
        self.attempts = snapshot["attempts"]
        latest = snapshot["latest"]
        if self.killed_at is None and latest and latest["step"] >= self.after_step and 1 in self.attempts[0]["workers"]:
            self.killed_at, self.step = time.time(), latest["step"]
            os.kill(self.attempts[0]["workers"][1]["pid"], signal.SIGKILL)


def test_sigkill_of_a_worker_resumes_bitwise(uninterrupted, storage):
    kill = KillRankOne(after_step=EVERY + 2)
    summary = fit(spec_for(storage, "killed"), on_progress=kill)
    assert kill.killed_at is not None, "the run ended before a worker could be killed"
    assert summary["world_sizes"] == [2, 2] and summary["restarts"] == 1
    recovery = summary["recoveries"][0]
    assert recovery["resumed_from_step"] % EVERY == 0 and 0 < recovery["resumed_from_step"] <= kill.step
    assert summary["param_sha256"] == uninterrupted["param_sha256"]
    assert summary["samples_sha256"] == uninterrupted["samples_sha256"] == expected_samples_sha256()
    restarted = kill.attempts[1]
    print(f"\nSIGKILL of rank 1 at step {kill.step}: new worker group running the train function after "
          f"{restarted['entered_at'] - kill.killed_at:.1f} s; next completed step {restarted['first_step_at'] - kill.killed_at:.1f} s "
          f"after the kill (resumed at step {recovery['resumed_from_step']})")


def test_driver_restart_continues_the_run(uninterrupted, storage, cluster):
    """A new driver process (the CLI) with the same (storage_path, name) continues the finished
    16-step run to step 20 instead of starting over (the in-memory 16-step summary stays the
    reference for the next test)."""
    command = [sys.executable, "-m", "raydeep", "train", "--address", cluster[0].address, "--storage-path", str(storage),
               "--name", "uninterrupted", "--steps", str(STEPS + EVERY), "--checkpoint-every", str(EVERY),
               "--num-workers", "2", *[arg for item in SCHEDULE for arg in ("--set", item)]]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"done: step {STEPS + EVERY}" in proc.stdout and f"from step {STEPS}" in proc.stdout
    summary = json.loads((storage / "uninterrupted" / "summary.json").read_text())
    assert summary["world_sizes"] == [2, 2] and summary["attempts"][1]["resumed_from_step"] == STEPS
    assert summary["global_samples"] == (STEPS + EVERY) * BATCH
    assert summary["samples_sha256"] == expected_samples_sha256(STEPS + EVERY)
    assert summary["param_sha256"] != uninterrupted["param_sha256"]  # it trained the 4 new steps


class RemoveNodeOfRankOne:
    """on_progress callback: remove the node running rank 1 once the run is past a checkpoint."""

    def __init__(self, cluster, nodes, after_step: int):
        self.cluster, self.nodes, self.after_step = cluster, nodes, after_step
        self.removed_at, self.step, self.attempts = None, None, []

    def __call__(self, snapshot: dict) -> None:
        self.attempts, latest = snapshot["attempts"], snapshot["latest"]
        if self.removed_at is not None or not latest or latest["step"] < self.after_step:
            return
        workers = self.attempts[0]["workers"]
        if 1 in workers:
            node = next(n for n in self.nodes if n.node_id == workers[1]["node_id"])
            self.removed_at, self.step = time.time(), latest["step"]
            self.cluster.remove_node(node, allow_graceful=False)


def test_node_loss_continues_on_one_worker_with_the_same_batch(cluster, uninterrupted, storage):
    """Elastic run (1 to 2 workers): the node of rank 1 disappears; the run continues on the
    other with the same global batch (twice the accumulation), its ZeRO-3 state resharded from 2
    ranks to 1, the same samples, and the uninterrupted run's loss and weights up to rounding."""
    spec = spec_for(storage, "elastic", num_workers=(1, 2), export_fp32=True)
    loss = RemoveNodeOfRankOne(*cluster, after_step=EVERY + 2)
    summary = fit(spec, on_progress=loss)
    assert loss.removed_at is not None, "the run ended before the node could be removed"
    assert summary["world_sizes"][0] == 2 and summary["world_sizes"][-1] == 1
    last = summary["attempts"][-1]
    assert (last["micro_batch"], last["grad_accum"]) == (8, 2)  # the same 16 samples a step
    assert summary["global_samples"] == STEPS * BATCH
    assert summary["samples_sha256"] == expected_samples_sha256()
    loss_gap = abs(summary["final_loss"] - uninterrupted["final_loss"])
    param_gap = max_abs_difference(load_fp32(f"{spec.run_uri}/model_fp32.safetensors"),
                                   load_fp32(str(storage / "uninterrupted" / "model_fp32.safetensors")))
    on_one = next(a for a in loss.attempts if a["world_size"] == 1)
    print(f"\nnode of rank 1 removed at step {loss.step}: continued on 1 worker from step "
          f"{on_one['resumed_from_step']}, first step {on_one['first_step_at'] - loss.removed_at:.1f} s after the "
          f"removal; world sizes {summary['world_sizes']}; final loss {summary['final_loss']:.6f} vs "
          f"{uninterrupted['final_loss']:.6f} uninterrupted; max |dtheta| {param_gap:.2g}")
    assert loss_gap <= 1e-3
    assert param_gap <= 1e-3
