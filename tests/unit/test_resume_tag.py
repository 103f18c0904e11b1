"""Which checkpoint a new Ray Train attempt resumes from: the newer of Ray Train's and ``latest``."""
from __future__ import annotations

import pytest
import torch

from raydeep.checkpoint import Storage, write_single
from raydeep.errors import CheckpointError
from raydeep.ray.worker import newest_tag


def _save(directory, step: int, latest: bool = True) -> None:
    write_single(str(directory), f"global_step{step}", {"w": torch.ones(2)}, counters={"global_steps": step},
                 save_latest=latest)


def test_latest_wins_when_the_report_did_not_reach_ray_train(tmp_path):
    _save(tmp_path, 4)
    _save(tmp_path, 6)  # committed, `latest` moved, but the worker died before Ray Train took the report
    assert newest_tag(Storage.open(str(tmp_path)), "global_step4") == "global_step6"


def test_ray_trains_checkpoint_wins_when_it_is_newer(tmp_path):
    _save(tmp_path, 10)
    _save(tmp_path, 8, latest=False)
    storage = Storage.open(str(tmp_path))
    (tmp_path / "latest").write_text("global_step8")  # e.g. an older run's pointer left behind
    assert newest_tag(storage, "global_step10") == "global_step10"


def test_nothing_to_resume_from(tmp_path):
    assert newest_tag(Storage.open(str(tmp_path)), None) is None


def test_a_reported_directory_without_manifest_is_named(tmp_path):
    (tmp_path / "global_step2").mkdir()
    with pytest.raises(CheckpointError, match="global_step2.*manifest.json"):
        newest_tag(Storage.open(str(tmp_path)), "global_step2")
