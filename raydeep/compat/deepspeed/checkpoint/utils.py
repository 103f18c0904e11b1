"""``deepspeed.checkpoint.utils.clone_tensors_for_torch_save``, as DeepSpeed 0.19.8 defines it."""
import torch


def clone_tensors_for_torch_save(item, device=torch.device("cpu")):
    """Copies of the tensors in ``item`` (nested lists, tuples and dicts) on ``device``, so a
    saved file holds each tensor's own storage, not the flat buffer a view of it points into."""
    if torch.is_tensor(item):
        return item.detach().clone().to(device)
    if isinstance(item, list):
        return [clone_tensors_for_torch_save(v, device) for v in item]
    if isinstance(item, tuple):
        return tuple(clone_tensors_for_torch_save(v, device) for v in item)
    if isinstance(item, dict):
        return type(item)({k: clone_tensors_for_torch_save(v, device) for k, v in item.items()})
    return item
