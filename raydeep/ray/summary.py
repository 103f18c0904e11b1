"""``<storage>/<name>/summary.json``: what a run did, in numbers two runs can be compared by.

- ``param_sha256``: digest of the consolidated fp32 parameters (:mod:`raydeep.ray.weights`);
- ``samples_sha256``: the sample ledger's digest of the ids consumed, in order (:mod:`raydeep.ray.ledger`);
- ``world_sizes``: one entry per attempt, earlier drivers' attempts (from the checkpoint's history)
  followed by this driver's (from the monitor, including attempts that died before checkpointing);
- ``recoveries``: for each restart seen by this driver, where the state came from
  (``restored_from``: ``checkpoint <tag>`` or ``memory snapshot <tag>``), the step it resumed at,
  the steps the failed attempt had completed past it (``steps_lost``, computed again), and the
  stall between the last step of the failed attempt and the first step of the next one (the kill
  itself happened in between);
- ``samples_per_s``: samples this driver advanced the run by, over its wall time (start-up and
  recoveries included);
- ``attempts[i].skipped_checkpoints``: ``[tag, reason]`` of damaged checkpoints an attempt passed
  over to resume from an older, intact one;
- ``memory_rank0``: rank 0's model-state bytes as the engine measures them (``memory_breakdown()``).
- ``hangs``: every step a rank's watchdog reported as hung while this driver watched (rank,
  step, seconds, timeout, the stack that ran the step, the last collective, the dump's path);
  empty when none;
- ``offload``: where the optimizer tier keeps the masters and optimizer states when they are
  offloaded (``tier``: ``host`` or ``actors``; the actor count, the offload nodes' ids, the bytes
  held, and per rank the seconds per step in the update, in transfer and in the CPU step), or null.
"""
from __future__ import annotations

import json

import pyarrow.fs as pafs


ATTEMPT_FIELDS = ("world_size", "micro_batch", "grad_accum", "resumed_from_step", "restored_from")


def build_summary(spec, result: dict, snapshot: dict, driver_id: str, started: float, ended: float) -> dict:
    seen = snapshot.get("attempts", [])
    earlier = [a for a in result["attempts"] if a["driver"] != driver_id]
    attempts = [{k: a.get(k) for k in ATTEMPT_FIELDS} for a in earlier + seen]
    for record, attempt in zip(attempts, earlier + seen):
        if attempt.get("skipped_checkpoints"):  # damaged checkpoints this attempt resumed past
            record["skipped_checkpoints"] = attempt["skipped_checkpoints"]
    first_step = seen[0]["resumed_from_step"] if seen else result["global_steps"]
    advanced = result["global_samples"] - first_step * result["train_batch_size"]
    elapsed = max(ended - started, 1e-9)
    return {
        "name": spec.name, "storage": spec.run_uri, "model": spec.model, "data": spec.data,
        "zero_stage": result["zero_stage"], "train_batch_size": result["train_batch_size"],
        "num_parameters": result["num_parameters"], "memory_rank0": result["memory"],
        "first_loss": result["first_loss"], "final_loss": result["final_loss"], "global_steps": result["global_steps"],
        "global_samples": result["global_samples"],
        "world_sizes": [a["world_size"] for a in attempts], "restarts": max(len(attempts) - 1, 0),
        "attempts": attempts, "recoveries": recoveries(seen),
        "samples_per_s": advanced / elapsed, "elapsed_s": elapsed,
        "param_sha256": result["param_sha256"], "samples_sha256": result["samples_sha256"],
        "offload": result.get("offload"), "compression": result.get("compression"),
        "hangs": [{k: v for k, v in hang.items() if k != "token"} for hang in snapshot.get("hangs", [])],
    }


def recoveries(attempts: list[dict]) -> list[dict]:
    out = []
    for before, after in zip(attempts, attempts[1:]):
        stall = None
        if before.get("last_step_at") and after.get("first_step_at"):
            stall = after["first_step_at"] - before["last_step_at"]
        last = before.get("last_step")
        out.append({"attempt": after["index"], "world_size": after["world_size"], "last_step_before": last,
                    "resumed_from_step": after["resumed_from_step"], "restored_from": after.get("restored_from"),
                    "steps_lost": None if last is None else max(0, last - after["resumed_from_step"]),
                    "stall_s": stall})
    return out


def write_json(uri: str, data: dict) -> None:
    fs, path = pafs.FileSystem.from_uri(uri) if "://" in uri else (pafs.LocalFileSystem(), uri)
    fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
    with fs.open_output_stream(path) as sink:
        sink.write((json.dumps(data, indent=2, sort_keys=True) + "\n").encode())


def read_json(uri: str) -> dict:
    fs, path = pafs.FileSystem.from_uri(uri) if "://" in uri else (pafs.LocalFileSystem(), uri)
    with fs.open_input_stream(path) as source:
        return json.loads(source.read())
