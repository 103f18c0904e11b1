"""What a worker trains: the model named by the run and the dataset it reads.

Both are built the same way on every rank and every attempt (the model from a fixed seed; the
engine then broadcasts rank 0's weights anyway), so nothing but the checkpoint carries state
between attempts.

>>> model = build_model("gpt-tiny", seed=0)
>>> sequence_shape(model)
(128, 256)
>>> len(open_dataset("synthetic", block_size=16, vocab_size=64, seed=0)) > 0
True
"""
from __future__ import annotations

import importlib

import torch
from torch import nn
from torch.utils.data import Dataset

SYNTHETIC_SAMPLES = 1 << 16
SYNTHETIC_PERIOD = 16  # a repeating pattern the model can learn, so the loss visibly falls


def build_model(name: str, seed: int) -> nn.Module:
    """A built-in GPT size (``gpt-tiny``, ...) or ``package.module:function`` returning a module
    whose ``forward(x, y)`` returns the loss."""
    torch.manual_seed(seed)
    if ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            factory = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            from raydeep.errors import ConfigError

            raise ConfigError("model", f"cannot load {name!r}: {exc}",
                              fix="pass a GPT size name or an importable package.module:function") from None
        return factory()
    from raydeep.models import build_gpt

    try:
        return build_gpt(name)
    except KeyError as exc:
        from raydeep.errors import ConfigError

        raise ConfigError("model", str(exc).strip('"'), value=name, fix="use one of the listed sizes") from None


def sequence_shape(model: nn.Module) -> tuple[int, int]:
    """(block_size, vocab_size) the model takes; a custom model states them as ``model.config``."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "block_size") or not hasattr(config, "vocab_size"):
        raise ValueError("the model needs a `config` with block_size and vocab_size to choose its data")
    return int(config.block_size), int(config.vocab_size)


def open_dataset(data: str, block_size: int, vocab_size: int, seed: int) -> Dataset:
    """``builtin`` (embedded byte corpus), ``synthetic`` or a Parquet token dataset path/URI."""
    from raydeep.data import ParquetTokenDataset, builtin_dataset, synthetic_dataset

    if data == "builtin":
        dataset, data_vocab = builtin_dataset(block_size), 256
    elif data == "synthetic":
        dataset = synthetic_dataset(SYNTHETIC_SAMPLES, block_size, vocab_size, seed=seed, period=SYNTHETIC_PERIOD)
        data_vocab = vocab_size
    else:
        dataset = ParquetTokenDataset(data)
        data_vocab = dataset.vocab_size
        if dataset.block_size > block_size:
            raise ValueError(f"{data}: samples of {dataset.block_size} tokens exceed the model's block size "
                             f"{block_size}")
    if data_vocab > vocab_size:
        raise ValueError(f"{data}: token ids up to {data_vocab - 1} exceed the model's vocabulary {vocab_size}")
    return dataset


def check_workload(model: str, data: str, seed: int) -> None:
    """On the driver, before any worker starts: the model builds (on the meta device: no memory)
    and the data source exists, so a typo fails in a second instead of in every worker."""
    with torch.device("meta"):
        block_size, vocab_size = sequence_shape(build_model(model, seed))
    if data in ("builtin", "synthetic"):
        return
    import pyarrow.fs as pafs

    fs, path = pafs.FileSystem.from_uri(data) if "://" in data else (pafs.LocalFileSystem(), data)
    if fs.get_file_info(path).type == pafs.FileType.NotFound:
        from raydeep.errors import ConfigError

        raise ConfigError("data", f"no Parquet token dataset at {data!r}",
                          fix="pass builtin, synthetic, or a path/URI made with `raydeep data build`")


def collate(dataset: Dataset, ids) -> tuple[torch.Tensor, torch.Tensor]:
    pairs = [dataset[int(i)] for i in ids]
    return torch.stack([x for x, _ in pairs]), torch.stack([y for _, y in pairs])
