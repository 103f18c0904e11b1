"""Per-rank model-state memory for ZeRO stages 0-3: pure arithmetic, no torch needed.

:func:`estimate_model_states` follows the ZeRO paper's model (Rajbhandari et al., SC'20):
mixed-precision Adam keeps 2 bytes/param of 16-bit weights, 2 of 16-bit gradients and
K = 12 of optimizer state (4 fp32 master + 4 momentum + 4 variance). Stage 1 partitions the
K part over the N data-parallel ranks, stage 2 also the gradients, stage 3 also the weights.

What is counted, per rank, in bytes:

* ``params`` -- the training-dtype weights (2 B/param mixed, 4 B fp32); a 1/N partition at
  stage 3. Stage 3's transient working set (gathered layers, prefetch) is not counted.
* ``grads`` -- training-dtype gradients; 1/N at stages 2-3.
* ``master`` -- the fp32 master weights (mixed precision only: in fp32 training the weights
  are the master); 1/N at stages >= 1.
* ``optimizer_states`` -- Adam momentum + variance, 8 B/param; 1/N at stages >= 1.
* ``buffers`` (only with ``include_buffers``) -- the persistent gradient-reduction buckets
  DeepSpeed allocates with ``contiguous_gradients`` (default on, forced on by offload):
  stages 1-2 hold ``reduce_bucket_size`` elements of gradient dtype, doubled when
  ``overlap_comm`` (off by default there); stage 3 holds one such bucket. Each bucket is
  allocated at full size however small the model. The all-gather of updated weights writes
  in place into the existing 16-bit flat weight buffer (in ``allgather_bucket_size`` shards
  where ``all_gather_into_tensor`` is missing), so it adds nothing. Stage 0 keeps no
  persistent bucket.
* ``cpu`` -- with ``offload_optimizer``: fp32 master (needed by the CPU optimizer even in fp32
  training), Adam states and the fp32 gradient partition the reduced gradients are copied
  into; at stages >= 2 the device then keeps no gradient partition. With ``offload_param``
  (stage 3): the weight partition.

Not counted: the transient fp32 copy of the gradient partition made at step time without
offload (DeepSpeed's own estimators count it as 4 B/param/N -- see
:func:`deepspeed_zero2_estimate`), activations, temporary buffers and allocator slack.
Partitions round up (``ceil(num_params / N)``), the size the largest rank holds.

Example:
    >>> est = estimate_model_states(7_500_000_000, world_size=64, stage=2)
    >>> round(est.total / 1e9, 1)
    16.6
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = [
    "GB",
    "PRECISION_BYTES",
    "MemoryEstimate",
    "deepspeed_zero2_estimate",
    "deepspeed_zero3_estimate",
    "estimate_model_states",
]

GB = 1e9  # decimal gigabytes, as the ZeRO paper and DeepSpeed's estimator printouts use

# Bytes per element of each training dtype (also the doctor's: raydeep.doctor).
PRECISION_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4}
_FP32 = 4
_ADAM_STATE_BYTES = 8  # momentum + variance, fp32 each


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-rank model-state bytes; the fields are device (accelerator) bytes, ``cpu`` is host.

    Example:
        >>> est = MemoryEstimate(params=2, grads=2, master=4, optimizer_states=8)
        >>> est.total, est.as_dict()["total"]
        (16, 16)
    """

    params: int
    grads: int
    master: int
    optimizer_states: int
    buffers: int = 0
    cpu: int = 0

    @property
    def total(self) -> int:
        """Device bytes per rank: everything except what lives on the CPU."""
        return self.params + self.grads + self.master + self.optimizer_states + self.buffers

    def as_dict(self) -> dict[str, int]:
        """All fields plus ``total``, in bytes."""
        return {**asdict(self), "total": self.total}

    def format_table(self) -> str:
        """A small table in GB (1e9 bytes).

        Example:
            >>> print(estimate_model_states(10**9, 8, 3).format_table())
            component           GB/rank
            params                0.250
            grads                 0.250
            master                0.500
            optimizer_states      1.000
            buffers               0.000
            total (device)        2.000
            cpu (offload)         0.000
        """
        rows = [(name, getattr(self, name)) for name in
                ("params", "grads", "master", "optimizer_states", "buffers")]
        rows += [("total (device)", self.total), ("cpu (offload)", self.cpu)]
        lines = [f"{'component':<18}{'GB/rank':>9}"]
        lines += [f"{name:<18}{value / GB:>9.3f}" for name, value in rows]
        return "\n".join(lines)


def _check_args(num_params: int, world_size: int, stage: int, precision: str,
                offload_optimizer: bool, offload_param: bool) -> None:
    if num_params < 0 or world_size < 1:
        raise ValueError(f"need num_params >= 0 and world_size >= 1, got {num_params}, {world_size}")
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}")
    if precision not in PRECISION_BYTES:
        raise ValueError(f"precision must be one of {sorted(PRECISION_BYTES)}, got {precision!r}")
    if offload_optimizer and stage == 0:
        raise ValueError("offload_optimizer needs ZeRO stage >= 1")
    if offload_param and stage != 3:
        raise ValueError("offload_param needs ZeRO stage 3")


def _bucket_bytes(stage: int, grad_bytes: int, reduce_bucket_size: int,
                  overlap_comm: bool | None) -> int:
    """Persistent gradient-reduction buckets (see the module docstring)."""
    if stage == 0:
        return 0
    if stage == 3:
        return reduce_bucket_size * grad_bytes
    overlap = bool(overlap_comm)  # DeepSpeed 0.19.8 defaults overlap_comm on only for stage 3
    return (2 if overlap else 1) * reduce_bucket_size * grad_bytes


def estimate_model_states(num_params: int, world_size: int, stage: int, precision: str = "fp16",
                          offload_optimizer: bool = False, offload_param: bool = False,
                          reduce_bucket_size: int = 500_000_000,
                          allgather_bucket_size: int = 500_000_000,
                          include_buffers: bool = False,
                          overlap_comm: bool | None = None) -> MemoryEstimate:
    """Per-rank model-state memory of Adam training under ZeRO ``stage`` on ``world_size`` ranks.

    ``precision`` is the training dtype (``"fp16"``/``"bf16"`` mixed precision with fp32 master,
    or ``"fp32"``). ``allgather_bucket_size`` is accepted for config symmetry but adds no
    bytes (the all-gather is in place); ``overlap_comm=None`` means DeepSpeed's default.

    Example:
        >>> [round(estimate_model_states(7.5e9, 64, s).total / 1e9, 1) for s in range(4)]
        [120.0, 31.4, 16.6, 1.9]
    """
    num_params = int(num_params)
    _check_args(num_params, world_size, stage, precision, offload_optimizer, offload_param)
    if reduce_bucket_size <= 0 or allgather_bucket_size <= 0:
        raise ValueError("bucket sizes must be positive")
    low = PRECISION_BYTES[precision]
    part = -(-num_params // world_size)  # ceil: the largest rank's partition
    opt_elems = part if stage >= 1 else num_params
    params = low * (part if stage == 3 else num_params)
    grads = low * (part if stage >= 2 else num_params)
    master = _FP32 * opt_elems if low != _FP32 else 0
    optimizer_states = _ADAM_STATE_BYTES * opt_elems
    cpu = 0
    if offload_optimizer:
        cpu = _FP32 * opt_elems + optimizer_states + _FP32 * opt_elems
        master = optimizer_states = 0
        if stage >= 2:
            grads = 0  # reduced partitions go straight to the CPU fp32 gradient buffer
    if offload_param:
        cpu, params = cpu + params, 0
    buffers = _bucket_bytes(stage, low, reduce_bucket_size, overlap_comm) if include_buffers else 0
    return MemoryEstimate(params, grads, master, optimizer_states, buffers, cpu)


def deepspeed_zero2_estimate(total_params: int, num_gpus_per_node: int = 1, num_nodes: int = 1,
                             cpu_offload: bool = True,
                             additional_buffer_factor: float = 1.5) -> tuple[int, int]:
    """``(cpu_bytes, gpu_bytes)`` exactly as DeepSpeed's ``estimate_zero2_model_states_mem_needs``.

    DeepSpeed's view differs from :func:`estimate_model_states`: its GPU figure counts 18 B/param
    partitioned (16-bit grads 2 + fp32 grads 4 + fp32 master 4 + Adam 8) plus 2 B/param of
    weights; its CPU figure is per node, with ``additional_buffer_factor`` slack.

    Example:
        >>> deepspeed_zero2_estimate(10**9, num_gpus_per_node=8, cpu_offload=False)
        (48000000000, 4250000000)
    """
    total_gpus = num_nodes * num_gpus_per_node
    if cpu_offload:
        gpu_mem = 2 * total_params
        # DeepSpeed's formula: the larger of one fp32 copy per GPU and 16 B/param, per node
        cpu_mem = total_params * max(4 * total_gpus, 16) * additional_buffer_factor
    else:
        gpu_mem = 2 * total_params + int(18 * total_params / total_gpus)
        cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem)


def deepspeed_zero3_estimate(total_params: int, largest_layer_params: int, num_gpus_per_node: int = 1,
                             num_nodes: int = 1, cpu_offload: bool = True, cpu_offload_params: bool = True,
                             zero_init: bool = True,
                             additional_buffer_factor: float = 1.5) -> tuple[int, int]:
    """``(cpu_bytes, gpu_bytes)`` exactly as DeepSpeed's ``estimate_zero3_model_states_mem_needs``.

    (DeepSpeed also returns the largest layer's bytes, ``4 * largest_layer_params``, as a third
    value; it is part of ``gpu_bytes`` here.) The GPU always holds the largest layer gathered in
    fp32-equivalent bytes; ``zero_init`` avoids a full model copy per rank on the CPU.

    Example:
        >>> deepspeed_zero3_estimate(10**9, 10**7, num_gpus_per_node=8, cpu_offload=False)
        (480000000, 2290000000)
    """
    total_gpus = num_nodes * num_gpus_per_node
    gpus_factor = 1 / num_nodes
    largest_layer_memory = 4 * largest_layer_params
    if cpu_offload:
        # 18 B/param on CPU with offloaded weights (16 optimizer side + 2 weights), else 16
        per_param = 18 if cpu_offload_params else 16
        if cpu_offload_params:
            gpu_mem = largest_layer_memory
        else:
            gpu_mem = largest_layer_memory + int(2 * total_params / total_gpus)
        if zero_init:
            cpu_mem = total_params * per_param * gpus_factor * additional_buffer_factor
        else:
            cpu_mem = total_params * max(4 * num_gpus_per_node, per_param * gpus_factor) * additional_buffer_factor
    else:
        gpu_mem = largest_layer_memory + int(18 * total_params / total_gpus)
        if zero_init:
            cpu_mem = largest_layer_params * 4 * num_gpus_per_node * additional_buffer_factor
        else:
            cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem)
