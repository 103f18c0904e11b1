"""Hugging Face training trains on raydeep through ``raydeep.compat`` (``import deepspeed``
served by raydeep) and its per-step losses equal the same run on DeepSpeed 0.19.8 to 1e-5; a run
saved at step 10 and resumed from there ends exactly where the straight run ends. Two paths:
``Trainer`` with ``TrainingArguments(deepspeed=ds_config)``, and Accelerate's
``DeepSpeedPlugin`` with ``DummyOptim``/``DummyScheduler`` and ``save_state``/``load_state``.

Each backend's runs are one torchrun launch of ``trainer_script.py`` on 2 gloo ranks (ZeRO-2,
gradient accumulation 2; see ``launch.ARGS``).

How raydeep runs where DeepSpeed is installed (CI's environment has the ``peers`` extra):
``raydeep.compat.install()`` refuses to pose as an installed DeepSpeed, so the raydeep launch
passes ``--hide-installed-deepspeed``, which puts a blocker for the top-level ``deepspeed`` first
on ``sys.meta_path``. install() then finds no DeepSpeed and goes ahead of the blocker; nothing
can reach the real package, and the script reports the file of every ``deepspeed`` module the
run loaded, which the test requires to be raydeep's.

DeepSpeed's side is run live (``peers``) and also read from ``deepspeed_losses.json``, recorded
by ``python -m tests.hf.launch`` under the versions it lists (compared only under the same ones),
so an environment without DeepSpeed still checks raydeep against DeepSpeed's numbers.
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from tests.hf.launch import ARGS, PATHS, RECORD, launch, versions  # noqa: E402

pytestmark = pytest.mark.slow
COMPAT = Path(__file__).resolve().parents[2] / "raydeep" / "compat" / "deepspeed"
SAVE_AT = int(ARGS[ARGS.index("--save-at") + 1])
STEPS = int(ARGS[ARGS.index("--steps") + 1])
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def raydeep_run(tmp_path_factory) -> dict:
    hide = ["--hide-installed-deepspeed"] if importlib.util.find_spec("deepspeed") is not None else []
    return launch("raydeep", tmp_path_factory.mktemp("raydeep"), *hide)


def _losses(records: list[dict]) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records}


def _assert_close(ours: list[dict], theirs: list[dict]) -> None:
    a, b = _losses(ours), _losses(theirs)
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1)), (sorted(a), sorted(b))
    worst = max(abs(a[step] - b[step]) for step in a)
    assert worst <= TOLERANCE, "\n".join(f"step {s}: raydeep {a[s]:.8f} deepspeed {b[s]:.8f}" for s in sorted(a))
    lrs = [{r["step"]: r["lr"] for r in records if "lr" in r} for records in (ours, theirs)]  # the Trainer's
    assert lrs[0] == pytest.approx(lrs[1], rel=1e-6, abs=1e-12)


def test_raydeep_served_every_deepspeed_module(raydeep_run):
    assert raydeep_run["deepspeed_modules"], "nothing imported deepspeed"
    foreign = [f for f in raydeep_run["deepspeed_modules"] if not Path(f).resolve().is_relative_to(COMPAT)]
    assert not foreign, f"deepspeed modules not served by raydeep.compat: {foreign}"


@pytest.mark.parametrize("path", PATHS)
def test_resume_ends_where_the_straight_run_ends(raydeep_run, path):
    """Exactly: the same ranks, micro-batches and arithmetic after a load that restored the
    masters, Adam's moments and step, the scheduler and the counters."""
    straight, resumed = _losses(raydeep_run[path]["straight"]), _losses(raydeep_run[path]["resumed"])
    assert sorted(resumed) == list(range(SAVE_AT + 1, STEPS + 1))
    assert resumed == {step: straight[step] for step in resumed}


@pytest.mark.parametrize("path", PATHS)
def test_losses_match_recorded_deepspeed(raydeep_run, path):
    record = json.loads(RECORD.read_text())
    if record["args"] != list(ARGS) or any(record["versions"][k] != v for k, v in versions().items()):
        pytest.skip(f"deepspeed_losses.json was recorded under {record['versions']} (here {versions()}); "
                    "re-record with `python -m tests.hf.launch` where DeepSpeed is installed")
    _assert_close(raydeep_run[path]["straight"], record[f"{path}.straight"])


@pytest.mark.peers
def test_losses_match_deepspeed(raydeep_run, tmp_path):
    pytest.importorskip("deepspeed")
    deepspeed_run = launch("deepspeed", tmp_path)
    for path in PATHS:
        _assert_close(raydeep_run[path]["straight"], deepspeed_run[path]["straight"])
        straight, resumed = _losses(deepspeed_run[path]["straight"]), _losses(deepspeed_run[path]["resumed"])
        assert resumed == {s: straight[s] for s in resumed}, f"DeepSpeed's own {path} resume drifted"


def _run_on_ranks(nproc: int, *argv: str) -> list:
    import os
    import subprocess
    import sys

    from tests.dist.harness import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
           str(free_port()), str(Path(__file__).with_name("resume_world_script.py")), *argv]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=Path(__file__).parent)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return json.loads(next(line for line in done.stdout.splitlines() if line.startswith("LOSSES "))[7:])


def test_a_trainer_checkpoint_resumes_on_another_number_of_ranks(tmp_path):
    # DeepSpeed 0.19.8 refuses this resume ("used a DP world size of 2 but the current world size
    # is 1", DeepSpeed #5405). Every step sees all 16 samples on any number of ranks, so the resumed
    # losses are the straight run's up to the order of the gradient sum (2 ranks' halves, or one
    # rank's whole): float32 rounding, a few ulps of a loss near 5 (ulp 4.8e-7) over 4 Adam steps.
    straight = _run_on_ranks(2, str(tmp_path / "two"))
    resumed = _run_on_ranks(1, str(tmp_path / "one"), str(tmp_path / "two" / "checkpoint-4"))
    assert [step for step, _ in straight] == list(range(1, 9)) and [step for step, _ in resumed] == [5, 6, 7, 8]
    assert straight[-1][1] < straight[4][1] < straight[0][1]  # it trains
    for (_, mine), (_, theirs) in zip(resumed, straight[4:]):
        assert abs(mine - theirs) <= 8 * 4.8e-7, (resumed, straight[4:])
