"""Which optimizer tier a config asks for, and where offload actors may run.

``offload_optimizer.device: "cpu"`` (ZeRO stages 1-3) offloads; ``raydeep.offload_target`` says
where to: ``host`` (the rank's host memory), ``actors`` (Ray actors on the nodes that
``raydeep.offload_resource`` marks), or ``auto``: actors when this rank is connected to a Ray
cluster that has such a node, the host otherwise.
"""
from __future__ import annotations

import inspect

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from raydeep.errors import ConfigError
from raydeep.tier.base import OptimizerTier
from raydeep.tier.local import HostTier, LocalTier
from raydeep.tier.lookahead import why_not

logger = logging.getLogger("raydeep")


def offload_placement(marker: str) -> dict:
    """Ray actor options selecting the nodes ``marker`` names: a custom resource, or ``key=value``
    for a node label.

    >>> offload_placement("raydeep_offload"), offload_placement("raydeep/role=offload")
    ({'resources': {'raydeep_offload': 0.001}}, {'label_selector': {'raydeep/role': 'offload'}})
    """
    from raydeep.tier.actors import RESOURCE_SHARE

    if "=" in marker:
        key, value = marker.split("=", 1)
        return {"label_selector": {key.strip(): value.strip()}}
    return {"resources": {marker: RESOURCE_SHARE}}


def offload_nodes(marker: str) -> list[str]:
    """Ids of the alive nodes ``marker`` selects ([] when this process is not connected to Ray)."""
    import ray

    if not ray.is_initialized():
        return []
    key, _, value = marker.partition("=")
    found = []
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        labels, resources = node.get("Labels") or {}, node.get("Resources") or {}
        if (labels.get(key.strip()) == value.strip()) if value else resources.get(marker, 0) > 0:
            found.append(node["NodeID"])
    return found


def near_the_rank(placement: dict, nodes: list[str]) -> dict:
    """``placement``, preferring this rank's own node where it is one of the offload ``nodes``
    (a GPU node marked for offload too): actors there exchange with the rank through shared
    memory (``raydeep.tier.shared_window``). Soft: with no room there they go to another marked
    node. For a resource marker only (a node label selects by itself)."""
    import ray

    here = ray.get_runtime_context().get_node_id()
    if here not in nodes or "resources" not in placement:
        return placement
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return {**placement, "scheduling_strategy": NodeAffinitySchedulingStrategy(here, soft=True)}


@dataclass(frozen=True)
class OffloadSettings:
    """What decides the tier: ``zero_optimization``'s stage, ``sub_group_size`` and
    ``offload_optimizer`` section, and ``raydeep``'s offload options."""

    stage: int
    sub_group_size: int
    offload: Any = None  # the offload_optimizer section, or None
    target: str = "auto"
    resource: str = "raydeep_offload"
    actors_per_rank: int = 1
    actor_cpus: float = 1.0
    tile: int = 1 << 22
    shared_memory: bool = True  # offload actors on the rank's node: through /dev/shm, not the object store
    threads: int | None = None
    delayed: bool = False  # the delayed parameter update will ask for submit/complete
    lookahead: bool = True  # ... and land it as Adam's predicted next step (raydeep.tier.lookahead)

    @classmethod
    def of(cls, zero, options) -> "OffloadSettings":
        """From the ``zero_optimization`` and ``raydeep`` sections."""
        zenflow = zero.zenflow is not None and zero.zenflow.overlap_step
        return cls(zero.stage, zero.sub_group_size, zero.offload_optimizer, options.offload_target,
                   options.offload_resource, options.offload_actors_per_rank, options.offload_actor_cpus,
                   tile=options.offload_tile_size, shared_memory=options.offload_shared_memory,
                   threads=options.cpu_update_threads,
                   delayed=options.delayed_update or zenflow, lookahead=options.delayed_update_lookahead)

    @property
    def offloading(self) -> bool:
        return self.offload is not None and self.offload.device != "none" and self.stage > 0


def select_tier(settings: OffloadSettings, units, group_options: list[dict], make_optimizer: Callable) -> OptimizerTier:
    """The tier ``settings`` ask for over the units (``make_optimizer`` must pickle for actors)."""
    offload = settings.offload
    if not settings.offloading:
        return LocalTier(units, group_options, make_optimizer, settings.sub_group_size)
    lookahead = settings.delayed and settings.lookahead
    if lookahead:
        kind = make_optimizer([{**o, "params": [nn.Parameter(torch.zeros(1))]} for o in group_options])
        reason = why_not(kind)
        if reason is not None:
            raise ConfigError("raydeep.delayed_update_lookahead", f"the delayed update's lookahead: {reason}", value=True,
                              fix="set raydeep.delayed_update_lookahead to false (ZeRO-Offload's plain one-step-"
                                  "delayed rule, which trains worse at Adam-like learning rates) or use Adam/AdamW")
    target = settings.target
    if target != "host":
        nodes = offload_nodes(settings.resource)
        if target == "actors" and not nodes:
            raise ConfigError("raydeep.offload_target", f"asks for offload actors, but no alive Ray node is marked "
                              f"by raydeep.offload_resource {settings.resource!r}", value=target,
                              fix="start offload nodes with ray start --resources='{\"%s\": 1}' (or --labels), or "
                                  "set raydeep.offload_target to \"auto\" or \"host\"" % settings.resource)
        target = "actors" if nodes else "host"
    if target == "host":
        return HostTier(units, group_options, make_optimizer, settings.sub_group_size, pin_memory=offload.pin_memory,
                        ratio=offload.ratio, tile=settings.tile, threads=settings.threads, delayed=settings.delayed,
                        lookahead=lookahead)
    from raydeep.tier.actors import ActorTier

    if offload.ratio < 1.0:
        logger.warning("offload_optimizer.ratio %s applies to the host tier; the actor tier offloads every "
                       "sub-group", offload.ratio)
    placement = near_the_rank(offload_placement(settings.resource), nodes)
    return ActorTier(units, group_options, make_optimizer, settings.sub_group_size, placement,
                     settings.actors_per_rank, settings.actor_cpus,
                     threads=settings.threads, lookahead=lookahead, tile=settings.tile,
                     shared_memory=settings.shared_memory)


def rebuild_client_optimizer(cls: type, defaults: dict, param_groups: list[dict]) -> torch.optim.Optimizer:
    """The user's optimizer class over the tier's masters with its own hyperparameters (a
    module-level function, so a ``functools.partial`` of it pickles for offload actors).
    Only the keywords ``cls`` takes: a subclass's ``defaults`` may carry its base's (torch's
    AdamW keeps Adam's ``decoupled_weight_decay``, which AdamW's constructor refuses)."""
    parameters = inspect.signature(cls.__init__).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        defaults = {k: v for k, v in defaults.items() if k in parameters}
    return cls(param_groups, **defaults)
