"""Built-in datasets: the embedded standard-library byte corpus and synthetic tokens."""

from raydeep.data.corpus import (
    DEFAULT_CORPUS_BYTES,
    ByteTokenDataset,
    SyntheticTokenDataset,
    builtin_corpus_bytes,
    builtin_corpus_files,
    builtin_dataset,
    synthetic_dataset,
)

__all__ = [
    "DEFAULT_CORPUS_BYTES",
    "ByteTokenDataset",
    "SyntheticTokenDataset",
    "builtin_corpus_bytes",
    "builtin_corpus_files",
    "builtin_dataset",
    "synthetic_dataset",
]
