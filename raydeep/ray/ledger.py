"""Which samples each step trains on, whatever the world size, and a digest of what was consumed.

The global sample order is a fixed function of ``(seed, epoch)``: epoch ``e`` is a permutation of
the dataset seeded by ``(seed, e)``, and the order is the epochs one after another. Global
position ``p`` is therefore always the same sample, and a run is fully described by how many
samples it has consumed (``engine.global_samples``): every attempt of a run continues at that
position, so a sample is neither skipped nor repeated across restarts, at any world size.

Inside one global step of ``B`` samples, micro step ``k`` of rank ``r`` (``W`` ranks, micro
batch ``m``) takes positions ``[(k * W + r) * m, (k * W + r + 1) * m)``. The step's batch is the
same set of samples at every world size; only who computes which part changes.

The :class:`SampleLedger` chains a SHA-256 over the ids consumed, step by step in position
order, from the ids the ranks actually trained on. Its state travels in the checkpoint, so the
digest of a run that was killed and resumed equals the digest of one that never stopped.

>>> order = SampleOrder(num_samples=10, seed=0)
>>> ids = order.ids(0, 10)
>>> sorted(ids.tolist()) == list(range(10)), order.ids(10, 10).tolist() != ids.tolist()
(True, True)
>>> micro_positions(step_start=0, micro_step=1, rank=0, world_size=2, micro_batch=2)
range(4, 6)
"""
from __future__ import annotations

import hashlib

import numpy as np

GENESIS = hashlib.sha256(b"raydeep sample ledger v1").hexdigest()


class SampleOrder:
    """The run's global sample order: epoch after epoch, each a permutation seeded by ``(seed, epoch)``."""

    def __init__(self, num_samples: int, seed: int, shuffle: bool = True):
        if num_samples <= 0:
            raise ValueError(f"the dataset is empty (num_samples={num_samples})")
        self.num_samples, self.seed, self.shuffle = num_samples, seed, shuffle
        self._epoch, self._perm = -1, None

    def epoch_permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            if self.shuffle:
                # PCG64 seeded from (seed, epoch): the same stream on every platform and numpy version.
                self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
            else:
                self._perm = np.arange(self.num_samples)
            self._epoch = epoch
        return self._perm

    def ids(self, start: int, count: int) -> np.ndarray:
        """Sample ids at global positions ``[start, start + count)`` (int64)."""
        out = np.empty(count, dtype=np.int64)
        filled = 0
        while filled < count:
            position = start + filled
            epoch, offset = divmod(position, self.num_samples)
            take = min(count - filled, self.num_samples - offset)
            out[filled:filled + take] = self.epoch_permutation(epoch)[offset:offset + take]
            filled += take
        return out


def micro_positions(step_start: int, micro_step: int, rank: int, world_size: int, micro_batch: int) -> range:
    """Global positions micro step ``micro_step`` of ``rank`` trains on (see the module docstring)."""
    first = step_start + (micro_step * world_size + rank) * micro_batch
    return range(first, first + micro_batch)


def step_ids_in_position_order(per_rank: list[np.ndarray], world_size: int, micro_batch: int) -> np.ndarray:
    """Reassemble one step's ids from each rank's list (micro steps in order) into position order."""
    grad_accum = len(per_rank[0]) // micro_batch
    blocks = [per_rank[r][k * micro_batch:(k + 1) * micro_batch] for k in range(grad_accum) for r in range(world_size)]
    return np.concatenate(blocks)


class SampleLedger:
    """Chained digest of the sample ids consumed, one link per optimizer step.

    >>> a, b = SampleLedger(), SampleLedger()
    >>> a.record(np.array([3, 1])); a.record(np.array([0, 2]))
    >>> b.record(np.array([3, 1, 0, 2]))
    >>> a.samples == b.samples, a.digest == b.digest  # step boundaries are part of the digest
    (True, False)
    """

    def __init__(self, digest: str = GENESIS, samples: int = 0, steps: int = 0):
        self.digest, self.samples, self.steps = digest, samples, steps

    def record(self, step_ids: np.ndarray) -> None:
        link = hashlib.sha256(bytes.fromhex(self.digest))
        link.update(np.ascontiguousarray(step_ids, dtype="<i8").tobytes())
        self.digest = link.hexdigest()
        self.samples += len(step_ids)
        self.steps += 1

    def state_dict(self) -> dict:
        return {"digest": self.digest, "samples": self.samples, "steps": self.steps}

    @classmethod
    def from_state(cls, state: dict) -> "SampleLedger":
        return cls(state["digest"], int(state["samples"]), int(state["steps"]))


def expected_digest(order: SampleOrder, steps: int, train_batch_size: int) -> str:
    """The digest an uninterrupted run of ``steps`` steps must end with (computed without training)."""
    ledger = SampleLedger()
    for step in range(steps):
        ledger.record(order.ids(step * train_batch_size, train_batch_size))
    return ledger.digest
