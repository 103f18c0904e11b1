"""Compressed communication: DeepSpeed's 1-bit Adam, 0/1 Adam and 1-bit LAMB over torch.distributed.

- ``bits``: sign bits packed eight to a byte on any device, and the padding rule;
- ``allreduce``: the two-phase compressed all-reduce with worker and server error feedback;
- ``optimizers``: ``OnebitAdam`` and ``ZeroOneAdam``, torch optimizers with DeepSpeed's rules;
- ``lamb``: ``OnebitLamb``, LAMB's per-parameter trust ratio on the compressed momentum;
- ``tier``: the optimizer tier through which they take over gradient communication;
- ``reference``: the same algorithms for N simulated workers in one process (the test oracle).
"""
from raydeep.compression.allreduce import CompressedAllReduce
from raydeep.compression.lamb import OnebitLamb
from raydeep.compression.optimizers import OnebitAdam, ZeroOneAdam

__all__ = ["CompressedAllReduce", "OnebitAdam", "OnebitLamb", "ZeroOneAdam"]
