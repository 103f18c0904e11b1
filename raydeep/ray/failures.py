"""Which failures Ray Train retries, and which end the run at once.

Ray Train restarts the whole worker group after any worker error, up to ``max_failures`` times.
That is right for a lost worker, node or offload actor: the next attempt resumes from the last
checkpoint. It is wrong for a deterministic failure, one that every attempt would hit again: a
bad config, a dataset that does not fit the model, a checkpoint of another model or with no
intact copy left. raydeep raises those as :class:`~raydeep.errors.RaydeepError`; this policy ends
the run on the first one, and the driver re-raises it so the user sees its one message (the
command line exits 2) instead of ``max_failures`` retries and a worker traceback.
"""
from __future__ import annotations

from raydeep.ray.ray_private import DefaultFailurePolicy, FailureDecision

from raydeep.errors import RaydeepError


def deterministic_error(failure: BaseException) -> RaydeepError | None:
    """The raydeep error inside a Ray Train failure (the lowest rank's), if any."""
    if isinstance(failure, RaydeepError):
        return failure
    found = getattr(failure, "controller_failure", None)
    if isinstance(found, RaydeepError):
        return found
    worker_failures = getattr(failure, "worker_failures", None) or {}
    for _, error in sorted(worker_failures.items()):
        if isinstance(error, RaydeepError):
            return error
    return None


class RaydeepFailurePolicy(DefaultFailurePolicy):
    """Ray Train's default policy, except that a raydeep error is never retried."""

    def make_decision(self, training_failed_error) -> FailureDecision:
        if deterministic_error(training_failed_error) is not None:
            return FailureDecision.RAISE
        return super().make_decision(training_failed_error)
