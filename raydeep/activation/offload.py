"""``raydeep.offload_activations``: every activation a model's forward saves for backward, outside
checkpointed regions, kept in pinned host memory and brought back when backward needs it --
torch's ``save_on_cpu``, with the copies to the host on a side stream (see
:mod:`raydeep.activation.host_copies`). Activation offload without recomputation: the device
memory of the saved activations against two copies over the bus per activation and step.

Parameters stay where they are (autograd saves them without a copy), and the inputs of
checkpointed regions go through their own store (``cpu_checkpointing``).

>>> import torch
>>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
>>> store = offload_saved_activations(model, torch.device("cpu"))
>>> model(torch.ones(2, 4, requires_grad=True)).sum().backward()
>>> store.host_bytes > 0
True
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from raydeep.activation.boundary_store import SavedTensorStore
from raydeep.activation.host_copies import copies_for

logger = logging.getLogger("raydeep")


def offload_saved_activations(model: nn.Module, device: torch.device, copies=None) -> SavedTensorStore:
    """Run ``model``'s forward with its saved activations kept in host memory; returns the store
    (``host_bytes`` counts what it kept). ``copies`` replaces the device calls (a test's stand-in)."""
    if device.type == "cpu" and copies is None:
        logger.warning("raydeep.offload_activations has no effect on a CPU device: the saved activations "
                       "already live in host memory")
    store = SavedTensorStore(to_host=True, copies=copies or copies_for(device))
    forward = model.forward

    def offloaded_forward(*args, **kwargs):
        with store.installed():
            return forward(*args, **kwargs)
    model.forward = offloaded_forward
    return store
