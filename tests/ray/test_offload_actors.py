"""The actor tier on a simulated cluster (``ray.cluster_utils.Cluster``): a head for the drivers,
two 1-CPU trainer nodes (resource ``trainer``) and one CPU offload node that carries
``raydeep_offload`` and the label ``raydeep/role=offload``.

- Parity: 2 gloo ranks that join the cluster train stages 1-3 in bf16 (and stage 2 in fp32) with their fp32
  masters and Adam states in offload actors, 2 actors per rank and sub-groups of 4096 elements
  (so every step pipelines several pieces through the object store), and must equal the same
  training without offload bit for bit: the actors run the same fused CPU kernel on the same
  values (``tests/dist/test_offload.py`` says why tiling keeps the bits).
- Placement: the actors run on the offload node, by node id; with no marked node, ``auto`` takes
  the host tier.
- Memory: the rank's own ``memory_breakdown()`` drops by the masters and the optimizer states.
- Through ``raydeep train``: the ``offload`` section of summary.json, the same weights as a run
  without offload, and recovery from ``ray.kill`` of an offload actor with the uninterrupted run's
  weights. After each run, no offload actor is alive and no placement group exists (State API).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import ray
import torch

from tests.dist.harness import run_ranks

pytestmark = pytest.mark.slow
MARK, LABEL = "raydeep_offload", {"raydeep/role": "offload"}
STEPS, EVERY = 8, 2


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    trainers = [cluster.add_node(num_cpus=1, resources={"trainer": 1}) for _ in range(2)]
    offload = cluster.add_node(num_cpus=4, resources={MARK: 1}, labels=LABEL)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    try:
        yield cluster, trainers, offload
    finally:
        ray.shutdown()
        cluster.shutdown()


def _alive_offload_actors() -> list:
    from ray.util.state import list_actors

    return [a for a in list_actors(filters=[("class_name", "=", "OffloadActor")], limit=1000) if a.state == "ALIVE"]


def _placement_groups() -> list:
    from ray.util.state import list_placement_groups

    return [pg for pg in list_placement_groups(limit=1000) if pg.state != "REMOVED"]


def _train(cfg: dict, save_to: str | None = None) -> dict:
    import raydeep
    from tests.dist.checkpoint_workloads import full_params
    from tests.dist.workloads import run_steps, tiny_gpt

    engine, *_ = raydeep.initialize(model=tiny_gpt(), config=cfg)
    losses = run_steps(engine, 3, 8)
    out = {"losses": losses, "params": full_params(engine), "memory": engine.memory_breakdown(),
           "tier": type(engine.tier).__name__, "report": engine.tier.report(),
           "numel": sum(p.numel() for p in engine.module.parameters())}
    if save_to:
        engine.save_checkpoint(save_to)
    engine.destroy()
    return out


ACTORS = {"offload_target": "actors", "offload_actors_per_rank": 2, "offload_actor_cpus": 0.5}


def _stage2_config(offload: bool, gas: int) -> dict:
    from tests.dist.workloads import config

    cfg = config(2, gas, 4, 1.0, raydeep=ACTORS, bf16={"enabled": True})  # 8 samples a step: gas 1 x 2 ranks, gas 2 x 1
    if offload:
        cfg["zero_optimization"].update(offload_optimizer={"device": "cpu"}, sub_group_size=4096)
    return cfg


# bf16 at every stage (the memory test reads them), fp32 at one: the actors run one kernel on
# whatever dtype the masters have, so more fp32 stages would add time, not coverage.
PARITY = [(1, "bf16"), (2, "fp32"), (2, "bf16"), (3, "bf16")]


def _parity(address: str, pairs: list[tuple[int, str]], checkpoints: str | None = None) -> dict:
    from tests.dist.workloads import config

    ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    try:
        out = {}
        for stage, precision in pairs:
            for name, options in (("none", {}), ("actors", ACTORS)):
                cfg = config(stage, 2, 2, 1.0, raydeep=options)
                if name == "actors":
                    cfg["zero_optimization"].update(offload_optimizer={"device": "cpu"}, sub_group_size=4096)
                if precision == "bf16":
                    cfg["bf16"] = {"enabled": True}
                out[(stage, precision, name)] = _train(cfg)
        auto = config(2, 2, 2, 1.0, raydeep={"offload_resource": "no_such_marker"})
        auto["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        out["auto without marked nodes"] = _train(auto)["tier"]
        if checkpoints:  # world 2 saves with and without offload actors, for the cross-load test
            for name, offload in (("actors", True), ("none", False)):
                _train(_stage2_config(offload, gas=1), save_to=f"{checkpoints}/{name}")
        return out
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return tmp_path_factory.mktemp("offload-checkpoints")


@pytest.fixture(scope="module")
def parity(cluster, checkpoints) -> dict:
    return run_ranks(_parity, 2, cluster[0].address, PARITY, str(checkpoints), fresh=True)[0]


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
            assert run["report"]["actors"] == 2 and run["report"]["node_ids"] == [offload_node], (stage, precision)
    assert parity["auto without marked nodes"] == "HostTier"
    assert _alive_offload_actors() == []


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_rank_memory_drops_by_the_masters_and_optimizer_states(parity, stage):
    """Mixed precision Adam: 4 (fp32 master) + 8 (two states) bytes per element of the rank's
    shard leave the rank, i.e. at least 12 psi / N."""
    base, run = parity[(stage, "bf16", "none")]["memory"], parity[(stage, "bf16", "actors")]["memory"]
    psi_over_n = parity[(stage, "bf16", "none")]["numel"] / 2
    moved = base["master"] + base["optimizer_states"]
    assert moved >= 12 * psi_over_n
    assert run["master"] == run["optimizer_states"] == 0
    assert run["total"] == base["total"] - moved and run["offloaded"] == moved
    print(f"\nstage {stage} bf16: rank memory {base['total']} -> {run['total']} bytes "
          f"(12 psi/N = {12 * psi_over_n:.0f}; offloaded {run['offloaded']})")


def _cross_load(address: str, checkpoints: str) -> dict:
    """World 1 loads each world-2 checkpoint into the other tier and trains one more step."""
    from tests.dist.checkpoint_workloads import full_params
    from tests.dist.workloads import run_steps, tiny_gpt

    import raydeep

    ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    try:
        out = {}
        for saved, loader in (("actors", "none"), ("none", "actors"), ("none", "none")):
            engine, *_ = raydeep.initialize(model=tiny_gpt(), config=_stage2_config(loader == "actors", gas=2))
            engine.load_checkpoint(f"{checkpoints}/{saved}")
            losses = run_steps(engine, 4, 8, skip=3)
            out[(saved, loader)] = {"losses": losses, "params": full_params(engine), "tier": type(engine.tier).__name__}
            engine.destroy()
        return out
    finally:
        ray.shutdown()


def test_checkpoints_cross_load_between_actors_and_none_at_another_world_size(parity, cluster, checkpoints):
    results = run_ranks(_cross_load, 1, cluster[0].address, str(checkpoints), fresh=True)[0]
    reference = results[("none", "none")]
    assert results[("none", "actors")]["tier"] == "ActorTier" and reference["tier"] == "LocalTier"
    for pair in (("actors", "none"), ("none", "actors")):
        assert results[pair]["losses"] == reference["losses"], pair
        assert all(torch.equal(results[pair]["params"][k], v) for k, v in reference["params"].items()), pair
    assert _alive_offload_actors() == []


# --- through raydeep train ----------------------------------------------------------------------
def _config_file(tmp_path, offload: bool) -> str:
    cfg = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0,
           "bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
           "zero_optimization": {"stage": 2, "sub_group_size": 16384},
           "raydeep": {"offload_actor_cpus": 0.5}}
    if offload:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    path = tmp_path / f"ds_config_{'offload' if offload else 'none'}.json"
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
def cli_runs(cluster, storage, tmp_path_factory):
    configs = tmp_path_factory.mktemp("configs")
    out = {}
    for name, offload in (("offload", True), ("none", False)):
        done = _raydeep_train(cluster, storage, name, _config_file(configs, offload))
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        out[name] = json.loads((storage / name / "summary.json").read_text())
    return out


def test_raydeep_train_writes_the_offload_section(cli_runs, cluster):
    section = cli_runs["offload"]["offload"]
    assert section["tier"] == "actors" and section["actors"] == 2
    assert section["node_ids"] == [cluster[2].node_id]
    assert section["bytes_held"] >= 12 * cli_runs["offload"]["num_parameters"]  # both ranks' shards, bf16 Adam
    for rank in section["ranks"]:
        assert rank["step_s"] > 0 and rank["cpu_step_s"] > 0 and rank["transfer_s"] > 0
    assert cli_runs["none"]["offload"] is None
    assert cli_runs["offload"]["param_sha256"] == cli_runs["none"]["param_sha256"]
    assert _alive_offload_actors() == [] and _placement_groups() == []


class KillAnOffloadActor:
    """on_progress callback: ray.kill one offload actor once the run is past a checkpoint."""

    def __init__(self, after_step: int):
        self.after_step, self.killed, self.step = after_step, None, None

    def __call__(self, snapshot: dict) -> None:
        latest = snapshot["latest"]
        if self.killed is None and latest and latest["step"] >= self.after_step:
            actors = _alive_offload_actors()
            if actors:
                self.killed, self.step = actors[0].name, latest["step"]
                ray.kill(ray.get_actor(actors[0].name, namespace=actors[0].ray_namespace), no_restart=True)


def test_a_killed_offload_actor_recovers_with_the_uninterrupted_weights(cli_runs, cluster, storage, tmp_path):
    from raydeep.ray import TrainSpec, fit

    spec = TrainSpec(ds_config=_config_file(tmp_path, True), num_workers=2, steps=STEPS, checkpoint_every=EVERY,
                     storage_path=str(storage), name="killed", resources_per_worker={"trainer": 1})
    kill = KillAnOffloadActor(after_step=EVERY + 1)
    summary = fit(spec, on_progress=kill)
    assert kill.killed is not None, "the run ended before an offload actor could be killed"
    assert summary["restarts"] >= 1 and summary["world_sizes"][-1] == 2
    assert summary["param_sha256"] == cli_runs["offload"]["param_sha256"]
    assert summary["samples_sha256"] == cli_runs["offload"]["samples_sha256"]
    time.sleep(1)
    assert _alive_offload_actors() == [] and _placement_groups() == []
    print(f"\nray.kill of offload actor {kill.killed[:8]} after step {kill.step}: restarts {summary['restarts']}, "
          f"resumed from step {summary['recoveries'][0]['resumed_from_step']}, bitwise equal weights")
