"""The offload actor's side of ``raydeep.tier.actors``: what runs in the actor process (a
``MasterShards`` over the sub-groups a rank gave it), and how tensors travel to and from it.

Tensors cross as numpy arrays (``to_wire``): Ray stores them zero-copy, and a numpy view pickles
only its own elements, where a torch view pickles its whole storage.
"""
from __future__ import annotations

import time
import warnings
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from raydeep.tier.base import UnitRange
from raydeep.tier.masters import MasterShards, Segment
from raydeep.tier.shared_window import SharedWindow, WindowLayout


def to_wire(t: torch.Tensor) -> np.ndarray:
    """A tensor's bytes as a numpy array Ray stores zero-copy (numpy has no bfloat16: its bits
    travel as int16). A numpy view pickles only its own elements (a torch view pickles its whole
    storage)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()


def from_wire(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """The tensor ``to_wire`` sent: a read-only view of the object store's buffer (never written)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        t = torch.from_numpy(a)
    return t.view(torch.bfloat16) if dtype == torch.bfloat16 else t


def payload_bytes(obj) -> int:
    """Bytes of the arrays and tensors in ``obj`` (lists, tuples, dicts, segments): what a call
    carries, less the small values."""
    if isinstance(obj, np.ndarray):
        return obj.nbytes
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(payload_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(payload_bytes(v) for v in obj)
    if isinstance(obj, (Segment, UnitRange)):
        return payload_bytes(obj.master) + payload_bytes(obj.states)
    return 0


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype a name such as ``"bfloat16"`` (as the wire carries it) names."""
    return getattr(torch, name)


def wire_states(states: dict[str, torch.Tensor]) -> dict[str, tuple[np.ndarray, str]]:
    """Per-element states for the wire: ``{kind: (array, dtype name)}``."""
    return {k: (to_wire(v), str(v.dtype).removeprefix("torch.")) for k, v in states.items()}


class OffloadActor:
    """Holds a ``MasterShards`` over the sub-groups a rank gave it (a Ray actor; see the module
    docstring). Every method is called by the owning rank only."""

    def __init__(self, sub_groups, group_options: list[dict], make_optimizer: Callable, threads: int):
        torch.set_num_threads(max(1, threads))
        self.sub_groups, self.group_options, self.make_optimizer = sub_groups, group_options, make_optimizer
        self.shards: MasterShards | None = None
        self.model_dtype = torch.float32
        self._out: torch.Tensor | None = None
        self._terms: torch.Tensor | None = None  # with the lookahead: parameters, bases and rates, reused
        self._saved: tuple[str, torch.Tensor, dict[str, torch.Tensor]] | None = None  # (key, master, states)
        self._staged: list[tuple] | None = None  # a checkpoint's ranges read by ``stage``, until loaded
        self.window: SharedWindow | None = None  # shared with a rank on this node (``shared_window``)
        self._first = [0]  # each sub-group's first chunk, in this actor's chunk order
        for sg in sub_groups:
            self._first.append(self._first[-1] + len(sg))

    def start(self, masters: list[np.ndarray], dtype_name: str) -> str:
        """Build the fp32 masters from the rank's parameters (model dtype); returns the node id."""
        import ray

        self.model_dtype = dtype_of(dtype_name)
        fp32 = [from_wire(a, self.model_dtype).to(torch.float32, copy=True) for a in masters]
        self.shards = MasterShards(self.sub_groups, fp32, self.group_options, self.make_optimizer)
        return ray.get_runtime_context().get_node_id()

    def open_window(self, path: str, layout: WindowLayout) -> bytes | None:
        """Map the rank's shared window at ``path``; returns its header (the rank checks that we
        see the same file), or None where this process does not see it."""
        self.window = SharedWindow.open(path, layout)
        return None if self.window is None else self.window.header()

    def step(self, k: int, grads: list[np.ndarray] | None, grad_dtype: str, scale: float,
             hyper: list[dict], lookahead: bool = False) -> tuple[list[np.ndarray] | tuple | None, float]:
        """Update sub-group ``k``; returns its chunks' parameters in the model dtype, or with
        ``lookahead`` their ``(bases, rates)`` (``raydeep.tier.lookahead``), and the seconds the CPU
        step took. ``grads`` None: the gradients are in the shared window, and the results go
        there too (None is returned in their place)."""
        began = time.perf_counter()
        if k == 0:
            self.shards.peak_grad_bytes = {}
        self.shards.set_hyperparameters(hyper)
        if grads is None:
            self._step_in_window(k, scale, lookahead)
            return None, time.perf_counter() - began
        dtype = dtype_of(grad_dtype)
        # The gradients are views of the object store's immutable buffers: never scaled in place.
        grads = [from_wire(a, dtype) for a in grads]
        if lookahead:
            return self._step_with_terms(k, grads, scale), time.perf_counter() - began
        params = self.shards.step_sub_group(k, grads, scale, writable=False)
        return self._parameters(params), time.perf_counter() - began

    def _step_in_window(self, k: int, scale: float, lookahead: bool) -> None:
        """Update sub-group ``k`` from the window's gradients (the rank does not read them again:
        an fp32 one may be scaled in place) into the window's result rows."""
        window, chunks = self.window, range(self._first[k], self._first[k] + len(self.sub_groups[k]))
        grads = [window.grad(i) for i in chunks]
        if lookahead:  # the parameters too (the fused pass writes the terms beside them), unread
            sizes = [c.numel for c in self.sub_groups[k]]
            outs = torch.split(self._buffer(sum(sizes)), sizes)
            self.shards.step_sub_group(k, grads, scale, outs=list(outs),
                                       terms=[(window.out(0, i), window.out(1, i)) for i in chunks])
        else:
            self.shards.step_sub_group(k, grads, scale, outs=[window.out(0, i) for i in chunks])

    def _step_with_terms(self, k: int, grads: list[torch.Tensor], scale: float) -> tuple[list, list]:
        """Update sub-group ``k`` writing its chunks' lookahead ``base`` and ``rate`` in the model
        dtype (in the update's own pass where it is fused), into reused buffers (as ``_parameters``)."""
        sizes = [c.numel for c in self.sub_groups[k]]
        if self._terms is None or self._terms.shape[1] < sum(sizes):
            self._terms = torch.empty(3, sum(sizes), dtype=self.model_dtype)  # parameters, bases, rates
        rows = [list(torch.split(row[:sum(sizes)], sizes)) for row in self._terms]
        self.shards.step_sub_group(k, grads, scale, writable=False, outs=rows[0], terms=list(zip(rows[1], rows[2])))
        return [to_wire(t) for t in rows[1]], [to_wire(t) for t in rows[2]]

    def parameters(self) -> list[np.ndarray]:
        """Every chunk's parameters in the model dtype (the masters rounded)."""
        return [to_wire(p.detach().to(self.model_dtype)) for p in self.shards.params]

    def _parameters(self, params: list[nn.Parameter]) -> list[np.ndarray]:
        """The chunks' masters in the model dtype, written into one reused buffer (Ray copies a
        return value into the object store before the next call runs, so reuse is safe)."""
        if self.model_dtype == torch.float32:
            return [to_wire(p.detach()) for p in params]
        buffer, out, offset = self._buffer(sum(p.numel() for p in params)), [], 0
        for p in params:
            out.append(to_wire(buffer[offset:offset + p.numel()].copy_(p.detach())))
            offset += p.numel()
        return out

    def _buffer(self, size: int) -> torch.Tensor:
        """``size`` elements of one reused model-dtype buffer."""
        if self._out is None or self._out.numel() < size:
            self._out = torch.empty(size, dtype=self.model_dtype)
        return self._out[:size]

    def export(self, ranges: dict[int, tuple[int, int]], with_optimizer: bool):
        segments = [Segment(s.unit, s.lo, s.hi, s.master.clone(), {k: v.clone() for k, v in s.states.items()})
                    for s in self.shards.export(ranges, with_optimizer)]
        dtypes, scalars = self.shards.scalars() if with_optimizer else ({}, {})
        return segments, dtypes, scalars

    def load(self, parts: list[tuple], kinds: list[dict[str, str]], scalars) -> list[np.ndarray]:
        """Set masters and states from ``parts``, ``(unit, lo, hi, master, states)`` over this
        actor's chunks only (``unit.local`` offsets, wire arrays), with ``kinds[unit]`` the state
        kinds (and dtypes) the rank has for each unit; returns every chunk's parameters in the
        model dtype."""
        tensors = [(unit, lo, hi, from_wire(master, torch.float32),
                    {kind: from_wire(values, dtype_of(dtype)) for kind, (values, dtype) in states.items()})
                   for unit, lo, hi, master, states in parts]
        return self._load(tensors, kinds, scalars)

    def _load(self, parts: list[tuple], kinds: list[dict[str, str]], scalars) -> list[np.ndarray]:
        """``load`` with tensors in ``parts``.

        ``MasterShards.load`` takes one range per unit: each unit's parts go into tensors over
        the span they cover, of which only this actor's chunks are written or read (the rest of
        the span is never touched, so its pages are never faulted in)."""
        spans = []
        for unit, unit_kinds in enumerate(kinds):
            mine = [p for p in parts if p[0] == unit]
            lo, hi = (min(p[1] for p in mine), max(p[2] for p in mine)) if mine else (0, 0)
            spans.append(UnitRange(lo, hi, torch.empty(hi - lo, dtype=torch.float32),
                                   {k: torch.empty(hi - lo, dtype=dtype_of(d)) for k, d in unit_kinds.items()}))
        for unit, lo, hi, master, states in parts:
            span = spans[unit]
            span.master[lo - span.start:hi - span.start].copy_(master)
            for kind, values in states.items():
                span.states[kind][lo - span.start:hi - span.start].copy_(values)
        self.shards.load(spans, scalars)
        return [to_wire(p.detach().to(self.model_dtype)) for p in self.shards.params]

    # --- checkpoint loads read here (ActorTier.remote_load) ----------------------------------------------
    def stage(self, source, plan: list[tuple], kinds: list[str]) -> tuple[str, str] | None:
        """Read this actor's ranges of a checkpoint itself and keep them until ``load_staged``.
        ``source`` reads them (a ``CheckpointReader``: each file verified against the manifest);
        ``plan`` lists ``(unit, lo, hi, pieces)``: the range ``[lo, hi)`` of a chunk
        (``unit.local`` offsets) and its parameters' pieces ``(name, start, end, offset in the
        range)``; ``kinds`` are the state kinds to read, the fp32 master first. Returns None, or
        ``(error class, message)`` for a damaged or unfit checkpoint, which the rank raises
        (nothing is staged then)."""
        from raydeep.errors import CheckpointError

        self._staged = None
        parts = []
        try:
            for unit, lo, hi, pieces in plan:
                out = {kind: torch.empty(hi - lo, dtype=source.state_dtype(kind)) for kind in kinds}
                for name, start, end, offset in pieces:
                    for kind, values in out.items():
                        values[offset:offset + end - start].copy_(source.read_range(kind, name, start, end))
                master = out.pop(kinds[0])
                parts.append((unit, lo, hi, master, out))
        except CheckpointError as err:
            return type(err).__name__, str(err)
        self._staged = parts
        return None

    def load_staged(self, kinds: list[dict[str, str]], scalars) -> list[np.ndarray]:
        """``load`` from what ``stage`` read."""
        parts, self._staged = self._staged, None
        assert parts is not None, "offload actor: nothing staged to load"
        return self._load(parts, kinds, scalars)

    def reload(self, chunks: list[int], values: list[np.ndarray]) -> None:
        """Chunks whose parameters were overwritten on the rank: take their masters from them."""
        with torch.no_grad():
            for i, a in zip(chunks, values):
                self.shards.params[i].copy_(from_wire(a, self.model_dtype))

    def memory(self) -> dict[str, int]:
        masters = sum(p.numel() * 4 for p in self.shards.params)
        states = sum(self.shards.memory().values())
        return {"master": masters, "optimizer_states": states,
                "step_buffers": sum(self.shards.peak_grad_bytes.values())}

    # --- checkpoints (see the module docstring) -------------------------------------------------------
    def snapshot(self, key: str, ranges: dict[int, tuple[int, int]]):
        """Copy, here, the masters and per-element states of this actor's chunk parts inside
        ``ranges`` (in chunk order, one tensor per kind), kept under ``key`` until written (one
        snapshot at a time: a new one replaces an unwritten one); returns the state dtypes and
        scalars."""
        self._saved = None
        segments = self.shards.export(ranges, True)
        dtypes, scalars = self.shards.scalars()
        master = torch.cat([s.master for s in segments]) if segments else torch.zeros(0)
        states = {k: torch.cat([s.states[k] for s in segments]) if segments else torch.zeros(0, dtype=d)
                  for k, d in dtypes.items()}
        self._saved = (key, master, states)
        return dtypes, scalars

    def _snapshot(self, key: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if self._saved is None or self._saved[0] != key:
            raise RuntimeError(f"offload actor: no snapshot {key} to write (a newer one replaced it?)")
        return self._saved[1], self._saved[2]

    def write_snapshot(self, key: str, sink, name: str) -> dict | None:
        """Write snapshot ``key`` as file ``name`` through ``sink`` and drop it; returns the
        sink's entry (digest and size), or None, keeping the snapshot, when this node cannot
        see where the rank writes (``sink.reachable()``)."""
        master, states = self._snapshot(key)
        if not sink.reachable():
            return None
        entry = sink(name, master, states)
        self._saved = None
        return entry

    def fetch_snapshot(self, key: str) -> tuple[np.ndarray, dict]:
        """Snapshot ``key`` handed to the rank (wire arrays), and dropped here."""
        master, states = self._snapshot(key)
        self._saved = None
        return to_wire(master), wire_states(states)

    def discard_snapshot(self, key: str) -> None:
        """Drop snapshot ``key`` if it is still held (a save that failed)."""
        if self._saved is not None and self._saved[0] == key:
            self._saved = None
