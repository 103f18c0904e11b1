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
BYTE_VOCAB = 256  # the builtin corpus is read as bytes
DATA_FIX = "pass builtin, synthetic, or a Parquet token dataset path/URI made with `raydeep data build`"


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
        from raydeep.errors import InputError

        raise InputError("--model", "the model has no `config` with block_size and vocab_size, which choose its "
                         "data", value=type(model).__name__, fix="give the module a `config` attribute with both")
    return int(config.block_size), int(config.vocab_size)


def open_dataset(data: str, block_size: int, vocab_size: int, seed: int) -> Dataset:
    """``builtin`` (embedded byte corpus), ``synthetic`` or a Parquet token dataset path/URI.

    Every token is checked against the model here too: the driver's check (:func:`check_data`)
    may have seen only a sample of a dataset written without column statistics."""
    from raydeep.data import ParquetTokenDataset, builtin_dataset, synthetic_dataset

    if data == "synthetic":
        return synthetic_dataset(SYNTHETIC_SAMPLES, block_size, vocab_size, seed=seed, period=SYNTHETIC_PERIOD)
    if data == "builtin":
        _check_fits(data, block_size, (0, BYTE_VOCAB - 1), "byte tokens", block_size, vocab_size)
        return builtin_dataset(block_size)
    dataset = _data_input(data, ParquetTokenDataset)
    _check_fits(data, dataset.block_size, dataset.token_range(), "every token", block_size, vocab_size)
    return dataset


def check_data(data: str, block_size: int, vocab_size: int) -> None:
    """On the driver: ``data`` exists, is a token dataset, and fits a model of this block and
    vocabulary size. Reads Parquet footers only (statistics give the token range), so a large
    remote dataset costs a few small reads; raises :class:`~raydeep.errors.InputError`."""
    from raydeep.data.parquet import describe_token_dataset

    if data == "synthetic":
        return  # drawn from the model's own vocabulary at its block size
    if data == "builtin":
        _check_fits(data, block_size, (0, BYTE_VOCAB - 1), "byte tokens", block_size, vocab_size)
        return
    info = _data_input(data, describe_token_dataset)
    how = "column statistics" if info.exact else "a sample of the first rows: the files have no statistics"
    _check_fits(data, info.block_size, (info.min_token, info.max_token), how, block_size, vocab_size)


def check_workload(model: str, data: str, seed: int) -> None:
    """On the driver, before any worker starts: the model builds (on the meta device: no memory)
    and the data fits it (:func:`check_data`), so a typo or a bad dataset fails in a second with
    one message instead of in every worker."""
    with torch.device("meta"):
        block_size, vocab_size = sequence_shape(build_model(model, seed))
    check_data(data, block_size, vocab_size)


def _data_input(data: str, read):
    """``read(data)``, its failures made :class:`~raydeep.errors.InputError` naming ``--data``:
    bad data is deterministic, so retrying a worker cannot help."""
    import pyarrow as pa

    from raydeep.data.parquet import TokenDatasetError
    from raydeep.errors import InputError

    try:
        return read(data)
    except TokenDatasetError as exc:
        # The message names the file only when it is one of several the path holds.
        raise InputError("--data", exc.problem if _names(data, exc.file) else str(exc), value=data,
                         fix=exc.fix) from None
    except FileNotFoundError as exc:
        problem = exc.strerror if _names(data, exc.filename) else str(exc)
        raise InputError("--data", problem, value=data, fix=DATA_FIX) from None
    except (pa.ArrowException, OSError) as exc:  # the filesystem itself: a bad URI, no access
        raise InputError("--data", f"cannot read it ({exc})", value=data, fix=DATA_FIX) from None


def _names(data: str, path) -> bool:
    """Whether a filesystem path is ``data`` itself (a URI's path lacks its scheme)."""
    return path in (data, data.split("://", 1)[-1])


def _check_fits(data: str, data_block: int, tokens: tuple[int, int], how: str, block_size: int,
                vocab_size: int) -> None:
    from raydeep.errors import InputError

    if data_block > block_size:
        raise InputError("--data", f"its samples have block size {data_block}, longer than the model's block size "
                         f"{block_size} (its longest context)", value=data,
                         fix=f"rebuild the data with `raydeep data build --block-size {block_size}` (or less), or "
                         "pick a --model with a longer context")
    low, high = tokens
    if low < 0:
        raise InputError("--data", f"token id {low} ({how}) is negative", value=data,
                         fix="token ids count from 0: tokenise the data again")
    if high >= vocab_size:
        raise InputError("--data", f"token id {high} ({how}) is outside the model's vocabulary of {vocab_size} "
                         f"(ids 0..{vocab_size - 1})", value=data,
                         fix=f"pick a --model whose vocab_size exceeds {high}, or tokenise the data with the "
                         "model's vocabulary")


def collate(dataset: Dataset, ids) -> tuple[torch.Tensor, torch.Tensor]:
    pairs = [dataset[int(i)] for i in ids]
    return torch.stack([x for x, _ in pairs]), torch.stack([y for _, y in pairs])
