"""The TorchTrainer raydeep builds: Ray Train's own callbacks, less the Ray Data ones it has no use for."""
from __future__ import annotations

from ray.train.v2._internal.callbacks import BackendSetupCallback, DatasetsCallback

from raydeep.ray import TrainSpec
from raydeep.ray.batch_plan import plan_batches
from raydeep.ray.trainer import RaydeepTorchTrainer, build_trainer


def callback_types(trainer) -> set[type]:
    return {type(callback) for callback in trainer._create_default_callbacks()}


def test_no_dataset_manager_without_datasets(tmp_path):
    # Without this, every worker group start (each restart) also starts a DatasetManager actor.
    spec = TrainSpec(num_workers=2, steps=4, storage_path=str(tmp_path), name="callbacks")
    ds_config = spec.resolved_ds_config()
    trainer = build_trainer(spec, ds_config, plan_batches(ds_config, 2, 2))
    types = callback_types(trainer)
    assert DatasetsCallback not in types
    assert BackendSetupCallback in types  # the process group is still Ray Train's


def test_datasets_keep_their_callback(tmp_path):
    trainer = RaydeepTorchTrainer(lambda: None, datasets={"train": lambda: None})
    assert DatasetsCallback in callback_types(trainer)
