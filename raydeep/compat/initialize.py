"""``deepspeed.initialize`` as the compatibility package serves it: raydeep's
:func:`raydeep.initialize`, with what accelerate and the Hugging Face Trainer pass made into
what raydeep's builder takes.

- The config dict is copied: DeepSpeed pops keys from it (``torch_adam``), and accelerate keeps
  the dict it passed as ``accelerator.deepspeed_config`` and reads it again later.
- ``steps_per_print: inf``, which accelerate always writes (to silence DeepSpeed's progress
  lines), means never: raydeep's config takes an integer or nothing, so it becomes nothing.
- Under ZeRO-Offload accelerate swaps a client torch Adam/AdamW for ``DeepSpeedCPUAdam``
  (``deepspeed.ops.adam``), which DeepSpeed's ``zero_force_ds_cpu_optimizer`` check accepts as its
  own CPU optimizer. raydeep's builder refuses every client optimizer under that check, so for
  this one the check is turned off in the copy: it is the optimizer the check asks for.
- A client torch optimizer (the Trainer's own AdamW, for a ds_config without an ``optimizer``
  section) is trained with its own parameter groups, as DeepSpeed trains it: the Trainer puts
  biases and LayerNorm weights in a group without weight decay. Passed as is (accelerate passes
  no ``model_parameters`` with it), raydeep's builder would group every parameter under the
  optimizer's defaults. So the groups become ``model_parameters`` and the optimizer a factory
  over them.
- ``lr_scheduler`` may be the Trainer's ``lr_scheduler_callable`` (a function of the optimizer,
  for a ds_config without a ``scheduler`` section): raydeep calls it with the torch optimizer over
  its fp32 master shards, as DeepSpeed calls it with its basic optimizer.
"""
from __future__ import annotations

import copy
import functools
import math
import sys

import torch

import raydeep
from raydeep.tier.select import rebuild_client_optimizer


def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None, lr_scheduler=None,
               distributed_port: int = 29500, mpu=None, dist_init_required: bool | None = None, collate_fn=None,
               config=None, mesh_param=None, config_params=None):
    """DeepSpeed's ``initialize``: returns ``(engine, optimizer, training_dataloader, lr_scheduler)``."""
    ds_cpu_optimizer = _is_ds_cpu_optimizer(optimizer)
    config, config_params = _adapt(config, ds_cpu_optimizer), _adapt(config_params, ds_cpu_optimizer)
    optimizer, model_parameters = _client_optimizer(optimizer, model_parameters)
    return raydeep.initialize(args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
                              training_data=training_data, lr_scheduler=lr_scheduler,
                              distributed_port=distributed_port, mpu=mpu, dist_init_required=dist_init_required,
                              collate_fn=collate_fn, config=config, mesh_param=mesh_param,
                              config_params=config_params)


def _client_optimizer(optimizer, model_parameters):
    """``(optimizer, model_parameters)`` as raydeep's builder takes them (see the module docstring)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        return optimizer, model_parameters
    # DeepSpeed steps a client optimizer over its own groups, whatever model_parameters says.
    model_parameters = [dict(group) for group in optimizer.param_groups]
    return functools.partial(rebuild_client_optimizer, type(optimizer), dict(optimizer.defaults)), model_parameters


def _is_ds_cpu_optimizer(optimizer) -> bool:
    adam = sys.modules.get("deepspeed.ops.adam")  # the compatibility package's, loaded as deepspeed
    return adam is not None and isinstance(optimizer, adam.DeepSpeedCPUAdam)


def _adapt(config, ds_cpu_optimizer: bool):
    if not isinstance(config, dict):
        return config  # a path or JSON text: nothing of accelerate's in it
    config = copy.deepcopy(config)
    if ds_cpu_optimizer:
        config["zero_force_ds_cpu_optimizer"] = False
    every = config.get("steps_per_print")
    if isinstance(every, float) and not math.isfinite(every):
        del config["steps_per_print"]
    return config
