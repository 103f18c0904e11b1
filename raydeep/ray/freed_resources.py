"""Ask for a new worker group once the old group's resources are back.

After a failure Ray Train removes the old worker group's placement group and asks for the new one
at once. The removed bundles reach the GCS's view of free resources some tens of milliseconds
later, so the new group's first placement attempt fails, and the GCS retries a pending placement
group only at its next periodic pass, once a second: half a second of idle cluster on every
restart, on average. Waiting for the freed resources first places the group at its first attempt.
The wait is bounded by that period: where the resources do not come back (a lost node, another
run holding them) the group is asked for at most a second later than before, and could not have
been placed in that second anyway (the free resources did not add up to it).
"""
from __future__ import annotations

import time
from typing import Callable

from raydeep.ray.ray_private import ControllerCallback

# The GCS's retry period for a pending placement group (fixed in Ray's C++): waiting longer than
# this could only delay a group Ray would have placed anyway.
GCS_RETRY_PERIOD_S = 1.0
POLL_S = 0.01
RAY_RESOURCE_DECIMALS = 4  # Ray keeps resource quantities in units of 1e-4


def group_demand(total_resources: dict[str, float], max_workers: int, num_workers: int) -> dict[str, float]:
    """Resources of ``num_workers`` workers, from the scaling config's ``total_resources`` (those
    of ``max_workers`` workers), in Ray's resource units (1e-4: 3 x 0.1 CPU is 0.3, not the float
    sum just above it, which no free 0.3 would ever cover).

    >>> group_demand({"CPU": 4.0, "GPU": 2.0}, 2, 1), group_demand({"CPU": 0.1 + 0.1 + 0.1}, 3, 3)
    ({'CPU': 2.0, 'GPU': 1.0}, {'CPU': 0.3})
    """
    return {key: round(value / max_workers * num_workers, RAY_RESOURCE_DECIMALS)
            for key, value in total_resources.items() if value > 0}


def covers(available: dict[str, float], demand: dict[str, float]) -> bool:
    """Whether the cluster's free resources add up to ``demand`` (necessary for placing it: a
    placement group cannot be placed on less).

    >>> covers({"CPU": 2.0, "memory": 1e9}, {"CPU": 2.0}), covers({"CPU": 1.0}, {"CPU": 2.0})
    (True, False)
    """
    return all(round(available.get(key, 0.0), RAY_RESOURCE_DECIMALS) >= value for key, value in demand.items())


def await_resources(demand: dict[str, float], available: Callable[[], dict],
                    timeout_s: float = GCS_RETRY_PERIOD_S) -> float:
    """Wait until ``available()`` covers ``demand``, at most ``timeout_s``; the seconds waited."""
    began = time.monotonic()
    while not covers(available(), demand) and time.monotonic() - began < timeout_s:
        time.sleep(POLL_S)
    return time.monotonic() - began


class AwaitFreedResources(ControllerCallback):
    """Before each worker group starts, wait until the cluster's free resources (the GCS's view,
    ``ray.available_resources``) cover the group."""

    def on_controller_start_worker_group(self, *, scaling_config, num_workers: int):
        import ray

        await_resources(group_demand(scaling_config.total_resources, scaling_config.max_workers, num_workers),
                        ray.available_resources)
        return None  # no label selector: where the group goes is not changed
