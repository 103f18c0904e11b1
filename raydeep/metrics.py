"""The per-step metrics of a run: one row per optimizer step, written by rank 0 as Parquet.

A run directory holds ``metrics/attempt-<A>.parquet``, one file per attempt of the worker group.
Each file is rewritten whole at every flush (write then rename: a reader never sees a half
file), so pyarrow or pandas can read it while the run goes on: in two row groups at most, the
newest flush's rows after every row before them (a flush's cost grows with the rows, not with
the number of flushes). A new
attempt resumes from the last checkpoint and trains again the steps after it: before writing
anything it cuts those steps from the older attempts' files, so across all files every step
appears once. :func:`read_metrics` reads them all.

The columns (:data:`SCHEMA`); times are seconds on rank 0, bytes are what rank 0 moved
(``raydeep.comm.CommStats``: the all-reduced tensor, the reduce-scatter input, the all-gather
output), null where unknown:

======================  ====================================================================
``step``                the global optimizer step just finished (1-based)
``attempt``             the worker group's attempt in this run (0 for the first)
``world_size``          data-parallel ranks in this attempt
``time``                wall clock (Unix seconds) at the end of the step
``loss``                the step's loss, averaged over every micro batch of every rank
``lr``                  learning rate of the first parameter group, after the step
``loss_scale``          fp16 loss scale used by the step (1.0 otherwise)
``grad_norm``           global gradient norm before clipping (null if not computed; inf on overflow)
``skipped_steps``       steps skipped for overflow so far in the run
``samples``             global samples consumed after the step
``step_s``              wall seconds of the step on rank 0, its checkpoint save excluded
``samples_per_s``       ``train_batch_size / step_s``
``tokens_per_s``        ``samples_per_s * sequence length``
``mfu``                 model FLOPs per second / (world size x the chip's peak), null when no peak
``forward_s``           seconds computing forward, all micro-steps (its waits are in comm_wait_s)
``backward_s``          seconds computing backward (its waits for reductions are in comm_wait_s)
``comm_wait_s``         seconds blocked waiting for collectives, in backward and in the step
``optimizer_s``         seconds in the optimizer step (norm, clipping, update), less its waits
``checkpoint_s``        seconds this step spent saving a checkpoint or memory snapshot (0 when it saved none)
``other_s``             the rest: data loading, the loss all-reduce, the ledger (forward_s,
                        backward_s, comm_wait_s, optimizer_s and other_s add up to step_s;
                        checkpoint_s comes on top)
``checkpoint_forward_s``    with ``activation_checkpointing.profile``: seconds in the checkpointed
                        regions' forwards (part of forward_s), else null
``checkpoint_recompute_s``  with ``profile``: seconds recomputing them (part of backward_s), else null
``bytes_<op>``          bytes of each collective in the step: all_reduce, reduce_scatter,
                        all_gather, broadcast, all_to_all (compressed 1-bit traffic included)
``model_state_bytes``   per rank (list, rank order): device bytes of model states
``peak_memory_bytes``   per rank: the allocator's peak so far (CUDA; null on CPU ranks)
``phase``               the optimizer tier's phase ("", "warmup", "compressed")
``restarts``            worker-group restarts before this attempt
======================  ====================================================================
"""
from __future__ import annotations

import pyarrow as pa

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all")

SCHEMA = pa.schema(
    [("step", pa.int64()), ("attempt", pa.int32()), ("world_size", pa.int32()), ("time", pa.float64()),
     ("loss", pa.float64()), ("lr", pa.float64()), ("loss_scale", pa.float64()), ("grad_norm", pa.float64()),
     ("skipped_steps", pa.int64()), ("samples", pa.int64()), ("step_s", pa.float64()),
     ("samples_per_s", pa.float64()), ("tokens_per_s", pa.float64()), ("mfu", pa.float64()),
     ("forward_s", pa.float64()), ("backward_s", pa.float64()), ("comm_wait_s", pa.float64()),
     ("optimizer_s", pa.float64()), ("checkpoint_s", pa.float64()), ("other_s", pa.float64()),
     ("checkpoint_forward_s", pa.float64()), ("checkpoint_recompute_s", pa.float64())]
    + [(f"bytes_{op}", pa.int64()) for op in COLLECTIVES]
    + [("model_state_bytes", pa.list_(pa.int64())), ("peak_memory_bytes", pa.list_(pa.int64())),
       ("phase", pa.string()), ("restarts", pa.int32())])

METRICS_DIR = "metrics"


def attempt_file(attempt: int) -> str:
    """The metrics file of ``attempt``, relative to the run directory."""
    return f"{METRICS_DIR}/attempt-{attempt}.parquet"


def collective_bytes(by_op: dict) -> dict[str, int]:
    """``{"bytes_<op>": n}`` for every column, from ``CommStats.summary()``-style ``{op: {"bytes": n}}``
    (labelled variants such as ``compressed_all_gather`` count under their collective)."""
    out = {f"bytes_{op}": 0 for op in COLLECTIVES}
    for label, entry in by_op.items():
        nbytes = entry["bytes"] if isinstance(entry, dict) else entry
        op = next((c for c in COLLECTIVES if label.endswith(c)), None)
        if op is not None:
            out[f"bytes_{op}"] += int(nbytes)
    return out


def read_metrics(run_uri: str) -> pa.Table:
    """Every attempt's rows of the run at ``run_uri`` (a path or URI), sorted by step."""
    import pyarrow.fs as pafs
    import pyarrow.parquet as pq

    from raydeep.storage import Storage

    storage = Storage.open(run_uri)
    tables = []
    if storage.is_dir(METRICS_DIR):
        found = storage.fs.get_file_info(pafs.FileSelector(storage.path(METRICS_DIR)))
        for info in sorted(found, key=lambda i: i.path):
            if info.path.endswith(".parquet"):
                with storage.fs.open_input_file(info.path) as f:
                    tables.append(pq.read_table(f, schema=SCHEMA))
    if not tables:
        return SCHEMA.empty_table()
    table = pa.concat_tables(tables)
    return table.sort_by([("step", "ascending"), ("attempt", "ascending")])
