"""Checkpoints that load on any world size and ZeRO stage, commit atomically, and never unpickle.

``engine.save_checkpoint`` / ``engine.load_checkpoint`` are the entry points; the format is
described in :mod:`raydeep.checkpoint.format`.
"""
from raydeep.checkpoint.checkpointer import Checkpointer
from raydeep.checkpoint.deepspeed_import import import_deepspeed
from raydeep.checkpoint.export import load_consolidated, load_into_engine
from raydeep.checkpoint.reader import CheckpointReader
from raydeep.storage import Storage
from raydeep.checkpoint.writer import committed_tags, prune, write_single

__all__ = ["CheckpointReader", "Checkpointer", "Storage", "committed_tags", "import_deepspeed", "load_consolidated",
           "load_into_engine", "prune", "write_single"]
