"""ActorTier: the fp32 masters and optimizer states in Ray actors on CPU nodes.

Accelerator nodes are scarce and CPU nodes plentiful, so each rank's masters and optimizer states
can live in ``OffloadActor`` processes on nodes marked for offload (a custom resource, or a node
label ``key=value``; ``raydeep.offload_resource``). The rank keeps only its parameters, gradients
and the hyperparameters the LR schedulers write.

A step, per sub-group k (``sub_group_size`` elements at most; with Adam/AdamW at most the transfer
tile, ``raydeep.offload_tile_size``: ``raydeep.tier.pieces.pieces_of``): the rank puts the owned
gradient chunks (model dtype, as numpy buffers) into the object store and calls ``step`` on the
actor that owns sub-group k (k mod the number of actors); the actor reads them zero-copy
(read-only: an object-store buffer is immutable, so even an fp32 gradient is scaled into a copy),
multiplies by the one scale, runs the torch optimizer on its fp32 masters, and returns the updated
parameters in the model dtype, which the rank copies into ``unit.local``. The overflow and clipping
decisions were made on the rank before anything was sent. What runs in the actor process, and how
tensors travel, is ``raydeep.tier.offload_actor``; an actor on the rank's own node exchanges them
through shared memory instead of the object store (``raydeep.tier.shared_window``).

Note: at most ``2 x actors`` sub-groups are in flight per rank (``in_flight_limit``): one
computing on each actor and the next queued behind it, which is all the overlap an actor that
runs its calls in order can use; more would only hold more gradients (and results) in the
object store at once, which for a large shard means spilling to disk. A step is ``_submit``
(captures the scale and the hyperparameters, and sends the first pieces: ``_put`` copies
their gradients into the object store) then ``_collect`` (the only writer of ``unit.local``);
``step`` is ``_collect(_submit(...))``. Whoever drives the pipeline takes the results oldest
first and sends the next piece into each freed place before copying the result. In a ``step``
that is ``_collect`` itself, reading the gradient shards where they are, so they must not change
until it returns. The delayed parameter update (``submit``/``complete``, the engine's
``raydeep.delayed_update``) runs while the next forward and backward do, after the engine has
cleared the gradients: there ``_submit`` copies the gradients once, into the object store (2
bytes per element of the shard in bf16, freed piece by piece as the actors finish with them) or
the shared window, a driver thread sends the pieces and takes the results, and ``_collect``
waits for it and lands them in ``unit.local``. A CPU rank lands them where they arrived (the
object store's buffers, or the window); on an accelerator the driver copies them into held host
buffers as they arrive (2 bytes per element, 4 with the lookahead), which travel to the device
at landing.

Checkpoints (``remote_snapshot``, ``remote_load``): ``raydeep.tier.remote_snapshot``.
Fault model and ownership: ``raydeep.tier.actor_faults``.
"""
from __future__ import annotations

import time
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from torch import nn

from raydeep.tier import actor_faults, remote_snapshot, shared_window
from raydeep.tier.actor_faults import OffloadActorLost, actors_owned_by, fetch, lost_errors
from raydeep.tier.base import OptimizerTier, UnitRange
from raydeep.tier.local import DEFAULT_TILE, wait_for_copies
from raydeep.tier.lookahead import look_ahead, rate_buffers
from raydeep.tier.masters import plan_sub_groups
from raydeep.tier.pieces import pieces_of
from raydeep.tier.offload_actor import OffloadActor, from_wire, payload_bytes, to_wire, wire_states
from raydeep.tier.remote_snapshot import RemoteSnapshot, merged_parts
from raydeep.tier.shared_window import WindowLayout
from raydeep.zero.flat import FlatUnit

__all__ = ["ActorTier", "OffloadActor", "OffloadActorLost", "RemoteSnapshot", "StepHandle", "actors_owned_by", "fetch",
           "from_wire", "lost_errors", "to_wire"]

# An offload actor takes this much of the marking resource: the resource marks nodes, the CPUs
# an actor asks for (``offload_actor_cpus``) are what limit how many fit on one.
RESOURCE_SHARE = 0.001

@dataclass
class StepHandle:
    """An update ``ActorTier._submit`` started and ``ActorTier._collect`` finishes."""

    grads: list[torch.Tensor]  # the gradient shards: pieces from ``next`` on are not sent yet
    scale: float
    hyper: list[dict]  # the hyperparameters at submit time
    grad_dtype: str
    began: float
    lookahead: bool = False  # the actors return the lookahead's (bases, rates), not parameters
    sent: list = field(default_factory=list)  # background: each sub-group's gradients, put in the object store
    next: int = 0  # the next sub-group to send
    in_flight: deque = field(default_factory=deque)  # (sub-group, call), oldest first
    out: list[torch.Tensor] = field(default_factory=list)  # where results go: each ``unit.local``, or held
    rates: list[torch.Tensor] = field(default_factory=list)  # with the lookahead: where its rates go (held)
    in_store: bool = False  # background on a CPU rank: results stay where they arrived until landed
    results: dict[int, list] = field(default_factory=dict)  # ... each sub-group's arrays (None: in its window)
    driver: Future | None = None  # the thread running ``_drive``, in the background
    held_back: bool = False  # submitted, nothing sent yet: ``release`` sends
    copying: float = 0.0  # seconds this process spent copying gradients and parameters and sending
    computing: dict[int, float] = field(default_factory=dict)  # CPU-step seconds per actor
    finished: float = 0.0  # when the last result was taken


class ActorTier(OptimizerTier):
    """This rank's optimizer tier in ``actors_per_rank`` offload actors (see the module docstring).

    ``make_optimizer`` must pickle (the actors build the optimizer); ``placement`` are the Ray
    actor options that select offload nodes (``resources`` or ``label_selector``).
    """

    def __init__(self, units: list[FlatUnit], group_options: list[dict], make_optimizer: Callable,
                 sub_group_size: int, placement: dict, actors_per_rank: int = 1, cpus_per_actor: float = 1,
                 start_timeout: float = 300.0, threads: int | None = None, lookahead: bool = False,
                 tile: int = DEFAULT_TILE, shared_memory: bool = True):
        import ray

        self.units = units
        # Hyperparameters live on the rank, in a torch optimizer over one placeholder per group, so
        # DeepSpeed's and torch's LR schedulers drive this tier as they drive any optimizer.
        self._holder = make_optimizer([{**o, "params": [nn.Parameter(torch.zeros(1))]} for o in group_options])
        self.sub_groups = plan_sub_groups([u.local.numel() for u in units], [u.group_index for u in units],
                                          pieces_of(sub_group_size, tile, self._holder))
        count = max(1, min(actors_per_rank, len(self.sub_groups)))
        # Sub-group k goes to actor k mod count, so consecutive sub-groups overlap across actors too.
        self.owner = [(k % count, k // count) for k in range(len(self.sub_groups))]
        self.in_flight_limit = 2 * count  # see the module docstring's note
        self._pending: StepHandle | None = None
        self._staged: dict[str, str] | None = None  # after remote_load: the state kinds (and dtypes) staged
        # Background updates on an accelerator: held host buffers for parameters (or bases), rates.
        self._held: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
        self._grad_bytes = 0  # the gradients a background update keeps in the object store
        self.land_from_store = not units or units[0].local.device.type == "cpu"  # a CPU rank: no copy
        self.lookahead = lookahead  # background updates land as raydeep.tier.lookahead predicts
        self._rates: list[torch.Tensor] = []  # the lookahead's, beside each ``unit.local``
        self._driver: ThreadPoolExecutor | None = None
        # Array bytes sent to and received from the actors (gradients, parameters, states).
        self.traffic = {"sent": 0, "received": 0}
        tag = uuid.uuid4().hex[:12]  # named, so `ray list actors` and ray.get_actor can find them
        options = [dict(name=f"raydeep-offload-{tag}-{a}", max_restarts=0, max_task_retries=0,
                        num_cpus=cpus_per_actor, **placement) for a in range(count)]
        args = [(self._mine(a), group_options, make_optimizer, threads or int(max(1, cpus_per_actor)))
                for a in range(count)]
        owner = actor_faults.owner()
        if owner is not None:
            self.actors = owner.create(options, args)
        else:
            remote = ray.remote(OffloadActor)
            self.actors = [remote.options(**o).remote(*a) for o, a in zip(options, args)]
        self.placement = placement
        started = [actor.start.remote([to_wire(self.units[c.unit].local[c.lo:c.hi]) for c in self._chunks(a)],
                                      str(units[0].dtype).removeprefix("torch."))
                   for a, actor in enumerate(self.actors)]
        ready, _ = ray.wait(started, num_returns=len(started), timeout=start_timeout)
        if len(ready) < len(started):
            self.close()
            raise OffloadActorLost(
                f"{len(started) - len(ready)} of {len(started)} offload actors did not start within "
                f"{start_timeout:.0f} s: no node selected by {placement} has {cpus_per_actor} CPU(s) free for each. "
                "Add offload nodes (ray start --resources='{\"<resource>\": 1}' --num-cpus N) or set "
                "raydeep.offload_target to \"host\"")
        self.node_ids = self._get(started)
        here = ray.get_runtime_context().get_node_id()
        self.windows = shared_window.share(self.actors, [self._layout(a) if shared_memory and node == here else None
                                                         for a, node in enumerate(self.node_ids)], tag)
        # Each sub-group's chunks' indices in its actor's order (its window's).
        self._in_window, at = [], [0] * len(self.actors)
        for k, (a, _) in enumerate(self.owner):
            self._in_window.append(range(at[a], at[a] + len(self.sub_groups[k])))
            at[a] += len(self.sub_groups[k])
        self.timings = {"steps": 0, "step_s": 0.0, "cpu_step_s": 0.0, "transfer_s": 0.0}

    def _mine(self, a: int) -> list[list]:
        return [sg for k, sg in enumerate(self.sub_groups) if self.owner[k][0] == a]

    def _chunks(self, a: int) -> list:
        """Actor ``a``'s chunks in its own (flat) order."""
        return [c for sg in self._mine(a) for c in sg]

    def _layout(self, a: int) -> WindowLayout | None:
        """Actor ``a``'s shared window: its chunks' gradients and results (None: mixed gradient dtypes)."""
        grad_dtypes = {u.grad.dtype if getattr(u, "grad", None) is not None else u.dtype for u in self.units}
        if len(grad_dtypes) != 1 or len({u.dtype for u in self.units}) != 1:
            return None
        return WindowLayout(tuple(c.numel for c in self._chunks(a)), grad_dtypes.pop(), self.units[0].dtype,
                            2 if self.lookahead else 1)

    def _get(self, refs):
        out = fetch(refs)
        self.traffic["received"] += payload_bytes(out)
        return out

    def _call(self, method, *args):
        self.traffic["sent"] += payload_bytes(args)
        return method.remote(*args)

    # --- the optimizer surface ----------------------------------------------------------------------
    @property
    def param_groups(self) -> list[dict]:
        return self._holder.param_groups

    @property
    def defaults(self) -> dict:
        return self._holder.defaults

    @property
    def optimizer_name(self) -> str:
        return type(self._holder).__name__

    @property
    def torch_optimizer(self) -> torch.optim.Optimizer:
        return self._holder

    def _hyper(self) -> list[dict]:
        return [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]

    # --- the update -----------------------------------------------------------------------------------
    def step(self, grad_shards: list[torch.Tensor], scale: float) -> None:
        self._collect(self._submit(grad_shards, scale))

    def _submit(self, grad_shards: list[torch.Tensor], scale: float, background: bool = False,
                hold: bool = False) -> StepHandle:
        """Start an update: capture ``scale`` and the hyperparameters, send the first
        ``in_flight_limit`` pieces. ``grad_shards`` must not change until ``_collect`` returns
        (it sends the rest), unless ``background``: then they are copied here first, a driver
        thread sends the rest and takes the results into held buffers, and ``_collect`` waits
        for it and copies them into ``unit.local``. With ``hold`` (background only) nothing is sent
        until ``release``."""
        assert self._pending is None, "the previous update was not collected"
        grad_dtype = str(grad_shards[0].dtype).removeprefix("torch.") if grad_shards else "float32"
        handle = StepHandle(list(grad_shards), scale, self._hyper(), grad_dtype, time.perf_counter(),
                            lookahead=background and self.lookahead)
        handle.out = [u.local for u in self.units]
        if background:
            # The engine clears the gradients next: they are copied once, into the object store,
            # where the pieces wait to be sent. A CPU rank lands the results from the object
            # store's buffers (``_land``); on an accelerator they are copied into held host
            # buffers as they arrive, to travel to the device at landing.
            handle.sent = [self._put(handle.grads, k) for k in range(len(self.sub_groups))]
            handle.grads = []
            handle.in_store = self.land_from_store
            if self._held is None:
                pin = any(u.local.is_cuda for u in self.units)  # copied to the device at landing
                self._held = ([], []) if handle.in_store else (
                    [torch.empty(u.local.numel(), dtype=u.dtype, pin_memory=pin) for u in self.units],
                    [torch.empty(u.local.numel(), dtype=u.dtype, pin_memory=pin) for u in self.units]
                    if self.lookahead else [])
                self._rates = rate_buffers([u.local for u in self.units]) if self.lookahead else []
            handle.out, handle.rates = self._held
            self._grad_bytes = sum(c.numel * grad_shards[c.unit].element_size() for k, ref in enumerate(handle.sent)
                                   if ref is not None for c in self.sub_groups[k])  # in the object store
            handle.copying = time.perf_counter() - handle.began
        self._pending = handle
        handle.held_back = hold
        if not hold:
            self._start(handle, background)
        return handle

    def _start(self, handle: StepHandle, background: bool) -> None:
        try:
            self._send(handle)
        except BaseException:
            self._pending = None
            raise
        if background:
            if self._driver is None:
                self._driver = ThreadPoolExecutor(1, thread_name_prefix="raydeep-offload")
            handle.driver = self._driver.submit(self._drive, handle)

    def release(self) -> None:
        handle = self._pending
        if handle is not None and handle.held_back:
            handle.held_back = False
            self._start(handle, background=True)

    def _send(self, handle: StepHandle) -> None:
        """Send pieces until ``in_flight_limit`` are in flight or none is left."""
        began = time.perf_counter()
        while len(handle.in_flight) < self.in_flight_limit and handle.next < len(self.sub_groups):
            k = handle.next
            a, local_k = self.owner[k]
            if handle.sent:  # the call holds the object now: it is freed once the actor is done with it
                payload, handle.sent[k] = handle.sent[k], None
            else:
                payload = self._put(handle.grads, k)
            handle.in_flight.append((k, self._call(self.actors[a].step, local_k, payload, handle.grad_dtype,
                                                   handle.scale, handle.hyper, handle.lookahead)))
            handle.next += 1
        handle.copying += time.perf_counter() - began

    def _put(self, grads: list[torch.Tensor], k: int):
        """Sub-group ``k``'s gradients, copied into its actor's shared window (None is returned:
        the actor reads them there), or into the object store."""
        import ray

        window = self.windows[self.owner[k][0]]
        if window is not None and all(grads[c.unit].dtype == window.layout.grad_dtype for c in self.sub_groups[k]):
            for i, c in zip(self._in_window[k], self.sub_groups[k]):
                window.grad(i).copy_(grads[c.unit][c.lo:c.hi])
                self.traffic["sent"] += c.numel * grads[c.unit].element_size()
            return None
        payload = [to_wire(grads[c.unit][c.lo:c.hi]) for c in self.sub_groups[k]]
        self.traffic["sent"] += payload_bytes(payload)
        return ray.put(payload)

    def _drive(self, handle: StepHandle) -> None:
        """Take each result, oldest first, send the next piece into its place, and copy the
        parameters into ``handle.out``, until every piece is back."""
        while handle.in_flight:
            k, call = handle.in_flight.popleft()
            arrays, seconds = self._get(call)
            if arrays is None:  # in the shared window: counted here, as ``_get`` counts arrays
                layout = self.windows[self.owner[k][0]].layout
                self.traffic["received"] += (sum(c.numel for c in self.sub_groups[k]) * layout.out_dtype.itemsize
                                             * (1 + handle.lookahead))
            self._send(handle)  # the freed place first: the actor gets its next piece while we copy
            started = time.perf_counter()
            if handle.in_store:
                handle.results[k] = arrays
            else:
                for c, value, rate in self._results(k, arrays, handle.lookahead):
                    handle.out[c.unit][c.lo:c.hi].copy_(value)
                    if rate is not None:
                        handle.rates[c.unit][c.lo:c.hi].copy_(rate)
            handle.copying += time.perf_counter() - started
            handle.computing[self.owner[k][0]] = handle.computing.get(self.owner[k][0], 0.0) + seconds
        handle.finished = time.perf_counter()

    def _collect(self, handle: StepHandle, ahead: tuple[list[torch.Tensor], float] | None = None) -> None:
        """Finish the update ``handle``; the only writer of ``unit.local`` (see ``_submit``). An
        update with the lookahead lands as ``base - rate * gradient`` from ``ahead`` (this step's
        gradient shards and scale), or, without them, as the masters' parameters, fetched."""
        assert handle is self._pending, "not the update in flight"
        self.release()
        try:
            if handle.driver is None:
                self._drive(handle)
            else:
                handle.driver.result()
                started = time.perf_counter()
                if handle.lookahead and ahead is None:  # landed for its own sake (a save, an overflow,
                    handle.results.clear()              # the end): no prediction
                    self._take_parameters([self._call(actor.parameters) for actor in self.actors])
                else:
                    self._land(handle, ahead)
                handle.finished = time.perf_counter()
                handle.copying += handle.finished - started
        finally:
            self._pending, handle.grads, handle.out, handle.rates, handle.results = None, [], [], [], {}
        t = self.timings
        t["steps"] += 1
        t["step_s"] += handle.finished - handle.began
        t["cpu_step_s"] += max(handle.computing.values(), default=0.0)
        t["transfer_s"] += handle.copying

    def _land(self, handle: StepHandle, ahead: tuple[list[torch.Tensor], float] | None) -> None:
        """Write a background update's results into ``unit.local``: its parameters, or with the
        lookahead ``base - rate * gradient`` from ``ahead`` (this step's gradients and scale)."""
        if not handle.in_store:  # held host buffers
            for i, (unit, out) in enumerate(zip(self.units, handle.out)):
                if handle.lookahead:
                    look_ahead(unit.local, out, handle.rates[i], self._rates[i], ahead[0][i], ahead[1])
                else:
                    unit.local.copy_(out, non_blocking=out.is_pinned())
            wait_for_copies(self.units)  # the next update's driver rewrites the held buffers
            return
        for k, arrays in handle.results.items():
            for c, value, rate in self._results(k, arrays, handle.lookahead):
                local = self.units[c.unit].local[c.lo:c.hi]
                if rate is None:
                    local.copy_(value)
                else:
                    look_ahead(local, value, rate, None, ahead[0][c.unit][c.lo:c.hi], ahead[1])

    def _results(self, k: int, arrays, lookahead: bool):
        """Sub-group ``k``'s ``(chunk, parameters or lookahead base, its rate or None)``, read-only:
        from ``arrays``, or where they are None from the actor's shared window."""
        if arrays is None:
            window = self.windows[self.owner[k][0]]
            for i, c in zip(self._in_window[k], self.sub_groups[k]):
                yield c, window.out(0, i), window.out(1, i) if lookahead else None
            return
        values, rates = arrays if lookahead else (arrays, None)
        for i, c in enumerate(self.sub_groups[k]):
            dtype = self.units[c.unit].dtype
            yield c, from_wire(values[i], dtype), None if rates is None else from_wire(rates[i], dtype)

    # The delayed parameter update (``OptimizerTier.submit``): the update runs in the background
    # while the next forward and backward do, and lands at the next ``submit`` or ``complete``.
    @property
    def pending(self) -> bool:
        return self._pending is not None

    def submit(self, grad_shards: list[torch.Tensor], scale: float) -> None:
        """Land the pending update (with the lookahead: as this step's gradients predict), then
        take this one (the gradients are copied: the engine clears them next); it starts in the
        background at ``release``."""
        if self._pending is not None:
            self._collect(self._pending, ahead=(grad_shards, scale))
        self._submit(grad_shards, scale, background=True, hold=True)

    def complete(self) -> None:
        if self._pending is not None:
            self._collect(self._pending)

    def reload_from_params(self, indices: list[int]) -> None:
        assert self._pending is None, "an update is in flight"
        wanted = set(indices)
        for a, actor in enumerate(self.actors):
            chunks = [(i, c) for i, c in enumerate(self._chunks(a)) if c.unit in wanted]
            if chunks:
                self._get(self._call(actor.reload, [i for i, _ in chunks],
                                     [to_wire(self.units[c.unit].local[c.lo:c.hi]) for _, c in chunks]))

    # --- state over element ranges ----------------------------------------------------------------------
    def _export(self, ranges, with_optimizer):
        assert self._pending is None, "an update is in flight"
        parts = self._get([a.export.remote(ranges, with_optimizer) for a in self.actors])
        dtypes, scalars = merged_parts([(part_dtypes, part_scalars) for _, part_dtypes, part_scalars in parts])
        return [s for part_segments, _, _ in parts for s in part_segments], dtypes, scalars

    def _import(self, pieces: list[UnitRange], scalars) -> None:
        """Each actor gets the parts of ``pieces`` inside its own chunks, and nothing else; after
        ``remote_load`` each loads what it staged instead (``pieces`` are not read)."""
        assert self._pending is None, "an update is in flight"
        if self._staged is not None:
            kinds, self._staged = [self._staged] * len(self.units), None
            self._take_parameters([self._call(actor.load_staged, kinds, scalars) for actor in self.actors])
            return
        kinds = [{k: str(v.dtype).removeprefix("torch.") for k, v in p.states.items()} for p in pieces]
        calls = []
        for a, actor in enumerate(self.actors):
            parts = []
            for c in self._chunks(a):
                piece = pieces[c.unit]
                lo, hi = max(piece.start, c.lo), min(piece.end, c.hi)
                if lo < hi:
                    cut = slice(lo - piece.start, hi - piece.start)
                    parts.append((c.unit, lo, hi, to_wire(piece.master[cut]),
                                  wire_states({k: v[cut] for k, v in piece.states.items()})))
            calls.append(self._call(actor.load, parts, kinds, scalars))
        self._take_parameters(calls)

    def _take_parameters(self, calls: list) -> None:
        """Copy what each actor's ``calls[a]`` returns, its chunks' parameters, into ``unit.local``."""
        for a, arrays in enumerate(self._get(calls)):
            for c, arr in zip(self._chunks(a), arrays):
                self.units[c.unit].local[c.lo:c.hi].copy_(from_wire(arr, self.units[c.unit].dtype))

    def remote_load(self, source, kinds: list[str], pieces_in: Callable) -> None:
        """Phase 1 of a checkpoint load, done by the actors: ``remote_snapshot.stage_load``."""
        assert self._pending is None, "an update is in flight"
        self._staged = remote_snapshot.stage_load(self, source, kinds, pieces_in)

    def remote_snapshot(self, ranges: list[tuple[int, int]]) -> RemoteSnapshot:
        """Like ``state_dict(ranges)``, but the masters and states are copied inside the actors and
        stay there, to be written by them: ``remote_snapshot.take``."""
        assert self._pending is None, "an update is in flight"
        return remote_snapshot.take(self, ranges)

    # --- accounting and lifetime ----------------------------------------------------------------------
    def memory(self) -> dict[str, dict[str, int]]:
        held: dict[str, dict[str, int]] = {"master": {}, "optimizer_states": {}, "step_buffers": {}}
        for node, found in zip(self.node_ids, self._get([a.memory.remote() for a in self.actors])):
            for kind, nbytes in found.items():
                held[kind][f"actor:{node}"] = held[kind].get(f"actor:{node}", 0) + nbytes
        # The background update's gradients in the object store, its host copies (parameters or
        # bases, rates) and the lookahead's rates on the device.
        buffers = [t for ts in (self._held or ()) for t in ts] + [r for r in self._rates if r is not None]
        for t in buffers:
            place = str(t.device)
            held["step_buffers"][place] = held["step_buffers"].get(place, 0) + t.numel() * t.element_size()
        shared = self._grad_bytes + sum(w.nbytes for w in self.windows if w is not None)
        if shared:
            held["step_buffers"]["cpu"] = held["step_buffers"].get("cpu", 0) + shared
        return held

    def report(self) -> dict:
        held = self.memory()
        steps = max(1, self.timings["steps"])
        return {"tier": "actors", "actors": len(self.actors), "node_ids": sorted(set(self.node_ids)),
                "shared_memory": sum(w is not None for w in self.windows),  # actors on this node
                "bytes_held": sum(sum(v.values()) for k, v in held.items() if k != "step_buffers"),
                "step_s": self.timings["step_s"] / steps, "transfer_s": self.timings["transfer_s"] / steps,
                "cpu_step_s": self.timings["cpu_step_s"] / steps}

    def close(self) -> None:
        import ray

        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors, self.windows = [], []
        if self._driver is not None:  # a background update still running fails at once, unread
            self._driver.shutdown()
            self._driver = None
        self._pending = None
