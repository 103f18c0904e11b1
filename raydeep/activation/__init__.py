"""Activation checkpointing: recompute a module's activations in backward instead of keeping them.

- :mod:`raydeep.activation.deepspeed_api` is DeepSpeed's ``deepspeed.checkpointing`` API
  (``checkpoint``, ``configure``, the RNG tracker), also importable as ``raydeep.checkpointing``;
- :mod:`raydeep.activation.wrap` wraps the modules a config names (``raydeep.checkpoint_modules``,
  ``activation_checkpointing``) when the engine is built.

- :mod:`raydeep.activation.offload` keeps every saved activation in host memory
  (``raydeep.offload_activations``).

Not to be confused with :mod:`raydeep.checkpoint`, which saves training state.
"""
from raydeep.activation.offload import offload_saved_activations
from raydeep.activation.wrap import apply_activation_checkpointing

__all__ = ["apply_activation_checkpointing", "offload_saved_activations"]
