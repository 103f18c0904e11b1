"""The KubeRay manifests in k8s/: the operator's own checks that apply to them (its CRD schemas are
checked separately, offline), and that what they run is a raydeep run that can start: the
RayJob's entrypoint parses and plans every world size its worker group can have."""
from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import ray
import yaml
from ray.runtime_env import RuntimeEnv

from raydeep.cli import build_parser, train_spec
from raydeep.ray import parse_num_workers
from raydeep.ray.trainer import plan_run

K8S = Path(__file__).resolve().parents[2] / "k8s"


def documents(name: str) -> list[dict]:
    return [doc for doc in yaml.safe_load_all((K8S / name).read_text()) if doc]


def ray_documents() -> list[dict]:
    return [doc for path in sorted(K8S.glob("*.yaml")) for doc in documents(path.name) if doc["kind"].startswith("Ray")]


def cluster_spec(doc: dict) -> dict:
    return doc["spec"]["rayClusterSpec"] if doc["kind"] == "RayJob" else doc["spec"]


def pod_specs(spec: dict) -> list[dict]:
    return [spec["headGroupSpec"]["template"]["spec"]] + [g["template"]["spec"] for g in spec["workerGroupSpecs"]]


def rayjob() -> dict:
    (job,) = [doc for doc in ray_documents() if doc["kind"] == "RayJob"]
    return job


def entrypoint_args():
    argv = shlex.split(rayjob()["spec"]["entrypoint"])
    assert argv[:3] == ["python", "-m", "raydeep"]
    return build_parser().parse_args(argv[3:])


def test_every_manifest_is_a_ray_io_v1_resource_for_the_tested_ray():
    docs = ray_documents()
    assert {doc["kind"] for doc in docs} == {"RayCluster", "RayJob"}
    for doc in docs:
        assert doc["apiVersion"] == "ray.io/v1"
        assert cluster_spec(doc)["rayVersion"] == ray.__version__


@pytest.mark.parametrize("doc", ray_documents(), ids=lambda doc: doc["kind"])
def test_operator_validation_rules(doc):
    """The checks of KubeRay's validation.go that these manifests could break."""
    spec = cluster_spec(doc)
    for group in spec["workerGroupSpecs"]:
        assert group["minReplicas"] <= group.get("replicas", group["minReplicas"]) <= group["maxReplicas"]
        assert not ("resources" in group and "resources" in group.get("rayStartParams", {}))
    if doc["kind"] == "RayJob":
        job = doc["spec"]
        if job.get("ttlSecondsAfterFinished", 0) > 0:
            assert job["shutdownAfterJobFinishes"] is True
        assert not ("backoffLimit" in job and "clusterSelector" in job)
        RuntimeEnv(**yaml.safe_load(job["runtimeEnvYAML"]))  # raises on unknown keys or bad values
    if spec.get("enableInTreeAutoscaling") and spec.get("autoscalerOptions", {}).get("version") == "v2":
        assert all(pod.get("restartPolicy", "Never") == "Never" for pod in pod_specs(spec))


@pytest.mark.parametrize("doc", ray_documents(), ids=lambda doc: doc["kind"])
def test_pods_one_gpu_rank_each_and_shared_run_storage(doc):
    spec = cluster_spec(doc)
    assert spec["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"  # drivers and the controller only
    claims = {claim["metadata"]["name"] for claim in documents("storage.yaml")}
    images = set()
    for pod in pod_specs(spec):
        (container,) = pod["containers"]
        images.add(container["image"])
        volumes = {volume["name"]: volume["persistentVolumeClaim"]["claimName"] for volume in pod["volumes"]}
        mounts = {mount["mountPath"]: volumes[mount["name"]] for mount in container["volumeMounts"]}
        assert mounts["/mnt/cluster_storage"] in claims
    assert len(images) == 1
    for group in spec["workerGroupSpecs"]:
        (container,) = group["template"]["spec"]["containers"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert container["resources"]["requests"]["nvidia.com/gpu"] == "1"
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in \
            group["template"]["spec"]["tolerations"]


def test_rayjob_entrypoint_is_a_run_its_cluster_can_serve():
    args = entrypoint_args()
    assert args.command == "train" and args.use_gpu
    assert args.storage_path.startswith("/mnt/cluster_storage/")
    assert args.name == rayjob()["metadata"]["name"]  # a retried job resumes the same run
    # The elastic range is the GPU group's replica range, and the batch plan serves every size in it.
    (group,) = rayjob()["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    low, high = parse_num_workers(args.num_workers)
    assert (low, high) == (group["minReplicas"], group["maxReplicas"])
    _, schedule = plan_run(train_spec(args))
    batch = {schedule.for_world_size(size).train_batch_size for size in range(low, high + 1)}
    assert batch == {96}
