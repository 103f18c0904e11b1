"""ZeRO++'s quantizers in plain torch ops: qwZ (int8 weights) and qgZ (int4 hierarchical gradients).

DeepSpeed runs these as a JIT-built CUDA extension (``QuantizerBuilder``); here they are vectorized
torch ops that run on any device (every tensor stays on its input's device) and reproduce the
kernels' arithmetic step for step. What each function reproduces:

- ``weight_groups``       ``runtime/zero/partition_parameters.py`` ``CUDAQuantizer.quantize`` (group count)
- ``quantize_weights``    ``CUDAQuantizer.quantize`` -> ``csrc/quantization/quantize.cu`` ``launch_quant``
                          (8 bits, Symmetric)
- ``dequantize_weights``  ``CUDAQuantizer.dequantize`` -> ``csrc/quantization/dequantize.cu``
- ``swizzle_quant``       ``csrc/quantization/swizzled_quantize.cu`` ``launch_swizzled_quant``
                          (4 bits, Symmetric, pipelining 1)
- ``quantized_reduction`` ``csrc/quantization/quant_reduce.cu`` ``launch_dequant_reduce``
- ``dequantize_int4``     ``dequantize.cu`` with 4 bits
- ``gradient_groups``, ``qgz_fallback_reason``, ``simulate_all_to_all_quant_reduce``:
                          ``runtime/comm/coalesced_collectives.py`` ``all_to_all_quant_reduce``

The arithmetic (``csrc/includes/quantization_utils.h``, ``Params<Symmetric, bits>``):

- a group's statistic is ``max |h|`` over its fp16 values ``h`` (taken in fp16, exact);
- ``scale = 2**bits / (2 * max)`` in fp32, or ``1.0`` for an all-zero group;
- ``q = clamp(rint(float(h) * scale), -2**(bits-1), 2**(bits-1) - 1)``: fp32 product, rounded half
  to even (``__float2int_rn``). The group's maximum maps to ``2**(bits-1)`` and clamps to one level
  below, so the largest positive value loses a full step;
- the stored parameter is ``1 / scale`` (fp32), so "scales" hold the step size, not its inverse;
- dequantization is ``fp16(float(q) * stored)`` (fp32 product, one rounding to fp16);
- int4 packs two values per byte, the first in the high nibble (``PackedInt4{high, low}`` with
  the bitfield ``high`` in bits 0-3 holding the second value).

Departures from DeepSpeed, all deliberate:

- ``quantize_weights`` zero-pads an input whose size is not a multiple of 8 up to the next multiple
  of 8 before grouping (DeepSpeed asserts instead); ``dequantize_weights(..., numel=n)`` drops the
  padding. Zeros never change a group's ``max |h|``, so the other values quantize as they would
  in a group of that size.
- ``swizzle_quant`` converts its input to fp16 first: DeepSpeed's kernel reads the gradient through
  an ``__half*`` whatever its dtype, so a bf16 or fp32 gradient is reinterpreted bit for bit. This is
  the same fix DeepSpeed's ``CUDAQuantizer.quantize`` applies to weights.
- Layouts the kernels cannot handle (a group that is not a whole number of 16-byte loads, more
  groups than partitions cover, a group past the largest unroll a kernel is instantiated for) raise
  ``ValueError`` here; DeepSpeed silently leaves uninitialized memory in its output or reads past a
  group. ``qgz_fallback_reason`` sends such tensors to the plain reduce-scatter.
- DeepSpeed builds the extension with ``--use_fast_math``, so on a GPU its ``2**bits / (2*max)`` and
  ``1 / scale`` are the hardware's approximate division and reciprocal (within 2 ulp). Here both are
  IEEE fp32. Where a maximum is a power of two both are exact and agree; otherwise a scale can
  differ in its last bits, which moves a value by one level only where ``h * scale`` lies within
  about ``2**-15`` of a rounding boundary.
- Non-finite inputs are out of scope (DeepSpeed's fp16 max and float-to-int conversion treat NaN
  and inf their own way; a loss scaler skips such steps anyway).
"""
from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

TARGET_GROUP_SIZE = 8000  # CUDAQuantizer.target_group_size ("optimal is 4k, target below 8k")
WEIGHT_BITS = 8
GRADIENT_BITS = 4

# One 16-byte load is eight fp16 values: every kernel here moves a group in whole loads.
HALVES_PER_LOAD = 8
# Largest group each kernel has an instantiation for (beyond it, no kernel is launched at all).
MAX_WEIGHT_GROUP = 4 * 256 * 16  # quantize.cu: external_unroll <= 4, 256 threads, 16 halves a step
MAX_SWIZZLE_GROUP = 5 * 512 * 16  # swizzled_quantize.cu: total_unroll <= 10, 512 threads, 8 halves a chunk
MAX_REDUCE_GROUP_BYTES = 12 * 1024 * 4  # quant_reduce.cu: unroll <= 12, 1024 threads, 4 bytes each


# ---------------------------------------------------------------------------------------------
# The shared arithmetic: Params<Symmetric, bits> and PackedInt4
# ---------------------------------------------------------------------------------------------


def _as_half(x: Tensor) -> Tensor:
    """The kernels read fp16: round once (to nearest even) from whatever dtype came in."""
    return x.reshape(-1).to(torch.float16)


def _symmetric_quantize(h: Tensor, bits: int) -> Tuple[Tensor, Tensor]:
    """Quantize each row of ``h`` (fp16, one group per row): ``(q int8, stored fp32 (groups, 1))``."""
    absmax = h.abs().amax(dim=1, keepdim=True).float()  # fp16 max is exact; float() is exact too
    # Params(float max): scale = (1 << bits) / (2 * max). An explicit fp32 division: Python's
    # ``scalar / tensor`` would go through reciprocal() and round twice.
    numerator = torch.full_like(absmax, float(1 << bits))
    scale = torch.where(absmax == 0, torch.ones_like(absmax), torch.div(numerator, 2 * absmax))
    q_min, q_max = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    # conversion::to<float>(val) * scale, then __float2int_rn: torch.round is round-half-even.
    q = torch.round(h.float() * scale).clamp_(q_min, q_max).to(torch.int8)
    stored = torch.div(torch.ones_like(scale), scale)  # Params::store writes 1 / scale
    return q, stored


def _symmetric_dequantize(q: Tensor, stored: Tensor) -> Tensor:
    """``fp16(float(q) * stored)`` per row: Params::dequantize<__half>."""
    return (q.float() * stored).to(torch.float16)


def _pack_int4(q: Tensor) -> Tensor:
    """Two int4 values a byte, the first in the high nibble (quantization_utils.h ``_chunk``)."""
    # unbind, not q[..., 0::2]: the slice makes a host-side index that a CUDA tensor under
    # FakeTensorMode (the device-discipline tests) cannot take
    first, second = q.to(torch.int32).unflatten(-1, (-1, 2)).unbind(-1)
    byte = ((first & 0xF) << 4) | (second & 0xF)
    return byte.to(torch.uint8).view(torch.int8)


def _unpack_int4(packed: Tensor) -> Tensor:
    """Inverse of ``_pack_int4``: sign-extended nibbles, high one first (dequantization_utils.h)."""
    b = packed.to(torch.int32)
    first = b >> 4  # arithmetic shift of a signed byte sign-extends the high nibble
    second = ((b & 0xF) ^ 8) - 8  # sign-extend the low nibble
    return torch.stack((first, second), dim=-1).flatten(-2).to(torch.int8)


def _fp16_add(a: Tensor, b: Tensor) -> Tensor:
    """One fp16 addition rounded once (``__hadd2``); an fp32 sum of two fp16 values rounds to the
    same fp16 as exact addition would (24 >= 2 * 11 + 2 bits)."""
    return (a.float() + b.float()).to(torch.float16)


# ---------------------------------------------------------------------------------------------
# qwZ: int8 weights
# ---------------------------------------------------------------------------------------------


def weight_groups(numel: int) -> int:
    """``CUDAQuantizer.quantize``'s adaptive group count for ``numel`` weights.

    Start at ``ceil(numel / 8000)`` groups, step up to the first count whose groups are a whole
    number of 8-value loads, then keep doubling while groups stay above 8000 values and still
    split evenly. DeepSpeed's asserts are ``ValueError`` here.
    """
    numel = int(numel)
    if numel <= 0:
        raise ValueError(f"qwZ needs a non-empty tensor to quantize, got {numel} elements")
    groups = math.ceil(numel / TARGET_GROUP_SIZE)
    while groups < numel:
        if numel % (8 * groups) == 0:
            break
        groups += 1
    while numel % (8 * groups * 2) == 0 and numel / groups > TARGET_GROUP_SIZE:
        groups *= 2
    if numel % (8 * groups) != 0:
        raise ValueError(f"qwZ needs the number of weights to be a multiple of 8 (8 * {groups} groups); "
                         f"{numel} is not (quantize_weights pads for you)")
    if numel / groups >= 16000:
        raise ValueError(f"qwZ groups hold at most 16000 weights; {numel} / {groups} is larger")
    if numel <= groups:
        raise ValueError(f"qwZ's adaptive grouping finds no group size for {numel} weights")
    return groups


def padded_weight_numel(numel: int) -> int:
    """raydeep's extension: the size quantize_weights pads to (the next multiple of 8)."""
    return -(-int(numel) // HALVES_PER_LOAD) * HALVES_PER_LOAD


def quantize_weights(x: Tensor, groups: Optional[int] = None) -> Tuple[Tensor, Tensor]:
    """``CUDAQuantizer.quantize(x)``: fp16 conversion, then 8-bit symmetric quantization per group.

    Returns ``(q, scales)``: ``q`` int8, flat, ``padded_weight_numel(x.numel())`` values (DeepSpeed
    keeps the input's shape; the flat form is the same bytes); ``scales`` fp32 of shape
    ``(groups, 1)``, each the group's step ``1 / scale``. ``groups`` defaults to
    ``weight_groups`` of the padded size.
    """
    h = _as_half(x)
    padded = padded_weight_numel(h.numel())
    if padded != h.numel():
        # raydeep's extension (DeepSpeed asserts): zeros never raise a group's max |h|.
        h = torch.cat([h, h.new_zeros(padded - h.numel())])
    if groups is None:
        groups = weight_groups(padded)
    _check_groups(padded, groups, max_group=MAX_WEIGHT_GROUP, what="quantize_weights")
    q, stored = _symmetric_quantize(h.view(groups, -1), WEIGHT_BITS)
    return q.reshape(-1), stored


def dequantize_weights(q: Tensor, scales: Tensor, dtype: torch.dtype = torch.float16,
                       numel: Optional[int] = None) -> Tensor:
    """``CUDAQuantizer.dequantize(q, scales, dtype)``: fp16 values with ``scales.numel()`` groups,
    then ``.to(dtype)``. ``numel`` drops quantize_weights' zero padding. Returns a flat tensor."""
    groups = scales.numel()
    _check_groups(q.numel(), groups, max_group=None, what="dequantize_weights")
    out = _symmetric_dequantize(q.reshape(groups, -1), scales.reshape(groups, 1)).reshape(-1)
    if numel is not None:
        out = out[:numel]
    return out if out.dtype == dtype else out.to(dtype)


def _check_groups(numel: int, groups: int, max_group: Optional[int], what: str) -> None:
    if groups <= 0 or numel % groups != 0:
        raise ValueError(f"{what}: {numel} values do not split into {groups} equal groups")
    per_group = numel // groups
    if per_group % HALVES_PER_LOAD != 0:
        # The kernels move 16-byte loads; a partial one would read (and write) the next group.
        raise ValueError(f"{what}: groups of {per_group} values are not a multiple of {HALVES_PER_LOAD}")
    if max_group is not None and per_group > max_group:
        raise ValueError(f"{what}: groups of {per_group} values exceed the kernel's {max_group}")


# ---------------------------------------------------------------------------------------------
# qgZ: int4 gradients, hierarchical all-to-all
# ---------------------------------------------------------------------------------------------


def gradient_groups(shape: Sequence[int], world_size: int, devices_per_node: int) -> Tuple[int, int]:
    """``all_to_all_quant_reduce``'s group counts for a gradient of ``shape`` (2-D or more):
    ``intra = max(shape[0], shape[1], world_size)`` for the swizzled quantization,
    ``inter = intra // devices_per_node`` for the re-quantization after the intra-node sum."""
    if len(shape) < 2:
        raise ValueError(f"qgZ groups a gradient by its first two dimensions; shape {tuple(shape)} has fewer")
    intra = max(int(shape[0]), int(shape[1]), int(world_size))
    return intra, intra // int(devices_per_node)


def qgz_fallback_reason(shape: Sequence[int], nodes: int, devices_per_node: int) -> Optional[str]:
    """Why a gradient of ``shape`` takes the plain reduce-scatter instead of qgZ, or None.

    DeepSpeed's two rules come first (its words): 1-D tensors, and sizes not divisible by
    ``2 * world_size``. Then raydeep's, for layouts DeepSpeed would push through kernels that
    cannot handle them (see the module docstring); those messages start with ``raydeep:``.
    """
    world = int(nodes) * int(devices_per_node)
    numel = math.prod(int(s) for s in shape)
    if len(shape) == 1:
        return "1-D tensor: DeepSpeed reduce-scatters 1-D tensors"
    if numel % (2 * world) != 0:
        return (f"tensor size = {numel} is not divisible by (2 * global_world_size) = {2 * world}: "
                f"DeepSpeed falls back to reduce_scatter")
    intra, _ = gradient_groups(shape, world, devices_per_node)
    per_group = numel // intra
    if intra % world != 0:
        return (f"raydeep: {intra} quantization groups do not split over {world} ranks "
                f"(DeepSpeed's swizzle would leave {intra % world} groups unwritten)")
    if per_group % HALVES_PER_LOAD != 0:
        return f"raydeep: groups of {per_group} values are not a multiple of {HALVES_PER_LOAD}"
    if per_group > MAX_SWIZZLE_GROUP:
        return f"raydeep: groups of {per_group} values exceed the swizzle kernel's {MAX_SWIZZLE_GROUP}"
    return None


def swizzle_quant(x: Tensor, groups: int, nodes: int, devices_per_node: int) -> Tuple[Tensor, Tensor]:
    """``swizzle_quant(x, groups, 4, Symmetric, 1, nodes, devices_per_node)``.

    ``x`` (fp16 after conversion, flat) is ``W = nodes * devices_per_node`` equal partitions, each
    ``groups / W`` quantization groups; partition ``p = n * devices_per_node + d`` (the one rank
    ``p`` will own) is written at position ``d * nodes + n``, so everything bound for local peer
    ``d`` is one contiguous chunk. Returns ``(packed int8 (numel/2,), scales fp32 (groups, 1))``,
    scales swizzled the same way.
    """
    h = _as_half(x)
    world = nodes * devices_per_node
    _check_groups(h.numel(), groups, max_group=MAX_SWIZZLE_GROUP, what="swizzle_quant")
    if groups % world != 0:
        raise ValueError(f"swizzle_quant: {groups} groups do not split into {world} partitions")
    q, stored = _symmetric_quantize(h.view(groups, -1), GRADIENT_BITS)
    packed = _pack_int4(q)
    # (node, device, ...) -> (device, node, ...): swizzled_quantize.cu's output_partition.
    packed = packed.view(nodes, devices_per_node, -1).transpose(0, 1).reshape(-1)
    scales = stored.view(nodes, devices_per_node, -1).transpose(0, 1).reshape(groups, 1)
    return packed, scales


def quantized_reduction(values: Tensor, scales: Tensor, in_groups: int, out_groups: int,
                        devices_per_node: int) -> Tuple[Tensor, Tensor]:
    """``quantized_reduction(values, scales, in_groups, out_groups, 4, Symmetric, devices_per_node)``.

    ``values`` is ``devices_per_node`` equal int4 tensors end to end (what the intra-node
    all-to-all delivered, peer 0's first), each with ``in_groups / devices_per_node`` groups of
    scales. Each value is dequantized to fp16, the pieces are summed in fp16 in peer order
    (``0 + t0 + t1 + ...``, each ``+`` one ``__hadd2``), and the sum re-quantized to int4 in
    ``out_groups`` groups. Returns ``(packed int8, scales fp32 (out_groups, 1))``; the packed
    result has the input's shape with its last dimension divided by ``devices_per_node``.
    """
    dpn = int(devices_per_node)
    total = values.numel()  # bytes: the kernel indexes the packed buffer, two values a byte
    if total % dpn != 0 or in_groups % dpn != 0 or scales.numel() != in_groups:
        raise ValueError(f"quantized_reduction: {total} bytes and {scales.numel()} scales "
                         f"({in_groups} groups) do not split over {dpn} devices")
    tensor_bytes = total // dpn
    in_groups_per_tensor = in_groups // dpn
    for count, what in ((in_groups_per_tensor, "input"), (out_groups, "output")):
        # Every 4-byte load must sit inside one group: the kernel takes one scale per load.
        if count <= 0 or tensor_bytes % count != 0 or (tensor_bytes // count) % 4 != 0:
            raise ValueError(f"quantized_reduction: {tensor_bytes} bytes a tensor do not make "
                             f"{count} {what} groups of whole 4-byte loads")
    if tensor_bytes // out_groups > MAX_REDUCE_GROUP_BYTES:
        raise ValueError(f"quantized_reduction: output groups of {tensor_bytes // out_groups} bytes "
                         f"exceed the kernel's {MAX_REDUCE_GROUP_BYTES}")
    q = _unpack_int4(values.reshape(dpn, in_groups_per_tensor, -1))
    pieces = _symmetric_dequantize(q, scales.reshape(dpn, in_groups_per_tensor, 1)).reshape(dpn, -1)
    acc = pieces.new_zeros(pieces.shape[1:])  # reduce::init<rop::Add, __half2>() is +0
    for piece in pieces.unbind(0):
        acc = _fp16_add(acc, piece)
    q_out, stored = _symmetric_quantize(acc.view(out_groups, -1), GRADIENT_BITS)
    out_shape = tuple(values.shape[:-1]) + (values.shape[-1] // dpn,)
    return _pack_int4(q_out).reshape(out_shape), stored


def dequantize_int4(packed: Tensor, scales: Tensor, groups: int,
                    dtype: torch.dtype = torch.float16) -> Tensor:
    """``dequantize(packed, scales, groups, 4, Symmetric)`` (fp16), then ``.to(dtype)``.
    The result has ``packed``'s shape with its last dimension doubled."""
    _check_groups(2 * packed.numel(), groups, max_group=None, what="dequantize_int4")
    if scales.numel() != groups:
        raise ValueError(f"dequantize_int4: {scales.numel()} scales for {groups} groups")
    q = _unpack_int4(packed.reshape(groups, -1))
    out = _symmetric_dequantize(q.reshape(groups, -1), scales.reshape(groups, 1))
    out_shape = tuple(packed.shape[:-1]) + (2 * packed.shape[-1],)
    out = out.reshape(out_shape)
    return out if out.dtype == dtype else out.to(dtype)


# ---------------------------------------------------------------------------------------------
# The whole qgZ reduce-scatter, simulated for W ranks in one process
# ---------------------------------------------------------------------------------------------


def local_group_ranks(node: int, devices_per_node: int) -> List[int]:
    """DeepSpeed's ``local_{node}`` group: the ranks of one node, in local-index order."""
    return [node * devices_per_node + d for d in range(devices_per_node)]


def global_group_ranks(local_index: int, nodes: int, devices_per_node: int) -> List[int]:
    """DeepSpeed's ``global_{local_index}`` group: that local index on every node, in node order."""
    return [n * devices_per_node + local_index for n in range(nodes)]


def _all_to_all_single(inputs: Sequence[Tensor]) -> List[Tensor]:
    """``all_to_all_single`` over one group, as lists: member ``i`` receives chunk ``i`` of every
    member's input, concatenated in member order."""
    size = len(inputs)
    chunks = [t.reshape(-1).chunk(size) for t in inputs]
    return [torch.cat([chunks[src][dst] for src in range(size)]).reshape(inputs[dst].shape)
            for dst in range(size)]


def simulate_reduce_scatter(per_rank_tensors: Sequence[Tensor]) -> List[Tensor]:
    """DeepSpeed's fallback, ``reduce_scatter_coalesced([tensor])`` over the whole world.

    Rank ``r`` gets the flat elements ``[r*c, r*c + c)`` with ``c = ceil(numel / W)`` (fewer at the
    end), each rank's copy divided by ``W`` first (``div_``, as CUDA torch computes it), summed in
    rank order in the tensor's dtype. NCCL chooses its own summation order; rank order is this
    simulation's, so only ``W = 2`` is order-independent.
    """
    world = len(per_rank_tensors)
    flats = [_divide_like_cuda(t.reshape(-1), world) for t in per_rank_tensors]
    chunk = math.ceil(flats[0].numel() / world)
    outputs = []
    for r in range(world):
        acc = flats[0][r * chunk:(r + 1) * chunk]
        for other in flats[1:]:
            acc = acc + other[r * chunk:(r + 1) * chunk]
        outputs.append(acc)
    return outputs


def _divide_like_cuda(t: Tensor, n: int) -> Tensor:
    """``t.div_(n)`` as torch runs it on CUDA: ``t * (1 / n)`` in t's op-math type (fp32 for the
    16-bit floats), rounded once to t's dtype."""
    if t.dtype in (torch.float16, torch.bfloat16, torch.float32):
        return (t.float() * _fp32_reciprocal(n, t.device)).to(t.dtype)
    return t * (1.0 / n)


def simulate_all_to_all_quant_reduce(per_rank_tensors: Sequence[Tensor], nodes: int,
                                     devices_per_node: int) -> List[Tensor]:
    """``all_to_all_quant_reduce([tensor], groups)`` for ``W = nodes * devices_per_node`` ranks.

    ``per_rank_tensors[r]`` is rank ``r``'s gradient; ranks are node-major (``r = n * dpn + d``).
    Returns rank ``r``'s partition: flat fp16, ``numel / W`` values, equal to
    ``sum over all ranks / nodes`` of partition ``r`` up to the quantization (DeepSpeed divides by
    the node count only, not by W; its reduce-scatter fallback divides by W). Tensors
    ``qgz_fallback_reason`` names take ``simulate_reduce_scatter`` instead (dtype kept).

    Per rank ``r = (m, d)``, as the engine runs it with real collectives (``G, G' =
    gradient_groups(shape, W, dpn)``, ``P`` = a partition, ``numel / W`` values):

    1. ``packed, scales = swizzle_quant(grad, G, nodes, dpn)``: ``packed`` is ``W`` swizzled
       partitions, position ``d' * nodes + n'`` holding partition ``n' * dpn + d'``.
    2. intra-node ``all_to_all_single`` of ``packed`` and of ``scales`` in ``local_{m}``
       (``local_group_ranks(m, dpn)``): chunk ``d'`` (``nodes`` partitions: ``n' * dpn + d'`` for
       every node ``n'``) goes to local peer ``d'``. Rank ``(m, d)`` then holds ``dpn`` pieces, piece
       ``s`` from local peer ``(m, s)``, each the partitions ``n' * dpn + d`` for ``n' = 0..nodes-1``.
    3. ``quantized_reduction(recv, recv_scales, G, G', dpn)`` sums the ``dpn`` pieces: ``nodes``
       partitions, the node-``m`` sum of partition ``n' * dpn + d`` at position ``n'``.
    4. inter-node ``all_to_all_single`` of that and of its scales in ``global_{d}``
       (``global_group_ranks(d, nodes, dpn)``): chunk ``n'`` goes to rank ``(n', d)``. Rank ``(m, d)``
       receives, from every node ``n'`` in node order, node ``n'``'s sum of partition ``m * dpn + d
       = r``: its own.
    5. ``average_node_chunks(recv, recv_scales, nodes)``: ``dequantize_int4`` with as many groups
       as scales arrived (``G' / nodes`` from each node) to fp16, the ``nodes`` chunks summed in
       node order in fp16 (``0 + c0 + c1 + ...``), then times ``1 / nodes`` (fp32) into fp16.
    """
    nodes, dpn = int(nodes), int(devices_per_node)
    world = nodes * dpn
    if len(per_rank_tensors) != world:
        raise ValueError(f"{len(per_rank_tensors)} tensors for {nodes} nodes x {dpn} devices")
    shape = tuple(per_rank_tensors[0].shape)
    if any(tuple(t.shape) != shape for t in per_rank_tensors):
        raise ValueError("every rank's gradient must have the same shape")
    if qgz_fallback_reason(shape, nodes, dpn) is not None:
        return simulate_reduce_scatter(per_rank_tensors)
    intra_groups, inter_groups = gradient_groups(shape, world, dpn)

    swizzled = [swizzle_quant(t, intra_groups, nodes, dpn) for t in per_rank_tensors]
    local_values: List[Optional[Tensor]] = [None] * world
    local_scales: List[Optional[Tensor]] = [None] * world
    for m in range(nodes):
        ranks = local_group_ranks(m, dpn)
        for rank, v in zip(ranks, _all_to_all_single([swizzled[r][0] for r in ranks])):
            local_values[rank] = v
        for rank, s in zip(ranks, _all_to_all_single([swizzled[r][1] for r in ranks])):
            local_scales[rank] = s

    reduced = [quantized_reduction(local_values[r], local_scales[r], intra_groups, inter_groups, dpn)
               for r in range(world)]
    global_values: List[Optional[Tensor]] = [None] * world
    global_scales: List[Optional[Tensor]] = [None] * world
    for d in range(dpn):
        ranks = global_group_ranks(d, nodes, dpn)
        for rank, v in zip(ranks, _all_to_all_single([reduced[r][0] for r in ranks])):
            global_values[rank] = v
        for rank, s in zip(ranks, _all_to_all_single([reduced[r][1] for r in ranks])):
            global_scales[rank] = s

    return [average_node_chunks(global_values[r], global_scales[r], nodes) for r in range(world)]


def sum_node_chunks(values: Tensor, scales: Tensor, nodes: int) -> Tensor:
    """``dequantize`` the inter-node all-to-all's output (``scales.numel()`` groups) to fp16, then
    ``sum(chunk(nodes))`` in fp16 in node order, flat: step 5 of ``all_to_all_quant_reduce``
    before its division by the node count."""
    full = dequantize_int4(values, scales, scales.numel()).reshape(-1)
    if full.numel() % nodes != 0:
        raise ValueError(f"{full.numel()} values do not split into {nodes} node chunks")
    chunks = full.view(nodes, -1).unbind(0)  # (not slices: the device-discipline tests' fake CUDA takes these)
    acc = torch.zeros_like(chunks[0])  # Python's sum() starts from 0
    for piece in chunks:
        acc = _fp16_add(acc, piece)
    return acc


def average_node_chunks(values: Tensor, scales: Tensor, nodes: int) -> Tensor:
    """Step 5 of ``all_to_all_quant_reduce``: :func:`sum_node_chunks`, then ``/ nodes`` in fp16."""
    acc = sum_node_chunks(values, scales, nodes)
    # ``fp16 / nodes`` on CUDA multiplies by the fp32 reciprocal (BinaryDivTrueKernel.cu: a CPU
    # scalar divisor becomes ``a * (1 / b)`` in fp32). Rounded to fp16 that equals a true division
    # (an fp16 quotient is never within fp32's error of an fp16 midpoint); written as CUDA does.
    return (acc.float() * _fp32_reciprocal(nodes, acc.device)).to(torch.float16)


def _fp32_reciprocal(n: int, device: torch.device) -> Tensor:
    """``1.0f / n`` rounded once to fp32 (a double quotient rounded to fp32 is the same number)."""
    return torch.tensor(1.0 / n, dtype=torch.float32, device=device)
