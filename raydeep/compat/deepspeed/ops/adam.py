"""``deepspeed.ops.adam``: ``DeepSpeedCPUAdam`` and ``FusedAdam`` as torch's Adam.

accelerate swaps a torch Adam/AdamW for ``DeepSpeedCPUAdam`` under ZeRO-Offload, and scripts
construct ``FusedAdam`` directly. raydeep rebuilds a client optimizer over its fp32 master shards
from its class and ``defaults``, so these are torch Adam with DeepSpeed's keywords
(``adamw_mode``: decoupled weight decay, DeepSpeed's default) and a ``defaults`` they accept back.
"""
import torch


class DeepSpeedCPUAdam(torch.optim.Adam):
    def __init__(self, model_params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 amsgrad=False, adamw_mode=True, fp32_optimizer_states=True, **torch_kwargs):
        if not bias_correction:
            raise ValueError(f"{type(self).__name__}(bias_correction=False) is not supported by raydeep")
        torch_kwargs.setdefault("decoupled_weight_decay", adamw_mode)
        super().__init__(model_params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         **torch_kwargs)


class FusedAdam(DeepSpeedCPUAdam):
    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, adam_w_mode=True,
                 weight_decay=0.0, amsgrad=False, set_grad_none=True, **torch_kwargs):
        torch_kwargs.setdefault("decoupled_weight_decay", adam_w_mode)
        super().__init__(params, lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                         weight_decay=weight_decay, amsgrad=amsgrad, **torch_kwargs)


__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]
