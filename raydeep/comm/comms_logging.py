"""DeepSpeed's ``comms_logger``: count and latency per collective and message size, and the
``log_summary`` table (``deepspeed.utils.comms_logging``'s columns and bandwidth factors).

``raydeep.comm`` holds one :class:`CommsLogger` while the config's ``comms_logger`` is enabled
and none otherwise, so a collective pays one ``is None`` test when logging is off.

Records are named as DeepSpeed names them (``all_reduce``, ``reduce_scatter_tensor``,
``all_gather_into_tensor``, ``broadcast``, ``all_to_all_single``); a labelled raydeep op such as
``compressed_all_gather`` keeps its label. The message size is the tensor DeepSpeed measures:
the one each rank hands to the collective (the all-gather's input shard, the reduce-scatter's
full input). Latency is what the caller waits: the call of a synchronous op, launch plus
``wait()`` of an asynchronous one; on CUDA the device is synchronised at the end of each
profiled op first, as DeepSpeed does, so the latency is the op's completion.

>>> log = CommsLogger(prof_all=True)
>>> log.append("all_reduce", "all_reduce", 2.0, 4 * 1024 ** 2, world=2)
>>> print(log.table().splitlines()[2].split())
['4.0', 'MB', '1', '2.00', '2.00', '33.55', '16.78']
"""
from __future__ import annotations

import logging
import math
import os
import sys

logger = logging.getLogger("raydeep")

# raydeep's op label -> DeepSpeed's log_name for the same collective.
DEEPSPEED_NAMES = {"all_reduce": "all_reduce", "reduce_scatter": "reduce_scatter_tensor",
                   "all_gather": "all_gather_into_tensor", "broadcast": "broadcast",
                   "all_to_all": "all_to_all_single"}
_COLUMNS = ("Comm. Op", "Message Size", "Count", "Total Latency(ms)", "Avg Latency(ms)", "tput_avg (Gbps)",
            "busbw_avg (Gbps)")
# Frames in these files are raydeep's own plumbing, not the caller the ``debug`` suffix names.
_PLUMBING = {os.path.abspath(__file__), os.path.join(os.path.dirname(os.path.abspath(__file__)), "__init__.py")}


def deepspeed_name(label: str) -> str:
    """The collective DeepSpeed would call for raydeep's op ``label`` (labelled variants by suffix)."""
    if label in DEEPSPEED_NAMES:
        return DEEPSPEED_NAMES[label]
    return next((DEEPSPEED_NAMES[op] for op in DEEPSPEED_NAMES if label.endswith(op)), label)


def convert_size(size_bytes: int) -> str:
    """DeepSpeed's message-size text: ``"4.0 MB"``, ``"0B"``."""
    if size_bytes == 0:
        return "0B"
    names = ("B", "KB", "MB", "GB", "TB", "PB", "EB", "ZB", "YB")
    i = int(math.floor(math.log(size_bytes, 1024)))
    return f"{round(size_bytes / math.pow(1024, i), 2)} {names[i]}"


def bandwidth_gbps(raw_op: str, size: int, latency_ms: float, world: int) -> tuple[float, float]:
    """(algorithmic, bus) bandwidth in Gbps with DeepSpeed's ``calc_bw_log`` factors (nccl-tests'
    conventions; the gather/scatter sizes are multiplied by the world size, as DeepSpeed does)."""
    duration = max(latency_ms, 1e-9)  # a sub-nanosecond no-op would divide by zero
    n = world
    if raw_op in ("all_gather_into_tensor", "reduce_scatter_tensor"):
        size *= n
        tput = size / duration
        busbw = tput * ((n - 1) / n)
    elif raw_op == "all_reduce":
        tput = size * 2 / duration
        busbw = (size / duration) * (2 * (n - 1) / n)
    elif raw_op == "all_to_all_single":
        tput = size / duration
        busbw = tput * ((n - 1) / n)
    else:  # broadcast and the point-to-point ops
        tput = busbw = size / duration
    return tput * 8 / 1e6, busbw * 8 / 1e6


def trim_mean(data: list[float], trim_percent: float = 0.1) -> float:
    """DeepSpeed's outlier-trimmed mean of the table's averages."""
    if not data:
        return 0.0
    data, k = sorted(data), int(round(len(data) * trim_percent))
    kept = data[k:len(data) - k]
    return sum(kept) / len(kept)


def caller_name() -> str:
    """The function that called into ``raydeep.comm`` (DeepSpeed's ``debug`` suffix names the
    caller of ``deepspeed.comm``'s op the same way)."""
    frame = sys._getframe(1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename) in _PLUMBING:
        frame = frame.f_back
    return frame.f_code.co_name if frame is not None else "?"


class CommsLogger:
    """Per-op, per-message-size records: ``{record: {size: [count, [ms], [algbw], [busbw]]}}``."""

    def __init__(self, verbose: bool = False, prof_all: bool = True, prof_ops: list[str] | tuple = (),
                 debug: bool = False, rank: int = 0):
        self.verbose, self.prof_all, self.prof_ops, self.debug = verbose, prof_all, set(prof_ops), debug
        self.rank = rank
        self.comms_dict: dict[str, dict[int, list]] = {}

    def profiles(self, label: str) -> bool:
        """``prof_all``, or the op named in ``prof_ops`` by DeepSpeed's name or raydeep's label."""
        return self.prof_all or label in self.prof_ops or deepspeed_name(label) in self.prof_ops

    def record_name(self, label: str) -> str:
        name = label if label not in DEEPSPEED_NAMES else DEEPSPEED_NAMES[label]
        return f"{name} | [Caller Func: {caller_name()}]" if self.debug else name

    def append(self, raw_op: str, record: str, latency_ms: float, msg_size: int, world: int) -> None:
        algbw, busbw = bandwidth_gbps(raw_op, msg_size, latency_ms, world)
        by_size = self.comms_dict.setdefault(record, {})
        if msg_size in by_size:
            entry = by_size[msg_size]
            entry[0] += 1
            entry[1].append(latency_ms)
            entry[2].append(algbw)
            entry[3].append(busbw)
        else:
            by_size[msg_size] = [1, [latency_ms], [algbw], [busbw]]
        if self.verbose and self.rank == 0:
            logger.info("comm op: %s | time (ms): %.2f | msg size: %s | algbw (Gbps): %.2f | busbw (Gbps): %.2f",
                        record, latency_ms, convert_size(msg_size), algbw, busbw)

    def summary(self) -> dict:
        """DeepSpeed's ``log_summary(return_dict=True)["summary"]``."""
        out: dict[str, dict[int, dict]] = {}
        for record, by_size in self.comms_dict.items():
            out[record] = {size: {"count": v[0], "total_latency_ms": sum(v[1]), "avg_latency_ms": trim_mean(v[1]),
                                  "tput_avg_gbps": trim_mean(v[2]), "busbw_avg_gbps": trim_mean(v[3]),
                                  "msg_size_bytes": size, "msg_size_str": convert_size(size)}
                           for size, v in sorted(by_size.items())}
        return out

    def table(self) -> str:
        """The text DeepSpeed's ``log_summary`` prints: a header, then each op and its sizes."""
        lines = ["".join(f"{c: <20}" for c in _COLUMNS)]
        for record, by_size in self.summary().items():
            lines.append(record)
            for size, s in by_size.items():
                lines.append(f"{' ': <20}{s['msg_size_str']: <20}{s['count']: <20}{s['total_latency_ms']: <20.2f}"
                             f"{s['avg_latency_ms']: <20.2f}{s['tput_avg_gbps']: <20.2f}{s['busbw_avg_gbps']: <20.2f}")
        return "\n".join(lines)

    def reset(self) -> None:
        self.comms_dict.clear()
