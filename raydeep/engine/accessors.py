"""DeepSpeed's engine surface beyond the step: the accessors, switches and model-save helpers
client scripts and the Hugging Face integrations call (``engine.global_rank``,
``engine.zero_optimization_stage()``, ``engine.no_sync()``, ``engine.save_16bit_model(...)``, ...),
with DeepSpeed 0.19.8's answers. The step itself reads top-down in :mod:`raydeep.engine.engine`;
the :class:`~raydeep.engine.engine.Engine` inherits these.

>>> import raydeep, torch
>>> engine, *_ = raydeep.initialize(model=torch.nn.Linear(2, 2), config={"train_batch_size": 1,
...     "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_optimization": {"stage": 2}})
>>> engine.global_rank, engine.dp_world_size, engine.zero_optimization(), engine.zero_optimization_partition_weights()
(0, 1, True, False)
"""
from __future__ import annotations

import contextlib
import logging
import os
from collections import OrderedDict

import torch

from raydeep.zero.gathered import GatheredParameters

logger = logging.getLogger("raydeep")


class DeepSpeedAccessors:
    """Mixed into the engine: reads ``settings``, ``rank``, ``world_size``, ``module``, ``optimizer``."""

    # --- ranks -------------------------------------------------------------------------------------
    @property
    def global_rank(self) -> int:
        return self.rank

    @property
    def dp_world_size(self) -> int:
        return self.world_size  # every rank is a data-parallel rank: raydeep has no model parallelism

    mp_world_size = 1  # DeepSpeed's model-parallel width, 1 without an mpu
    seq_parallel_group = None

    # --- the config's answers ----------------------------------------------------------------------
    def train_batch_size(self) -> int:
        return self.settings.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.settings.micro_batch

    def gradient_accumulation_steps(self) -> int:
        return self.settings.grad_accum

    def gradient_clipping(self) -> float:
        return self.settings.gradient_clipping

    def steps_per_print(self) -> int | None:
        return self.settings.steps_per_print

    def fp16_enabled(self) -> bool:
        return self.settings.precision == "fp16"

    def bfloat16_enabled(self) -> bool:
        return self.settings.precision == "bf16"

    def zero_optimization_stage(self) -> int:
        return self.settings.stage

    def zero_optimization(self) -> bool:
        return self.settings.stage > 0

    def zero_optimization_partition_gradients(self) -> bool:
        return self.settings.stage >= 2

    def zero_optimization_partition_weights(self) -> bool:
        return self.settings.stage == 3

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        return self.settings.gather_16bit_weights_on_model_save

    def wall_clock_breakdown(self) -> bool:
        return self.settings.wall_clock_breakdown

    def __getattr__(self, name: str):
        """What the engine lacks is read from the wrapped model, as DeepSpeed's engine does
        (``engine.gradient_checkpointing_enable()``, ``engine.config`` of a Hugging Face model ...)."""
        try:
            return super().__getattr__(name)  # nn.Module's: parameters, buffers, submodules
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")
            if module is not None and name != "module" and hasattr(module, name):
                return getattr(module, name)
            raise

    # --- the optimizer's state, as DeepSpeed reports it -----------------------------------------------
    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def get_mom(self) -> list:
        return [g.get("betas", g.get("momentum")) for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        """The last ``engine.step()``'s norm (after unscaling, before clipping); ``inf`` after an
        overflow. A step the client took with ``optimizer.step()`` leaves it alone, as in DeepSpeed:
        read ``optimizer._global_grad_norm`` then."""
        return self._global_grad_norm

    def was_step_applied(self) -> bool:
        return self._step_applied

    @property
    def cur_scale(self) -> float:
        return self.loss_scaler.loss_scale

    # --- accumulation switches -----------------------------------------------------------------------
    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Override the micro-step counter's answer to "is this backward the last of the step?"
        until called again (DeepSpeed's manual accumulation: False before the first micro-batches,
        True before the last, then one ``engine.step()``)."""
        self._boundary_override = bool(is_boundary)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside keep their gradients on this rank (no reduction), DeepSpeed's
        contract: stages 0 and 1 only, not re-entrant, and no ``engine.step()`` inside."""
        assert not self.zero_optimization_partition_gradients(), \
            f"no_sync context manager is incompatible with gradient partitioning logic of ZeRO stage " \
            f"{self.zero_optimization_stage()}"
        assert not self.inside_no_sync_ctxt, "no_sync context manager reentry is unsupported"
        self.inside_no_sync_ctxt = True
        try:
            yield
        finally:
            self.inside_no_sync_ctxt = False

    # --- the model's weights ---------------------------------------------------------------------------
    def module_state_dict(self, destination=None, prefix: str = "", keep_vars: bool = False,
                          exclude_frozen_parameters: bool = False) -> dict:
        """The module's own ``state_dict`` (stage-3 parameters appear as this rank's empty
        placeholders, as in DeepSpeed: use ``_zero3_consolidated_16bit_state_dict`` there)."""
        out = self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        if exclude_frozen_parameters:
            for name, param in self.module.named_parameters():
                if not param.requires_grad:
                    out.pop(prefix + name, None)
        return out

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict | None:
        """Collective. The full weights in the model's dtype on rank 0's CPU, gathered one module at
        a time (DeepSpeed's layer-by-layer walk, so the device never holds the whole model);
        ``None`` on the other ranks. Tied parameters stay tied: one tensor under each name."""
        if not self.zero_optimization_partition_weights():
            raise ValueError("this function requires ZeRO-3 mode")
        state = OrderedDict() if self.rank == 0 else None
        first_name: dict[int, str] = {}

        def visit(module: torch.nn.Module, prefix: str) -> None:
            with GatheredParameters(list(module.parameters(recurse=False))):
                if state is not None:
                    for name, param in module.named_parameters(recurse=False):
                        if param is None or (exclude_frozen_parameters and not param.requires_grad):
                            continue
                        if id(param) in first_name:
                            state[prefix + name] = state[first_name[id(param)]]
                        else:
                            state[prefix + name] = param.detach().cpu().clone()
                            first_name[id(param)] = prefix + name
                    for name, buf in module.named_buffers(recurse=False):
                        if buf is not None and name not in module._non_persistent_buffers_set:
                            state[prefix + name] = buf.detach().cpu()
            for name, child in module.named_children():
                visit(child, prefix + name + ".")

        visit(self.module, "")
        return state

    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """Collective. Rank 0 writes the model's weights (its dtype: the 16-bit ones in fp16/bf16
        training) to ``save_dir/save_filename`` with ``torch.save``. At stage 3 only with
        ``stage3_gather_16bit_weights_on_model_save`` (else ``False``, nothing written, as DeepSpeed).
        For the exact fp32 masters, save a checkpoint and ``raydeep convert export`` it."""
        path = os.path.join(save_dir, save_filename)
        if self.zero_optimization_partition_weights():
            if not self.zero_gather_16bit_weights_on_model_save():
                logger.info("Did not save the model %s because stage3_gather_16bit_weights_on_model_save is False",
                            path)
                return False
            state = self._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters)
        else:
            state = self.module_state_dict(exclude_frozen_parameters=exclude_frozen_parameters)
        if self.rank == 0:
            os.makedirs(save_dir, exist_ok=True)
            logger.info("Saving model weights to %s, tag: global_step%d", path, self.global_steps)
            torch.save(state, path)
        return True
