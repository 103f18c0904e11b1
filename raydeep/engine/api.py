"""The drop-in surface DeepSpeed scripts call: ``initialize``, ``init_distributed`` and
``add_config_arguments``, with DeepSpeed's signatures and return values.

>>> import raydeep, torch
>>> engine, optimizer, loader, scheduler = raydeep.initialize(model=torch.nn.Linear(2, 2),
...     config={"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
>>> engine.train_batch_size(), loader, scheduler
(1, None, None)
"""
from __future__ import annotations

import argparse
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from raydeep import comm
from raydeep.comm.process_group import init_distributed, rank_device
from raydeep.config import load_config
from raydeep.engine.builder import build_engine


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's ``--deepspeed`` and ``--deepspeed_config`` flags to ``parser``."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true", help="Enable DeepSpeed (raydeep)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file.")
    group.add_argument("--deepscale", default=False, action="store_true", help=argparse.SUPPRESS)
    group.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
    return parser


def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None, lr_scheduler=None,
               distributed_port: int = 29500, mpu=None, dist_init_required: bool | None = None, collate_fn=None,
               config=None, mesh_param=None, config_params=None, overrides=None):
    """Build the engine: returns ``(engine, optimizer, training_dataloader, lr_scheduler)``.

    ``config`` (or ``args.deepspeed_config``) is a ds_config dict, path, JSON or base64;
    ``overrides`` resolves ``"auto"`` values (dotted keys). Runs in one process too.
    """
    assert model is not None, "deepspeed.initialize requires a model"
    if mpu is not None or mesh_param is not None:
        raise NotImplementedError("model parallelism (mpu/mesh_param) is not supported by raydeep")
    config = _pick_config(args, config, config_params)
    if dist_init_required or (dist_init_required is None and not dist.is_initialized()
                              and int(os.environ.get("WORLD_SIZE", 1)) > 1):
        init_distributed(distributed_port=distributed_port)
    cfg = load_config(config, world_size=comm.world_size(), overrides=overrides)
    engine = build_engine(model, cfg, model_parameters, optimizer, lr_scheduler, device=rank_device(), raw_config=config)
    if training_data is not None:
        sampler = DistributedSampler(training_data, num_replicas=comm.world_size(), rank=comm.rank())
        engine.training_dataloader = DataLoader(training_data, batch_size=cfg.train_micro_batch_size_per_gpu,
                                                sampler=sampler, collate_fn=collate_fn,
                                                drop_last=cfg.dataloader_drop_last)
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


def _pick_config(args, config, config_params):
    config = config if config is not None else config_params
    from_args = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    assert not (from_args and config is not None), "Not sure how to proceed, we were given deepspeed configs in the " \
        "deepspeed arguments and deepspeed.initialize() function call"
    config = config if config is not None else from_args
    if config is None:
        raise ValueError("DeepSpeed requires --deepspeed_config to specify configuration file")
    return config
