"""raydeep: DeepSpeed's ZeRO training runtime, rebuilt natively on Ray and PyTorch.

Change ``import deepspeed`` to ``import raydeep as deepspeed`` and keep your ds_config.json.

The names below are loaded on first use: the small actors of a run (its progress monitor, its
snapshot store) live in ``raydeep.ray`` modules that need neither torch nor the engine, and a
process that starts one should not pay for either (seconds of CPU and hundreds of MB each).
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

# name -> (module, attribute in it); a name not here that is a subpackage or module of raydeep
# (raydeep.comm, raydeep.tier, ...) is imported on first use too.
_EXPORTS = {
    "ConfigError": ("raydeep.config", "ConfigError"),
    "RaydeepConfig": ("raydeep.config", "RaydeepConfig"),
    "load_config": ("raydeep.config", "load_config"),
    "Engine": ("raydeep.engine", "Engine"),
    # DeepSpeed's name: `isinstance(model, deepspeed.DeepSpeedEngine)` in client code
    "DeepSpeedEngine": ("raydeep.engine", "Engine"),
    "add_config_arguments": ("raydeep.engine", "add_config_arguments"),
    "init_distributed": ("raydeep.engine", "init_distributed"),
    "initialize": ("raydeep.engine", "initialize"),
    "get_accelerator": ("raydeep.accelerator", "get_accelerator"),
}

__all__ = ["ConfigError", "DeepSpeedEngine", "Engine", "accelerator", "checkpointing", "comm", "get_accelerator",
           "RaydeepConfig", "__version__", "add_config_arguments", "init_distributed", "initialize", "load_config",
           "zero"]


def __getattr__(name: str):
    if name in _EXPORTS:
        module, attribute = _EXPORTS[name]
        value = getattr(importlib.import_module(module), attribute)
    elif not name.startswith("__"):
        try:
            value = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as err:
            if err.name != f"{__name__}.{name}":
                raise  # the submodule exists and failed to import: say why
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
