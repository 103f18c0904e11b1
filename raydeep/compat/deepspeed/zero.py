"""``deepspeed.zero``: DeepSpeed's alias of ``deepspeed.runtime.zero`` -- raydeep's ``zero.Init``
and ``GatheredParameters`` (:mod:`raydeep.zero`)."""
from deepspeed.runtime.zero import GatheredParameters, Init, partition_parameters  # noqa: F401

__all__ = ["GatheredParameters", "Init"]
