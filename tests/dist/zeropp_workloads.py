"""ZeRO++ workloads for the distributed tests: 4 gloo ranks declared as 2 nodes x 2
(``LOCAL_WORLD_SIZE=2``), and a counter of the bytes each rank sends to another node.

:class:`NodeBytes` counts independently of raydeep's own statistics: it wraps
``torch.distributed.isend`` (on gloo raydeep's all-gathers, reduce-scatters and all-to-alls are
point-to-point exchanges, ``raydeep.comm.exchange``) and attributes each send to the pair of nodes
it crosses, under the phase of the step (forward, backward, step) and the raydeep collective that
issued it (``all_gather`` or ``reduce_scatter``: set by wrapping ``raydeep.comm``'s functions).
"""
from __future__ import annotations

from collections import defaultdict

import torch

from tests.dist.workloads import config, global_batches, tiny_gpt

RANKS_PER_NODE = 2
GATHERS = ("all_gather",)
REDUCES = ("reduce_scatter", "all_to_all")  # qgZ's reduce-scatter is two all-to-alls


class NodeBytes:
    def __init__(self, ranks_per_node: int = RANKS_PER_NODE):
        import torch.distributed as dist

        import raydeep.comm as rcomm

        self.dist, self.rcomm, self.per_node = dist, rcomm, ranks_per_node
        self.me = dist.get_rank()
        self.phase, self.op, self.counting = "forward", "other", False
        self.cross: dict[tuple[str, str], int] = defaultdict(int)
        self.intra: dict[tuple[str, str], int] = defaultdict(int)
        self._saved = {"isend": dist.isend, "all_to_all_single": dist.all_to_all_single}
        dist.isend, dist.all_to_all_single = self._isend, self._all_to_all_single
        for name in GATHERS + REDUCES:
            if hasattr(rcomm, name):
                self._saved[name] = getattr(rcomm, name)
                setattr(rcomm, name, self._labelled(name, getattr(rcomm, name)))

    def _labelled(self, name, original):
        op = "all_gather" if name in GATHERS else "reduce_scatter"

        def labelled(*args, **kwargs):
            outer, self.op = self.op, op
            try:
                return original(*args, **kwargs)
            finally:
                self.op = outer
        return labelled

    def _count(self, dst: int, nbytes: int) -> None:
        if self.counting and dst != self.me:
            crossing = dst // self.per_node != self.me // self.per_node
            (self.cross if crossing else self.intra)[(self.phase, self.op)] += nbytes

    def _isend(self, tensor, dst=None, *args, **kwargs):
        self._count(dst, tensor.numel() * tensor.element_size())
        return self._saved["isend"](tensor, dst, *args, **kwargs)

    def _all_to_all_single(self, output, input, *args, group=None, **kwargs):
        """Chunk ``j`` of ``input`` goes to the group's rank ``j`` (even splits: raydeep's use)."""
        size = self.dist.get_world_size(group)
        for j in range(size):
            dst = self.dist.get_global_rank(group, j) if group is not None else j
            self._count(dst, input.numel() * input.element_size() // size)
        return self._saved["all_to_all_single"](output, input, *args, group=group, **kwargs)

    def close(self) -> None:
        self.dist.isend = self._saved.pop("isend")
        self.dist.all_to_all_single = self._saved.pop("all_to_all_single")
        for name, original in self._saved.items():
            setattr(self.rcomm, name, original)


def zeropp_config(precision: str = "fp32", gas: int = 2, **zero) -> dict:
    cfg = config(3, gas=gas, micro=2, clip=1.0)
    cfg["zero_optimization"].update(zero)
    if precision != "fp32":
        cfg[precision] = {"enabled": True}
    return cfg


def train_counting(cfg: dict, steps: int, count_from: int = 1, seed: int = 1) -> dict:
    """Train the tiny GPT with ``cfg`` on this rank; returns the losses, the full parameters, the
    bytes sent across and within nodes per step (steps ``count_from..steps-1``: the first step
    records stage 3's trace), by (phase, op), and the engine's own count of those steps' collectives
    per step (``ops``)."""
    import torch.distributed as dist

    import raydeep
    from raydeep.zero import GatheredParameters

    rank, world = dist.get_rank(), dist.get_world_size()
    model = tiny_gpt()
    engine, *_ = raydeep.initialize(model=model, config=cfg)
    counter = NodeBytes()
    micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    losses = []
    try:
        for step, batch in enumerate(global_batches(steps, micro * gas * world, seed=seed)):
            counter.counting = step >= count_from
            if step == count_from:
                engine.reset_comm_stats()
            step_loss = 0.0
            for k in range(gas):
                lo = (k * world + rank) * micro
                x = batch[lo:lo + micro]
                counter.phase = "forward"
                loss = engine(x[:, :-1], x[:, 1:])
                counter.phase = "backward"
                engine.backward(loss)
                counter.phase = "step"
                engine.step()
                step_loss += loss.item() / gas
            total = torch.tensor([step_loss], dtype=torch.float64)
            dist.all_reduce(total)
            losses.append(total.item() / world)
    finally:
        counter.close()
    counted = steps - count_from
    ops = {op: {"calls": s["calls"] / counted, "bytes": s["bytes"] / counted} for op, s in engine.comm_stats().items()}
    with GatheredParameters(list(model.parameters())):
        params = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    per_step = lambda table: {f"{phase}/{op}": n / counted for (phase, op), n in table.items()}  # noqa: E731
    return {"losses": losses, "params": params, "cross": per_step(counter.cross), "intra": per_step(counter.intra),
            "memory": engine.memory_breakdown(), "ops": ops}


def summed(results: list[dict], kind: str) -> dict[str, float]:
    """Every rank's bytes per step of ``kind`` ("cross" or "intra"), added up."""
    total: dict[str, float] = defaultdict(float)
    for r in results:
        for key, n in r[kind].items():
            total[key] += n
    return dict(total)


def train_corpus(cfg: dict, steps: int) -> list[float]:
    """Train the tiny GPT on the built-in corpus (the same random windows for every config); the
    per-step losses averaged over the ranks."""
    import torch.distributed as dist

    import raydeep
    from raydeep.data import builtin_dataset
    from tests.dist.workloads import SEQ

    rank, world = dist.get_rank(), dist.get_world_size()
    dataset = builtin_dataset(block_size=SEQ, max_bytes=200_000)
    engine, *_ = raydeep.initialize(model=tiny_gpt(), config=cfg)
    micro = engine.train_micro_batch_size_per_gpu()
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        ids = torch.randint(len(dataset), (micro * world,), generator=gen).tolist()[rank * micro:(rank + 1) * micro]
        x, y = (torch.stack(t) for t in zip(*(dataset[i] for i in ids)))
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        total = torch.tensor([loss.item()], dtype=torch.float64)
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def qgz_reduce_scatter(per_rank: list[torch.Tensor], group: int) -> torch.Tensor:
    """This rank's ``raydeep.zero.qgz.reduce_scatter_sum`` of its tensor in ``per_rank`` (flat),
    over real collectives, with quantization groups of at most ``group`` values."""
    import torch.distributed as dist

    from raydeep.zero import hierarchy, qgz

    rank, world = dist.get_rank(), dist.get_world_size()
    per_node = hierarchy.ranks_per_node(world)
    local = hierarchy._blocks(world, per_node, rank)
    across = hierarchy._strided(world, per_node, rank)
    flat = per_rank[rank].reshape(-1)
    out = torch.empty(flat.numel() // world, dtype=torch.float32)
    qgz.reduce_scatter_sum(out, flat, local, across, group)
    return out


def checkpoint_round_trip(directory: str, cfg: dict, before: int, after: int) -> dict:
    """Train ``before`` steps, save, train ``after`` more (the straight run); then a fresh engine
    loads the checkpoint and trains the same ``after`` steps. Returns both runs' losses and
    parameters, and the saved fp32 parameters read back with GatheredParameters right after load."""
    import raydeep
    from raydeep.zero import GatheredParameters
    from tests.dist.workloads import run_steps

    def gathered(model):
        with GatheredParameters(list(model.parameters())):
            return {n: p.detach().float().clone() for n, p in model.named_parameters()}

    batch = 16
    model = tiny_gpt()
    engine, *_ = raydeep.initialize(model=model, config=cfg)
    run_steps(engine, before, batch)
    engine.save_checkpoint(directory)
    saved = gathered(model)
    straight = run_steps(engine, before + after, batch, skip=before)
    straight_params = gathered(model)
    model = tiny_gpt()
    engine, *_ = raydeep.initialize(model=model, config=cfg)
    engine.load_checkpoint(directory)
    loaded = gathered(model)
    resumed = run_steps(engine, before + after, batch, skip=before)
    return {"straight": straight, "resumed": resumed, "straight_params": straight_params,
            "resumed_params": gathered(model), "saved": saved, "loaded": loaded}
