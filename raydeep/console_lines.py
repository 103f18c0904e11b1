"""The lines DeepSpeed prints on rank 0's console: the ``steps_per_print`` progress line, the
``wall_clock_breakdown`` timer lines and the ``comms_logger`` table.

raydeep logs them to the ``raydeep`` logger with ``extra=CONSOLE``. In a Ray Train worker they
land in the worker's log, which ``raydeep train`` keeps off the driver's console unless
``--verbose``; so rank 0's session collects them with :class:`ConsoleLines` and sends them with
its step events, and the driver prints them above the progress bar, where a DeepSpeed user
looks for them.

>>> import logging
>>> log = logging.getLogger("raydeep.console-doctest")
>>> log.setLevel(logging.INFO)
>>> lines = ConsoleLines.attach(log)
>>> log.info("time (ms) | fwd: %.2f", 1.5, extra=CONSOLE)
>>> log.info("not for the console")
>>> lines.take(), lines.take()
(['time (ms) | fwd: 1.50'], [])
>>> lines.detach()
"""
from __future__ import annotations

import logging

CONSOLE = {"console": True}  # the ``extra`` that marks a record as one of DeepSpeed's console lines

# Lines kept between two step events at most: a run logging far more than this per step (a
# debug comms logger) keeps the newest; its worker log still has them all.
MAX_PENDING = 1000


class ConsoleLines(logging.Handler):
    """Collects the messages of records marked with :data:`CONSOLE` until :meth:`take`."""

    def __init__(self, logger: logging.Logger):
        super().__init__(level=logging.INFO)
        self.logger, self._lines = logger, []

    @classmethod
    def attach(cls, logger: logging.Logger | None = None) -> "ConsoleLines":
        handler = cls(logger or logging.getLogger("raydeep"))
        handler.logger.addHandler(handler)
        return handler

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "console", False):
            self._lines.append(record.getMessage())
            del self._lines[:-MAX_PENDING]

    def take(self) -> list[str]:
        lines, self._lines = self._lines, []
        return lines

    def detach(self) -> None:
        self.logger.removeHandler(self)
