"""``raydeep train`` / ``raydeep data build`` argument handling, and the ``ray job submit`` files:
user mistakes fail before any Ray process starts (no cluster needed here)."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import ray
import yaml

from raydeep.cli import build_parser, main, train_spec
from raydeep.data import ParquetTokenDataset
from raydeep.ray.trainer import plan_run

REPO = Path(__file__).resolve().parents[2]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("argv, needles", [
    (["--num-workers", "1:3"], ["world size 3", "valid world sizes: [1, 2, 4, 8, 16]"]),
    (["--num-workers", "two"], ["num_workers", "MIN:MAX"]),
    (["--num-workers", "3:2"], ["num_workers"]),
    (["--set", "gradient_clip=1.0"], ["gradient_clip", "did you mean"]),
    (["--model", "gpt-huge"], ["gpt-huge", "gpt-tiny"]),
    (["--model", "no_such_module:make"], ["no_such_module"]),
    (["--data", "missing.parquet"], ["missing.parquet", "raydeep data build"]),
    (["--name", "a/b"], ["name"]),
])
def test_user_mistakes_exit_2_before_ray_starts(tmp_path, capsys, argv, needles):
    code, _, err = run(capsys, "train", "--storage-path", str(tmp_path), *argv)
    assert code == 2, err
    assert err.startswith("error:") and "Traceback" not in err
    for needle in needles:
        assert needle in err, (needle, err)
    assert not ray.is_initialized()


def test_train_arguments_reach_the_spec():
    args = build_parser().parse_args(["train", "--num-workers", "1:4", "--steps", "7", "--use-gpu", "--set", "a=1",
                                      "--name", "r", "--checkpoint-every", "3", "--data", "synthetic"])
    assert (args.num_workers, args.steps, args.use_gpu, args.set, args.name, args.checkpoint_every, args.data) == \
        ("1:4", 7, True, ["a=1"], "r", 3, "synthetic")


def test_data_build_writes_a_parquet_dataset(tmp_path, capsys):
    text = tmp_path / "notes.txt"
    text.write_text("raydeep " * 40)
    out = tmp_path / "notes.parquet"
    code, stdout, err = run(capsys, "data", "build", str(out), str(text), "--block-size", "15")
    assert code == 0, err
    assert f"{(8 * 40 + 1) // 16} samples" in stdout
    assert ParquetTokenDataset(str(out)).block_size == 15


def test_runtime_env_is_valid_for_ray():
    from ray.runtime_env import RuntimeEnv

    env = yaml.safe_load((REPO / "jobs" / "runtime_env.yaml").read_text())
    RuntimeEnv(**env)  # raises on unknown keys or bad values
    assert env["working_dir"] == "." and "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S" in env["env_vars"]


def test_documented_job_entrypoint_parses():
    readme = (REPO / "jobs" / "README.md").read_text()
    block = re.search(r"ray job submit ((?:.*\\\n)*.*)", readme).group(1).replace("\\\n", " ")
    entrypoint = shlex.split(block.split(" -- ", 1)[1])
    assert entrypoint[:3] == ["python", "-m", "raydeep"]
    args = build_parser().parse_args([a.replace('"$RUN"', "run").replace("$RUN", "run") for a in entrypoint[3:]])
    assert args.command == "train" and args.num_workers == "2:4" and args.use_gpu
    # The batch plan serves every world size of the documented elastic range.
    _, schedule = plan_run(train_spec(args))
    assert [schedule.for_world_size(w).train_batch_size for w in (2, 3, 4)] == [96] * 3
