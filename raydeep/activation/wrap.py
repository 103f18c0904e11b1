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

``activation_checkpointing.number_checkpoints`` N, with ``"block"``: of the L blocks, only N are
wrapped, evenly spread (block ``i * L // N`` for i < N; with N = L / k, every k-th block), all of
them when N >= L. With the other choices every chosen module is wrapped: a config written for
DeepSpeed (where the model code decides what is checkpointed and N only sizes buffers) must not
lose checkpoints it had -- the field report's 175B config sets N = 12 on a 96-layer model.
This trades memory for time between "attention only" and "every block": each wrapped block keeps
its input instead of all its activations and recomputes once. Evenly spread rather than the first
N because the saved bytes and the recomputation are the same either way, and spreading them lets a
region's work overlap the plain blocks around it: with ``cpu_checkpointing`` each block input's copy
to the host runs on the side stream during the following blocks' compute instead of N copies
queueing at the start, and at stage 3 the recomputation in backward interleaves with the
per-block gradient reduction instead of bunching up at its end. DeepSpeed sizes its contiguous
buffers with the same number (one slot per checkpointed layer), which
``contiguous_memory_optimization`` does here too.

The other options of the section apply inside each region (:mod:`raydeep.activation.region`).

Note: the wrapper replaces the instance's ``forward``, so ``nn.Module.__call__`` still runs the
module's hooks around it -- ZeRO-3 gathers the parameters before the region and, during the
recomputation inside backward, the hooks of submodules run again (stage 3 keeps what they fetch
until the gradients are reduced).
"""
from __future__ import annotations

import logging

from torch import nn

from raydeep.activation.deepspeed_api import checkpointer_for, unimplemented_options
from raydeep.activation.options import CheckpointOptions
from raydeep.activation.region import Checkpointer

logger = logging.getLogger("raydeep")

# Options config.rules already warns about when the config is loaded.
_WARNED_AT_LOAD = ("partition_activations",)


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


def spread(modules: list[nn.Module], number: int | None) -> list[nn.Module]:
    """``number`` of ``modules``, evenly spread (see the module docstring); all when None or >= their count.

    >>> spread(list(range(12)), 4), spread(list(range(5)), 2), spread([0, 1], 12)
    ([0, 3, 6, 9], [0, 2], [0, 1])
    """
    total = len(modules)
    if number is None or number >= total:
        return list(modules)
    return [modules[i * total // number] for i in range(number)]


def wrap(module: nn.Module, checkpointer: Checkpointer | None = None) -> None:
    """Make ``module``'s forward a checkpointed region (idempotent); ``checkpointer`` applies the
    section's options (default: none of them)."""
    if "_raydeep_checkpointed" in module.__dict__:
        return
    forward = module.forward
    module.__dict__["_raydeep_checkpointed"] = module.__dict__.get("forward")  # an instance override, if any
    run = checkpointer or checkpointer_for(CheckpointOptions())
    module.__dict__["_raydeep_checkpointer"] = run  # what a caller reads its store's counts from

    def checkpointed_forward(*args, **kwargs):
        return run(forward, *args, **kwargs)
    module.forward = checkpointed_forward


def unwrap(module: nn.Module) -> None:
    if "_raydeep_checkpointed" in module.__dict__:
        previous = module.__dict__.pop("_raydeep_checkpointed")
        module.__dict__.pop("_raydeep_checkpointer", None)
        if previous is None:
            del module.forward  # the class's forward shows through again
        else:
            module.forward = previous


def apply_activation_checkpointing(model: nn.Module, section, spec, checkpointer: Checkpointer | None = None
                                   ) -> list[nn.Module]:
    """Wrap the modules ``spec`` selects (``number_checkpoints`` of them, see the module docstring)
    when the ``activation_checkpointing`` ``section`` is present; returns the wrapped modules.
    ``checkpointer`` replaces the one built from the section (a test's device stand-ins)."""
    if section is None or spec == "none":
        return []
    for text in unimplemented_options(section):
        if not text.startswith(tuple(f"activation_checkpointing.{k} " for k in _WARNED_AT_LOAD)):
            logger.warning(text)
    options = CheckpointOptions.from_section(section)
    chosen = select_modules(model, spec)
    if not chosen:
        logger.warning("activation checkpointing: no module matches raydeep.checkpoint_modules=%r; the engine "
                       "checkpoints nothing (the model's own checkpoint calls still apply)", spec)
    modules = spread(chosen, options.number_checkpoints) if spec == "block" else chosen
    if len(modules) < len(chosen):
        logger.info("activation checkpointing: number_checkpoints=%d of the %d modules raydeep.checkpoint_modules=%r "
                    "selects are checkpointed", len(modules), len(chosen), spec)
    run = checkpointer or checkpointer_for(options)
    for module in modules:
        wrap(module, run)
    return modules
