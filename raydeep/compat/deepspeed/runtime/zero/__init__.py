"""``deepspeed.runtime.zero`` (which DeepSpeed also exposes as ``deepspeed.zero``)."""
from raydeep.zero import GatheredParameters, Init

from deepspeed.runtime.zero import partition_parameters  # noqa: F401

__all__ = ["GatheredParameters", "Init", "partition_parameters"]
