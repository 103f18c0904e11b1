"""raydeep's Ray runtime: the engine in Ray Train V2 workers, with a driver-side batch plan,
a sample ledger for exactly-once data across restarts, and reshardable checkpoints reported
through ``ray.train.report``.

>>> from raydeep.ray import TrainSpec, plan_batches
>>> plan_batches({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 8}, 1, 2).for_world_size(1).grad_accum
2
"""
from raydeep.ray.batch_plan import BatchSchedule, plan_batches
from raydeep.ray.ledger import SampleLedger, SampleOrder
from raydeep.ray.spec import DEFAULT_DS_CONFIG, TrainSpec, parse_num_workers

__all__ = ["DEFAULT_DS_CONFIG", "BatchSchedule", "SampleLedger", "SampleOrder", "TrainSpec", "build_trainer", "fit",
           "parse_num_workers", "plan_batches"]


def __getattr__(name):
    # The driver pieces import Ray Train; load them on first use so `import raydeep.ray` stays light.
    if name in ("fit", "build_trainer"):
        from raydeep.ray import trainer

        return getattr(trainer, name)
    raise AttributeError(name)
