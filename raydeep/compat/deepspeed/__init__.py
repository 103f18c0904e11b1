"""DeepSpeed's top-level module, served by raydeep: loaded as ``deepspeed`` by the finder that
:func:`raydeep.compat.install` puts on ``sys.meta_path`` (never import it by its raydeep path).

``initialize`` is raydeep's (:mod:`raydeep.compat.initialize` adapts what accelerate passes);
``DeepSpeedEngine`` is raydeep's engine class, so ``isinstance`` checks in accelerate (unwrapping
the model) see through it.
"""

if __name__ != "deepspeed":
    raise ImportError("raydeep/compat/deepspeed is DeepSpeed's package as raydeep serves it: call "
                      "raydeep.compat.install(), then `import deepspeed`")

from raydeep import checkpointing, init_distributed  # noqa: E402
from raydeep.compat import advertised_version as _advertised_version  # noqa: E402
from raydeep.compat.initialize import initialize  # noqa: E402
from raydeep.engine import Engine as DeepSpeedEngine  # noqa: E402
from raydeep.engine import add_config_arguments  # noqa: E402

from deepspeed import accelerator, comm, ops, runtime, utils, zero  # noqa: E402
from deepspeed.accelerator import get_accelerator  # noqa: E402

__version__ = _advertised_version()
__version_major__, __version_minor__, __version_patch__ = (int(part) for part in __version__.split(".")[:3])
__git_hash__ = None
__git_branch__ = None

dist = comm  # DeepSpeed's own alias


def tp_model_init(*args, **kwargs):
    raise NotImplementedError("tensor parallelism (tensor_parallel.autotp_size > 1) is not supported by raydeep, "
                              "which runs data-parallel ZeRO only")


__all__ = ["DeepSpeedEngine", "accelerator", "add_config_arguments", "checkpointing", "comm", "dist",
           "get_accelerator", "init_distributed", "initialize", "ops", "runtime", "tp_model_init", "utils", "zero"]
