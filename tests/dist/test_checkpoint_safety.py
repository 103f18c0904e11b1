"""A crash at any point of a save leaves the previous checkpoint loadable; corruption is named;
loading never unpickles."""
from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
import torch

from raydeep.checkpoint import CheckpointReader
from raydeep.checkpoint import format as fmt
from tests.dist import checkpoint_crash
from tests.dist.harness import run_ranks

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _distinct_ports(n: int) -> list[int]:
    """``n`` free ports, all different (each held until all are picked)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def _crash(directory, point, port: int) -> subprocess.Popen:
    env = {**os.environ, "CRASH_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1"}
    return subprocess.Popen([sys.executable, "-m", "tests.dist.checkpoint_crash", str(directory), point], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


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
    # The crashing processes are independent (a directory each): started together, so their
    # imports share both cores instead of taking turns.
    directories = [tmp_path / point for point in checkpoint_crash.POINTS]
    ports = _distinct_ports(len(directories))
    crashes = [_crash(*args) for args in zip(directories, checkpoint_crash.POINTS, ports)]
    for point, directory, proc in zip(checkpoint_crash.POINTS, directories, crashes):
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == checkpoint_crash.KILLED, (point, err[-3000:])
        if point in ("first-file", "before-manifest"):
            assert not (directory / "doomed").exists()  # never visible under its own name
    directories = [str(d) for d in directories]
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
    saved = torch.load, pickle.load
    torch.load = refuse
    pickle.load = refuse
    try:
        engine = build(3)
        engine.load_checkpoint(directory)
    finally:
        torch.load, pickle.load = saved  # the pooled rank (tests.dist.harness) runs other workloads
    return engine.global_steps
