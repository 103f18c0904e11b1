"""The two accelerators: one interface (DeepSpeed's ``DeepSpeedAccelerator`` methods that client
scripts call), the CPU's answers and CUDA's (``torch.cuda``'s)."""
from __future__ import annotations

import contextlib
import os

import torch


def _not_here(what: str, instead: str):
    raise NotImplementedError(f"raydeep has no {what}: {instead}")


class Accelerator:
    """What both devices answer the same way; subclasses fill in the device-specific part."""

    _name = ""
    _communication_backend_name = ""

    def name(self) -> str:
        return self._name

    def communication_backend_name(self) -> str:
        return self._communication_backend_name

    def device(self, device_index=None):
        return None

    # --- RNG (torch's host generator; CUDA adds its own below) ------------------------------------
    def random(self):
        return torch.random

    def initial_seed(self) -> int:
        return torch.initial_seed()

    def default_generator(self, device_index=None):
        return torch.default_generator

    # --- precision ---------------------------------------------------------------------------------
    def is_fp64_supported(self) -> bool:
        return True

    def supported_dtypes(self) -> list:
        return [dtype for dtype, ok in ((torch.float, True), (torch.bfloat16, self.is_bf16_supported()),
                                        (torch.float16, self.is_fp16_supported())) if ok]

    def is_triton_supported(self) -> bool:
        return False

    # --- host memory -------------------------------------------------------------------------------
    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1, **_ignored) -> torch.Tensor:
        return tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return False

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name

    # --- profiling ranges and lazy calls -----------------------------------------------------------
    def range_push(self, msg: str, domain=None, category=None) -> None:
        return None

    def range_pop(self, domain=None) -> None:
        return None

    def lazy_call(self, callback):
        return callback()

    # --- graphs: not captured here -----------------------------------------------------------------
    def create_graph(self):
        return None

    def capture_to_graph(self, graph, pool=None, stream=None):
        return contextlib.nullcontext()

    def replay_graph(self, graph) -> None:
        return None

    def is_current_stream_capturing(self) -> bool:
        return False

    # --- legacy tensor types -----------------------------------------------------------------------
    BFloat16Tensor = property(lambda self: self._tensor_type(torch.bfloat16))
    ByteTensor = property(lambda self: self._tensor_type(torch.uint8))
    DoubleTensor = property(lambda self: self._tensor_type(torch.float64))
    FloatTensor = property(lambda self: self._tensor_type(torch.float32))
    HalfTensor = property(lambda self: self._tensor_type(torch.float16))
    IntTensor = property(lambda self: self._tensor_type(torch.int32))
    LongTensor = property(lambda self: self._tensor_type(torch.int64))

    def _tensor_type(self, dtype: torch.dtype):
        device = self._name

        def make(*size):
            return torch.empty(*size, dtype=dtype, device=device)

        return make

    # --- DeepSpeed's kernels ----------------------------------------------------------------------
    def op_builder_dir(self):
        _not_here("op builders", "raydeep compiles nothing at run time; its optimizers are torch's")

    def create_op_builder(self, op_name: str):
        _not_here(f"op builder {op_name!r}", "raydeep compiles nothing at run time; use the optimizer by its "
                  "ds_config name (Adam, AdamW, Lamb, OneBitAdam, ...)")

    def get_op_builder(self, class_name: str):
        self.create_op_builder(class_name)

    def build_extension(self):
        _not_here("extension builds", "raydeep compiles nothing at run time")

    def export_envs(self) -> list[str]:
        return []

    def visible_devices_envs(self) -> list[str]:
        return []

    def set_visible_devices_envs(self, current_env: dict, local_accelerator_ids) -> None:
        for env in self.visible_devices_envs():
            current_env[env] = ",".join(map(str, local_accelerator_ids))

    def get_compile_backend(self) -> str:
        return "inductor"

    def __repr__(self) -> str:
        return f"<raydeep {self._name} accelerator>"


class CpuAccelerator(Accelerator):
    """Ranks on the host over gloo. Synchronous: timers read the host clock, nothing to wait for."""

    _name, _communication_backend_name = "cpu", "gloo"

    def __init__(self):
        self._peak_rss = self._rss()

    @staticmethod
    def _rss() -> int:
        import psutil

        return psutil.Process().memory_info().rss

    def is_synchronized_device(self) -> bool:
        return True

    use_host_timers = resolves_data_dependency = handles_memory_backpressure = is_synchronized_device

    def device_name(self, device_index=None) -> str:
        return "cpu"

    def current_device_name(self) -> str:
        return "cpu"

    def current_device(self):
        return os.environ.get("LOCAL_RANK", 0)  # DeepSpeed's answer: the local rank stands for the device

    def set_device(self, device_index) -> None:
        return None

    def device_count(self) -> int:
        return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", 1)))

    def is_available(self) -> bool:
        return True

    def synchronize(self, device_index=None) -> None:
        return None

    def get_rng_state(self, device_index=None) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device_index=None) -> None:
        torch.set_rng_state(new_state)

    def manual_seed(self, seed: int):
        return torch.manual_seed(seed)

    manual_seed_all = manual_seed

    def Stream(self, *args, **kwargs):  # noqa: N802 - DeepSpeed's name
        return None

    def stream(self, stream):
        return contextlib.nullcontext()

    def current_stream(self, device_index=None):
        return None

    default_stream = current_stream

    def Event(self, *args, **kwargs):  # noqa: N802 - DeepSpeed's name
        return None

    def empty_cache(self) -> None:
        return None

    # Host memory: the process's resident set (what DeepSpeed's CPU accelerator reports).
    def memory_allocated(self, device_index=None) -> int:
        rss = self._rss()
        self._peak_rss = max(self._peak_rss, rss)
        return rss

    memory_cached = memory_reserved = memory_allocated

    def max_memory_allocated(self, device_index=None) -> int:
        self.memory_allocated()
        return self._peak_rss

    max_memory_cached = max_memory_reserved = max_memory_allocated

    def reset_peak_memory_stats(self, device_index=None) -> None:
        self._peak_rss = self._rss()

    reset_max_memory_allocated = reset_max_memory_cached = reset_peak_memory_stats

    def memory_stats(self, device_index=None) -> dict:
        return {"allocated_bytes.all.current": self.memory_allocated(),
                "allocated_bytes.all.peak": self.max_memory_allocated()}

    def total_memory(self, device_index=None) -> int:
        import psutil

        return psutil.virtual_memory().total

    def available_memory(self, device_index=None) -> int:
        import psutil

        return psutil.virtual_memory().available

    def is_bf16_supported(self) -> bool:
        return True

    def is_fp16_supported(self) -> bool:
        """DeepSpeed's answer: whether oneDNN has fp16 kernels on this CPU (raydeep trains fp16 on
        any CPU; this says whether it is fast)."""
        try:
            return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
        except (AttributeError, RuntimeError):
            return False


class CudaAccelerator(Accelerator):
    """Ranks on NVIDIA GPUs over NCCL: ``torch.cuda`` under DeepSpeed's names."""

    _name, _communication_backend_name = "cuda", "nccl"

    def is_synchronized_device(self) -> bool:
        return False

    use_host_timers = resolves_data_dependency = handles_memory_backpressure = is_synchronized_device

    def device_name(self, device_index=None) -> str:
        return "cuda" if device_index is None else f"cuda:{device_index}"

    def device(self, device_index=None):
        return torch.cuda.device(device_index)

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}"

    def current_device(self) -> int:
        return torch.cuda.current_device()

    def set_device(self, device_index) -> None:
        torch.cuda.set_device(device_index)

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def synchronize(self, device_index=None) -> None:
        torch.cuda.synchronize(device_index)

    def get_rng_state(self, device_index=None) -> torch.Tensor:
        return torch.cuda.get_rng_state() if device_index is None else torch.cuda.get_rng_state(device_index)

    def set_rng_state(self, new_state: torch.Tensor, device_index=None) -> None:
        if device_index is None:
            torch.cuda.set_rng_state(new_state)
        else:
            torch.cuda.set_rng_state(new_state, device_index)

    def manual_seed(self, seed: int):
        return torch.cuda.manual_seed(seed)

    def manual_seed_all(self, seed: int):
        return torch.cuda.manual_seed_all(seed)

    def initial_seed(self) -> int:
        return torch.cuda.initial_seed()

    def default_generator(self, device_index=None):
        return torch.cuda.default_generators[torch.cuda.current_device() if device_index is None else device_index]

    @property
    def Stream(self):  # noqa: N802 - DeepSpeed's name, a class
        return torch.cuda.Stream

    def stream(self, stream):
        return torch.cuda.stream(stream)

    def current_stream(self, device_index=None):
        return torch.cuda.current_stream(device_index)

    def default_stream(self, device_index=None):
        return torch.cuda.default_stream(device_index)

    @property
    def Event(self):  # noqa: N802 - DeepSpeed's name, a class
        return torch.cuda.Event

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def memory_allocated(self, device_index=None) -> int:
        return torch.cuda.memory_allocated(device_index)

    def max_memory_allocated(self, device_index=None) -> int:
        return torch.cuda.max_memory_allocated(device_index)

    def reset_max_memory_allocated(self, device_index=None) -> None:
        torch.cuda.reset_peak_memory_stats(device_index)

    reset_peak_memory_stats = reset_max_memory_cached = reset_max_memory_allocated

    def memory_reserved(self, device_index=None) -> int:
        return torch.cuda.memory_reserved(device_index)

    memory_cached = memory_reserved

    def max_memory_reserved(self, device_index=None) -> int:
        return torch.cuda.max_memory_reserved(device_index)

    max_memory_cached = max_memory_reserved

    def memory_stats(self, device_index=None) -> dict:
        return torch.cuda.memory_stats(device_index)

    def total_memory(self, device_index=None) -> int:
        return torch.cuda.get_device_properties(device_index or 0).total_memory

    def available_memory(self, device_index=None) -> int:
        free, _total = torch.cuda.mem_get_info(device_index)
        return free

    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()

    def is_fp16_supported(self) -> bool:
        return True

    def is_triton_supported(self) -> bool:
        return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 8

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1, **_ignored) -> torch.Tensor:
        return tensor.pin_memory()

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned()

    def range_push(self, msg: str, domain=None, category=None) -> None:
        torch.cuda.nvtx.range_push(msg)

    def range_pop(self, domain=None) -> None:
        torch.cuda.nvtx.range_pop()

    def lazy_call(self, callback):
        return torch.cuda._lazy_call(callback)

    def create_graph(self):
        return torch.cuda.CUDAGraph()

    def capture_to_graph(self, graph, pool=None, stream=None):
        return torch.cuda.graph(graph, pool, stream)

    def replay_graph(self, graph) -> None:
        graph.replay()

    def is_current_stream_capturing(self) -> bool:
        return torch.cuda.is_current_stream_capturing()

    def visible_devices_envs(self) -> list[str]:
        return ["CUDA_VISIBLE_DEVICES"]
