"""DeepSpeed's TensorBoard monitor: scalars in ``<output_path>/<job_name>/events.out.tfevents.*``."""
from __future__ import annotations

import os

# The writer's thread flushes at least this often; close() flushes the rest.
FLUSH_SECS = 10


class TensorBoardMonitor:
    """One ``SummaryWriter`` over DeepSpeed's directory for the section (``tensorboard``)."""

    def __init__(self, section):
        from torch.utils.tensorboard import SummaryWriter

        # DeepSpeed joins the two as they are: output_path "" writes under ./<job_name>.
        self.log_dir = os.path.join(section.output_path, section.job_name)
        os.makedirs(self.log_dir, exist_ok=True)
        self.writer = SummaryWriter(log_dir=self.log_dir, flush_secs=FLUSH_SECS)

    def write_events(self, events) -> None:
        # No flush per step (DeepSpeed's flushes every call): the writer's thread flushes every
        # FLUSH_SECS, so rank 0 never waits on the file system.
        for name, value, step in events:
            self.writer.add_scalar(name, value, step)

    def close(self) -> None:
        self.writer.close()
