"""``deepspeed.ops``: the optimizer classes libraries construct by name. DeepSpeed's JIT-built
kernels (``op_builder``) do not exist here; these run torch's implementations."""
from deepspeed.ops import adam  # noqa: F401
