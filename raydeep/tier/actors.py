"""ActorTier: the fp32 masters and optimizer states in Ray actors on CPU nodes.

Accelerator nodes are scarce and CPU nodes plentiful, so each rank's masters and optimizer states
can live in ``OffloadActor`` processes on nodes marked for offload (a custom resource, or a node
label ``key=value``; ``raydeep.offload_resource``). The rank keeps only its parameters, gradients
and the hyperparameters the LR schedulers write.

A step, per sub-group k (``sub_group_size`` elements at most): the rank puts the owned gradient
chunks (model dtype, as numpy buffers) into the object store and calls ``step`` on the actor
that owns sub-group k; the actor reads them zero-copy, multiplies by the one scale, runs the torch
optimizer on its fp32 masters, and returns the updated parameters in the model dtype, which the
rank copies into ``unit.local``. All calls are submitted before the first result is awaited, so
sub-group k+1 is in transit while the actor computes sub-group k (an actor runs its calls in
order). The overflow and clipping decisions were made on the rank before anything was sent.

Fault model: Ray Train restarts the whole worker group. The actors are created by the worker
with ``max_restarts=0``, so they share its fate: they die with it, and a dead actor fails the
attempt (``OffloadActorLost``, retried) whose next attempt recreates them from the checkpoint.
No placement group is created, so none can leak.
"""
from __future__ import annotations

import time
import uuid
import warnings
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from raydeep.tier.base import OptimizerTier, UnitRange
from raydeep.tier.masters import MasterShards, Segment, plan_sub_groups
from raydeep.zero.flat import FlatUnit

# An offload actor takes this much of the marking resource: the resource marks nodes, the CPUs
# an actor asks for (``offload_actor_cpus``) are what limit how many fit on one.
RESOURCE_SHARE = 0.001


class OffloadActorLost(RuntimeError):
    """An offload actor died (its node was lost or it was killed). Retryable: Ray Train restarts
    the worker group, whose next attempt recreates the actors from the last checkpoint."""


def to_wire(t: torch.Tensor) -> np.ndarray:
    """A tensor's bytes as a numpy array Ray stores zero-copy (numpy has no bfloat16: its bits
    travel as int16)."""
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


class OffloadActor:
    """Holds a ``MasterShards`` over the sub-groups a rank gave it (a Ray actor; see the module
    docstring). Every method is called by the owning rank only."""

    def __init__(self, sub_groups, group_options: list[dict], make_optimizer: Callable, threads: int):
        torch.set_num_threads(max(1, threads))
        self.sub_groups, self.group_options, self.make_optimizer = sub_groups, group_options, make_optimizer
        self.shards: MasterShards | None = None
        self.model_dtype = torch.float32
        self._out: torch.Tensor | None = None

    def start(self, masters: list[np.ndarray], dtype_name: str) -> str:
        """Build the fp32 masters from the rank's parameters (model dtype); returns the node id."""
        import ray

        self.model_dtype = getattr(torch, dtype_name)
        fp32 = [from_wire(a, self.model_dtype).to(torch.float32, copy=True) for a in masters]
        self.shards = MasterShards(self.sub_groups, fp32, self.group_options, self.make_optimizer)
        return ray.get_runtime_context().get_node_id()

    def step(self, k: int, grads: list[np.ndarray], grad_dtype: str, scale: float,
             hyper: list[dict]) -> tuple[list[np.ndarray], float]:
        """Update sub-group ``k``; returns its chunks' parameters in the model dtype and the seconds
        the CPU step took."""
        began = time.perf_counter()
        if k == 0:
            self.shards.peak_grad_bytes = {}
        self.shards.set_hyperparameters(hyper)
        dtype = getattr(torch, grad_dtype)
        params = self.shards.step_sub_group(k, [from_wire(a, dtype) for a in grads], scale)
        return self._parameters(params), time.perf_counter() - began

    def _parameters(self, params: list[nn.Parameter]) -> list[np.ndarray]:
        """The chunks' masters in the model dtype, written into one reused buffer (Ray copies a
        return value into the object store before the next call runs, so reuse is safe)."""
        if self.model_dtype == torch.float32:
            return [to_wire(p.detach()) for p in params]
        size = sum(p.numel() for p in params)
        if self._out is None or self._out.numel() < size:
            self._out = torch.empty(size, dtype=self.model_dtype)
        out, offset = [], 0
        for p in params:
            out.append(to_wire(self._out[offset:offset + p.numel()].copy_(p.detach())))
            offset += p.numel()
        return out

    def export(self, ranges: dict[int, tuple[int, int]], with_optimizer: bool):
        segments = [Segment(s.unit, s.lo, s.hi, s.master.clone(), {k: v.clone() for k, v in s.states.items()})
                    for s in self.shards.export(ranges, with_optimizer)]
        dtypes, scalars = self.shards.scalars() if with_optimizer else ({}, {})
        return segments, dtypes, scalars

    def load(self, pieces: list[UnitRange], scalars) -> list[np.ndarray]:
        """Set masters and states; returns every chunk's parameters in the model dtype."""
        self.shards.load(pieces, scalars)
        return [to_wire(p.detach().to(self.model_dtype)) for p in self.shards.params]

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


class ActorTier(OptimizerTier):
    """This rank's optimizer tier in ``actors_per_rank`` offload actors (see the module docstring).

    ``make_optimizer`` must pickle (the actors build the optimizer); ``placement`` are the Ray
    actor options that select offload nodes (``resources`` or ``label_selector``).
    """

    def __init__(self, units: list[FlatUnit], group_options: list[dict], make_optimizer: Callable,
                 sub_group_size: int, placement: dict, actors_per_rank: int = 1, cpus_per_actor: float = 1,
                 start_timeout: float = 300.0):
        import ray

        self.units = units
        self.sub_groups = plan_sub_groups([u.local.numel() for u in units], [u.group_index for u in units],
                                          sub_group_size)
        # Hyperparameters live on the rank, in a torch optimizer over one placeholder per group, so
        # DeepSpeed's and torch's LR schedulers drive this tier as they drive any optimizer.
        self._holder = make_optimizer([{**o, "params": [nn.Parameter(torch.zeros(1))]} for o in group_options])
        count = max(1, min(actors_per_rank, len(self.sub_groups)))
        # Sub-group k goes to actor k mod count, so consecutive sub-groups overlap across actors too.
        self.owner = [(k % count, k // count) for k in range(len(self.sub_groups))]
        remote = ray.remote(OffloadActor)
        tag = uuid.uuid4().hex[:12]  # named, so `ray list actors` and ray.get_actor can find them
        self.actors = [remote.options(name=f"raydeep-offload-{tag}-{a}", max_restarts=0, max_task_retries=0,
                                      num_cpus=cpus_per_actor, **placement)
                       .remote(self._mine(a), group_options, make_optimizer, int(max(1, cpus_per_actor)))
                       for a in range(count)]
        self.placement = placement
        started = [actor.start.remote([to_wire(self.units[c.unit].local[c.lo:c.hi]) for sg in self._mine(a)
                                       for c in sg], str(units[0].dtype).removeprefix("torch."))
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
        self.timings = {"steps": 0, "step_s": 0.0, "cpu_step_s": 0.0, "transfer_s": 0.0}

    def _mine(self, a: int) -> list[list]:
        return [sg for k, sg in enumerate(self.sub_groups) if self.owner[k][0] == a]

    def _get(self, refs):
        import ray

        try:
            return ray.get(refs)
        except ray.exceptions.RayActorError as err:
            raise OffloadActorLost(f"an offload actor of this rank died ({type(err).__name__}); the attempt fails "
                                   "and restarts from the last checkpoint") from err

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
        began, hyper = time.perf_counter(), self._hyper()
        grad_dtype = str(grad_shards[0].dtype).removeprefix("torch.") if grad_shards else "float32"
        calls = []
        for k, sub_group in enumerate(self.sub_groups):  # all submitted first: transfers overlap compute
            a, local_k = self.owner[k]
            payload = [to_wire(grad_shards[c.unit][c.lo:c.hi]) for c in sub_group]
            calls.append(self.actors[a].step.remote(local_k, payload, grad_dtype, scale, hyper))
        copying, computing = time.perf_counter() - began, [0.0] * len(self.actors)
        for k, (sub_group, call) in enumerate(zip(self.sub_groups, calls)):
            arrays, seconds = self._get(call)
            started = time.perf_counter()
            for c, a in zip(sub_group, arrays):
                self.units[c.unit].local[c.lo:c.hi].copy_(from_wire(a, self.units[c.unit].dtype))
            copying += time.perf_counter() - started
            computing[self.owner[k][0]] += seconds
        t = self.timings
        t["steps"] += 1
        t["step_s"] += time.perf_counter() - began
        t["cpu_step_s"] += max(computing)
        t["transfer_s"] += copying

    def reload_from_params(self, indices: list[int]) -> None:
        wanted = set(indices)
        for a, actor in enumerate(self.actors):
            chunks = [(i, c) for i, c in enumerate(c for sg in self._mine(a) for c in sg) if c.unit in wanted]
            if chunks:
                self._get(actor.reload.remote([i for i, _ in chunks],
                                              [to_wire(self.units[c.unit].local[c.lo:c.hi]) for _, c in chunks]))

    # --- state over element ranges ----------------------------------------------------------------------
    def _export(self, ranges, with_optimizer):
        segments, dtypes, scalars = [], {}, {}
        for part_segments, part_dtypes, part_scalars in self._get([a.export.remote(ranges, with_optimizer)
                                                                   for a in self.actors]):
            segments += part_segments
            dtypes.update(part_dtypes)
            for g, found in part_scalars.items():
                scalars.setdefault(g, {}).update(found)
        return segments, dtypes, scalars

    def _import(self, pieces: list[UnitRange], scalars) -> None:
        results = self._get([actor.load.remote(pieces, scalars) for actor in self.actors])
        for a, arrays in enumerate(results):
            for c, arr in zip((c for sg in self._mine(a) for c in sg), arrays):
                self.units[c.unit].local[c.lo:c.hi].copy_(from_wire(arr, self.units[c.unit].dtype))

    # --- accounting and lifetime ----------------------------------------------------------------------
    def memory(self) -> dict[str, dict[str, int]]:
        held: dict[str, dict[str, int]] = {"master": {}, "optimizer_states": {}, "step_buffers": {}}
        for node, found in zip(self.node_ids, self._get([a.memory.remote() for a in self.actors])):
            for kind, nbytes in found.items():
                held[kind][f"actor:{node}"] = held[kind].get(f"actor:{node}", 0) + nbytes
        return held

    def report(self) -> dict:
        held = self.memory()
        steps = max(1, self.timings["steps"])
        return {"tier": "actors", "actors": len(self.actors), "node_ids": sorted(set(self.node_ids)),
                "bytes_held": sum(sum(v.values()) for k, v in held.items() if k != "step_buffers"),
                "step_s": self.timings["step_s"] / steps, "transfer_s": self.timings["transfer_s"] / steps,
                "cpu_step_s": self.timings["cpu_step_s"] / steps}

    def close(self) -> None:
        import ray

        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors = []
