"""raydeep: DeepSpeed's ZeRO training runtime, rebuilt natively on Ray and PyTorch.

Change ``import deepspeed`` to ``import raydeep as deepspeed`` and keep your ds_config.json.
"""
from raydeep.config import ConfigError, RaydeepConfig, load_config

__version__ = "0.1.0"

__all__ = ["ConfigError", "RaydeepConfig", "__version__", "load_config"]
