"""The actor tier on the package's simulated cluster (tests/ray/conftest.py): a head for the
drivers, two 1-CPU trainer nodes (resource ``trainer``) and one CPU offload node that carries
``raydeep_offload`` and the label ``raydeep/role=offload``.

- Parity: 2 gloo ranks that join the cluster train stages 1-3 in bf16 (and stage 2 in fp32) with their fp32
  masters and Adam states in offload actors, in sub-groups of 4096 elements (so every step
  pipelines several pieces through the object store), and must equal the same training without
  offload bit for bit: the actors run the same fused CPU kernel on the same values
  (``tests/dist/test_offload.py`` says why tiling keeps the bits). Stage 2 in bf16 runs 2 actors
  per rank (sub-group k goes to actor k mod 2); the other stages 1 each: which actor owns a
  sub-group does not depend on the stage, and every actor is a process to start.
- Placement: the actors run on the offload node, by node id; with no marked node, ``auto`` takes
  the host tier. A rank on the offload node gets its actors beside it, through shared memory,
  with the object store's bits (the delayed update with its lookahead).
- Memory, measured from the tensors each process really holds (tests/ray/tensors.py), not from
  raydeep's accounting: the rank keeps no fp32 master or optimizer state, its offload actors hold
  ZeRO's 12 bytes per element of the rank's shard, and ``memory_breakdown()`` agrees with both.
- Through ``raydeep train``: the ``offload`` section of summary.json, the same weights as the same
  training without offload (in plain gloo processes, which a Ray run reproduces bit for bit:
  tests/ray/test_trainer.py), and recovery from ``ray.kill`` of an offload actor with the
  uninterrupted run's weights. After each run (finished, or failed and restarted), no actor of
  the run is alive, no placement group exists and no object is left (State API).
- Memory snapshots with the actor tier: the loss of a rank's node (2 workers to 1) resumes from
  the newest snapshot in the driver's store, past the last checkpoint (the same world size, bit
  for bit, from snapshots the actors hold: tests/ray/test_snapshot_holders.py).
- A run with no intact checkpoint fails once, with one message, and leaves nothing behind.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import ray
import torch

from tests.dist.harness import run_ranks
from tests.ray.tensors import actor_storage_bytes, storage_bytes

pytestmark = pytest.mark.slow
STEPS, EVERY = 8, 2
SUB_GROUP = 4096  # elements per sub-group in the parity runs


@pytest.fixture(scope="module")
def cluster(shared_ray):
    """(cluster, trainer nodes, offload node): the package's shared cluster, this process its driver."""
    return shared_ray.cluster, shared_ray.trainers, shared_ray.offload


def _alive_offload_actors() -> list:
    from ray.util.state import list_actors

    return [a for a in list_actors(filters=[("state", "=", "ALIVE")], limit=1000) if a.class_name in OFFLOAD_ACTORS]


def _placement_groups() -> list:
    from ray.util.state import list_placement_groups

    return [pg for pg in list_placement_groups(limit=1000) if pg.state != "REMOVED"]


def _train(cfg: dict, save_to: str | None = None) -> dict:
    """3 steps on this rank; with what the rank and its offload actors hold in fp32 tensors after them."""
    import raydeep
    from tests.dist.checkpoint_workloads import full_params
    from tests.dist.workloads import run_steps, tiny_gpt

    engine, *_ = raydeep.initialize(model=tiny_gpt(), config=cfg)
    losses = run_steps(engine, 3, 8)
    out = {"losses": losses, "params": full_params(engine), "memory": engine.memory_breakdown(),
           "tier": type(engine.tier).__name__, "report": engine.tier.report(),
           "numel": sum(p.numel() for p in engine.module.parameters()),
           "param_tensors": len(list(engine.module.parameters())), "rank_fp32_bytes": storage_bytes(engine),
           "actor_fp32_bytes": [actor_storage_bytes(a) for a in getattr(engine.tier, "actors", [])]}
    if save_to:
        engine.save_checkpoint(save_to)
    engine.destroy()
    return out


def actors_options(per_rank: int) -> dict:
    return {"offload_target": "actors", "offload_actors_per_rank": per_rank, "offload_actor_cpus": 0.5}


def _config(stage: int, precision: str, offload: bool, gas: int = 2, micro: int = 2, actors_per_rank: int = 2) -> dict:
    """The parity runs' config (8 samples a step: gas 2 x micro 2 x 2 ranks, or gas 4 x 1 rank)."""
    from tests.dist.workloads import config

    cfg = config(stage, gas, micro, 1.0, raydeep=actors_options(actors_per_rank) if offload else {})
    if offload:
        cfg["zero_optimization"].update(offload_optimizer={"device": "cpu"}, sub_group_size=SUB_GROUP)
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


# bf16 at every stage (the memory test reads them), fp32 at one: the actors run one kernel on
# whatever dtype the masters have, so more fp32 stages would add time, not coverage. The value:
# offload actors per rank.
PARITY = {(1, "bf16"): 1, (2, "fp32"): 1, (2, "bf16"): 2, (3, "bf16"): 1}
CHECKPOINTED = (2, "bf16")  # its runs save the checkpoints the cross-load test loads


def _parity(address: str, pairs: dict, checkpoints: str | None = None) -> dict:
    from tests.dist.workloads import config

    ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    try:
        out = {}
        for (stage, precision), per_rank in pairs.items():
            for name in ("none", "actors"):
                cfg = _config(stage, precision, name == "actors", actors_per_rank=per_rank)
                save = f"{checkpoints}/{name}" if checkpoints and (stage, precision) == CHECKPOINTED else None
                out[(stage, precision, name)] = _train(cfg, save_to=save)
        auto = config(2, 2, 2, 1.0, raydeep={"offload_resource": "no_such_marker"})
        auto["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        out["auto without marked nodes"] = _train(auto)["tier"]
        return out
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return tmp_path_factory.mktemp("offload-checkpoints")


@pytest.fixture(scope="module")
def parity(cluster, checkpoints) -> dict:
    return run_ranks(_parity, 2, cluster[0].address, PARITY, str(checkpoints))[0]


@pytest.mark.parametrize("stage,precision", PARITY)
def test_actor_tier_trains_bitwise_like_no_offload(parity, stage, precision):
    base, run = parity[(stage, precision, "none")], parity[(stage, precision, "actors")]
    assert run["tier"] == "ActorTier" and base["tier"] == "LocalTier"
    assert run["losses"] == base["losses"]
    for key, value in base["params"].items():
        assert (run["params"][key] == value).all(), key


def test_actors_run_on_the_offload_node_and_auto_falls_back_to_the_host(parity, cluster):
    offload_node = cluster[2].node_id
    for (stage, precision, name), run in ((k, v) for k, v in parity.items() if isinstance(k, tuple)):
        if name == "actors":
            assert run["report"]["actors"] == PARITY[(stage, precision)], (stage, precision)
            assert run["report"]["node_ids"] == [offload_node], (stage, precision)
    assert parity["auto without marked nodes"] == "HostTier"
    assert _alive_offload_actors() == []


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_masters_and_optimizer_states_leave_the_rank_for_its_offload_actors(parity, stage):
    """bf16 Adam, measured in the processes' real tensors: the rank keeps no fp32 tensor but one
    placeholder element per option group (the LR schedulers' hyperparameter holder), where
    without offload it held its fp32 masters and both Adam states; the rank's offload actors hold
    ZeRO's 4 + 8 = 12 bytes per element of the rank's shard of psi elements, psi/N padded by less
    than one element per parameter tensor, plus each actor's one fp32 gradient buffer of a
    sub-group at most. ``memory_breakdown()`` says the same: what the actors hold, less the
    buffers, and nothing left on the rank."""
    base, run = parity[(stage, "bf16", "none")], parity[(stage, "bf16", "actors")]
    psi_over_n, tensors = base["numel"] / 2, base["param_tensors"]
    held, buffers = sum(run["actor_fp32_bytes"]), len(run["actor_fp32_bytes"]) * 4 * SUB_GROUP
    print(f"\nstage {stage} bf16: fp32 bytes on the rank {base['rank_fp32_bytes']} -> {run['rank_fp32_bytes']}; "
          f"in its {len(run['actor_fp32_bytes'])} actor(s) {held} (12 psi/N = {12 * psi_over_n:.0f})")
    assert run["rank_fp32_bytes"] <= 4 * tensors  # the placeholders: at most one element per group
    assert base["rank_fp32_bytes"] >= 12 * psi_over_n
    assert 12 * psi_over_n <= held <= 12 * (psi_over_n + tensors) + buffers
    memory = run["memory"]
    assert memory["master"] == memory["optimizer_states"] == 0
    assert held - buffers <= memory["offloaded"] <= held
    assert memory["total"] == base["memory"]["total"] - memory["offloaded"]


def _cross_load(address: str, checkpoints: str) -> dict:
    """World 1 loads each world-2 checkpoint into the other tier and trains one more step."""
    from tests.dist.checkpoint_workloads import full_params
    from tests.dist.workloads import run_steps, tiny_gpt

    import raydeep

    ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    try:
        out = {}
        for saved, loader in (("actors", "none"), ("none", "actors"), ("none", "none")):
            config = _config(*CHECKPOINTED, offload=loader == "actors", gas=4)
            engine, *_ = raydeep.initialize(model=tiny_gpt(), config=config)
            engine.load_checkpoint(f"{checkpoints}/{saved}")
            losses = run_steps(engine, 4, 8, skip=3)
            out[(saved, loader)] = {"losses": losses, "params": full_params(engine), "tier": type(engine.tier).__name__}
            engine.destroy()
        return out
    finally:
        ray.shutdown()


def _engine_beside_its_actors() -> dict:
    """One gloo rank on the offload node (a GPU node marked for offload would be the same): the
    delayed update with its lookahead over an offload actor, through shared memory and through
    the object store; each run's losses, parameters and offload report."""
    import torch.distributed as dist

    import raydeep
    from tests.dist.checkpoint_workloads import full_params
    from tests.dist.harness import free_port
    from tests.dist.workloads import run_steps, tiny_gpt

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        out = {}
        for shared in (True, False):
            cfg = _config(2, "bf16", True, gas=4, actors_per_rank=1)
            cfg["raydeep"].update(offload_shared_memory=shared, delayed_update=True, delayed_update_warmup_steps=1)
            engine, *_ = raydeep.initialize(model=tiny_gpt(), config=cfg)
            losses = run_steps(engine, 4, 8)
            engine.tier.complete()
            out[shared] = {"losses": losses, "params": full_params(engine), "report": engine.tier.report()}
            engine.destroy()
        return out
    finally:
        dist.destroy_process_group()


def test_an_engine_beside_its_offload_actors_trains_through_shared_memory_with_the_same_bits(shared_ray):
    """The engine whose rank runs on an offload node: its actors are placed on its node and share
    memory with it, and the delayed update with the lookahead trains bit for bit as through the
    object store."""
    from tests.ray.conftest import OFFLOAD_MARK

    found = ray.get(ray.remote(_engine_beside_its_actors).options(num_cpus=0.5, resources={OFFLOAD_MARK: 0.001})
                    .remote())
    shared, store = found[True], found[False]
    assert shared["report"]["shared_memory"] == 1 and store["report"]["shared_memory"] == 0
    assert shared["report"]["node_ids"] == store["report"]["node_ids"] == [shared_ray.offload.node_id]
    assert shared["losses"] == store["losses"]
    for name, value in shared["params"].items():
        assert torch.equal(value, store["params"][name]), name


def test_checkpoints_cross_load_between_actors_and_none_at_another_world_size(parity, cluster, checkpoints):
    results = run_ranks(_cross_load, 1, cluster[0].address, str(checkpoints))[0]
    reference = results[("none", "none")]
    assert results[("none", "actors")]["tier"] == "ActorTier" and reference["tier"] == "LocalTier"
    for pair in (("actors", "none"), ("none", "actors")):
        assert results[pair]["losses"] == reference["losses"], pair
        assert all(torch.equal(results[pair]["params"][k], v) for k, v in reference["params"].items()), pair
    assert _alive_offload_actors() == []


# --- through raydeep train ----------------------------------------------------------------------
def _config_file(tmp_path, offload: bool, snapshot_every: int = 0) -> str:
    cfg = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0,
           "bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
           "zero_optimization": {"stage": 2, "sub_group_size": 16384},
           "raydeep": {"offload_actor_cpus": 0.5, "memory_snapshot_every": snapshot_every}}
    if offload:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    path = tmp_path / f"ds_config_{'offload' if offload else 'none'}{'_snapshots' if snapshot_every else ''}.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def _raydeep_train(cluster, storage, name: str, config: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "raydeep", "train", "--address", cluster[0].address, "--config", config,
               "--storage-path", str(storage), "--name", name, "--steps", str(STEPS), "--checkpoint-every",
               str(EVERY), "--num-workers", "2", "--worker-resources", '{"trainer": 1}']
    return subprocess.run(command, capture_output=True, text=True, timeout=600, env={**os.environ, "COLUMNS": "400"})


@pytest.fixture(scope="module")
def storage(tmp_path_factory):
    return tmp_path_factory.mktemp("offload-runs")


@pytest.fixture(scope="module")
def cli_run(cluster, storage, tmp_path_factory) -> dict:
    """``raydeep train`` with the optimizer offloaded to actors: its summary."""
    done = _raydeep_train(cluster, storage, "offload", _config_file(tmp_path_factory.mktemp("configs"), True))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((storage / "offload" / "summary.json").read_text())


def _param_tensors(model: str = "gpt-tiny") -> int:
    from raydeep.models import build_gpt

    return len(list(build_gpt(model).parameters()))


def _eventually(check, timeout_s: float = 30.0) -> bool:
    """``check()`` once it holds, polling: Ray removes a finished run's actors and placement group
    asynchronously. False if it never did within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


# The actors a run starts: its own (offload actors, the snapshot store, the progress monitor) and
# Ray Train's (the controller and the worker group).
# Offload actors: made by the rank, or by a run's snapshot store (raydeep.ray.snapshot_holders).
OFFLOAD_ACTORS = ("OffloadActor", "HoldingOffloadActor")
RUN_ACTORS = (*OFFLOAD_ACTORS, "SnapshotStore", "RunMonitor", "TrainController", "RayTrainWorker")


def _alive_run_actors() -> list:
    from ray.util.state import list_actors

    return [a for a in list_actors(filters=[("state", "=", "ALIVE")], limit=1000) if a.class_name in RUN_ACTORS]


def _objects() -> list:
    """Every object in the cluster, whoever holds a reference to it (the State API's view)."""
    from ray.util.state import list_objects

    return list_objects(limit=10000, raise_on_missing_output=False)


def _nothing_left() -> bool:
    return _alive_run_actors() == [] and _placement_groups() == [] and _objects() == []


def test_raydeep_train_writes_the_offload_section(cli_run, cluster, storage, tmp_path):
    """The summary's ``offload`` section, and the run's weights (its fp32 masters) against the same
    training without offload in two plain gloo processes (a Ray run reproduces those bit for bit:
    tests/ray/test_trainer.py::test_two_ray_workers_equal_two_plain_processes)."""
    from raydeep.ray import TrainSpec
    from raydeep.ray.weights import param_sha256
    from tests.ray.plain import train_plain

    section = cli_run["offload"]
    assert section["tier"] == "actors" and section["actors"] == 2
    assert section["node_ids"] == [cluster[2].node_id]
    # Both ranks' shards in bf16 Adam: 12 bytes per element, each unit padded by less than one
    # element per rank (so by less than one per parameter tensor over the 2 ranks).
    psi = cli_run["num_parameters"]
    assert 12 * psi <= section["bytes_held"] <= 12 * (psi + _param_tensors())
    for rank in section["ranks"]:
        # Per step: an actor's CPU work lies between the rank's first call and its last result,
        # one call after another, and so do the rank's own copies: neither can exceed the step.
        assert 0 < rank["cpu_step_s"] <= rank["step_s"], rank
        assert 0 < rank["transfer_s"] <= rank["step_s"], rank
        assert rank["shared_memory"] == 0  # the actors are on the offload node, the ranks on trainer nodes
    plain = TrainSpec(ds_config=_config_file(tmp_path, False), num_workers=2, steps=STEPS, checkpoint_every=EVERY,
                      storage_path=str(storage), name="plain")
    assert cli_run["param_sha256"] == param_sha256(run_ranks(train_plain, 2, plain, STEPS)[0]["masters"])
    assert _eventually(_nothing_left)


class KillAnOffloadActor:
    """on_progress callback: once the run is past a checkpoint, measure what the run's offload
    actors hold (their real fp32 tensors), then ray.kill one of them."""

    def __init__(self, after_step: int):
        self.after_step, self.killed, self.step, self.held = after_step, None, None, None

    def __call__(self, snapshot: dict) -> None:
        latest = snapshot["latest"]
        if self.killed is None and latest and latest["step"] >= self.after_step:
            found = _alive_offload_actors()
            if found:
                actors = [ray.get_actor(a.name, namespace=a.ray_namespace) for a in found]
                # Its training state only: a checkpoint's copy may be held too while it is written.
                self.held = [actor_storage_bytes(a, attribute="shards") for a in actors]
                self.killed, self.step = found[0].name, latest["step"]
                ray.kill(actors[0], no_restart=True)


def test_a_killed_offload_actor_recovers_with_the_uninterrupted_weights(cli_run, cluster, storage, tmp_path):
    from raydeep.ray import TrainSpec, fit

    spec = TrainSpec(ds_config=_config_file(tmp_path, True), num_workers=2, steps=STEPS, checkpoint_every=EVERY,
                     storage_path=str(storage), name="offload-killed", resources_per_worker={"trainer": 1})
    kill = KillAnOffloadActor(after_step=EVERY + 1)
    summary = fit(spec, on_progress=kill)
    assert kill.killed is not None, "the run ended before an offload actor could be killed"
    assert summary["restarts"] >= 1 and summary["world_sizes"][-1] == 2
    assert summary["param_sha256"] == cli_run["param_sha256"]
    assert summary["samples_sha256"] == cli_run["samples_sha256"]
    # What the actors reported holding (masters and Adam states) is what they held, less at most
    # one fp32 gradient buffer of a sub-group (16384 elements) each.
    held, reported = sum(kill.held), summary["offload"]["bytes_held"]
    assert len(kill.held) == 2 and reported <= held <= reported + len(kill.held) * 4 * 16384, (kill.held, reported)
    assert _eventually(_nothing_left)
    print(f"\nray.kill of offload actor {kill.killed[:8]} after step {kill.step}: restarts {summary['restarts']}, "
          f"resumed from step {summary['recoveries'][0]['resumed_from_step']}, bitwise equal weights")


class RemoveNodeOfRankOne:
    """on_progress callback: remove the node running rank 1 once the run is past ``after_step``."""

    def __init__(self, cluster, nodes, after_step: int):
        self.cluster, self.nodes, self.after_step = cluster, nodes, after_step
        self.removed, self.step, self.attempts = None, None, []

    def __call__(self, snapshot: dict) -> None:
        self.attempts, latest = snapshot["attempts"], snapshot["latest"]
        if self.removed is not None or not latest or latest["step"] < self.after_step:
            return
        workers = self.attempts[0]["workers"]
        if 1 in workers:
            node = next(n for n in self.nodes if n.node_id == workers[1]["node_id"])
            self.removed, self.step = node, latest["step"]
            self.cluster.remove_node(node, allow_graceful=False)


def fit_losing_the_node_of_rank_one(shared_ray, spec, after_step: int):
    """``fit(spec)`` while the node of rank 1 is removed past ``after_step``; a new trainer node
    takes its place afterwards, and Ray Train sees both trainer nodes again before this returns
    (test_trainer.py's elastic run follows). Returns the summary and the :class:`RemoveNodeOfRankOne`."""
    from raydeep.ray import fit
    from tests.ray.test_trainer import _wait_for_free_trainers

    loss = RemoveNodeOfRankOne(shared_ray.cluster, shared_ray.trainers, after_step=after_step)
    try:
        summary = fit(spec, on_progress=loss)
    finally:
        if loss.removed is not None:
            shared_ray.replace_trainer(loss.removed)
            _wait_for_free_trainers(2)
    assert loss.removed is not None, "the run ended before the node could be removed"
    return summary, loss


def test_a_lost_trainer_node_resumes_on_one_worker_from_the_memory_snapshot(cli_run, shared_ray, storage, tmp_path,
                                                                           monkeypatch):
    """The same with a resize: the node of rank 1 is removed (its rank and that rank's offload
    actors die with their owner); the run continues on one worker, from the newest snapshot,
    its masters and Adam states resharded from 2 ranks to 1 out of the driver's memory, with
    the same samples and the uninterrupted run's loss to bf16's precision. A new trainer node then
    takes the lost one's place."""
    from raydeep.ray import TrainSpec
    from tests.ray.test_trainer import check_resumed_from_the_newest_state

    monkeypatch.setenv("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "3")  # read by the controller fit() starts
    spec = TrainSpec(ds_config=_config_file(tmp_path, True, snapshot_every=1), num_workers=(1, 2), steps=STEPS,
                     checkpoint_every=EVERY, storage_path=str(storage), name="offload-snapshot-resized",
                     resources_per_worker={"trainer": 1})
    summary, loss = fit_losing_the_node_of_rank_one(shared_ray, spec, after_step=EVERY + 1)
    assert summary["world_sizes"][0] == 2 and summary["world_sizes"][-1] == 1
    last = summary["attempts"][-1]
    assert (last["micro_batch"], last["grad_accum"]) == (4, 4)  # the same 16 samples a step
    on_one = next(a for a in loss.attempts if a["world_size"] == 1)
    print(f"\nnode of rank 1 removed at step {loss.step} (offload actors): continued on 1 worker from step "
          f"{on_one['resumed_from_step']} ({on_one['restored_from']})")
    check_resumed_from_the_newest_state(on_one, EVERY)
    assert on_one["resumed_from_step"] >= loss.step - 1
    assert summary["samples_sha256"] == cli_run["samples_sha256"]
    # One worker accumulates the step's 4 micro-batches where two ranks summed 2 each: the bf16
    # gradients round differently, so the weights agree to bf16's precision, not bit for bit
    # (2**-8 relative per rounding: the loss after a few steps moves by less than half of that).
    gap = abs(summary["final_loss"] - cli_run["final_loss"])
    print(f"final loss {summary['final_loss']:.6f} vs {cli_run['final_loss']:.6f} uninterrupted: gap {gap:.2e}")
    assert gap <= 2e-3 * abs(cli_run["final_loss"])
    assert _eventually(_nothing_left)


def test_a_failed_run_fails_once_with_one_message_and_leaves_nothing_behind(cli_run, cluster, storage):
    """A run that fails, here at once (it resumes a run whose every checkpoint is damaged: a
    deterministic error), fails at its first attempt (no Ray Train retries) with one message that
    names each damaged checkpoint and does not advise running it again, and leaves no actor,
    placement group or object, even while its caller still holds the error, as a notebook or a
    Tune trial does. (The CLI turns such an error into exit 2 and that message:
    tests/ray/test_cli_train.py, tests/unit/test_checkpoint_fallback.py.)"""
    from raydeep.errors import CorruptCheckpointError
    from raydeep.ray import TrainSpec, fit
    from tests.ray.test_trainer import _flip_a_byte, _train_workers_ever_started

    damaged = storage / "offload-damaged"
    shutil.copytree(storage / "offload", damaged)
    tags = sorted((damaged / "checkpoints").glob("global_step*"))
    for tag in tags:
        _flip_a_byte(sorted(tag.glob("rank*.safetensors"))[0])
    spec = TrainSpec(ds_config=_config_file(storage, True), num_workers=2, steps=STEPS + EVERY,
                     checkpoint_every=EVERY, storage_path=str(storage), name=damaged.name,
                     resources_per_worker={"trainer": 1})
    workers_before = _train_workers_ever_started()
    with pytest.raises(CorruptCheckpointError) as failure:
        fit(spec)
    message = str(failure.value)
    print(f"\n{message}")
    assert "no intact checkpoint" in message and all(tag.name in message for tag in tags), message
    assert "re-run with" not in message
    assert _train_workers_ever_started() - workers_before == 2  # one worker group: Ray Train did not retry
    assert _eventually(_nothing_left), (_alive_run_actors(), _placement_groups(), _objects())
