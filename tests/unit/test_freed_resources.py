"""The wait before a new worker group asks for its placement group (raydeep/ray/freed_resources.py)."""
from __future__ import annotations

import inspect

from ray.train import ScalingConfig

from raydeep.ray.freed_resources import AwaitFreedResources, await_resources, covers, group_demand
from raydeep.ray.ray_private import ControllerCallback
from raydeep.ray.trainer import RaydeepTorchTrainer


def test_the_wait_ends_when_the_old_groups_resources_are_back():
    views = iter([{"CPU": 0.0}, {"CPU": 1.0}, {"CPU": 2.0, "memory": 5.0}])
    polls = []

    def available():
        polls.append(1)
        return next(views)

    await_resources({"CPU": 2.0}, available, timeout_s=5.0)
    assert len(polls) == 3  # it asked until they covered the group, and no more


def test_the_wait_gives_up_after_the_gcs_retry_period():
    # Resources that never come back (a lost node): the group is asked for anyway, as Ray would.
    waited = await_resources({"CPU": 2.0}, lambda: {"CPU": 1.0}, timeout_s=0.05)
    assert waited >= 0.05


def test_the_demand_is_the_groups_at_its_size():
    scaling = ScalingConfig(num_workers=(1, 4), resources_per_worker={"CPU": 2, "trainer": 1})
    assert group_demand(scaling.total_resources, scaling.max_workers, 3) == {"CPU": 6.0, "trainer": 3.0}
    gpus = ScalingConfig(num_workers=2, use_gpu=True)
    assert group_demand(gpus.total_resources, gpus.max_workers, 2) == {"GPU": 2.0}
    # Fractions in Ray's units: three workers of 0.1 CPU fit in a free 0.3 (their float sum does not).
    tenths = ScalingConfig(num_workers=3, resources_per_worker={"CPU": 0.1})
    assert covers({"CPU": 0.3}, group_demand(tenths.total_resources, tenths.max_workers, 3))


def test_every_raydeep_trainer_waits_through_ray_trains_controller_hook():
    hook = ControllerCallback.on_controller_start_worker_group
    assert list(inspect.signature(hook).parameters) == ["self", "scaling_config", "num_workers"]
    from ray.train.v2._internal.execution.controller import TrainController

    assert "on_controller_start_worker_group" in inspect.getsource(TrainController._start_worker_group)
    trainer = RaydeepTorchTrainer(lambda config: None, scaling_config=ScalingConfig(num_workers=1))
    assert sum(isinstance(c, AwaitFreedResources) for c in trainer._create_default_callbacks()) == 1
