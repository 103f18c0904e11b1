"""``deepspeed.checkpoint``: only ``utils.clone_tensors_for_torch_save``, which accelerate
calls to save a state dict."""
