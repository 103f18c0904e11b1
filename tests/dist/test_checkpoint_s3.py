"""Checkpoints through a real S3 API: an S3-compatible server (moto's server mode) started here.

Two ranks save to ``s3://`` (one synchronously, one asynchronously), another layout loads from
it, and the result equals the same checkpoint round-tripped through a local directory.
"""
from __future__ import annotations

import os

import pytest
import torch

from raydeep.checkpoint import CheckpointReader
from tests.dist.harness import free_port, run_ranks

pytestmark = [pytest.mark.slow, pytest.mark.peers]  # the S3 server is moto's: a peer package


@pytest.fixture(scope="module")
def bucket_uri():
    moto_server = pytest.importorskip("moto.server")
    port = free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    # Spawned ranks inherit these; the test server accepts any credentials.
    saved = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")}
    os.environ.update(AWS_ACCESS_KEY_ID="test", AWS_SECRET_ACCESS_KEY="test", AWS_DEFAULT_REGION="us-east-1")
    import boto3

    boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}").create_bucket(Bucket="ckpt")
    yield f"s3://ckpt/{{path}}?endpoint_override=127.0.0.1:{port}&scheme=http&region=us-east-1"
    server.stop()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def save_both(s3_uri: str, local_dir: str) -> None:
    from tests.dist.checkpoint_workloads import GLOBAL_BATCH, build
    from tests.dist.workloads import run_steps

    engine = build(3)
    run_steps(engine, 2, GLOBAL_BATCH)
    engine.save_checkpoint(local_dir)
    engine.save_checkpoint(s3_uri, async_save=True)  # written while the next step trains
    run_steps(engine, 3, GLOBAL_BATCH, skip=2)
    engine.save_checkpoint(s3_uri)  # waits for the first, then a second tag
    engine.destroy()


def load_from(uri: str, tag: str) -> dict:
    from tests.dist.checkpoint_workloads import build, full_params

    engine = build(1)
    path, _ = engine.load_checkpoint(uri, tag=tag)
    return {"path": path, "steps": engine.global_steps, "params": full_params(engine)}


def test_s3_round_trip(bucket_uri, tmp_path):
    s3 = bucket_uri.format(path="run")
    run_ranks(save_both, 2, s3, str(tmp_path))
    reader = CheckpointReader.open(s3)
    assert reader.tag == "global_step3"  # ``latest`` on S3 names the newest tag
    assert reader.path.startswith("s3://ckpt/run/") and "endpoint_override" not in reader.path
    reader.verify_all()
    from_s3 = run_ranks(load_from, 1, s3, "global_step2")[0]
    from_local = run_ranks(load_from, 1, str(tmp_path), "global_step2")[0]
    assert from_s3["steps"] == from_local["steps"] == 2
    for name, value in from_local["params"].items():
        assert torch.equal(from_s3["params"][name], value), name
