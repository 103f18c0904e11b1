"""Launching ``trainer_script.py`` under torchrun (2 gloo ranks), and the recorded DeepSpeed run
it is compared with.

``python -m tests.hf.launch`` re-records ``deepspeed_losses.json`` from the installed DeepSpeed
(the environment needs the ``peers`` extra and transformers/accelerate); do it when transformers,
accelerate or torch change, since the model's initialisation and the Trainer's arithmetic are
theirs. The record keeps the versions it was made with, and the test compares against it only
under the same versions.
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

from tests.dist.harness import free_port

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "trainer_script.py"
RECORD = HERE / "deepspeed_losses.json"
# The runs the test makes: ZeRO-2, gradient accumulation 2, 20 steps, saved at 10 and resumed
# from there. The Trainer with the ds_config's AdamW and the Trainer's scheduler (the ds_config has
# none); the Trainer with its own AdamW as a client optimizer; accelerate with the ds_config's
# AdamW and WarmupDecayLR.
ARGS = ("--stage", "2", "--gas", "2", "--steps", "20", "--save-at", "10", "--also-hf-optimizer", "--accelerate")
PATHS = ("trainer", "trainer_hf_optimizer", "accelerate")
VERSIONED = ("torch", "transformers", "accelerate")


def launch(backend: str, out: Path, *extra: str, timeout: int = 300) -> dict:
    """Run the script on 2 ranks; returns rank 0's RESULT."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(free_port()), str(SCRIPT), "--backend", backend, "--out", str(out), *ARGS, *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-6000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def versions() -> dict[str, str]:
    return {name: importlib.metadata.version(name) for name in VERSIONED}


def record(out: Path) -> dict:
    """Run on the installed DeepSpeed and write the record."""
    result = launch("deepspeed", out)
    data = {"versions": {**versions(), "deepspeed": importlib.metadata.version("deepspeed")}, "args": list(ARGS)}
    for path in PATHS:
        data.update({f"{path}.straight": result[path]["straight"], f"{path}.resumed": result[path]["resumed"]})
    RECORD.write_text(_compact_json(data))
    return data


def _compact_json(data: dict) -> str:
    """One line per step record, so a re-record reads as a diff of steps."""
    lines = []
    for key, value in data.items():
        if isinstance(value, list) and value and isinstance(value[0], dict):
            rows = ",\n".join(f"  {json.dumps(row)}" for row in value)
            lines.append(f" {json.dumps(key)}: [\n{rows}\n ]")
        else:
            lines.append(f" {json.dumps(key)}: {json.dumps(value)}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        written = record(Path(tmp))
    print(f"wrote {RECORD} ({written['versions']})")
