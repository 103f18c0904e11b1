"""DeepSpeed's CSV monitor: ``<output_path>/<job_name>/<event name, "/" and " " as "_">.csv``,
each with the header ``step,<last part of the name>`` and one ``<global_samples>,<value>`` row
per step, e.g. ``Train_Samples_lr.csv``::

    step,lr
    8,0.001
"""
from __future__ import annotations

import csv
import os


class CsvMonitor:
    """DeepSpeed's ``csvMonitor``, with each file kept open in append mode instead of reopened
    for every row (the bytes are the same)."""

    def __init__(self, section):
        self.log_dir = os.path.join(section.output_path, section.job_name)
        os.makedirs(self.log_dir, exist_ok=True)
        self._files: dict[str, tuple] = {}

    def write_events(self, events) -> None:
        for name, value, step in events:
            entry = self._files.get(name) or self._open(name)
            entry[1].writerow([step, value])
        for handle, _ in self._files.values():
            handle.flush()  # a reader (or a crash) sees every finished step

    def _open(self, name: str) -> tuple:
        # As DeepSpeed: the header once per file per run, appended to what an earlier run wrote.
        filename = name.replace("/", "_").replace(" ", "_")
        handle = open(os.path.join(self.log_dir, filename + ".csv"), "a+", newline="")
        writer = csv.writer(handle)
        writer.writerow(["step", name.split("/")[-1]])
        self._files[name] = (handle, writer)
        return self._files[name]

    def close(self) -> None:
        for handle, _ in self._files.values():
            handle.close()
        self._files = {}
