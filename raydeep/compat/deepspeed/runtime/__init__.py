"""``deepspeed.runtime``: the submodules libraries import by path (``engine``, ``lr_schedules``,
``zero.partition_parameters``)."""
from deepspeed.runtime import engine, lr_schedules, zero  # noqa: F401
