"""A second oracle for raydeep's ZeRO++ quantizers: DeepSpeed's CUDA kernels, thread by thread.

Transcribed from DeepSpeed 0.19.8 (the installed ``deepspeed`` package):

- ``runtime/zero/partition_parameters.py``  ``CUDAQuantizer.quantize`` / ``dequantize``
- ``runtime/comm/coalesced_collectives.py`` ``all_to_all_quant_reduce``, ``reduce_scatter_coalesced``
- ``ops/csrc/quantization/pt_binding.cpp``  the launch arguments (``quantize_kernel``,
  ``dequantize``, ``ds_swizzle_quant``, ``quantized_reduction``)
- ``ops/csrc/quantization/quantize.cu``     ``launch_quant``, ``cached_quantization``
- ``ops/csrc/quantization/dequantize.cu``   ``launch_dequantize_kernel``; ``includes/dequantization_utils.h``
- ``ops/csrc/quantization/swizzled_quantize.cu`` ``launch_swizzled_quant_impl``, ``swizzled_quant_kernel``
- ``ops/csrc/quantization/quant_reduce.cu`` ``launch_dequant_reduce_impl``, ``dequant_reduce``
- ``ops/csrc/includes/quantization_utils.h`` ``Params<Symmetric>``, ``GroupStats``, ``_chunk``,
  ``local_array``; ``quantization.h`` ``PackedInt4``; ``ds_kernel_utils.h`` ``next_pow2``

Nothing here comes from ``raydeep``. The style is the kernels': every launch computes DeepSpeed's
grid and block, then loops over blocks and threads, and each thread loads, reduces and stores its
16-byte (or 4-byte) chunks at the offsets the kernel computes. Scalars are numpy's ``float16`` /
``float32``, whose arithmetic is IEEE (rounded to nearest even), like the GPU's. Global memory is a
numpy array per buffer; output buffers start as a sentinel, and a kernel that leaves a byte or a
scale unwritten, or reads outside its input, raises ``UndefinedBehaviour`` (DeepSpeed would hand
back ``torch.empty`` garbage or read a neighbour's memory).

The ranks of ``all_to_all_quant_reduce`` run side by side as generators that yield at each
collective; ``run_ranks`` serves the collectives from plain lists (the fake process group):
``all_to_all_single`` hands member ``i`` chunk ``i`` of every member, in member order;
``reduce_scatter`` hands member ``i`` the rank-order sum of chunk ``i``.

Departures (none in the arithmetic the kernels specify):

- DeepSpeed compiles the kernels with ``--use_fast_math``, so on a GPU ``(1 << bits) / (2 * max)``
  and ``1 / scale`` are approximate (within 2 ulp); here they are IEEE divisions, as the source
  reads;
- ``torch``'s CUDA ``half_tensor / n`` (a CPU scalar divisor) is ``half(float(a) * (1.0f / n))``
  (``aten/src/ATen/native/cuda/BinaryDivTrueKernel.cu``); the ``/ num_nodes`` and the
  reduce-scatter's ``div_(world_sz)`` are written that way here;
- NCCL's reduce-scatter sums in its own (ring) order; here in rank order;
- the cross-thread maximum (``reduce::partitioned_block``) is a plain ``max`` over the threads of
  a group: the maximum of fp16 magnitudes is exact in any order.
"""
from __future__ import annotations

import math
from typing import Dict, Iterator, List, Sequence, Tuple

import numpy as np
import torch

SYMMETRIC = "Symmetric"
GRANULARITY = 16  # quantize::granularity, bytes per load
H_PER_LOAD = GRANULARITY // 2  # quantize::h_per_load
H2_PER_LOAD = GRANULARITY // 4  # quantize::h2_per_load
UNWRITTEN = -999  # sentinel in the int16 copies of int8 output buffers


class UndefinedBehaviour(RuntimeError):
    """The DeepSpeed kernel would read outside its input or leave output uninitialized."""


# --------------------------------------------------------------------------------------------
# ds_kernel_utils.h, conversion_utils.h, quantization.h
# --------------------------------------------------------------------------------------------


def next_pow2(val: int) -> int:
    rounded_val = val - 1
    rounded_val |= rounded_val >> 1
    rounded_val |= rounded_val >> 2
    rounded_val |= rounded_val >> 4
    rounded_val |= rounded_val >> 8
    return rounded_val + 1


def float2int_rn(val: np.float32) -> int:
    """``__float2int_rn``: round to nearest, ties to even."""
    return int(np.rint(val))


def to_float(val) -> np.float32:
    return np.float32(val)


def float2half(val: np.float32) -> np.float16:
    """``__float2half``: round to nearest even."""
    return np.float16(val)


def packed_int4_byte(high: int, low: int) -> int:
    """``PackedInt4{int8_t high : 4; int8_t low : 4;}`` as one byte: the first-declared bitfield
    takes the least significant bits (GCC/NVCC, little-endian). Returns the byte as int8."""
    byte = (high & 0xF) | ((low & 0xF) << 4)
    return byte - 256 if byte >= 128 else byte


def packed_int4_fields(byte: int) -> Tuple[int, int]:
    """``(high, low)`` read back from a byte as signed 4-bit bitfields."""
    b = byte & 0xFF
    high, low = b & 0xF, b >> 4
    return (high - 16 if high >= 8 else high), (low - 16 if low >= 8 else low)


# --------------------------------------------------------------------------------------------
# quantization_utils.h: Params<Type::Symmetric, numBits>
# --------------------------------------------------------------------------------------------


class SymmetricParams:
    def __init__(self, num_bits: int, scale: np.float32):
        self.num_bits = num_bits
        self.scale = np.float32(scale)

    @classmethod
    def from_max(cls, num_bits: int, max_val: np.float32) -> "SymmetricParams":
        # Params(float max)
        if max_val == 0:
            scale = np.float32(1.0)
        else:
            scale = np.float32(1 << num_bits) / (np.float32(2) * np.float32(max_val))
        return cls(num_bits, scale)

    @classmethod
    def from_memory(cls, num_bits: int, params: np.ndarray, group_index: int) -> "SymmetricParams":
        # Params(const float* params, int group_index): loads the stored value as ``scale``
        return cls(num_bits, params[group_index])

    def quantize(self, val: np.float16) -> int:
        q_min = -(1 << (self.num_bits - 1))
        q_max = (1 << (self.num_bits - 1)) - 1
        val_f = to_float(val) * self.scale
        data_i32 = float2int_rn(val_f)
        data_i32 = min(max(data_i32, q_min), q_max)
        return data_i32

    def dequantize_half(self, val: int) -> np.float16:
        val_deq_f = to_float(val) * self.scale
        return float2half(val_deq_f)

    def store(self, params: np.ndarray, group_index: int) -> None:
        store_scale = np.float32(1) / self.scale
        params[group_index] = store_scale


class SymmetricGroupStats:
    """GroupStats<Symmetric>: a running max of ``__habs2`` over fp16 values, per thread."""

    def __init__(self):
        self.cur_max = np.float16(-np.inf)  # reduce::init<rop::Max, __half2>()

    def update(self, val: np.float16) -> None:
        self.cur_max = max(self.cur_max, np.abs(np.float16(val)))

    @staticmethod
    def get_params(stats_of_group_threads: Sequence["SymmetricGroupStats"], num_bits: int) -> SymmetricParams:
        # conversion::to<float2>(cur_max), max of the two lanes, then partitioned_block<Max>
        max_val = max(to_float(s.cur_max) for s in stats_of_group_threads)
        return SymmetricParams.from_max(num_bits, max_val)


def quantize_chunk(halves: Sequence[np.float16], num_bits: int, q_params: SymmetricParams) -> List[int]:
    """``quantize::_chunk``: 8 halves to 8 int8 or 4 packed int4 bytes."""
    elems = 16 // 2
    num_elems_packed = 8 // num_bits
    out = []
    for i in range(0, elems, num_elems_packed):
        if num_elems_packed == 1:
            out.append(q_params.quantize(halves[i]))
        else:
            data_i8_1 = q_params.quantize(halves[i])
            data_i8_2 = q_params.quantize(halves[i + 1])
            out.append(packed_int4_byte(high=data_i8_2, low=data_i8_1))  # PackedInt4{data_i8_2, data_i8_1}
    return out


def dequantize_chunk(data: Sequence[int], num_bits: int, q_params: SymmetricParams) -> List[np.float16]:
    """``dequantize::chunk<__half>``: int8 bytes (or packed int4) to 8 halves."""
    num_elems_packed = 8 // num_bits
    iters = H_PER_LOAD // num_elems_packed
    out: List[np.float16] = [np.float16(0)] * H_PER_LOAD
    for i in range(iters):
        if num_elems_packed == 1:
            out[i] = q_params.dequantize_half(data[i])
        else:
            high, low = packed_int4_fields(data[i])
            out[2 * i] = q_params.dequantize_half(low)
            out[2 * i + 1] = q_params.dequantize_half(high)
    return out


# --------------------------------------------------------------------------------------------
# memory_access_utils.h, modelled on numpy buffers
# --------------------------------------------------------------------------------------------


def load_halves(buf: np.ndarray, offset: int, do_access: bool = True) -> List[np.float16]:
    """``load_global<16>``: 8 halves, or zeros when the predicate is false."""
    if not do_access:
        return [np.float16(0)] * H_PER_LOAD
    if offset < 0 or offset + H_PER_LOAD > buf.size:
        raise UndefinedBehaviour(f"16-byte load at half {offset} past a buffer of {buf.size}")
    return [buf[offset + k] for k in range(H_PER_LOAD)]


def load_bytes(buf: np.ndarray, offset: int, count: int) -> List[int]:
    if offset < 0 or offset + count > buf.size:
        raise UndefinedBehaviour(f"{count}-byte load at {offset} past a buffer of {buf.size}")
    return [int(buf[offset + k]) for k in range(count)]


def store_bytes(buf: np.ndarray, offset: int, values: Sequence[int]) -> None:
    if offset < 0 or offset + len(values) > buf.size:
        raise UndefinedBehaviour(f"store at {offset} past a buffer of {buf.size}")
    for k, v in enumerate(values):
        buf[offset + k] = v


def new_int8_output(count: int) -> np.ndarray:
    return np.full(count, UNWRITTEN, dtype=np.int16)


def new_scales(count: int) -> np.ndarray:
    return np.full(count, np.nan, dtype=np.float32)


def finish_int8(buf: np.ndarray, what: str) -> np.ndarray:
    if (buf == UNWRITTEN).any():
        raise UndefinedBehaviour(f"{what}: {(buf == UNWRITTEN).sum()} output bytes left uninitialized")
    return buf.astype(np.int8)


def finish_scales(buf: np.ndarray, what: str) -> np.ndarray:
    if np.isnan(buf).any():
        raise UndefinedBehaviour(f"{what}: {np.isnan(buf).sum()} scales left uninitialized")
    return buf


# --------------------------------------------------------------------------------------------
# quantize.cu: launch_quant + cached_quantization (+ quantize::local_array)
# --------------------------------------------------------------------------------------------


def launch_quant(input_data: np.ndarray, groups: int, elems_per_group: int, num_bits: int
                 ) -> Tuple[np.ndarray, np.ndarray]:
    max_threads = 256
    internal_unroll = 2
    is_subblock_schedule = elems_per_group <= 128
    h_per_step = H_PER_LOAD if is_subblock_schedule else H_PER_LOAD * internal_unroll
    one_step_threads = next_pow2((elems_per_group + h_per_step - 1) // h_per_step)
    threads_per_group = one_step_threads if one_step_threads < max_threads else max_threads
    groups_per_block = (max_threads + threads_per_group - 1) // threads_per_group if is_subblock_schedule else 1
    groups_launch = (groups_per_block + groups - 1) // groups_per_block
    block = (threads_per_group, groups_per_block)
    grid = groups_launch
    elems_per_step = threads_per_group * h_per_step
    external_unroll = (elems_per_group + elems_per_step - 1) // elems_per_step

    # LAUNCH_CACHED_QUANT(q_bits, quant_type, unroll_factor, internal_unroll, threads_per_group)
    if is_subblock_schedule:
        if threads_per_group not in (1, 2, 4, 8, 16):
            raise UndefinedBehaviour("no kernel for this sub-block schedule")
        template = (1, 1, threads_per_group)
    elif external_unroll in (1, 2, 3, 4):
        template = (external_unroll, internal_unroll, max_threads)
    else:
        raise UndefinedBehaviour(f"launch_quant launches nothing for {elems_per_group} elements a group")
    unroll, internal, tpg_template = template

    output = new_int8_output(groups * elems_per_group * num_bits // 8)
    params = new_scales(groups)
    for block_x in range(grid):
        cached_quantization(output, params, input_data, groups, elems_per_group, num_bits, block_x, block,
                            unroll, internal, tpg_template, max_threads)
    return finish_int8(output, "quantize"), finish_scales(params, "quantize")


def cached_quantization(output_data, params, input_data, groups, elems_per_group, q_bits, block_x, block,
                        UNROLL, internal_unroll, threads_per_group, max_threads):
    block_dim_x, block_dim_y = block
    tb_size = block_dim_x * block_dim_y
    for thread_y in range(block_dim_y):
        block_num = (block_x * max_threads // threads_per_group) + thread_y
        if block_num >= groups:
            continue  # its loads read past the input; its stores are predicated off
        # Indexing offsets
        block_offset = (block_x * (max_threads // threads_per_group) * elems_per_group) + (thread_y * elems_per_group)
        stride = tb_size * H_PER_LOAD
        local_buffers = {}
        stats = []
        for thread_x in range(block_dim_x):
            elem_offset = thread_x * H_PER_LOAD
            base_offset = block_offset + elem_offset
            local_buffer = []
            for i in range(UNROLL):
                for j in range(internal_unroll):
                    iteration = i * internal_unroll + j
                    local_buffer.append(load_halves(input_data, base_offset + iteration * stride,
                                                    elem_offset + iteration * stride < elems_per_group))
            # _local_serial_reduce
            s = SymmetricGroupStats()
            for chunk in local_buffer:
                for v in chunk:
                    s.update(v)
            stats.append(s)
            local_buffers[thread_x] = local_buffer
        q_params = SymmetricGroupStats.get_params(stats, q_bits)
        # quantize::local_array (the one taking q_params)
        num_ele_int8 = 8 // q_bits
        for thread_x in range(block_dim_x):
            elem_offset = thread_x * H_PER_LOAD
            base_offset = (block_num * elems_per_group + elem_offset) // num_ele_int8
            out_stride = tb_size * H_PER_LOAD // num_ele_int8
            if thread_x == 0 and block_num < groups:
                q_params.store(params, block_num)
            for i in range(UNROLL * internal_unroll):
                if elem_offset + i * out_stride * num_ele_int8 < elems_per_group and block_num < groups:
                    local_output = quantize_chunk(local_buffers[thread_x][i], q_bits, q_params)
                    store_bytes(output_data, base_offset + i * out_stride, local_output)


# --------------------------------------------------------------------------------------------
# dequantize.cu: launch_dequantize_kernel<__half> + dequantize::_to_global
# --------------------------------------------------------------------------------------------


def launch_dequantize_kernel(q_data: np.ndarray, q_params: np.ndarray, num_bits: int, elems_per_group: int,
                             total_elems: int) -> np.ndarray:
    unroll = 8
    threads = 512
    sizeof_T = 2  # __half
    elems_per_block = unroll * threads * GRANULARITY // sizeof_T
    grid = (total_elems + elems_per_block - 1) // elems_per_block

    load_granularity = (GRANULARITY // sizeof_T) // (1 if num_bits == 8 else 2)
    load_step_stride = load_granularity * threads
    load_block_stride = load_step_stride * unroll
    T_per_chunk = GRANULARITY // sizeof_T
    store_step_stride = T_per_chunk * threads
    store_block_stride = store_step_stride * unroll

    out = np.full(total_elems, np.nan, dtype=np.float16)
    for block_x in range(grid):
        for thread_x in range(threads):
            load_base = block_x * load_block_stride + thread_x * load_granularity
            elem_id_base = block_x * store_block_stride + thread_x * T_per_chunk
            for i in range(unroll):
                elem_id_iter = elem_id_base + i * store_step_stride
                if elem_id_iter < total_elems:
                    loaded = load_bytes(q_data, load_base + i * load_step_stride, load_granularity)
                    group_index = elem_id_iter // elems_per_group
                    params = SymmetricParams.from_memory(num_bits, q_params, group_index)
                    chunk = dequantize_chunk(loaded, num_bits, params)
                    if elem_id_iter + T_per_chunk > total_elems:
                        raise UndefinedBehaviour("16-byte store past the output")
                    out[elem_id_iter:elem_id_iter + T_per_chunk] = chunk
    return out


# --------------------------------------------------------------------------------------------
# swizzled_quantize.cu
# --------------------------------------------------------------------------------------------


def launch_swizzled_quant(input_data: np.ndarray, num_bits: int, groups: int, elems_per_group: int,
                          pipelining: int, nodes: int, devices_per_node: int) -> Tuple[np.ndarray, np.ndarray]:
    max_threads_c, min_threads_c = 512, 32
    step_granularity = 2
    h_per_step = step_granularity * H_PER_LOAD
    one_step_threads = next_pow2((elems_per_group + h_per_step - 1) // h_per_step)
    max_threads = one_step_threads if one_step_threads < max_threads_c else max_threads_c
    threads = min_threads_c if max_threads < min_threads_c else max_threads

    groups_per_partition = groups // (nodes * devices_per_node)
    assert groups_per_partition % pipelining == 0
    contiguous_groups = groups_per_partition // pipelining
    partitions = nodes * devices_per_node
    grid = (contiguous_groups, pipelining, partitions)

    elems_per_step = threads * h_per_step
    external_unroll = (elems_per_group + elems_per_step - 1) // elems_per_step
    total_unroll = external_unroll * step_granularity
    assert total_unroll % 2 == 0
    if threads < 512:
        total_chunks = 2
    elif total_unroll in (2, 4, 6, 8, 10):
        total_chunks = total_unroll
    else:
        raise UndefinedBehaviour(f"swizzled quant launches nothing for {elems_per_group} elements a group")

    q_data = new_int8_output(input_data.size * num_bits // 8)
    q_scales = new_scales(groups)
    for bz in range(grid[2]):
        for by in range(grid[1]):
            for bx in range(grid[0]):
                swizzled_quant_kernel(q_data, q_scales, input_data, elems_per_group, nodes, devices_per_node,
                                      num_bits, total_chunks, threads, (bx, by, bz), grid)
    return finish_int8(q_data, "swizzle_quant"), finish_scales(q_scales, "swizzle_quant")


def swizzled_quant_kernel(quantized_data, quantized_scales, uncompressed_data, elems_per_group, nodes,
                          devices_per_node, numBits, totalChunks, threads, block_idx, grid_dim):
    bx, by, bz = block_idx
    gx, gy, _ = grid_dim
    # Indexing offsets, same as normal quantization for in-case
    block_rank = bx + by * gx + bz * gx * gy
    block_offset = block_rank * elems_per_group
    stride = threads * H_PER_LOAD

    local_buffers = []
    stats = []
    for thread_x in range(threads):
        elem_offset = thread_x * H_PER_LOAD
        base_offset = block_offset + elem_offset
        s = SymmetricGroupStats()
        local_buffer = []
        for i in range(totalChunks):
            chunk = load_halves(uncompressed_data, base_offset + i * stride, elem_offset + i * stride < elems_per_group)
            for v in chunk:
                s.update(v)
            local_buffer.append(chunk)
        local_buffers.append(local_buffer)
        stats.append(s)
    params = SymmetricGroupStats.get_params(stats, numBits)

    partition_id = bz
    partition_offset = partition_id // devices_per_node
    partition_base = (partition_id % devices_per_node) * nodes
    pipelining_offset = by * (devices_per_node * nodes)
    output_partition = pipelining_offset + partition_base + partition_offset

    out_scalar_effect = 8 // numBits
    out_block_rank = output_partition * gx + bx
    out_block_offset = out_block_rank * elems_per_group // out_scalar_effect
    out_stride = stride // out_scalar_effect

    for thread_x in range(threads):
        elem_offset = thread_x * H_PER_LOAD
        out_base = out_block_offset + elem_offset // out_scalar_effect
        if thread_x == 0:
            params.store(quantized_scales, out_block_rank)
        for i in range(totalChunks):
            if i * stride + elem_offset < elems_per_group:
                local_output = quantize_chunk(local_buffers[thread_x][i], numBits, params)
                store_bytes(quantized_data, out_base + i * out_stride, local_output)


# --------------------------------------------------------------------------------------------
# quant_reduce.cu
# --------------------------------------------------------------------------------------------


def pow2_round_1(raw_value: int) -> int:
    return (((raw_value - 1) >> 1) + 1) << 1


def launch_dequant_reduce(input_data: np.ndarray, input_scales: np.ndarray, num_gpus: int, num_bits: int,
                          out_groups: int, elems_per_out_group: int, elems_per_in_tensor: int,
                          groups_per_in_tensor: int, elems_per_in_group: int) -> Tuple[np.ndarray, np.ndarray]:
    elems_per_thread = num_bits  # "a coincidence": 8 halves per 16 bytes, two int4 a byte
    one_step_threads = next_pow2((elems_per_out_group + elems_per_thread - 1) // elems_per_thread)
    threads = one_step_threads if one_step_threads < 1024 else 1024
    elems_per_step = threads * elems_per_thread
    unroll_raw = (elems_per_out_group + elems_per_step - 1) // elems_per_step
    unroll = pow2_round_1(unroll_raw) if unroll_raw >= 4 else unroll_raw
    if unroll not in (1, 2, 3, 4, 6, 8, 10, 12):
        raise UndefinedBehaviour(f"dequant_reduce has no kernel for unroll {unroll}")

    reduced_data = new_int8_output(elems_per_in_tensor)
    reduced_scales = new_scales(out_groups)
    for block_x in range(out_groups):
        dequant_reduce(reduced_data, reduced_scales, input_data, input_scales, elems_per_out_group,
                       elems_per_in_tensor, groups_per_in_tensor, elems_per_in_group, num_gpus, num_bits,
                       unroll, block_x, threads)
    return finish_int8(reduced_data, "quantized_reduction"), finish_scales(reduced_scales, "quantized_reduction")


def dequant_reduce(reduced_data, reduced_scales, input_data, input_scales, elems_per_out_group,
                   elems_per_in_tensor, groups_per_in_tensor, elems_per_in_group, num_tensors, numBits,
                   totalChunks, block_x, block_dim_x):
    mem_granularity = 8 if numBits == 8 else 4
    elems_per_load = mem_granularity  # bytes (int8_t)
    storage_values = 16 // 4  # __half2 per 16 bytes

    block_offset = block_x * elems_per_out_group
    stride = block_dim_x * elems_per_load

    local_buffers = []
    stats = []
    for thread_x in range(block_dim_x):
        elem_offset = thread_x * elems_per_load
        base_offset = block_offset + elem_offset
        s = SymmetricGroupStats()
        local_buffer = []
        for i in range(totalChunks):
            iteration_buffer = [np.float16(0)] * (2 * storage_values)  # reduce::init<rop::Add, __half2>()
            iter_offset = i * stride + base_offset
            iter_scale_idx = iter_offset // elems_per_in_group
            do_loads = i * stride + elem_offset < elems_per_out_group
            for j in range(num_tensors):
                if do_loads:
                    load_buffer = load_bytes(input_data, j * elems_per_in_tensor + iter_offset, elems_per_load)
                    params = SymmetricParams.from_memory(
                        numBits, input_scales[j * groups_per_in_tensor:], iter_scale_idx)
                    dequant_buffer = dequantize_chunk(load_buffer, numBits, params)
                    for k in range(2 * storage_values):
                        iteration_buffer[k] = np.float16(iteration_buffer[k] + dequant_buffer[k])  # __hadd2
            for v in iteration_buffer:
                s.update(v)
            local_buffer.append(iteration_buffer)
        local_buffers.append(local_buffer)
        stats.append(s)

    params = SymmetricGroupStats.get_params(stats, numBits)
    params.store(reduced_scales, block_x)

    for thread_x in range(block_dim_x):
        elem_offset = thread_x * elems_per_load
        base_offset = block_offset + elem_offset
        for i in range(totalChunks):
            iter_offset = i * stride + base_offset
            if i * stride + elem_offset < elems_per_out_group:
                local_output = quantize_chunk(local_buffers[thread_x][i], numBits, params)
                store_bytes(reduced_data, iter_offset, local_output)


# --------------------------------------------------------------------------------------------
# pt_binding.cpp: the Python-visible ops, on torch tensors in and out
# --------------------------------------------------------------------------------------------


def _half_numpy(t: torch.Tensor) -> np.ndarray:
    if t.dtype != torch.float16:
        raise TypeError(f"the kernel reads __half; DeepSpeed would reinterpret {t.dtype} bits")
    return t.detach().cpu().contiguous().view(-1).numpy()


def quantize(input_vals: torch.Tensor, groups: int, num_bits: int, quant_type=SYMMETRIC):
    """``quantize_kernel``: returns ``(int8 output of the input's shape, float params (groups, 1))``."""
    data = _half_numpy(input_vals)
    elems_per_group = data.size // groups
    out, params = launch_quant(data, groups, elems_per_group, num_bits)
    sizes = list(input_vals.shape)
    sizes[-1] //= 1 if num_bits == 8 else 2
    return torch.from_numpy(out).view(sizes), torch.from_numpy(params).view(groups, 1)


def dequantize(quantized_data: torch.Tensor, params: torch.Tensor, groups: int, num_bits: int,
               quant_type=SYMMETRIC) -> torch.Tensor:
    """``dequantize<__half>``."""
    sizes = list(quantized_data.shape)
    sizes[-1] *= 1 if num_bits == 8 else 2
    total_elems = math.prod(sizes)
    elems_per_group = total_elems // groups
    out = launch_dequantize_kernel(quantized_data.contiguous().view(-1).numpy(),
                                   params.contiguous().view(-1).numpy(), num_bits, elems_per_group, total_elems)
    return torch.from_numpy(out).view(sizes)


def swizzle_quant(input_vals: torch.Tensor, groups: int, num_bits: int, quant_type, pipeline_size: int,
                  nodes: int, devices_per_node: int):
    """``ds_swizzle_quant``: ``(int8 (numel * bits / 8,), float scales (groups, 1))``."""
    data = _half_numpy(input_vals)
    elems_per_group = data.size // groups
    out, scales = launch_swizzled_quant(data, num_bits, groups, elems_per_group, pipeline_size, nodes,
                                        devices_per_node)
    return torch.from_numpy(out), torch.from_numpy(scales).view(groups, 1)


def quantized_reduction(input_vals: torch.Tensor, input_scales: torch.Tensor, in_groups: int, out_groups: int,
                        num_bits: int, quant_type, devices_per_node: int):
    sz = list(input_vals.shape)
    sz[-1] = sz[-1] // devices_per_node
    elems_per_in_tensor = input_vals.numel() // devices_per_node
    elems_per_in_group = elems_per_in_tensor // (in_groups // devices_per_node)
    elems_per_out_group = elems_per_in_tensor // out_groups
    out, scales = launch_dequant_reduce(input_vals.contiguous().view(-1).numpy(),
                                        input_scales.contiguous().view(-1).numpy(), devices_per_node, num_bits,
                                        out_groups, elems_per_out_group, elems_per_in_tensor,
                                        in_groups // devices_per_node, elems_per_in_group)
    return torch.from_numpy(out).view(sz), torch.from_numpy(scales).view(out_groups, 1)


# --------------------------------------------------------------------------------------------
# partition_parameters.py: CUDAQuantizer
# --------------------------------------------------------------------------------------------


class CUDAQuantizer:
    target_group_size = 8000

    def __init__(self):
        self.group_size_cache: Dict[int, int] = {}

    def groups_for(self, numel: int) -> int:
        try:
            groups = self.group_size_cache[numel]
        except KeyError:
            groups = math.ceil(numel / self.target_group_size)
            while groups < numel:
                if numel % (8 * groups) == 0:
                    break
                groups += 1
            while True:
                if numel % (8 * groups * 2) == 0 and numel / groups > self.target_group_size:
                    groups *= 2
                else:
                    break
            assert numel % (8 * groups) == 0, f"{numel} cannot be divided by 8*{groups}"
            assert numel / groups < 16000, f"{numel} / {groups} is larger than 16k"
            assert numel > groups, f"cannot find a group size for input tensor of size {numel}"
            self.group_size_cache[numel] = groups
        return groups

    def quantize(self, param: torch.Tensor, groups=None):
        if groups is None:
            groups = self.groups_for(param.numel())
        param = param.to(dtype=torch.half)
        return quantize(param, groups, 8, SYMMETRIC)

    def dequantize(self, quantized_param, scale, dtype=None):
        dequantized = dequantize(quantized_param, scale, scale.numel(), 8, SYMMETRIC)
        if dtype is not None and dequantized.dtype != dtype:
            dequantized = dequantized.to(dtype)
        return dequantized


# --------------------------------------------------------------------------------------------
# coalesced_collectives.py, per rank, with a list-based fake process group
# --------------------------------------------------------------------------------------------


class FakeGroup:
    def __init__(self, ranks: Sequence[int]):
        self.ranks = tuple(ranks)


def get_local_all_to_all_groups(world_size: int, device_per_node: int) -> Dict[str, FakeGroup]:
    """``utils/groups.py`` ``_get_local_all_to_all_group`` for more than one node."""
    groups = {}
    num_local = world_size // device_per_node
    for i in range(num_local):
        groups[f"local_{i}"] = FakeGroup([j + device_per_node * i for j in range(device_per_node)])
    for i in range(device_per_node):
        groups[f"global_{i}"] = FakeGroup([i + j * device_per_node for j in range(num_local)])
    return groups


def div_like_cuda(t: torch.Tensor, n: int) -> torch.Tensor:
    """``t / n`` (or ``t.div_(n)``) as torch runs it on CUDA: ``a * (1.0f / n)`` in op-math."""
    inv = np.float32(1.0) / np.float32(n)
    return (t.float() * float(inv)).to(t.dtype)


def reduce_scatter_coalesced(rank: int, world_sz: int, tensors: List[torch.Tensor]) -> Iterator:
    this_rank = rank
    partition_lst_for_each_tensor = [None] * len(tensors)
    for tensor_idx, tensor in enumerate(tensors):
        flattened_tensor = tensor.reshape(-1)
        chunk_sz = math.ceil(tensor.numel() / world_sz)
        partition_lst_for_each_tensor[tensor_idx] = [
            flattened_tensor[r * chunk_sz:r * chunk_sz + chunk_sz] for r in range(0, world_sz)
        ]
    padded_partition_sz_for_each_tensor = tuple(math.ceil(t.numel() / world_sz) for t in tensors)
    if len(tensors) == 1 and tensors[0].numel() % world_sz == 0:
        tensor_partition_flat_buffer = tensors[0].reshape(-1)
    else:
        tensor_partition_lst_with_padding = []
        for r in range(world_sz):
            for tensor_idx in range(len(tensors)):
                tensor_chunk = partition_lst_for_each_tensor[tensor_idx][r]
                tensor_partition_lst_with_padding.append(tensor_chunk)
                padding_sz = padded_partition_sz_for_each_tensor[tensor_idx] - tensor_chunk.numel()
                if padding_sz > 0:
                    # torch.empty in DeepSpeed: whatever is there only ever lands in padding
                    tensor_partition_lst_with_padding.append(torch.zeros(padding_sz, dtype=tensor_chunk.dtype))
        tensor_partition_flat_buffer = torch.cat(tensor_partition_lst_with_padding)
    tensor_partition_flat_buffer = div_like_cuda(tensor_partition_flat_buffer, world_sz)  # pre-divide
    mine = yield ("reduce_scatter", tensor_partition_flat_buffer, None)
    output_lst = [None] * len(tensors)
    offset = 0
    for tensor_idx in range(len(tensors)):
        output_lst[tensor_idx] = mine.narrow(0, offset, partition_lst_for_each_tensor[tensor_idx][this_rank].numel())
        offset += padded_partition_sz_for_each_tensor[tensor_idx]
    return output_lst


def all_to_all_quant_reduce(rank: int, world_size: int, local_world_size: int, tensors: List[torch.Tensor],
                            groups: Dict[str, FakeGroup]) -> Iterator:
    global_world_size = world_size
    num_nodes = global_world_size // local_world_size
    this_rank = rank
    intra_idx = int(this_rank / local_world_size)
    inter_idx = this_rank % local_world_size
    output_lst = [None] * len(tensors)
    for idx, tensor in enumerate(tensors):
        if tensor.dim() == 1:
            output_lst[idx] = (yield from reduce_scatter_coalesced(rank, world_size, [tensor]))[0]
        elif tensor.numel() % (2 * global_world_size) != 0:
            output_lst[idx] = (yield from reduce_scatter_coalesced(rank, world_size, [tensor]))[0]
        else:
            intra_quant_group = max(tensor.shape[0], tensor.shape[1], global_world_size)
            inter_quant_group = intra_quant_group // local_world_size
            intra_quant_int4, intra_q_scales = swizzle_quant(tensor, intra_quant_group, 4, SYMMETRIC, 1, num_nodes,
                                                             local_world_size)
            local_output = yield ("all_to_all_single", intra_quant_int4, groups[f"local_{intra_idx}"])
            scale_output = yield ("all_to_all_single", intra_q_scales, groups[f"local_{intra_idx}"])
            global_input_tensor, global_scales = quantized_reduction(local_output, scale_output, intra_quant_group,
                                                                     inter_quant_group, 4, SYMMETRIC,
                                                                     local_world_size)
            global_output = yield ("all_to_all_single", global_input_tensor, groups[f"global_{inter_idx}"])
            global_scale_output = yield ("all_to_all_single", global_scales, groups[f"global_{inter_idx}"])
            final_output = dequantize(global_output, global_scale_output, global_scale_output.numel(), 4, SYMMETRIC)
            assert final_output.numel() % num_nodes == 0
            total = sum(list(final_output.chunk(num_nodes)))  # fp16 adds, from Python's 0
            output_lst[idx] = div_like_cuda(total, num_nodes).view(-1)
    return output_lst


def _serve(op: str, members: Sequence[int], inputs: Dict[int, torch.Tensor]) -> Dict[int, torch.Tensor]:
    size = len(members)
    if op == "all_to_all_single":
        out = {}
        for i, dst in enumerate(members):
            pieces = []
            for src in members:
                flat = inputs[src].reshape(-1)
                if flat.numel() % size != 0:
                    raise UndefinedBehaviour(f"all_to_all_single of {flat.numel()} over {size} ranks")
                n = flat.numel() // size
                pieces.append(flat[i * n:(i + 1) * n])
            out[dst] = torch.cat(pieces).view(inputs[dst].shape)
        return out
    if op == "reduce_scatter":
        out = {}
        for i, dst in enumerate(members):
            acc = None
            for src in members:  # rank order (NCCL's ring order is its own)
                n = inputs[src].numel() // size
                piece = inputs[src][i * n:(i + 1) * n]
                acc = piece.clone() if acc is None else acc + piece
            out[dst] = acc
        return out
    raise ValueError(op)


def run_ranks(generators: List[Iterator]) -> List:
    """Step every rank's generator to its next collective, serve the collectives, repeat."""
    world = len(generators)
    results: List = [None] * world
    pending: Dict[int, Tuple] = {}
    sends: List = [None] * world
    live = set(range(world))
    while live:
        for r in sorted(live):
            try:
                pending[r] = generators[r].send(sends[r])
            except StopIteration as stop:
                results[r] = stop.value
                live.discard(r)
                pending.pop(r, None)
        if not pending:
            break
        by_group: Dict[Tuple, Dict[int, torch.Tensor]] = {}
        ops: Dict[Tuple, str] = {}
        for r, (op, tensor, group) in pending.items():
            members = tuple(range(world)) if group is None else group.ranks
            by_group.setdefault(members, {})[r] = tensor
            ops[members] = op
        for members, inputs in by_group.items():
            if set(inputs) != set(members):
                raise RuntimeError(f"collective {ops[members]} on {members}: only {sorted(inputs)} joined")
            for r, t in _serve(ops[members], members, inputs).items():
                sends[r] = t
        pending = {}
    return results


def all_to_all_quant_reduce_world(per_rank_tensors: Sequence[torch.Tensor], nodes: int,
                                  devices_per_node: int) -> List[torch.Tensor]:
    """Every rank's ``all_to_all_quant_reduce([tensor], groups)[0]``."""
    world = nodes * devices_per_node
    groups = get_local_all_to_all_groups(world, devices_per_node)
    gens = [all_to_all_quant_reduce(r, world, devices_per_node, [per_rank_tensors[r]], groups)
            for r in range(world)]
    return [out[0] for out in run_ranks(gens)]
