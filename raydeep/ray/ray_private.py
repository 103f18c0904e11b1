"""Every private Ray API raydeep uses, in one place, with the Ray release they were checked on.

Ray keeps its ``_internal``/``_private`` modules and ``TorchTrainer``'s underscore methods stable
within a release, not across them. ``raydeep`` pins Ray to that release (``pyproject.toml``);
a Ray outside it gets one warning here, and ``tests/unit/test_ray_private.py`` checks each name
below and the signatures raydeep relies on, so a Ray upgrade fails there first, by name.

- ``DefaultFailurePolicy``/``FailureDecision``: the failure policy that never retries a
  deterministic raydeep error (:mod:`raydeep.ray.failures`);
- ``DatasetsCallback``: left out of the default callbacks when no Ray Datasets are given;
- ``ControllerCallback`` (a ``DeveloperAPI``): the hook before each worker group starts
  (:mod:`raydeep.ray.freed_resources`);
- ``TRAINER_OVERRIDES``: the ``TorchTrainer`` methods ``RaydeepTorchTrainer`` overrides (the
  policy reaches Ray Train's ``TrainController`` as its ``failure_policy`` keyword);
- ``canonicalize_bootstrap_address``: Ray's own lookup of the cluster ``ray start`` left running.
"""
from __future__ import annotations

import logging

import ray
from ray.train.v2._internal.callbacks import DatasetsCallback
from ray.train.v2._internal.execution.callback import ControllerCallback
from ray.train.v2._internal.execution.failure_handling import DefaultFailurePolicy, FailureDecision

logger = logging.getLogger("raydeep")

CHECKED_ON = "2.60"  # the Ray release (major.minor) these names and signatures were checked on
TRAINER_OVERRIDES = ("_initialize_and_run_controller", "_create_default_callbacks")

__all__ = ["CHECKED_ON", "ControllerCallback", "DatasetsCallback", "DefaultFailurePolicy", "FailureDecision", "TRAINER_OVERRIDES",
           "canonicalize_bootstrap_address", "checked_release"]


def checked_release(version: str = ray.__version__) -> bool:
    """Whether ``version`` is the release these private names were checked on.

    >>> checked_release("2.60.1"), checked_release("2.61.0")
    (True, False)
    """
    return version == CHECKED_ON or version.startswith(CHECKED_ON + ".")


def canonicalize_bootstrap_address(address: str | None):
    """Ray's ``ray._private.services.canonicalize_bootstrap_address`` (imported when called: it
    is only needed to find a cluster left running on this machine)."""
    from ray._private.services import canonicalize_bootstrap_address as lookup

    return lookup(address)


if not checked_release():
    logger.warning("raydeep was checked with Ray %s.x and this is Ray %s: its use of Ray Train's private APIs "
                   "(raydeep.ray.ray_private) may not hold; install ray==%s.*", CHECKED_ON, ray.__version__,
                   CHECKED_ON)
