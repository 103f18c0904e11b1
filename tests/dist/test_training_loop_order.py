"""The training loop's order of events, seen by a session that records them (no Ray).

A step is reported done to the driver only once its memory snapshot is whole: the driver counts
the steps a failed attempt lost from the last step it heard of, so a step it heard of before its
snapshot existed would be lost when a kill landed in between.
"""
from __future__ import annotations

from tests.dist.harness import run_ranks

STEPS, CHECKPOINT_EVERY = 4, 2


class RecordingSession:
    driver_id, skipped = "test", []

    def __init__(self):
        self.events: list[tuple[str, object]] = []

    def restore(self, engine):
        return None

    def save(self, engine, tag, client_state, metrics):
        self.events.append(("save", engine.global_steps))

    def snapshot(self, engine, tag, client_state):
        self.events.append(("snapshot", engine.global_steps))

    def snapshot_room(self):
        return None

    def drop_snapshots(self):
        pass

    def preemption_notice(self):
        return None

    def attempt_started(self, record):
        pass

    def step_started(self, step):
        pass

    def step_finished(self, seconds):
        pass

    def step_done(self, event):
        self.events.append(("step_done", event["step"]))

    def close(self):
        pass


def _record_a_run(run_dir: str) -> list:
    from raydeep.ray.batch_plan import plan_batches
    from raydeep.ray.loop import run_training
    from raydeep.ray.spec import TrainSpec

    ds_config = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2,
                 "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
                 "zero_optimization": {"stage": 2}, "raydeep": {"memory_snapshot_every": 1, "metrics": False}}
    spec = TrainSpec(ds_config=ds_config, num_workers=2, steps=STEPS, checkpoint_every=CHECKPOINT_EVERY,
                     storage_path=run_dir, name="order")
    session = RecordingSession()
    run_training(spec, ds_config, plan_batches(ds_config, 2, 2), session)
    return session.events


def test_a_step_is_reported_done_after_its_snapshot_and_before_its_checkpoint(tmp_path):
    events = run_ranks(_record_a_run, 2, str(tmp_path))[0]
    # Snapshots every step but the last (the final checkpoint holds it); checkpoints every 2 steps.
    assert events == [("snapshot", 1), ("step_done", 1),
                      ("snapshot", 2), ("step_done", 2), ("save", 2),
                      ("snapshot", 3), ("step_done", 3),
                      ("step_done", 4), ("save", 4)]
