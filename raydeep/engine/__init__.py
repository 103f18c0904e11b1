"""The ZeRO engine: ``initialize`` builds an :class:`Engine` from a model and a ds_config."""
from raydeep.engine.api import add_config_arguments, init_distributed, initialize
from raydeep.engine.engine import Engine

__all__ = ["Engine", "add_config_arguments", "init_distributed", "initialize"]
