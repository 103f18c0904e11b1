"""The KubeRay manifests in k8s/: the operator's own checks that apply to them (its CRD schemas are
checked separately, offline), that what they run is a raydeep run that can start (the RayJob's
entrypoint parses and plans every world size its worker group can have), and that they stay
locked down: every container non-root without privileges, Ray's token only from the Secret, and
a NetworkPolicy admitting only the cluster's own pods, the RayJob's submitter and the operator.

Each security property is a ``check_*`` function over parsed documents; the tests run them on the
manifests, and ``test_each_check_rejects_its_property_removed`` runs them on copies with one
property removed, so a check that stopped checking would fail there."""
from __future__ import annotations

import copy
import re
import shlex
from pathlib import Path

import pytest
import ray
import yaml
from ray.runtime_env import RuntimeEnv

from raydeep.cli import build_parser, train_spec
from raydeep.config.sections import RaydeepSection
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


OFFLOAD_LABEL = {"raydeep/role": "offload"}  # the node label cluster/README.md documents


def offload_groups(spec: dict) -> list[dict]:
    """The CPU offload worker groups: those whose Ray nodes carry raydeep's offload resource."""
    return [g for g in spec["workerGroupSpecs"] if RaydeepSection().offload_resource in g.get("resources", {})]


def gpu_groups(spec: dict) -> list[dict]:
    """The worker groups that run ranks: every group but the offload ones."""
    offload = offload_groups(spec)
    return [g for g in spec["workerGroupSpecs"] if g not in offload]


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
        volumes = {volume["name"]: volume for volume in pod["volumes"]}
        mounts = {mount["mountPath"]: volumes[mount["name"]] for mount in container["volumeMounts"]}
        assert mounts["/mnt/cluster_storage"]["persistentVolumeClaim"]["claimName"] in claims
    for group in spec["workerGroupSpecs"]:
        # /dev/shm in memory on every worker: Ray's object store lives there, and so do the windows
        # offload actors share with ranks on their node (a container's default is 64 MiB)
        pod = group["template"]["spec"]
        (container,) = pod["containers"]
        volumes = {volume["name"]: volume for volume in pod["volumes"]}
        (shm,) = [volumes[m["name"]] for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm"]
        assert shm["emptyDir"]["medium"] == "Memory", group["groupName"]
    assert len(images) == 1
    assert gpu_groups(spec)
    for group in gpu_groups(spec):
        (container,) = group["template"]["spec"]["containers"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert container["resources"]["requests"]["nvidia.com/gpu"] == "1"
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in \
            group["template"]["spec"]["tolerations"]


@pytest.mark.parametrize("name", ["raycluster.yaml", "rayjob.yaml"])
def test_cpu_offload_group_marked_by_raydeeps_default_resource_and_label(name):
    """Each manifest has a CPU offload group that raydeep.offload_target "auto" finds with the default
    raydeep.offload_resource: the Ray custom resource in the group's ``resources`` (not also in
    rayStartParams, which the operator rejects), the node label in ``labels``, and no GPU."""
    (doc,) = documents(name)
    spec = cluster_spec(doc)
    (group,) = [g for g in spec["workerGroupSpecs"] if "nvidia.com/gpu" not in
                g["template"]["spec"]["containers"][0]["resources"]["limits"]]
    assert set(group["resources"]) == {RaydeepSection().offload_resource}
    assert float(group["resources"][RaydeepSection().offload_resource]) > 0
    assert offload_groups(spec) == [group]
    assert group["labels"] == OFFLOAD_LABEL
    assert not {"resources", "labels"} & set(group.get("rayStartParams", {}))
    assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"] and group["replicas"] >= 1
    pod = group["template"]["spec"]
    (container,) = pod["containers"]
    for kind in ("requests", "limits"):
        assert not [key for key in container["resources"][kind] if "gpu" in key]
        assert float(container["resources"][kind]["cpu"]) >= 1
    assert not pod.get("tolerations")


def test_rayjob_entrypoint_is_a_run_its_cluster_can_serve():
    args = entrypoint_args()
    assert args.command == "train" and args.use_gpu
    assert args.storage_path.startswith("/mnt/cluster_storage/")
    assert args.name == rayjob()["metadata"]["name"]  # a retried job resumes the same run
    # The elastic range is the GPU group's replica range, and the batch plan serves every size in it.
    (group,) = gpu_groups(rayjob()["spec"]["rayClusterSpec"])
    low, high = parse_num_workers(args.num_workers)
    assert (low, high) == (group["minReplicas"], group["maxReplicas"])
    _, schedule = plan_run(train_spec(args))
    batch = {schedule.for_world_size(size).train_batch_size for size in range(low, high + 1)}
    assert batch == {96}


# --- security: non-root containers, Ray's token from the Secret, a NetworkPolicy -----------------

SECRET, TOKEN_KEY = "raydeep-ray-token", "auth_token"  # KubeRay's authOptions.secretName reads this key
RAY_UID = 1000  # `ray` in the rayproject/ray images
DASHBOARD = 8265
OPERATOR_POD = {"app.kubernetes.io/component": "kuberay-operator"}  # Helm and kustomize installs alike
DASHBOARD_ONLY = [{"protocol": "TCP", "port": DASHBOARD}]


def policies() -> list[dict]:
    return [doc for path in sorted(K8S.glob("*.yaml")) for doc in documents(path.name)
            if doc["kind"] == "NetworkPolicy"]


def ray_templates(doc: dict) -> dict[str, dict]:
    spec = cluster_spec(doc)
    groups = {f"worker group {g['groupName']}": g["template"] for g in spec["workerGroupSpecs"]}
    return {"head": spec["headGroupSpec"]["template"], **groups}


def all_templates(doc: dict) -> dict[str, dict | None]:
    """Every pod template, the RayJob's submitter included (None when left to KubeRay, whose
    default submitter has no securityContext and no token)."""
    submitter = {"submitter": doc["spec"].get("submitterPodTemplate")} if doc["kind"] == "RayJob" else {}
    return {**ray_templates(doc), **submitter}


def check_container(where: str, context: dict | None, pod_context: dict) -> None:
    assert context, f"{where}: no securityContext"
    assert context.get("runAsNonRoot") is True, f"{where}: runAsNonRoot"
    assert context.get("runAsUser", pod_context.get("runAsUser")) == RAY_UID, f"{where}: runs as uid {RAY_UID}"
    assert context.get("allowPrivilegeEscalation") is False, f"{where}: allowPrivilegeEscalation"
    assert not context.get("privileged"), f"{where}: privileged"
    capabilities = context.get("capabilities") or {}
    assert capabilities.get("drop") == ["ALL"] and not capabilities.get("add"), f"{where}: capabilities"
    seccomp = context.get("seccompProfile") or pod_context.get("seccompProfile")
    assert seccomp == {"type": "RuntimeDefault"}, f"{where}: seccompProfile"


def check_locked_down(doc: dict) -> None:
    """Every container non-root, no privilege escalation, no capabilities, RuntimeDefault seccomp;
    pods with volumes get an fsGroup so the ray user can write the run storage."""
    head_context = {}
    for where, template in all_templates(doc).items():
        assert template, f"{where}: no pod template"
        pod = template["spec"]
        pod_context = pod.get("securityContext") or {}
        head_context = head_context or pod_context
        assert pod_context.get("runAsNonRoot") is True, f"{where}: pod runAsNonRoot"
        if pod.get("volumes"):
            assert pod_context.get("fsGroup") is not None, f"{where}: fsGroup for the mounted storage"
        for container in pod["containers"] + pod.get("initContainers", []):
            check_container(f"{where}/{container['name']}", container.get("securityContext"), pod_context)
    spec = cluster_spec(doc)
    if spec.get("enableInTreeAutoscaling"):  # KubeRay adds an autoscaler container to the head pod
        check_container("autoscaler", spec.get("autoscalerOptions", {}).get("securityContext"), head_context)


def check_token_from_secret(doc: dict) -> None:
    """Token auth on, with the token from the Secret (secretKeyRef) in every container we declare,
    and authOptions naming the same Secret for the containers the operator adds."""
    assert cluster_spec(doc).get("authOptions") == {"mode": "token", "secretName": SECRET}
    for where, template in all_templates(doc).items():
        assert template, f"{where}: no pod template"
        for container in template["spec"]["containers"]:
            env = {var["name"]: var for var in container.get("env", [])}
            assert env.get("RAY_AUTH_MODE", {}).get("value") == "token", f"{where}: RAY_AUTH_MODE=token"
            token = env.get("RAY_AUTH_TOKEN") or {}
            assert "value" not in token, f"{where}: a literal RAY_AUTH_TOKEN"
            assert token.get("valueFrom") == {"secretKeyRef": {"name": SECRET, "key": TOKEN_KEY}}, \
                f"{where}: RAY_AUTH_TOKEN from the Secret {SECRET}"


def selects(selector: dict | None, labels: dict) -> bool:
    match = (selector or {}).get("matchLabels") or {}
    return bool(match) and not (selector or {}).get("matchExpressions") and match.items() <= labels.items()


def ray_pod_labels(doc: dict) -> list[dict]:
    """The labels each Ray pod of ``doc`` is sure to carry: its template's, plus KubeRay's
    ray.io/cluster where the cluster's name is fixed (a RayJob's gets a random suffix)."""
    fixed = {"ray.io/cluster": doc["metadata"]["name"]} if doc["kind"] == "RayCluster" else {}
    return [{**(template.get("metadata") or {}).get("labels", {}), **fixed}
            for template in ray_templates(doc).values()]


def peer_kind(peer: dict, doc: dict, own: dict) -> str:
    assert "ipBlock" not in peer, f"an ipBlock opens Ray's ports to addresses: {peer}"
    if "namespaceSelector" in peer:  # only the operator comes from another namespace
        namespace = peer["namespaceSelector"]
        assert set(namespace.get("matchLabels") or {}) == {"kubernetes.io/metadata.name"} \
            and not namespace.get("matchExpressions"), f"the operator's namespace, by name: {peer}"
        assert peer.get("podSelector") == {"matchLabels": OPERATOR_POD}, f"the operator's pods only: {peer}"
        return "operator"
    if peer.get("podSelector") == own:
        return "cluster"
    submitter = doc["spec"].get("submitterPodTemplate") if doc["kind"] == "RayJob" else None
    if submitter and selects(peer.get("podSelector"), (submitter.get("metadata") or {}).get("labels", {})):
        return "submitter"
    raise AssertionError(f"a peer outside the Ray cluster, its submitter and the operator: {peer}")


def check_network_policy(doc: dict, network_policies: list[dict]) -> None:
    """Ingress to the Ray pods only from the same cluster's pods (any port), the RayJob's
    submitter and the operator (the dashboard only); no ipBlock, no rule open to every source."""
    pods = ray_pod_labels(doc)
    relevant = [policy for policy in network_policies
                if any(selects(policy["spec"].get("podSelector"), labels) for labels in pods)]
    assert relevant, f"no NetworkPolicy selects the pods of {doc['kind']} {doc['metadata']['name']}"
    found = set()
    for policy in relevant:
        spec, name = policy["spec"], policy["metadata"]["name"]
        assert all(selects(spec["podSelector"], labels) for labels in pods), f"{name}: selects every Ray pod"
        assert "Ingress" in spec.get("policyTypes", []), f"{name}: policyTypes Ingress"
        for rule in spec.get("ingress", []):
            assert rule.get("from"), f"{name}: a rule without `from` admits every source"
            kinds = {peer_kind(peer, doc, spec["podSelector"]) for peer in rule["from"]}
            if kinds != {"cluster"}:
                assert rule.get("ports") == DASHBOARD_ONLY, f"{name}: {kinds} reach the dashboard only"
            found |= kinds
    needed = {"cluster", "operator"} | ({"submitter"} if doc["kind"] == "RayJob" else set())
    assert needed <= found, f"no ingress rule for {needed - found}: those pods could not reach Ray"


@pytest.mark.parametrize("doc", ray_documents(), ids=lambda doc: doc["kind"])
def test_every_container_is_non_root_without_privileges(doc):
    check_locked_down(doc)


@pytest.mark.parametrize("doc", ray_documents(), ids=lambda doc: doc["kind"])
def test_ray_token_auth_with_the_token_from_the_secret(doc):
    check_token_from_secret(doc)
    (head,) = ray_templates(doc)["head"]["spec"]["containers"]
    assert {port["name"]: port["containerPort"] for port in head["ports"]}["dashboard"] == DASHBOARD


def test_no_literal_token_and_auth_never_disabled():
    """No Secret (the token is made at install time, README.md), no literal token, no
    RAY_AUTH_MODE other than token, in the manifests or the runtime env they hand to Ray."""
    def walk(node):
        if isinstance(node, dict):
            yield node
            for value in node.values():
                yield from walk(value)
        elif isinstance(node, list):
            for value in node:
                yield from walk(value)

    for path in sorted(K8S.glob("*.yaml")):
        assert not re.search(r"RAY_AUTH_MODE\W+disabled", path.read_text()), path.name
        for doc in documents(path.name):
            assert doc["kind"] != "Secret", f"{path.name}: a token committed as a Secret"
            for node in walk(doc):
                if node.get("name") == "RAY_AUTH_TOKEN":
                    assert "value" not in node, f"{path.name}: a literal RAY_AUTH_TOKEN"
                if node.get("name") == "RAY_AUTH_MODE":
                    assert node.get("value") == "token", f"{path.name}: {node}"
            if doc["kind"] == "RayJob":
                env_vars = yaml.safe_load(doc["spec"]["runtimeEnvYAML"]).get("env_vars", {})
                assert not {"RAY_AUTH_MODE", "RAY_AUTH_TOKEN"} & set(env_vars)
    # The README's command creates the Secret and key the manifests read.
    assert f"kubectl create secret generic {SECRET} --from-literal={TOKEN_KEY}=" in (K8S / "README.md").read_text()


@pytest.mark.parametrize("doc", ray_documents(), ids=lambda doc: doc["kind"])
def test_network_policy_admits_only_the_cluster_its_submitter_and_the_operator(doc):
    check_network_policy(doc, policies())


def _head(job):
    return job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]


def _worker(job):
    return job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]


def _submitter(job):
    return job["spec"]["submitterPodTemplate"]["spec"]


def _context(pod):
    return pod["containers"][0]["securityContext"]


def _env(pod, name):
    (var,) = [var for var in pod["containers"][0]["env"] if var["name"] == name]
    return var


def _job_policy(network_policies):
    (policy,) = [p for p in network_policies if p["metadata"]["name"] == f"{rayjob()['metadata']['name']}-ray"]
    return policy["spec"]


def _ingress(network_policies):  # [the cluster's own pods, the submitter, the operator]
    return _job_policy(network_policies)["ingress"]


# Each entry removes (or weakens) one property in a copy of the RayJob (j) and the NetworkPolicies
# (n); the check named must then fail.
MUTATIONS = {
    "no securityContext on a worker": ("locked_down", lambda j, n: _worker(j)["containers"][0].pop("securityContext")),
    "head container may run as root": ("locked_down", lambda j, n: _context(_head(j)).pop("runAsNonRoot")),
    "head runs as uid 0": ("locked_down", lambda j, n: _context(_head(j)).update(runAsUser=0)),
    "submitter may escalate": ("locked_down", lambda j, n: _context(_submitter(j)).pop("allowPrivilegeEscalation")),
    "worker keeps capabilities": ("locked_down", lambda j, n: _context(_worker(j)).pop("capabilities")),
    "no seccomp profile": ("locked_down", lambda j, n: (_context(_worker(j)).pop("seccompProfile"),
                                                       _worker(j)["securityContext"].pop("seccompProfile"))),
    "no fsGroup for the storage": ("locked_down", lambda j, n: _head(j)["securityContext"].pop("fsGroup")),
    "autoscaler unconfined": ("locked_down",
                              lambda j, n: j["spec"]["rayClusterSpec"]["autoscalerOptions"].pop("securityContext")),
    "KubeRay's default submitter": ("locked_down", lambda j, n: j["spec"].pop("submitterPodTemplate")),
    "no authOptions": ("token", lambda j, n: j["spec"]["rayClusterSpec"].pop("authOptions")),
    "literal token": ("token", lambda j, n: _env(_worker(j), "RAY_AUTH_TOKEN").update(value="x" * 64)),
    "token from another Secret": ("token", lambda j, n: _env(_head(j), "RAY_AUTH_TOKEN").update(
        valueFrom={"secretKeyRef": {"name": "other", "key": TOKEN_KEY}})),
    "submitter without the token": ("token", lambda j, n: _submitter(j)["containers"][0].pop("env")),
    "auth disabled on a worker": ("token", lambda j, n: _env(_worker(j), "RAY_AUTH_MODE").update(value="disabled")),
    "no NetworkPolicy": ("network", lambda j, n: n.clear()),
    "open to 0.0.0.0/0": ("network", lambda j, n: _ingress(n).append({"from": [{"ipBlock": {"cidr": "0.0.0.0/0"}}]})),
    "a rule for every source": ("network", lambda j, n: _ingress(n).append({"ports": DASHBOARD_ONLY})),
    "every pod of the namespace": ("network", lambda j, n: _ingress(n)[0]["from"].append({"podSelector": {}})),
    "operator reaches every port": ("network", lambda j, n: _ingress(n)[2].pop("ports")),
    "operator from any namespace": ("network", lambda j, n: _ingress(n)[2]["from"][0].update(namespaceSelector={})),
    "policy selects other pods": ("network", lambda j, n: _job_policy(n)["podSelector"].update(
        matchLabels={"raydeep.io/cluster": "other"})),
    "cluster pods cannot talk": ("network", lambda j, n: _ingress(n).pop(0)),
    "submitter shut out": ("network", lambda j, n: _ingress(n).pop(1)),
}
CHECKS = {"locked_down": lambda job, nps: check_locked_down(job),
          "token": lambda job, nps: check_token_from_secret(job),
          "network": check_network_policy}


@pytest.mark.parametrize("mutation", MUTATIONS)
def test_each_check_rejects_its_property_removed(mutation):
    check, mutate = MUTATIONS[mutation]
    job, network_policies = copy.deepcopy(rayjob()), copy.deepcopy(policies())
    CHECKS[check](job, network_policies)  # the unmodified copy passes
    mutate(job, network_policies)
    with pytest.raises(AssertionError):
        CHECKS[check](job, network_policies)
