"""Which checkpoints a new Ray Train attempt may resume from: every committed one, newest first,
whether Ray Train's report or ``latest`` names it."""
from __future__ import annotations

import torch

from raydeep.checkpoint import Storage, write_single
from raydeep.ray.worker import resume_candidates


def _save(directory, step: int, latest: bool = True) -> None:
    write_single(str(directory), f"global_step{step}", {"w": torch.ones(2)}, counters={"global_steps": step},
                 save_latest=latest)


def test_latest_wins_when_the_report_did_not_reach_ray_train(tmp_path):
    _save(tmp_path, 4)
    _save(tmp_path, 6)  # committed, `latest` moved, but the worker died before Ray Train took the report
    assert resume_candidates(Storage.open(str(tmp_path)), "global_step4") == (["global_step6", "global_step4"], [])


def test_ray_trains_checkpoint_wins_when_it_is_newer(tmp_path):
    _save(tmp_path, 10)
    _save(tmp_path, 8, latest=False)
    storage = Storage.open(str(tmp_path))
    (tmp_path / "latest").write_text("global_step8")  # e.g. an older run's pointer left behind
    assert resume_candidates(storage, "global_step10") == (["global_step10", "global_step8"], [])


def test_nothing_to_resume_from(tmp_path):
    assert resume_candidates(Storage.open(str(tmp_path)), None) == ([], [])


def test_a_reported_directory_without_manifest_is_named_as_damaged(tmp_path):
    _save(tmp_path, 1)
    (tmp_path / "global_step2").mkdir()
    tags, damaged = resume_candidates(Storage.open(str(tmp_path)), "global_step2")
    assert tags == ["global_step1"]
    assert damaged[0][0] == "global_step2" and "manifest.json is missing" in damaged[0][1]
