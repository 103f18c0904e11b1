"""A damaged newest checkpoint: resumes fall back to the newest intact one, loads never read
outside the checkpoint directory, and Ray Train does not retry what cannot get better."""
from __future__ import annotations

import json

import pytest
import torch
from ray.train import WorkerGroupError
from ray.train.v2._internal.execution.failure_handling import FailureDecision

import raydeep
from raydeep.checkpoint import CheckpointReader, Storage, write_single
from raydeep.errors import CheckpointError, ConfigError, CorruptCheckpointError
from raydeep.ray.failures import RaydeepFailurePolicy, deterministic_error
from raydeep.ray.worker import resume_candidates

CONFIG = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}


def _engine(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    engine, *_ = raydeep.initialize(model=model, config=CONFIG)
    return engine


def _train_step(engine) -> None:
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(engine.global_steps))
    engine.backward(engine(x).pow(2).mean())
    engine.step()


def _params(engine) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def _flip_a_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # inside the tensor data: the safetensors header still parses
    path.write_bytes(bytes(data))


@pytest.fixture()
def two_checkpoints(tmp_path):
    """global_step1 and global_step2 of one run, with the parameters each one holds."""
    engine, saved = _engine(), {}
    for step in (1, 2):
        _train_step(engine)
        engine.save_checkpoint(str(tmp_path), tag=f"global_step{step}", client_state={"step": step})
        saved[step] = _params(engine)
    return tmp_path, saved


def _rank_file(directory, tag: str):
    return next((directory / tag).glob("rank*.safetensors"))


def test_a_corrupt_newest_checkpoint_falls_back_to_the_newest_intact_one(two_checkpoints):
    directory, saved = two_checkpoints
    _flip_a_byte(_rank_file(directory, "global_step2"))
    tags, damaged = resume_candidates(Storage.open(str(directory)), "global_step2")
    assert tags == ["global_step2", "global_step1"] and damaged == []

    engine = _engine(seed=1)
    tag, client, skipped = engine.checkpointer.load_first_intact(str(directory), tags, damaged)
    assert tag == "global_step1" and client["step"] == 1 and engine.global_steps == 1
    assert [t for t, _ in skipped] == ["global_step2"]
    assert "rank" in skipped[0][1] and "sha256 expected" in skipped[0][1]  # names the file and both digests
    for name, value in _params(engine).items():  # nothing of the damaged checkpoint survives
        assert torch.equal(value, saved[1][name]), name


def test_no_intact_checkpoint_is_one_error_that_does_not_advise_a_rerun(two_checkpoints):
    directory, _ = two_checkpoints
    for tag in ("global_step1", "global_step2"):
        _flip_a_byte(_rank_file(directory, tag))
    tags, damaged = resume_candidates(Storage.open(str(directory)), None)
    with pytest.raises(CorruptCheckpointError) as info:
        _engine().checkpointer.load_first_intact(str(directory), tags, damaged)
    text = str(info.value)
    assert "no intact checkpoint" in text and "global_step1" in text and "global_step2" in text
    assert "new run name" in text and "resume from the last" not in text


def test_an_unreadable_manifest_named_by_latest_is_reported_not_skipped_silently(two_checkpoints):
    directory, _ = two_checkpoints
    (directory / "global_step2" / "manifest.json").write_text("{not json")
    tags, damaged = resume_candidates(Storage.open(str(directory)), None)
    assert tags == ["global_step1"]
    assert damaged[0][0] == "global_step2" and "not valid JSON" in damaged[0][1]


def test_a_checkpoint_of_another_model_is_not_passed_over(two_checkpoints):
    directory, _ = two_checkpoints
    torch.manual_seed(0)
    other, *_ = raydeep.initialize(model=torch.nn.Linear(4, 1), config=CONFIG)
    with pytest.raises(CheckpointError, match="does not fit this model") as info:
        other.checkpointer.load_first_intact(str(directory), ["global_step2", "global_step1"])
    assert not isinstance(info.value, CorruptCheckpointError)


@pytest.mark.parametrize("latest", ["../outside", "/etc", "..", "a\\b", ""])
def test_latest_cannot_point_outside_the_checkpoint_directory(tmp_path, latest):
    write_single(str(tmp_path / "run"), "global_step1", {"w": torch.ones(2)})
    (tmp_path / "run" / "latest").write_text(latest)
    with pytest.raises(CorruptCheckpointError, match="not a plain name"):
        CheckpointReader.open(str(tmp_path / "run"))
    tags, damaged = resume_candidates(Storage.open(str(tmp_path / "run")), None)
    assert tags == ["global_step1"] and damaged[0][0] == "latest"


def test_manifest_file_names_cannot_leave_the_tag_directory(tmp_path):
    write_single(str(tmp_path), "global_step1", {"w": torch.ones(2)})
    manifest_path = tmp_path / "global_step1" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    name = next(iter(manifest["files"]))
    manifest["files"]["../../secret.safetensors"] = manifest["files"].pop(name)
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(CorruptCheckpointError, match="file name '../../secret.safetensors' is not a plain name"):
        CheckpointReader.open(str(tmp_path))


@pytest.mark.parametrize("tag", ["../x", "a/b", ".hidden"])
def test_a_tag_passed_by_the_caller_is_checked_too(tmp_path, tag):
    write_single(str(tmp_path), "global_step1", {"w": torch.ones(2)})
    with pytest.raises(CheckpointError, match="plain name") as info:
        CheckpointReader.open(str(tmp_path), tag)
    assert not isinstance(info.value, CorruptCheckpointError)  # the caller's mistake, not damage
    with pytest.raises(ValueError, match="checkpoint tag"):
        _engine().save_checkpoint(str(tmp_path), tag=tag)


def test_raydeep_errors_are_not_retried_and_other_worker_errors_are():
    policy = RaydeepFailurePolicy(__import__("ray.train", fromlist=["FailureConfig"]).FailureConfig(max_failures=3))
    corrupt = WorkerGroupError("rank 1 failed", {0: RuntimeError("collective aborted"),
                                                 1: CorruptCheckpointError("no intact checkpoint")})
    assert deterministic_error(corrupt) is corrupt.worker_failures[1]
    assert policy.make_decision(corrupt) == FailureDecision.RAISE
    bad_config = WorkerGroupError("rank 0 failed", {0: ConfigError("optimizer.type", "unknown", value="Adamm")})
    assert policy.make_decision(bad_config) == FailureDecision.RAISE
    lost = WorkerGroupError("rank 0 died", {0: RuntimeError("actor died")})
    assert deterministic_error(lost) is None
    assert [policy.make_decision(lost) for _ in range(4)] == [FailureDecision.RETRY] * 3 + [FailureDecision.RAISE]


def test_a_save_that_lost_an_offload_actor_is_retried():
    """What every rank raises when one lost an offload actor during a save (the checkpointer's
    agreement, tests/dist/test_checkpoint_async.py) is a loss, which Ray Train retries."""
    from raydeep.errors import LostResource
    from raydeep.tier.actors import OffloadActorLost

    policy = RaydeepFailurePolicy(__import__("ray.train", fromlist=["FailureConfig"]).FailureConfig(max_failures=1))
    lost = WorkerGroupError("rank 1 failed", {0: LostResource("checkpoint write failed: rank 1: an offload actor ..."),
                                              1: OffloadActorLost("an offload actor of this rank ... was lost")})
    assert deterministic_error(lost) is None
    assert [policy.make_decision(lost) for _ in range(2)] == [FailureDecision.RETRY, FailureDecision.RAISE]
