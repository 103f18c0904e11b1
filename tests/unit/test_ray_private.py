"""The private Ray APIs raydeep uses (``raydeep.ray.ray_private``) are there, with the signatures
raydeep calls them with: a Ray upgrade that moves or changes one fails here, by name, before a
training run does."""
from __future__ import annotations

import inspect

import ray
from ray.train.torch import TorchTrainer

from raydeep.ray import ray_private
from raydeep.ray.trainer import RaydeepTorchTrainer


def parameters(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def test_this_ray_is_the_release_the_private_names_were_checked_on():
    assert ray_private.checked_release(), f"Ray {ray.__version__}: re-check raydeep/ray/ray_private.py"


def test_the_failure_policy_seam():
    assert issubclass(ray_private.DefaultFailurePolicy, object)
    assert parameters(ray_private.DefaultFailurePolicy.make_decision) == ["self", "training_failed_error"]
    assert parameters(ray_private.DefaultFailurePolicy.__init__)[:2] == ["self", "failure_config"]
    assert {"RAISE", "RETRY"} <= {d.name for d in ray_private.FailureDecision}


def test_the_trainer_methods_raydeep_overrides_exist_with_their_signatures():
    for name in ray_private.TRAINER_OVERRIDES:
        ours, theirs = getattr(RaydeepTorchTrainer, name), getattr(TorchTrainer, name, None)
        assert theirs is not None, f"TorchTrainer.{name} is gone"
        assert ours is not theirs, f"RaydeepTorchTrainer no longer overrides {name}"
        assert parameters(ours) == parameters(theirs), name
    # raydeep's policy reaches the controller's constructor as a keyword of these kwargs
    from ray.train.v2._internal.execution.controller import TrainController

    assert "failure_policy" in parameters(TrainController.__init__)


def test_the_callbacks_and_the_address_lookup():
    assert inspect.isclass(ray_private.DatasetsCallback)
    from ray._private import services

    assert parameters(services.canonicalize_bootstrap_address)[0] == "addr"
