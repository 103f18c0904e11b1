"""A crash at any point of a save leaves the previous checkpoint loadable; corruption is named;
loading never unpickles."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from raydeep.checkpoint import CheckpointReader
from raydeep.checkpoint import format as fmt
from tests.dist import checkpoint_crash
from tests.dist.harness import free_port, run_ranks

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _crash(directory, point):
    env = {**os.environ, "CRASH_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "1"}
    return subprocess.run([sys.executable, "-m", "tests.dist.checkpoint_crash", str(directory), point], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)


def load_params(directories: list[str], stage: int) -> list[dict]:
    """On this rank: for each directory, a fresh engine loads ``latest``; returns what it got."""
    from tests.dist.checkpoint_workloads import build, full_params

    out = []
    for directory in directories:
        engine = build(stage)
        path, _ = engine.load_checkpoint(directory)
        out.append({"path": path, "steps": engine.global_steps, "params": full_params(engine)})
    return out


def test_killed_save_leaves_previous_checkpoint(tmp_path):
    directories = []
    for point in checkpoint_crash.POINTS:
        directory = tmp_path / point
        done = _crash(directory, point)
        assert done.returncode == checkpoint_crash.KILLED, (point, done.stderr[-3000:])
        if point in ("first-file", "before-manifest"):
            assert not (directory / "doomed").exists()  # never visible under its own name
        directories.append(str(directory))
    loaded = run_ranks(load_params, 2, directories, 2)[0]
    for point, directory, got in zip(checkpoint_crash.POINTS, directories, loaded):
        reader = CheckpointReader.open(directory)
        assert reader.tag == "good", point  # ``latest`` never moved to the half-written tag
        reader.verify_all()
        assert got["path"].endswith("good") and got["steps"] == 2, point
        for name in reader.params:
            assert torch.equal(got["params"][name], reader.full("fp32", name)), (point, name)


def corrupt_load(directory: str) -> str:
    from tests.dist.checkpoint_workloads import build

    engine = build(1)
    try:
        engine.load_checkpoint(directory)
    except Exception as err:  # every rank must fail, none may hang
        return f"{type(err).__name__}: {err}"
    return "loaded"


def save_two_ranks(directory: str) -> None:
    from tests.dist.checkpoint_workloads import GLOBAL_BATCH, build
    from tests.dist.workloads import run_steps

    engine = build(2)
    run_steps(engine, 1, GLOBAL_BATCH)
    engine.save_checkpoint(directory)


@pytest.fixture
def saved_two_ranks(tmp_path):
    run_ranks(save_two_ranks, 2, str(tmp_path))
    return tmp_path


def test_loads_without_unpickling_and_names_a_bit_flip(saved_two_ranks):
    tmp_path = saved_two_ranks
    # fresh ranks: the workload disables torch.load and pickle.load for the rest of its processes
    assert run_ranks(load_without_unpickling, 2, str(tmp_path), fresh=True) == [1, 1]
    shard = tmp_path / "global_step1" / fmt.rank_file(1, 2)
    data = bytearray(shard.read_bytes())
    expected = fmt.sha256(bytes(data))
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    messages = run_ranks(corrupt_load, 2, str(tmp_path))
    for message in messages:
        assert fmt.rank_file(1, 2) in message and expected in message and fmt.sha256(bytes(data)) in message, message


def load_without_unpickling(directory: str) -> int:
    import pickle

    from tests.dist.checkpoint_workloads import build

    def refuse(*args, **kwargs):
        raise AssertionError("checkpoint loading must not unpickle")
    torch.load = refuse
    pickle.load = refuse
    engine = build(3)
    engine.load_checkpoint(directory)
    return engine.global_steps
