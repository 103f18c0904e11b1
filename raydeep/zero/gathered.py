"""``raydeep.zero.GatheredParameters``: use stage-3 parameters outside their module's forward.

>>> import torch
>>> with GatheredParameters([torch.nn.Parameter(torch.ones(2))]):  # not partitioned: a no-op
...     pass
"""
from __future__ import annotations

from torch import nn

from raydeep.zero import owners


class GatheredParameters:
    """Gather partitioned parameters on enter; on exit, if ``modifier_rank`` is set, broadcast
    that rank's modifications into every rank's shard, then release them again."""

    def __init__(self, params, modifier_rank: int | None = None, fwd_module: nn.Module | None = None,
                 enabled: bool = True):
        params = [params] if isinstance(params, nn.Parameter) else list(params)
        strategy = next((owner for owner in map(owners.owner_of, params) if owner is not None), None)
        self.ctx = strategy.gathered(params) if enabled and strategy is not None else None
        self.modifier_rank = modifier_rank

    def __enter__(self):
        if self.ctx is not None:
            self.ctx.__enter__()
        return self

    def __exit__(self, *exc):
        if self.ctx is None:
            return
        if self.modifier_rank is not None and exc[0] is None:
            self.ctx.write_back(self.modifier_rank)
        self.ctx.__exit__(*exc)
