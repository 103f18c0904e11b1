"""Collective-order checking: a rank that diverges fails in seconds, naming the op, instead of hanging.

ZeRO-3's most common failure is ranks issuing different collectives: one rank runs an extra
forward (``generate()`` on rank 0 only), takes another branch, or was configured with another
bucket size. NCCL then waits for the partner collective until its timeout, half an hour later,
and says only which op timed out.

With the check on (``"raydeep": {"check_collective_order": true}`` or
``RAYDEEP_CHECK_COLLECTIVES=1``), every collective ``raydeep.comm`` issues is first announced on a
separate gloo group: each rank contributes its sequence number and a fingerprint of the op, the
shape and the dtype. Equal fingerprints let the collective run; the first difference stops every
rank at the same sequence number with a :class:`CollectiveOrderError` that lists, per rank, the
op, the shape, the call site and the unit (module or bucket) it belongs to. A rank that never
arrives makes the others fail after ``raydeep.collective_order_timeout_s`` with what they were
about to issue.

What torch already offers: ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` wraps every process group and
checks op types and shapes the same way, but must be set before the group exists, names neither
the call site nor the unit, and waits for a missing rank until the process group's timeout;
NCCL's flight recorder (``TORCH_NCCL_TRACE_BUFFER_SIZE``) explains a hang after the fact. This
module adds the names and the short timeout; both torch facilities can be used alongside.

The check costs one small gloo all-gather per collective: a debugging mode, off by default.
"""
from __future__ import annotations

import os
import sys
import time
import zlib
from datetime import timedelta

import torch
import torch.distributed as dist

from raydeep.errors import RaydeepError

ENV = "RAYDEEP_CHECK_COLLECTIVES"
_HERE = {os.path.abspath(__file__), os.path.abspath(os.path.join(os.path.dirname(__file__), "comm.py"))}
# Frames of these are the machinery between the op and the user's training loop.
_PACKAGES = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in (sys.modules[__package__], torch))


class CollectiveOrderError(RaydeepError):
    """Ranks issued different collectives (or one never issued its next one)."""


def requested(config_flag: bool) -> bool:
    """True when the config key or the environment variable asks for the check."""
    return bool(config_flag) or os.environ.get(ENV, "") not in ("", "0")


def call_site(depth: int = 2) -> str:
    """Where the op came from, innermost first: ``depth`` frames outside the comm layer, then the
    first frame outside raydeep (the training loop that called the engine)."""
    frame, found = sys._getframe(1), []
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        inside = path.startswith(_PACKAGES)
        if path not in _HERE and (len(found) < depth or not inside):
            found.append(f"{_short(path)}:{frame.f_lineno} in {frame.f_code.co_name}")
            if not inside:
                break
        frame = frame.f_back
    return " <- ".join(found)


def _short(path: str) -> str:
    parts = path.replace("\\", "/").split("/")
    for anchor in ("raydeep", "tests"):
        if anchor in parts:
            return "/".join(parts[parts.index(anchor):])
    return "/".join(parts[-2:])


def describe(op: str, tensor: torch.Tensor) -> str:
    return f"{op} {tuple(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')}"


class OrderChecker:
    """Announces each collective on its own gloo group before it runs (see the module docstring)."""

    def __init__(self, timeout_s: float, group=None):
        # A group of its own: its messages can never be confused with the training collectives,
        # and its timeout is seconds, not the training group's half hour. Every rank creates it
        # at the same point (engine construction), as dist.new_group requires.
        self.timeout_s = timeout_s
        self.world = dist.GroupMember.WORLD  # the training group this checker belongs to
        self.group = dist.new_group(ranks=None if group is None else dist.get_process_group_ranks(group),
                                    backend="gloo", timeout=timedelta(seconds=timeout_s))
        self.size, self.rank, self.seq = dist.get_world_size(self.group), dist.get_rank(self.group), 0

    def check(self, op: str, tensor: torch.Tensor, owner: str) -> None:
        self.seq += 1
        what = describe(op, tensor)
        fingerprint = zlib.crc32(what.encode())
        mine = torch.tensor([self.seq, fingerprint], dtype=torch.int64)
        everyone = [torch.empty_like(mine) for _ in range(self.size)]
        started = time.monotonic()
        try:
            dist.all_gather(everyone, mine, group=self.group)
        except RuntimeError as err:  # gloo's timeout: some rank never announced its collective #seq
            raise CollectiveOrderError(
                f"collective #{self.seq} on rank {self.rank} ({what}, {owner or 'no unit'}, from {call_site()}): not "
                f"every rank announced its collective #{self.seq} within {self.timeout_s:g} s "
                f"({time.monotonic() - started:.1f} s waited). Another rank is stuck, finished early or issued "
                f"fewer collectives (a skipped forward, an early exit). ({type(err).__name__}: {err})") from None
        if all(int(t[1]) == fingerprint and int(t[0]) == self.seq for t in everyone):
            return
        self._report(what, owner)

    def _report(self, what: str, owner: str) -> None:
        """Every rank saw the same mismatch at the same sequence number: exchange the details."""
        mine = {"rank": self.rank, "op": what, "unit": owner or "-", "site": call_site()}
        details: list = [None] * self.size
        dist.all_gather_object(details, mine, group=self.group)
        lines = [f"  rank {d['rank']}: {d['op']}  unit {d['unit']}  at {d['site']}" for d in details]
        same_op = len({d["op"].split()[0] for d in details}) == 1
        hint = ("The same op with different shapes: the ranks' configs (bucket sizes, partition units) or "
                "models differ; give every rank the same ds_config and model." if same_op else
                "Every rank must run the same forwards, backwards and steps: ZeRO-3 gathers parameters in "
                "every forward, so an extra forward on one rank (generate() or evaluation on rank 0 only) "
                "needs the same call on every rank.")
        raise CollectiveOrderError(
            f"ranks diverged at collective #{self.seq}: they issued different collectives, which would hang "
            "until the process group's timeout:\n" + "\n".join(lines) + "\n" + hint)

    def close(self) -> None:
        try:
            dist.destroy_process_group(self.group)
        except (RuntimeError, ValueError):
            pass  # the default group is already gone: so is this one
