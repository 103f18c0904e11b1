"""Engine-side activation checkpointing: wrap chosen modules' ``forward`` in
``raydeep.checkpointing.checkpoint`` (non-reentrant ``torch.utils.checkpoint``).

Trigger. DeepSpeed turns the feature on with the ds_config's ``activation_checkpointing`` section
and leaves *where* to the model code (``deepspeed.checkpointing.checkpoint(block, x)``). raydeep
keeps that switch: only when the section is present does the engine also wrap the modules named
by ``raydeep.checkpoint_modules``:

- ``"attention"`` (default; the field report found checkpointing only attention the best balance
  of memory saved against recomputation): ``model.attention_modules()`` if the model has it, else
  every module whose class name contains "Attention";
- ``"block"``: ``model.transformer_blocks()`` if present, else every element of an ``nn.ModuleList``;
- a list of class names; ``"none"``: wrap nothing (the model's own ``checkpoint`` calls still work).

Only the outermost of nested choices is wrapped, and a region the model already checkpoints runs
the wrapped modules inside it plainly (see ``raydeep.checkpointing``), so nothing is recomputed twice.

Note: the wrapper replaces the instance's ``forward``, so ``nn.Module.__call__`` still runs the
module's hooks around it -- ZeRO-3 gathers the parameters before the region and, during the
recomputation inside backward, the hooks of submodules run again (stage 3 keeps what they fetch
until the gradients are reduced).
"""
from __future__ import annotations

import logging

from torch import nn

from raydeep.activation.deepspeed_api import checkpoint, unimplemented_options

logger = logging.getLogger("raydeep")

# Options config.rules already warns about when the config is loaded.
_WARNED_AT_LOAD = ("partition_activations", "cpu_checkpointing", "contiguous_memory_optimization",
                   "synchronize_checkpoint_boundary", "profile")


def select_modules(model: nn.Module, spec) -> list[nn.Module]:
    """The modules ``spec`` names (see the module docstring), outermost only, in model order.

    >>> from raydeep.models import build_gpt
    >>> model = build_gpt("gpt-tiny", n_layer=2)
    >>> [type(m).__name__ for m in select_modules(model, "attention")]
    ['CausalSelfAttention', 'CausalSelfAttention']
    >>> [type(m).__name__ for m in select_modules(model, ["MLP", "Block"])]
    ['Block', 'Block']
    """
    if spec == "none":
        return []
    if spec == "attention":
        chosen = _from_helper(model, "attention_modules") or \
            [m for m in model.modules() if "attention" in type(m).__name__.lower()]
    elif spec == "block":
        chosen = _from_helper(model, "transformer_blocks") or \
            [m for ml in model.modules() if isinstance(ml, nn.ModuleList) for m in ml]
    else:
        names = set(spec)
        chosen = [m for m in model.modules() if type(m).__name__ in names]
    chosen_ids = {id(m) for m in chosen}
    inner = {id(d) for m in chosen for d in m.modules() if d is not m}
    order = [m for m in model.modules() if id(m) in chosen_ids and id(m) not in inner]
    return [m for m in order if m is not model] or ([model] if model in chosen else [])


def _from_helper(model: nn.Module, name: str) -> list[nn.Module]:
    helper = getattr(model, name, None)
    return list(helper()) if callable(helper) else []


def wrap(module: nn.Module) -> None:
    """Make ``module``'s forward a checkpointed region (idempotent)."""
    if "_raydeep_checkpointed" in module.__dict__:
        return
    forward = module.forward
    module.__dict__["_raydeep_checkpointed"] = module.__dict__.get("forward")  # an instance override, if any

    def checkpointed_forward(*args, **kwargs):
        return checkpoint(forward, *args, **kwargs)
    module.forward = checkpointed_forward


def unwrap(module: nn.Module) -> None:
    if "_raydeep_checkpointed" in module.__dict__:
        previous = module.__dict__.pop("_raydeep_checkpointed")
        if previous is None:
            del module.forward  # the class's forward shows through again
        else:
            module.forward = previous


def apply_activation_checkpointing(model: nn.Module, section, spec) -> list[nn.Module]:
    """Wrap the modules ``spec`` selects when the ``activation_checkpointing`` ``section`` is present;
    returns the wrapped modules."""
    if section is None or spec == "none":
        return []
    for text in unimplemented_options(section):
        if not text.startswith(tuple(f"activation_checkpointing.{k} " for k in _WARNED_AT_LOAD)):
            logger.warning(text)
    modules = select_modules(model, spec)
    if not modules:
        logger.warning("activation checkpointing: no module matches raydeep.checkpoint_modules=%r; the engine "
                       "checkpoints nothing (the model's own checkpoint calls still apply)", spec)
    for module in modules:
        wrap(module)
    return modules
