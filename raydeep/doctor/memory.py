"""Per-rank memory of a raydeep run, itemised, from the config and the model's shape alone.

Model states follow the ZeRO formula (:func:`raydeep.estimate.estimate_model_states`), with
stage 3's persistent parameters (at most ``stage3_param_persistence_threshold`` elements each)
kept whole on every rank as DeepSpeed and raydeep keep them. On top of them a step needs
*transient* memory, and its peak is the larger of two phases that never overlap:

* **forward and backward** -- the saved activations of one micro batch (below), plus at stage 3
  the gathered parameters (the unit being computed and what is prefetched, within
  ``stage3_prefetch_bucket_size`` and ``stage3_max_live_parameters``, or, if more, the blocks
  kept gathered from forward to backward within ``stage3_max_reuse_distance``) and that unit's full
  gradient before its reduce-scatter; at stage 2 the flattened gradient bucket, which is built
  late in backward when most activations are gone, so it counts alone;
* **the optimizer step** -- the fp32 gradient copy of the rank's partition and the foreach Adam's
  temporaries: four fp32 copies of the partition, or of one ``sub_group_size`` sub-group (on the
  CPU instead with ``offload_optimizer``).

Activations, for a GPT block (pre-LayerNorm, fused QKV, SDPA, 4h MLP), counted as the tensors
autograd saves, in units of ``u = micro_batch * seq * hidden`` elements of the training dtype:
17u per block without checkpointing (LN inputs 2; in the attention, QKV input 1 and output 3,
attention output 1, projection input 1; MLP input 1, its 4h hidden before and after GELU 8);
checkpointing the attention keeps 1u (its input) of its 6u and needs the 6u once again while
recomputing in backward; checkpointing the
whole block keeps its input (1u) and recomputes 17u once. The head keeps 2u and two fp32
``micro_batch * seq * vocab`` tensors (the loss is computed in fp32). These counts were checked
against the allocator in a real run (``tests/dist/test_doctor_memory.py``).

Not counted: the fragmentation the CUDA caching allocator adds, given as its own margin
(:data:`FRAGMENTATION`), and the communication library's own buffers.

>>> from raydeep.config import load_config
>>> from raydeep.doctor.shape import ModelShape
>>> cfg = load_config({"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2}}, world_size=2)
>>> plan = plan_memory(cfg, ModelShape.from_gpt("gpt-tiny"))
>>> [row.name for row in plan.device_rows][:4]
['params', 'grads', 'master', 'optimizer_states']
"""
from __future__ import annotations

from dataclasses import dataclass, field

from raydeep.config.model import RaydeepConfig
from raydeep.doctor.shape import ModelShape
from raydeep.doctor.stage3 import kept_between_passes, persistent_params
from raydeep.estimate import GB, PRECISION_BYTES, estimate_model_states

__all__ = ["FRAGMENTATION", "CHECKPOINTING", "MemoryPlan", "MemoryRow", "activation_bytes", "plan_memory",
           "saved_activation_bytes"]

# Margin for the CUDA caching allocator's fragmentation: reserved minus allocated memory in long
# runs is typically 5-15% of the peak (the field report's reason for empty_cache and sub_group_size).
FRAGMENTATION = 0.10
CHECKPOINTING = ("none", "attention", "block")
_SAVED_PER_BLOCK = 17  # u per block, see the module docstring
_ATTENTION_SAVED = 6  # of which the attention's own (QKV input 1 and output 3, attention output 1, projection input 1)
_STEP_COPIES = 4  # fp32 copies of the partition the optimizer step holds at once


@dataclass(frozen=True)
class MemoryRow:
    name: str
    bytes: int
    note: str = ""


@dataclass
class MemoryPlan:
    """Per-rank device rows (model states, then transient), host rows per node, and the verdict."""

    formula: str
    device_rows: list[MemoryRow]
    host_rows: list[MemoryRow]
    model_states: int  # device bytes of params + grads + master + optimizer states
    transient: int  # the larger phase's bytes (see the module docstring)
    peak_phase: str  # "forward/backward" or "optimizer step"
    activations: dict[str, int] = field(default_factory=dict)  # per checkpointing choice
    checkpointing: str = "none"
    device_memory: int | None = None
    host_memory: int | None = None
    on_device: bool = True  # a GPU run: the fragmentation margin applies

    @property
    def allocated(self) -> int:
        """Peak bytes the allocator hands out: model states plus the larger transient phase."""
        return self.model_states + self.transient

    @property
    def margin(self) -> int:
        return int(FRAGMENTATION * self.allocated) if self.on_device else 0

    @property
    def device_total(self) -> int:
        return self.allocated + self.margin

    @property
    def host_total(self) -> int:
        return sum(row.bytes for row in self.host_rows)

    @property
    def fits(self) -> bool | None:
        """None when the memory sizes are unknown."""
        verdicts = []
        if self.device_memory is not None:
            verdicts.append(self.device_total <= self.device_memory)
        if self.host_memory is not None and self.host_rows:
            verdicts.append(self.host_total <= self.host_memory)
        return all(verdicts) if verdicts else None

    def as_dict(self) -> dict:
        return {"device": {r.name: r.bytes for r in self.device_rows}, "host_per_node": {r.name: r.bytes for r in self.host_rows},
                "model_states": self.model_states, "transient": self.transient, "peak_phase": self.peak_phase,
                "allocated": self.allocated, "fragmentation_margin": self.margin, "device_total": self.device_total,
                "host_total": self.host_total, "activations_by_checkpointing": self.activations,
                "checkpointing": self.checkpointing, "device_memory": self.device_memory,
                "host_memory": self.host_memory, "fits": self.fits}

    def format_table(self) -> str:
        """The itemised table in GB (1e9 bytes), device rows per rank then host rows per node."""
        width = max(len(r.name) for r in self.device_rows + self.host_rows + [MemoryRow("fragmentation margin", 0)])
        lines = [f"{'per-rank device memory':<{width}}  {'GB':>9}  note"]
        lines += [f"{r.name:<{width}}  {r.bytes / GB:>9.3f}  {r.note}".rstrip() for r in self.device_rows[:4]]
        lines.append(f"{'= model states':<{width}}  {self.model_states / GB:>9.3f}  {self.formula}")
        lines += [f"{r.name:<{width}}  {r.bytes / GB:>9.3f}  {r.note}".rstrip() for r in self.device_rows[4:]]
        lines.append(f"{'= allocated at peak':<{width}}  {self.allocated / GB:>9.3f}  peak phase: {self.peak_phase}")
        if self.on_device:
            lines.append(f"{'fragmentation margin':<{width}}  {self.margin / GB:>9.3f}  "
                         f"{FRAGMENTATION:.0%} for the caching allocator")
        cap = f" of {self.device_memory / GB:.1f}" if self.device_memory else ""
        lines.append(f"{'= device total':<{width}}  {self.device_total / GB:>9.3f}{cap}")
        if self.host_rows:
            lines.append("")
            lines.append(f"{'host memory per node':<{width}}  {'GB':>9}  note")
            lines += [f"{r.name:<{width}}  {r.bytes / GB:>9.3f}  {r.note}".rstrip() for r in self.host_rows]
            cap = f" of {self.host_memory / GB:.1f}" if self.host_memory else ""
            lines.append(f"{'= host total':<{width}}  {self.host_total / GB:>9.3f}{cap}")
        return "\n".join(lines)


def activation_bytes(shape: ModelShape, micro_batch: int, precision: str, checkpointing: str,
                     checkpointed: int | None = None) -> int:
    """Peak saved-activation bytes of one micro batch (see the module docstring); ``checkpointed``
    of the layers' modules are checkpointed (all by default; ``number_checkpoints`` with blocks).

    >>> shape = ModelShape.from_gpt("gpt-tiny")
    >>> [round(activation_bytes(shape, 4, "fp32", c) / 1e6, 1) for c in CHECKPOINTING]
    [19.4, 15.7, 7.1]
    """
    if checkpointing not in CHECKPOINTING:
        raise ValueError(f"checkpointing must be one of {CHECKPOINTING}, got {checkpointing!r}")
    e = PRECISION_BYTES[precision]
    u = micro_batch * shape.seq * shape.hidden
    n = 0 if checkpointing == "none" else shape.layers if checkpointed is None else min(checkpointed, shape.layers)
    # a checkpointed module keeps its input (1u) of what it saves, and recomputes it once in backward
    own = {"none": 0, "attention": _ATTENTION_SAVED, "block": _SAVED_PER_BLOCK}[checkpointing]
    blocks = shape.layers * _SAVED_PER_BLOCK - n * (own - 1) + (own if n else 0)
    head = 2 * u * e + 2 * micro_batch * shape.seq * shape.vocab * 4
    return blocks * u * e + head


def saved_activation_bytes(shape: ModelShape, micro_batch: int, precision: str, checkpointing: str,
                           checkpointed: int | None = None) -> int:
    """Bytes one micro batch's forward saves for backward (the distinct storages autograd keeps,
    as ``saved_tensors_hooks`` count them): the part of :func:`activation_bytes` left after the
    forward, without the recomputation's and the loss gradient's transients. ``checkpointed``:
    how many of the layers' blocks are checkpointed when checkpointing blocks (all by default;
    ``number_checkpoints``). ``benchmarks/activation.py`` holds it to the counted bytes.

    >>> shape = ModelShape.from_gpt("gpt-tiny")
    >>> saved_activation_bytes(shape, 4, "fp32", "block", checkpointed=0) == saved_activation_bytes(shape, 4, "fp32", "none")
    True
    """
    if checkpointing not in CHECKPOINTING:
        raise ValueError(f"checkpointing must be one of {CHECKPOINTING}, got {checkpointing!r}")
    e = PRECISION_BYTES[precision]
    u = micro_batch * shape.seq * shape.hidden
    per_block = _SAVED_PER_BLOCK - 1  # the attention's output is the projection's input: one storage
    if checkpointing == "none":
        blocks = shape.layers * per_block
    elif checkpointing == "attention":
        blocks = shape.layers * (per_block - (_ATTENTION_SAVED - 1) + 1)
    else:
        n = shape.layers if checkpointed is None else min(checkpointed, shape.layers)
        blocks = n + (shape.layers - n) * per_block
    # The head saves 2u and one fp32 micro_batch x seq x vocab tensor (log-softmax's output);
    # the peak's second one is its gradient, made in backward.
    head = 2 * u * e + micro_batch * shape.seq * shape.vocab * 4
    return blocks * u * e + head


def checkpointing_of(cfg: RaydeepConfig) -> str:
    """What the engine checkpoints for this config: nothing without an ``activation_checkpointing``
    section, else ``raydeep.checkpoint_modules`` (a list of class names counts as "block")."""
    if cfg.activation_checkpointing is None:
        return "none"
    modules = cfg.raydeep.checkpoint_modules
    return modules if isinstance(modules, str) else "block"


def plan_memory(cfg: RaydeepConfig, shape: ModelShape, device_memory: int | None = None,
                host_memory: int | None = None, gpus_per_node: int = 1, on_device: bool = True,
                checkpointing: str | None = None) -> MemoryPlan:
    """The itemised per-rank memory of ``cfg`` (resolved for its world size) training ``shape``.

    ``checkpointing`` overrides what the config checkpoints (the doctor compares the choices);
    ``on_device`` False (a CPU run) drops the caching allocator's margin."""
    zero, n = cfg.zero_optimization, cfg.world_size
    stage, precision = zero.stage, cfg.precision
    e, micro = PRECISION_BYTES[precision], cfg.train_micro_batch_size_per_gpu
    offload_opt = zero.offload_optimizer is not None and zero.offload_optimizer.device != "none" and stage >= 1
    offload_param = zero.offload_param is not None and zero.offload_param.device != "none" and stage == 3
    persistent = persistent_params(cfg, shape) if stage == 3 else 0
    partitioned = shape.params - persistent
    est = estimate_model_states(partitioned, n, stage, precision, offload_optimizer=offload_opt,
                                offload_param=offload_param)
    if persistent:  # whole on every rank: weights, gradients, and the optimizer's share of them
        full = estimate_model_states(persistent, n, 2, precision, offload_optimizer=offload_opt)
        est = type(est)(params=est.params + e * persistent, grads=est.grads + full.grads, master=est.master + full.master,
                        optimizer_states=est.optimizer_states + full.optimizer_states, cpu=est.cpu + full.cpu)
    part = -(-shape.params // n) if stage >= 1 else shape.params
    rows = [MemoryRow("params", est.params, _params_note(stage, n, persistent, offload_param)),
            MemoryRow("grads", est.grads, "reduced straight into the CPU's fp32 gradient partition"
                      if offload_opt and stage >= 2 else "1/N of the gradients" if stage >= 2 else "every gradient"),
            MemoryRow("master", est.master, "fp32 master weights" + (", 1/N" if stage >= 1 else "")
                      if precision != "fp32" else "the fp32 weights are the master"),
            MemoryRow("optimizer_states", est.optimizer_states, "Adam momentum + variance (fp32)"
                      + (", 1/N" if stage >= 1 else "") + (" -- offloaded" if offload_opt else ""))]
    hpz = zero.zero_hpz_partition_size
    if stage == 3 and 1 < hpz < n:  # ZeRO++ hpZ: each rank keeps 1/hpz of every gathered unit
        rows.append(MemoryRow("hpZ secondary partition", e * -(-partitioned // hpz),
                              f"1/{hpz} of the partitioned weights (zero_hpz_partition_size), kept from each step's "
                              "first gather so later gathers stay in the node"))
    model_states = sum(r.bytes for r in rows)
    formula = _formula_text(stage, n, precision, offload_opt, persistent)

    choice = checkpointing or checkpointing_of(cfg)
    ac = cfg.activation_checkpointing
    checkpointed = ac.number_checkpoints if ac is not None else None  # how many blocks the engine wraps (wrap.spread)
    acts = {c: activation_bytes(shape, micro, precision, c, checkpointed if c == "block" else None)
            for c in CHECKPOINTING}
    live = gathered_grad = 0
    if stage == 3:
        unit = min(shape.block_params, partitioned)
        ahead = min(zero.prefetch_bucket_size, max(0, zero.max_live_parameters - unit))
        # At the turn from forward to backward the blocks kept for reuse are all gathered.
        kept = kept_between_passes(cfg, shape) * shape.block_params
        live = e * min(partitioned, max(unit + ahead, kept))
        gathered_grad = e * unit
    bucket = _reduce_bucket(cfg, shape, e)
    # The bucket is flattened during backward, once most activations are freed: it peaks alone.
    forward_backward = max(acts[choice] + live + gathered_grad, bucket)
    sub_group = zero.sub_group_size or part
    step = 0 if offload_opt else _STEP_COPIES * 4 * min(part, sub_group)
    transient = max(forward_backward, step)
    rows += [MemoryRow("activations", acts[choice], f"micro batch {micro} x seq {shape.seq}, checkpointing: {choice}")]
    if stage == 3:
        rows.append(MemoryRow("gathered parameters", live, "the unit computed + prefetched (stage3_prefetch_bucket_size, "
                              "stage3_max_live_parameters)"))
        rows.append(MemoryRow("unit gradient", gathered_grad, "a unit's full gradient before its reduce-scatter"))
    if bucket:
        rows.append(MemoryRow("reduce bucket", bucket, "reduce_bucket_size elements (or the model, if smaller)"))
    rows.append(MemoryRow("optimizer step", step, "on the CPU (offload_optimizer)" if offload_opt else
                          "fp32 gradient copy + Adam temporaries of the partition (sub_group_size bounds it)"))
    return MemoryPlan(formula=formula, device_rows=rows, host_rows=_host_rows(est.cpu, shape, n, gpus_per_node, offload_opt),
                      model_states=model_states, transient=transient,
                      peak_phase="forward/backward" if forward_backward >= step else "optimizer step",
                      activations=acts, checkpointing=choice, device_memory=device_memory, host_memory=host_memory,
                      on_device=on_device)


def _formula_text(stage: int, n: int, precision: str, offload: bool, persistent: int) -> str:
    """The ZeRO formula the model-state rows follow, in bytes per parameter (Psi parameters)."""
    low = PRECISION_BYTES[precision]
    k = (4 if low == 2 else 0) + 8  # fp32 master (mixed precision only) + Adam momentum and variance
    p = f"{low} Psi" + (f"/{n}" if stage == 3 else "")
    g = "0" if offload and stage >= 2 else f"{low} Psi" + (f"/{n}" if stage >= 2 else "")
    o = "0 (on the CPU)" if offload else f"{k} Psi" + (f"/{n}" if stage >= 1 else "")
    extra = f", Psi excluding the {persistent:,} persistent elements, kept whole" if persistent else ""
    return f"ZeRO formula: params {p} + grads {g} + optimizer {o}{extra}"


def _params_note(stage: int, n: int, persistent: int, offloaded: bool) -> str:
    if offloaded:
        return "offload_param: partitions in host memory"
    if stage < 3:
        return "every parameter, training dtype"
    return f"1/{n} partition + {persistent:,} persistent elements whole"


def _reduce_bucket(cfg: RaydeepConfig, shape: ModelShape, e: int) -> int:
    """The gradient bucket stages 2-3 flatten for a reduce-scatter during backward (stage 3's is
    the unit gradient row); stages 0-1 reduce the gradient buffers in place at the boundary."""
    if cfg.zero_optimization.stage != 2:
        return 0
    comm = PRECISION_BYTES.get(cfg.communication_data_type or "", e)
    return comm * min(cfg.zero_optimization.reduce_bucket_size, shape.params)


def _host_rows(cpu_per_rank: int, shape: ModelShape, n: int, gpus_per_node: int, offload: bool) -> list[MemoryRow]:
    if not cpu_per_rank:
        return []
    ranks = min(n, gpus_per_node)
    rows = [MemoryRow("offloaded states", cpu_per_rank * ranks, f"{ranks} rank(s): fp32 master, Adam states, "
                      "fp32 gradient partition" if offload else f"{ranks} rank(s): parameter partitions")]
    if offload:
        rows.append(MemoryRow("pinned staging", int(0.5 * cpu_per_rank * ranks / 4), "pinned host buffers for the "
                              "device<->host copies (about half the fp32 gradient partition)"))
    return rows
