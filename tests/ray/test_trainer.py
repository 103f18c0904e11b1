"""raydeep on Ray Train, on one simulated cluster (``ray.cluster_utils.Cluster``: a head for the
drivers, two 1-CPU trainer nodes and a 4-CPU node): parity with plain processes, exactly-once
data, a SIGKILLed worker (resumed from the memory snapshot between checkpoints, with 1-bit Adam's
error feedback, or from the checkpoint where the snapshot store was lost with it), a driver
restart past a corrupt checkpoint, and finally, under an elastic run, a drained (preempted) node.
tests/ray/test_offload_actors.py has the rest, with the actor tier: the unplanned loss of a node
(resumed from the same memory snapshots as the drained run, resharded 2 to 1) and a run with no
intact checkpoint (it fails once and leaves nothing behind).

Every run is checked against one uninterrupted run: the tiny GPT, ZeRO-3, 2 workers, 16 steps of
16 samples, a checkpoint every 4 steps (the 1-bit Adam run against the same training in plain
gloo processes, which a Ray run reproduces bit for bit). Equal ``param_sha256`` means
bitwise-equal consolidated fp32 parameters; equal ``samples_sha256`` means the same sample ids in
the same order (see raydeep.ray.ledger). The tests run in file order on the package's shared
cluster (tests/ray/conftest.py); the drain test, which removes a node (and puts a new one in its
place), comes last.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from raydeep.data import builtin_dataset
from raydeep.ray import TrainSpec, fit
from raydeep.ray.ledger import SampleOrder, expected_digest
from raydeep.ray.weights import load_fp32, max_abs_difference, param_sha256
from tests.dist.harness import run_ranks
from tests.ray.plain import train_plain

pytestmark = pytest.mark.slow

STEPS, EVERY, BATCH = 16, 4, 16
# The schedule's length is part of the run: fixed here (instead of "auto", i.e. --steps), so a
# run continued past its first --steps keeps the learning rates it started with.
SCHEDULE = [f"scheduler.params.total_num_steps={2 * STEPS}", "scheduler.params.warmup_num_steps=2"]


@pytest.fixture(scope="module")
def cluster(shared_ray):
    """(cluster, trainer nodes) of the package's shared cluster (tests/ray/conftest.py), this
    process connected to it for the module."""
    return shared_ray.cluster, shared_ray.trainers


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
    assert summary["offload"] is None  # nothing offloaded: no section (test_offload_actors.py has one)
    assert summary["samples_sha256"] == expected_samples_sha256()
    assert summary["final_loss"] < 4.5  # it learns: ln(256) = 5.55 at the start
    assert summary["samples_per_s"] > 0
    on_disk = json.loads((storage / "uninterrupted" / "summary.json").read_text())
    assert on_disk == json.loads(json.dumps(summary))


def test_the_default_snapshot_cadence_measures_after_the_second_step(uninterrupted, storage):
    """``raydeep.memory_snapshot_every`` is "auto" by default: the first memory snapshot follows
    the attempt's second step (timed in that step's ``checkpoint_s``), and its cost sets the gap
    to the next one. A snapshot of the tiny GPT's state takes several times the 3% of a step that
    "auto" allows, so the next step takes none."""
    from raydeep.metrics import read_metrics

    rows = read_metrics(spec_for(storage, "uninterrupted").run_uri).to_pylist()
    saved = {r["step"] for r in rows if r["checkpoint_s"] > 0}
    assert {2, EVERY, 2 * EVERY} <= saved and not {1, 3} & saved, sorted(saved)


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


def monitored_config(out, snapshot_every: int) -> dict:
    """The default ds_config with DeepSpeed's monitors, timers and comms logger on, and memory
    snapshots every ``snapshot_every`` steps: none of them changes the arithmetic, so the run
    still ends bitwise equal to the uninterrupted one."""
    import copy

    from raydeep.ray.spec import DEFAULT_DS_CONFIG

    return {**copy.deepcopy(DEFAULT_DS_CONFIG), "steps_per_print": EVERY, "wall_clock_breakdown": True,
            "raydeep": {"memory_snapshot_every": snapshot_every},
            "comms_logger": {"enabled": True},
            "tensorboard": {"enabled": True, "output_path": str(out / "tb"), "job_name": "kill"},
            "csv_monitor": {"enabled": True, "output_path": str(out / "csv"), "job_name": "kill"}}


def check_step_metrics(run_uri: str, resumed: int, snapshot_every: int) -> None:
    """The Parquet rows: one per step across both attempts; the killed attempt's rows past the
    checkpoint the restart resumed from were cut, and attempt 1's start right after it."""
    from raydeep.metrics import read_metrics

    rows = read_metrics(run_uri).to_pylist()
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert [r["attempt"] for r in rows] == [0] * resumed + [1] * (STEPS - resumed)
    assert all(r["restarts"] == r["attempt"] and r["world_size"] == 2 for r in rows)
    assert [r["samples"] for r in rows] == [BATCH * r["step"] for r in rows]
    assert all(r["tokens_per_s"] > 0 and r["mfu"] is None for r in rows)  # no peak on a CPU
    assert all(len(r["model_state_bytes"]) == 2 and min(r["model_state_bytes"]) > 0 for r in rows)
    assert all(r["bytes_all_gather"] > 0 and r["bytes_reduce_scatter"] > 0 for r in rows)  # ZeRO-3
    # Every step without a save or a snapshot spent none; each save of attempt 1 reached its row at
    # a later flush.
    assert all(r["checkpoint_s"] == 0 for r in rows if r["step"] % snapshot_every)
    assert all(r["checkpoint_s"] > 0 for r in rows if r["attempt"] == 1 and r["step"] % EVERY == 0)


def check_monitors(out, head_node, run_name: str) -> None:
    """DeepSpeed's TensorBoard and CSV files, and its timer lines and comms table in the workers'
    logs (Ray Train's application log of each worker, JSON lines tagged with the run's name)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tb" / "kill"))
    events.Reload()
    losses = events.Scalars("Train/Samples/train_loss")
    assert losses[-1].step == STEPS * BATCH  # x is global_samples, as DeepSpeed writes it
    assert (out / "csv" / "kill" / "Train_Samples_train_loss.csv").is_file()
    assert (out / "csv" / "kill" / "Train_Samples_lr.csv").is_file()
    messages = []
    for log in (Path(head_node.get_session_dir_path()) / "logs" / "train").glob("ray-train-app-worker-*.log"):
        for line in log.read_text().splitlines():
            record = json.loads(line)
            if record.get("run_name") == run_name:
                messages.append(record.get("message", ""))
    assert any(m.startswith("time (ms) | fwd:") for m in messages), messages[-20:]
    assert any("Comm. Op" in m for m in messages), messages[-20:]


def snapshot_config(every: int = 1) -> dict:
    """The default ds_config with memory snapshots every ``every`` steps (they change no arithmetic)."""
    import copy

    from raydeep.ray.spec import DEFAULT_DS_CONFIG

    return {**copy.deepcopy(DEFAULT_DS_CONFIG), "raydeep": {"memory_snapshot_every": every}}


def check_resumed_from_the_newest_state(record: dict, every: int) -> None:
    """A restart resumed from the newest state there was: the memory snapshot of its step or, where
    that step saved a checkpoint, the checkpoint (or the step's snapshot, when the worker died
    before the checkpoint was committed)."""
    resumed = record["resumed_from_step"]
    sources = ["checkpoint", "memory snapshot"] if resumed % every == 0 else ["memory snapshot"]
    assert record["restored_from"] in [f"{source} global_step{resumed}" for source in sources], record


def _snapshot_stores() -> list:
    from ray.util.state import list_actors

    return list_actors(filters=[("class_name", "=", "SnapshotStore")], detail=True, raise_on_missing_output=False)


def onebit_config(snapshot_every: int) -> dict:
    """1-bit Adam at stage 0, compressing from step 3 on, with memory snapshots every ``snapshot_every`` steps."""
    config = snapshot_config(snapshot_every)
    config["optimizer"] = {"type": "OneBitAdam", "params": {"lr": 2e-3, "freeze_step": 2, "weight_decay": 0.01}}
    config["zero_optimization"] = {"stage": 0}
    return config


def test_sigkill_between_checkpoints_resumes_from_the_memory_snapshot(storage):
    """Snapshots every step, checkpoints every 4, 1-bit Adam past its freeze step: rank 1 is
    killed past a checkpoint, and the next worker group resumes from the newest snapshot
    in the driver's store instead of the checkpoint, losing no step it had reported. Each rank's
    error feedback comes back from the driver's memory with the rest, so the run ends bitwise
    equal to the uninterrupted one and consumes every sample once. The store goes with the run.
    The uninterrupted run is the same training in two plain gloo processes, which a Ray run
    reproduces bit for bit (test_two_ray_workers_equal_two_plain_processes): a Ray run of its own
    would start a worker group more for the same bits. (ZeRO-3's snapshots: the drain test.)"""
    steps = 2 * EVERY
    spec = spec_for(storage, "snapshot-killed", ds_config=onebit_config(1), steps=steps)
    kill = KillRankOne(after_step=EVERY + 1)
    summary = fit(spec, on_progress=kill)
    assert kill.killed_at is not None and summary["restarts"] == 1
    recovery = summary["recoveries"][0]
    print(f"\nSIGKILL of rank 1 at step {kill.step} (1-bit Adam, checkpoint every {EVERY}): {recovery}")
    check_resumed_from_the_newest_state(recovery, EVERY)
    assert recovery["resumed_from_step"] > EVERY  # in the compressed stage (from step 3), past the checkpoint
    assert recovery["steps_lost"] == 0  # a step is reported done once its snapshot is whole
    assert summary["compression"]["phase"] == "compressed" and summary["compression"]["compressed_bytes"] > 0
    straight = run_ranks(train_plain, 2, spec, steps)[0]
    assert summary["param_sha256"] == param_sha256(straight["params"])
    assert summary["samples_sha256"] == expected_samples_sha256(steps)
    assert [a["state"] for a in _snapshot_stores()].count("ALIVE") == 0


class KillRankOneAndTheStore(KillRankOne):
    """SIGKILL the snapshot store's process, then rank 1: both copies of the recent state gone.
    Rank 1 is killed only once the store was found (through the State API) and killed."""

    def __init__(self, after_step: int):
        super().__init__(after_step)
        self.store_killed = False

    def __call__(self, snapshot: dict) -> None:
        latest = snapshot["latest"]
        if not self.store_killed and latest and latest["step"] >= self.after_step:
            alive = [store for store in _snapshot_stores() if store["state"] == "ALIVE"]
            for store in alive:
                os.kill(store["pid"], signal.SIGKILL)
            self.store_killed = bool(alive)  # not listed yet: again at the next poll
        if self.store_killed:
            super().__call__(snapshot)


def test_sigkill_with_the_snapshot_store_lost_resumes_from_the_checkpoint_bitwise(uninterrupted, storage, cluster,
                                                                                tmp_path):
    """Rank 1 is killed past the first checkpoint, together with the snapshot store (memory
    snapshots every 2 steps): both copies of the recent state are gone, so the restarted group
    resumes from the checkpoint, says why, and ends with the uninterrupted run's weights and
    samples. The run's observability survives it too (see the checks below)."""
    snapshot_every = 2
    kill = KillRankOneAndTheStore(after_step=EVERY + 2)
    spec = spec_for(storage, "snapshot-lost", ds_config=monitored_config(tmp_path, snapshot_every))
    summary = fit(spec, on_progress=kill)
    assert kill.killed_at is not None, "the run ended before a worker could be killed"
    assert summary["world_sizes"] == [2, 2] and summary["restarts"] == 1
    recovery = summary["recoveries"][0]
    resumed = recovery["resumed_from_step"]  # the last checkpoint before the kill
    assert resumed % EVERY == 0 and 0 < resumed <= kill.step, recovery
    assert recovery["restored_from"].startswith(f"checkpoint global_step{resumed} (memory snapshots lost: ")
    assert summary["param_sha256"] == uninterrupted["param_sha256"]
    assert summary["samples_sha256"] == uninterrupted["samples_sha256"] == expected_samples_sha256()  # nothing twice
    restarted = kill.attempts[1]
    print(f"\nstore and rank 1 killed at step {kill.step}: new worker group running the train function after "
          f"{restarted['entered_at'] - kill.killed_at:.1f} s; next completed step {restarted['first_step_at'] - kill.killed_at:.1f} s "
          f"after the kill ({recovery['restored_from']})")
    check_step_metrics(spec.run_uri, resumed, snapshot_every)
    check_monitors(tmp_path, cluster[0].head_node, spec.name)


def _flip_a_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # inside the tensor data: the file still parses, its sha256 does not match
    path.write_bytes(bytes(data))


def _train_command(cluster, storage, steps: int) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "raydeep", "train", "--address", cluster[0].address, "--storage-path", str(storage),
               "--name", "uninterrupted", "--steps", str(steps), "--checkpoint-every", str(EVERY),
               "--num-workers", "2", *[arg for item in SCHEDULE for arg in ("--set", item)]]
    env = {**os.environ, "COLUMNS": "400"}  # rich wraps at 80 columns without a terminal: keep lines whole
    return subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)


def test_driver_restart_continues_the_run_past_a_corrupt_checkpoint(uninterrupted, storage, cluster):
    """A new driver process (the CLI) with the same (storage_path, name) continues the finished
    16-step run to step 20 instead of starting over. Its newest checkpoint (step 16) has a bit
    flipped in one rank's file: the run warns, naming the file, resumes from step 12, and trains
    every sample exactly once (the ledger is the step-12 checkpoint's). The in-memory 16-step
    summary stays the reference for the next tests."""
    checkpoints = storage / "uninterrupted" / "checkpoints"
    damaged = sorted((checkpoints / f"global_step{STEPS}").glob("rank*.safetensors"))[-1]
    _flip_a_byte(damaged)
    proc = _train_command(cluster, storage, STEPS + EVERY)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    print(f"\n{proc.stdout}")
    assert f"checkpoint global_step{STEPS} is damaged" in proc.stdout and damaged.name in proc.stdout
    assert f"done: step {STEPS + EVERY}" in proc.stdout and f"from step {STEPS - EVERY}" in proc.stdout
    summary = json.loads((storage / "uninterrupted" / "summary.json").read_text())
    assert summary["world_sizes"] == [2, 2] and summary["attempts"][1]["resumed_from_step"] == STEPS - EVERY
    assert summary["attempts"][1]["skipped_checkpoints"][0][0] == f"global_step{STEPS}"
    assert summary["global_samples"] == (STEPS + EVERY) * BATCH
    assert summary["samples_sha256"] == expected_samples_sha256(STEPS + EVERY)
    assert summary["param_sha256"] != uninterrupted["param_sha256"]  # it trained the new steps
    # The re-trained step 16 was saved beside the damaged one, never into its directory (which
    # Ray Train still tracks and deletes when it rotates it out).
    assert (checkpoints / f"global_step{STEPS}-attempt2" / "manifest.json").is_file()


def _train_workers_ever_started() -> int:
    """Ray Train worker actors this cluster has created, dead or alive (the GCS keeps them all)."""
    from ray._private.state import actors

    return sum(actor["ActorClassName"] == "RayTrainWorker" for actor in actors().values())


def _wait_for_free_trainers(count: int, timeout_s: float = 60.0) -> None:
    """Until exactly ``count`` trainer nodes are alive and free, and Ray Train's autoscaling
    coordinator has seen them: an elastic run sizes itself from the coordinator's view of the
    nodes, which it refreshes every 20 s (``TICK_INTERVAL_S``), so one started sooner after a node
    was replaced would start on fewer workers. The coordinator is asked to look now instead."""
    import ray

    def ready() -> bool:
        alive = [n for n in ray.nodes() if n["Alive"] and n["Resources"].get("trainer")]
        return len(alive) == count and ray.available_resources().get("trainer", 0) >= count

    deadline = time.monotonic() + timeout_s
    while not ready() and time.monotonic() < deadline:
        time.sleep(0.2)
    try:  # a detached actor of Ray's, started by the first elastic run
        coordinator = ray.get_actor("AutoscalingCoordinator", namespace="AutoscalingCoordinator")
    except ValueError:
        return  # no elastic run yet: the first one reads the nodes as they are
    # Its own "recompute against a fresh view of the cluster" (one tick, as its 20 s timer does).
    ray.get(coordinator.get_reserved_resources.remote("raydeep-tests", recompute=True))


class DrainNodeOfRankOne:
    """on_progress callback: once the run is past a checkpoint, drain the node of rank 1 as a
    preemption with a deadline: the GCS call that ``ray drain-node --reason
    DRAIN_NODE_REASON_PREEMPTION --deadline-remaining-seconds N`` and the autoscaler make (made
    here directly: the command takes seconds to start, longer than this run's remaining steps)."""

    def __init__(self, address: str, after_step: int, deadline_s: float):
        self.address, self.after_step, self.deadline_s = address, after_step, deadline_s
        self.node_id, self.step, self.attempts, self.accepted = None, None, [], None

    def __call__(self, snapshot: dict) -> None:
        self.attempts, latest = snapshot["attempts"], snapshot["latest"]
        if self.node_id is not None or not latest or latest["step"] < self.after_step:
            return
        workers = self.attempts[0]["workers"]
        if 1 in workers:
            from ray._raylet import GcsClient
            from ray.core.generated import autoscaler_pb2

            self.node_id, self.step = workers[1]["node_id"], latest["step"]
            deadline_ms = int((time.time() + self.deadline_s) * 1000)
            self.accepted = GcsClient(address=self.address).drain_node(
                self.node_id, autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
                "spot reclaim (test)", deadline_ms)


def test_a_drained_node_moves_the_run_without_losing_a_step(shared_ray, uninterrupted, storage, monkeypatch):
    """A preemption notice for the node of rank 1 (a drain with a 1 s deadline): from the next
    step every rank snapshots each step into the driver's memory, and waits once the deadline is
    closer than three steps; at the deadline Ray Train ends the
    worker group and starts it again on the node that is left, which resumes at the last step taken
    (no snapshot cadence set: the notice alone turns them on).
    The run ends with the uninterrupted
    run's samples and weights, and with ``max_failures`` 0: a preemption is not a failure."""
    monkeypatch.setenv("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "1")  # read by the controller fit() starts
    monkeypatch.setenv("RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S", "0.5")  # Ray's 5 s is most of this short run
    monkeypatch.setenv("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "3")
    spec = spec_for(storage, "drained", num_workers=(1, 2), resources_per_worker={"trainer": 1}, max_failures=0)
    # early and short, so the run is still going at the deadline on a fast machine too
    drain = DrainNodeOfRankOne(shared_ray.address, after_step=2, deadline_s=1.0)
    try:
        summary = fit(spec, on_progress=drain)
    finally:
        if drain.node_id is not None:  # the drained node takes no new work: a new one in its place
            node = next(n for n in shared_ray.trainers if n.node_id == drain.node_id)
            shared_ray.cluster.remove_node(node, allow_graceful=False)
            shared_ray.replace_trainer(node)
            _wait_for_free_trainers(2)  # the next elastic run must find both, not start on one
    assert drain.node_id is not None, "the run ended before the node could be drained"
    assert drain.accepted[0], drain.accepted
    assert summary["world_sizes"][0] == 2 and summary["world_sizes"][-1] == 1 and summary["restarts"] == 1
    last = summary["attempts"][-1]
    assert (last["micro_batch"], last["grad_accum"]) == (8, 2)  # the same 16 samples a step
    recovery = summary["recoveries"][0]
    print(f"\nnode of rank 1 drained at step {drain.step} (deadline 1 s): {recovery}")
    check_resumed_from_the_newest_state(recovery, EVERY)
    assert recovery["resumed_from_step"] > drain.step and recovery["steps_lost"] == 0, recovery
    assert summary["samples_sha256"] == expected_samples_sha256()
    assert summary["param_sha256"] == uninterrupted["param_sha256"]
