"""``ray job submit`` against a real Ray head, as ``jobs/README.md`` tells users to run it: the job
ships this checkout (``jobs/runtime_env.yaml``), its driver joins the cluster through
``RAY_ADDRESS``, and with the same ``--name`` it continues a run that ``raydeep train`` started on
the head's machine, at another size."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray
from ray._common.utils import get_ray_address_file

from raydeep.data import builtin_dataset
from raydeep.ray.ledger import SampleOrder, expected_digest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent  # the cluster's Python: `python` in the entrypoint is this one
BATCH = 16  # the default ds_config's train_batch_size


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def head():
    """A Ray head with the dashboard (the job server); yields its address for ``ray job``. It runs
    beside the package's shared cluster (tests/ray/conftest.py), so it is stopped by its own
    processes, not ``ray stop`` (which stops every Ray process on the machine)."""
    if ray.is_initialized():
        ray.shutdown()  # a connection left by an earlier module
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", "RAY_AUTH_MODE": "disabled"}
    address_file = Path(get_ray_address_file(None))
    previous_address = address_file.read_text() if address_file.is_file() else None
    started = []
    try:
        # Every port on a free one: Ray's defaults may be taken by the shared cluster or another Ray.
        # A port found free can be taken before Ray binds it (other test processes start clusters
        # too), so a failed start is tried again on new ports, and its own output is shown.
        for attempt in range(3):
            gcs_port, dashboard_port = free_port(), free_port()
            started.append(gcs_port)
            done = subprocess.run([BIN / "ray", "start", "--head", f"--port={gcs_port}",
                                   f"--dashboard-port={dashboard_port}", "--dashboard-host=127.0.0.1",
                                   f"--dashboard-agent-listen-port={free_port()}",
                                   f"--ray-client-server-port={free_port()}", "--num-cpus=2", "--disable-usage-stats"],
                                  env=env, capture_output=True, text=True)
            if done.returncode == 0:
                break
            stop_head(gcs_port)
        assert done.returncode == 0, f"ray start failed 3 times; the last said:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
        yield f"http://127.0.0.1:{dashboard_port}", env
    finally:
        for port in started:
            stop_head(port)
        # `ray start` pointed `ray.init()` on this machine at its head; point it back.
        if previous_address is None:
            address_file.unlink(missing_ok=True)
        else:
            address_file.write_text(previous_address)


def stop_head(gcs_port: int) -> None:
    """SIGKILL the processes of the Ray head whose GCS listens on ``gcs_port`` (each names that
    address or port on its command line), with the processes they started."""
    import psutil

    def of_this_head(args: list[str]) -> bool:
        return any(arg.endswith(f":{gcs_port}") or arg == f"--gcs_server_port={gcs_port}" for arg in args)

    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if of_this_head(proc.info["cmdline"] or []):
                found += [proc, *proc.children(recursive=True)]
        except psutil.NoSuchProcess:
            pass
    for proc in found:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(found, timeout=10)


def run_submission(command: list, env: dict) -> subprocess.CompletedProcess:
    """``ray job submit``, again while the head answers that its job agent is not up yet (Ray
    starts the agent after the dashboard; a loaded machine can take a while): that is Ray's
    readiness, not the job's outcome. Any other failure is returned as it is."""
    deadline = time.monotonic() + 120
    while True:
        proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        if proc.returncode == 0 or "No available agent to submit job" not in proc.stderr or time.monotonic() > deadline:
            return proc
        time.sleep(5)


def submit(head, submission_id: str, *train_args: str) -> subprocess.CompletedProcess:
    address, env = head
    command = [BIN / "ray", "job", "submit", "--address", address, "--runtime-env", "jobs/runtime_env.yaml",
               "--submission-id", submission_id, "--", "python", "-m", "raydeep", "train", *train_args]
    return run_submission(command, env)


def train_here(head, tmp_path, *args: str) -> subprocess.CompletedProcess:
    """``raydeep train`` with no --address on the machine where ``ray start --head`` runs."""
    _, env = head
    env = {key: value for key, value in env.items() if key != "RAY_ADDRESS"}
    command = [sys.executable, "-m", "raydeep", "train", "--storage-path", str(tmp_path), "--checkpoint-every", "2", *args]
    return subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)


def test_a_run_started_here_continues_as_a_submitted_job(head, tmp_path):
    """``raydeep train`` without --address joins the cluster ``ray start`` left, as plain
    ``ray.init()`` does (not fought: "When connecting to an existing cluster, num_cpus and num_gpus
    must not be provided"), and trains 4 steps on 1 worker. A submitted job with the same
    ``--name`` (a driver restart, now with 2 workers) resumes at step 4 from the 1-worker
    checkpoint (resharded), keeps the global batch and trains to 6: every sample once, across both."""
    from ray.job_submission import JobSubmissionClient, JobType

    client = JobSubmissionClient(head[0])
    drivers_before = sum(job.type == JobType.DRIVER for job in client.list_jobs())
    first = train_here(head, tmp_path, "--num-workers", "1", "--steps", "4", "--name", "job")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "joined the Ray cluster running at" in first.stdout and "done: step 4" in first.stdout
    assert sum(job.type == JobType.DRIVER for job in client.list_jobs()) == drivers_before + 1  # it ran there
    assert json.loads((tmp_path / "job" / "summary.json").read_text())["global_steps"] == 4

    second = submit(head, "job-2", "--steps", "6", "--num-workers", "2", "--checkpoint-every", "2",
                    "--storage-path", str(tmp_path), "--name", "job")
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "Job 'job-2' succeeded" in second.stdout + second.stderr
    summary = json.loads((tmp_path / "job" / "summary.json").read_text())
    assert (summary["global_steps"], summary["global_samples"]) == (6, 6 * BATCH)
    assert [(a["world_size"], a["resumed_from_step"]) for a in summary["attempts"]] == [(1, 0), (2, 4)]
    order = SampleOrder(len(builtin_dataset(128)), seed=0)
    assert summary["samples_sha256"] == expected_digest(order, 6, BATCH)


def test_a_run_the_cluster_cannot_hold_is_refused_at_once(head, tmp_path):
    """Refused with exit 2 and what to do instead, not left waiting for resources."""
    proc = train_here(head, tmp_path, "--num-workers", "4", "--steps", "2", "--name", "too-big")
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "cannot hold 4 worker(s)" in proc.stderr and "--address local" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_submitted_bench_job_runs_its_ranks_as_actors(head, tmp_path):
    """``jobs/bench.py`` as jobs/README.md submits it: the ranks are Ray actors of the cluster."""
    address, env = head
    command = [BIN / "ray", "job", "submit", "--address", address, "--runtime-env", "jobs/runtime_env.yaml",
               "--submission-id", "bench-1", "--", "python", "jobs/bench.py", "--world", "2", "--steps", "1",
               "--warmup", "0", "--model", "gpt-tiny", "--n-layer", "1", "--seq", "16", "--micro-batch", "1",
               "--gas", "1", "--bucket", "20000", "--no-deepspeed", "--out", str(tmp_path)]
    proc = run_submission(command, env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "bench.json").read_text())
    assert summary["machine"]["ranks"] == "Ray actors"
    assert "| raydeep z3 |" in proc.stdout and "| FSDP2 |" in proc.stdout
