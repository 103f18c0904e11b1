"""raydeep: DeepSpeed's ZeRO training runtime, rebuilt natively on Ray and PyTorch.

Change ``import deepspeed`` to ``import raydeep as deepspeed`` and keep your ds_config.json.
"""
from raydeep import accelerator, checkpointing, comm, zero
from raydeep.accelerator import get_accelerator
from raydeep.config import ConfigError, RaydeepConfig, load_config
from raydeep.engine import Engine, add_config_arguments, init_distributed, initialize

__version__ = "0.1.0"
DeepSpeedEngine = Engine  # DeepSpeed's name: `isinstance(model, deepspeed.DeepSpeedEngine)` in client code

__all__ = ["ConfigError", "DeepSpeedEngine", "Engine", "accelerator", "checkpointing", "comm", "get_accelerator", "RaydeepConfig", "__version__", "add_config_arguments", "init_distributed",
           "initialize", "load_config", "zero"]
