"""The optimizer ``initialize`` returns, for clients that step it themselves.

Ray's DeepSpeed example and many fine-tuning loops write::

    model.backward(loss); optimizer.step(); lr_scheduler.step(); optimizer.zero_grad()

instead of ``model.step()``. DeepSpeed 0.19.8 returns its ZeRO optimizer there (stages 1-3, or
fp16/bf16 at stage 0; the bare torch optimizer at fp32 stage 0), and that loop then gets:

- the update on the reduced gradients: overflow check and loss-scale update, unscaling, and
  ``gradient_clipping`` (which the bare torch optimizer of fp32 stage 0 does not apply: the
  engine clips there, in ``engine.step()``);
- no counter: ``global_steps``, ``micro_steps`` and ``skipped_steps`` stay where they are, so
  ``save_checkpoint`` without a tag names every save ``global_step0``, and the engine's
  accumulation boundary is read from a ``micro_steps`` that never moves (every backward is a
  boundary with ``gradient_accumulation_steps`` 1; with more, only ``engine.step()`` works);
- the scheduler stepped only by the client's ``lr_scheduler.step()``.

:class:`ClientOptimizer` does exactly that over the engine's optimizer tier, and otherwise
forwards to the tier (``param_groups``, ``state``, the torch ``optimizer``, ...).
"""
from __future__ import annotations


class ClientOptimizer:
    """DeepSpeed's ZeRO-optimizer contract over ``engine``'s optimizer tier."""

    def __init__(self, engine):
        self._engine = engine
        self.overflow = False  # the last step's, as DeepSpeed's optimizers expose it
        self._global_grad_norm: float | None = None

    def step(self, closure=None) -> None:
        """Apply the update the last backward passes prepared (see the module docstring)."""
        if closure is not None:
            raise ValueError("optimizer.step(closure): DeepSpeed's ZeRO optimizers take no closure; run the "
                             "forward and model.backward(loss) before optimizer.step()")
        engine = self._engine
        if not engine.is_gradient_accumulation_boundary():
            raise RuntimeError(
                f"optimizer.step() between accumulation boundaries: with gradient_accumulation_steps "
                f"{engine.gradient_accumulation_steps()} the gradients are reduced only at the boundary, which "
                "engine.step() advances. Call model.step() after every micro-batch instead of optimizer.step() "
                "(it steps the optimizer and the scheduler at the boundary), or mark the last micro-batch with "
                "model.set_gradient_accumulation_boundary(True) before its backward")
        # fp32 at stage 0: DeepSpeed hands back the bare torch optimizer, which does not clip.
        bare = engine.zero_optimization_stage() == 0 and not (engine.fp16_enabled() or engine.bfloat16_enabled())
        self.overflow, self._global_grad_norm = engine.apply_update(clip=not bare)
        if not bare:
            engine.strategy.zero_grad()  # ZeRO's step leaves no gradient behind (the bare optimizer does)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._engine.strategy.zero_grad()

    @property
    def param_groups(self) -> list[dict]:
        return self._engine.tier.param_groups

    @property
    def loss_scale(self) -> float:
        return self._engine.loss_scaler.loss_scale

    cur_scale = loss_scale

    def state_dict(self):
        raise NotImplementedError(
            "optimizer.state_dict(): raydeep's optimizer state is sharded over the ranks and saved with the rest of "
            "the run by engine.save_checkpoint(dir), which every rank calls and which loads back at any world size "
            "(engine.load_checkpoint(dir))")

    def load_state_dict(self, state_dict) -> None:
        self.state_dict()

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self._engine.tier, name)

    def __repr__(self) -> str:
        return f"ClientOptimizer({self._engine.tier!r})"
