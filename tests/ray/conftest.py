"""One simulated Ray cluster for the tests/ray modules.

Starting a cluster costs seconds of both cores on a 2-core CI machine (a GCS, raylets, the
dashboard and its agents, prestarted workers), so the modules share one
``ray.cluster_utils.Cluster``, started on first use and stopped after the last test of this
package. Its nodes serve every module's needs:

- a head for the drivers (no CPUs: nothing is scheduled next to the GCS; Ray Train's controller
  and raydeep's RunMonitor are pinned to the driver's node, so they live here);
- two 1-CPU trainer nodes that carry the resource ``trainer`` (a run asks for them with
  ``resources_per_worker={"trainer": 1}`` or ``--worker-resources``);
- one 4-CPU offload node that carries ``raydeep_offload`` and the label ``raydeep/role=offload``
  (offload actors, and any worker that asks for a CPU only).

The GCS declares a silent node dead after three missed 1 s health checks, as a cluster tuned for
fast failover would: test_trainer.py's node-loss test removes a trainer node and puts a new one in
its place (:meth:`SharedCluster.replace_trainer`), so the modules after it find the same layout.

A module connects its driver with the ``shared_ray`` fixture and is disconnected when it ends, so a
module that expects no connection (tests/ray/test_cli_train.py) finds none. ``ray start`` for
``ray job submit`` is a head of its own (test_job_submit.py).
"""
from __future__ import annotations

import os
import socket

import pytest

# Ray Train's preemption watcher is an extra actor process per worker group (started again on
# every restart) that polls for node drains; nothing drains the simulated nodes, so it would only
# take CPU from the workers that start beside it. raydeep turns it off for the local clusters it
# starts itself (raydeep.ray.trainer.LOCAL_CLUSTER_TUNING); the tests join clusters by address,
# so they turn it off here. Ray Train's Prometheus metrics callbacks are off too: no test reads them.
os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
os.environ.setdefault("RAY_TRAIN_METRICS_ENABLED", "0")

OFFLOAD_MARK, OFFLOAD_LABEL = "raydeep_offload", {"raydeep/role": "offload"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class SharedCluster:
    """The package's cluster: ``address``, ``head_node``, ``trainers`` (two nodes) and ``offload``."""

    def __init__(self):
        from ray.cluster_utils import Cluster

        fast_failover = {"health_check_period_ms": 1000, "health_check_failure_threshold": 3}
        # The dashboard (the State API the tests read) and the head's dashboard agent (the job
        # server's) on ports of their own: Ray's defaults (8265, 52365) may be taken by another Ray
        # on this machine, such as test_job_submit.py's `ray start` head.
        self.cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 0, "_system_config": fast_failover, "dashboard_port": free_port(),
            "dashboard_agent_listen_port": free_port()})
        self.trainers = [self._add_trainer() for _ in range(2)]
        self.offload = self.cluster.add_node(num_cpus=4, resources={OFFLOAD_MARK: 1}, labels=OFFLOAD_LABEL)
        self.cluster.wait_for_nodes()

    def _add_trainer(self):
        return self.cluster.add_node(num_cpus=1, resources={"trainer": 1})

    def replace_trainer(self, node) -> None:
        """A new trainer node in place of ``node``, which a test removed."""
        self.trainers = [n for n in self.trainers if n is not node] + [self._add_trainer()]
        self.cluster.wait_for_nodes()

    @property
    def address(self) -> str:
        return self.cluster.address

    @property
    def head_node(self):
        return self.cluster.head_node

    def shutdown(self) -> None:
        self.cluster.shutdown()


@pytest.fixture(scope="package")
def ray_cluster():
    import ray

    if ray.is_initialized():
        ray.shutdown()  # a connection left by something else
    shared = SharedCluster()
    try:
        yield shared
    finally:
        if ray.is_initialized():
            ray.shutdown()
        shared.shutdown()


def connect(address: str) -> None:
    """This process as a driver of the cluster at ``address`` (leaving any other one first)."""
    import ray

    if ray.is_initialized():
        if ray.get_runtime_context().gcs_address == address:
            return
        ray.shutdown()
    ray.init(address=address, logging_level="ERROR", log_to_driver=False)


@pytest.fixture(scope="module")
def shared_ray(ray_cluster):
    """The shared cluster with this process connected as a driver for the module; disconnected after."""
    import ray

    connect(ray_cluster.address)
    try:
        yield ray_cluster
    finally:
        ray.shutdown()


@pytest.fixture
def connected(shared_ray):
    """``shared_ray``, reconnected if an earlier test of the module left (``ray.shutdown()``)."""
    connect(shared_ray.address)
    return shared_ray
