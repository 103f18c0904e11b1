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


def trainer_for(tmp_path, *overrides: str, use_gpu: bool = False):
    spec = TrainSpec(num_workers=2, steps=4, storage_path=str(tmp_path), name="torch-config", use_gpu=use_gpu,
                     overrides=list(overrides))
    ds_config = spec.resolved_ds_config()
    return spec, build_trainer(spec, ds_config, plan_batches(ds_config, 2, 2))


def test_the_process_group_timeout_comes_from_the_config_and_ray_picks_the_backend(tmp_path):
    _, trainer = trainer_for(tmp_path)
    assert (trainer.backend_config.backend, trainer.backend_config.timeout_s) == ("gloo", 600)
    assert "TORCH_NCCL_DUMP_ON_TIMEOUT" not in trainer.run_config.worker_runtime_env.get("env_vars", {})
    _, trainer = trainer_for(tmp_path, "raydeep.collective_timeout_s=120", use_gpu=True)
    assert (trainer.backend_config.backend, trainer.backend_config.timeout_s) == ("nccl", 120)


def test_gpu_workers_get_the_nccl_flight_recorder_unless_the_user_set_it(tmp_path, monkeypatch):
    spec, trainer = trainer_for(tmp_path, use_gpu=True)
    env = trainer.run_config.worker_runtime_env["env_vars"]
    assert env == {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
                   "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": f"{spec.run_uri}/diagnostics/nccl_trace_rank_"}
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "50")
    _, trainer = trainer_for(tmp_path, use_gpu=True)
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE" not in trainer.run_config.worker_runtime_env["env_vars"]
    _, trainer = trainer_for(tmp_path, "raydeep.watchdog=false", use_gpu=True)
    assert not trainer.run_config.worker_runtime_env.get("env_vars")
