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


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True, distributed_port: int = 29500,
                     verbose: bool = True, timeout: timedelta = timedelta(minutes=30), init_method: str | None = None,
                     dist_init_required: bool | None = None, config=None, rank: int = -1, world_size: int = -1) -> None:
    """Initialise torch.distributed from the environment (torchrun, Ray Train, or one process).

    Without ``WORLD_SIZE`` in the environment this sets up a one-rank group, as DeepSpeed does
    for a script started with plain ``python``.
    """
    if dist.is_initialized() or dist_init_required is False:
        return
    env = os.environ
    if world_size < 0:
        world_size = int(env.get("WORLD_SIZE", 1))
    if rank < 0:
        rank = int(env.get("RANK", 0))
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    env.setdefault("MASTER_PORT", str(distributed_port))
    env.setdefault("LOCAL_RANK", env.get("LOCAL_RANK", "0"))
    backend = dist_backend or ("nccl" if _wants_cuda(None) else "gloo")
    if "nccl" in backend:
        rank_device(backend)  # set this rank's device before the group: NCCL binds its communicator to it
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timeout)


def _wants_cuda(backend: str | None) -> bool:
    """Whether a rank on ``backend`` computes on CUDA. The backend decides where there is one:
    gloo sends CPU tensors only (its point-to-point ops refuse CUDA ones), and gloo ranks that
    built on the GPU would all land on ``cuda:0``. Without a process group, CUDA where available
    unless ``DS_ACCELERATOR=cpu`` (DeepSpeed's override)."""
    if backend is not None:
        return "nccl" in backend
    return torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR", "").lower() != "cpu"


def rank_device(backend: str | None = None) -> torch.device:
    """This rank's device, following ``backend`` (default: the process group's, if any):
    ``cuda:LOCAL_RANK`` for NCCL (made current), the CPU for gloo.

    >>> rank_device("gloo")
    device(type='cpu')
    """
    if backend is None and dist.is_available() and dist.is_initialized():
        backend = dist.get_backend()
    if not _wants_cuda(backend):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError(f"raydeep: the process group's backend is {backend!r}, which needs a CUDA device, and "
                           "this process sees none; use backend 'gloo' on CPU-only machines")
    # Ray sets CUDA_VISIBLE_DEVICES per worker, so LOCAL_RANK indexes the visible devices.
    local = int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count()
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


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
