"""Built-in datasets: the embedded standard-library byte corpus, synthetic tokens, Parquet token files."""

from raydeep.data.corpus import (
    DEFAULT_CORPUS_BYTES,
    ByteTokenDataset,
    SyntheticTokenDataset,
    builtin_corpus_bytes,
    builtin_corpus_files,
    builtin_dataset,
    synthetic_dataset,
)
from raydeep.data.parquet import (
    ParquetTokenDataset,
    TokenDatasetError,
    TokenDatasetInfo,
    build_byte_dataset,
    describe_token_dataset,
    write_token_parquet,
)

__all__ = [
    "DEFAULT_CORPUS_BYTES",
    "ByteTokenDataset",
    "ParquetTokenDataset",
    "SyntheticTokenDataset",
    "TokenDatasetError",
    "TokenDatasetInfo",
    "build_byte_dataset",
    "builtin_corpus_bytes",
    "builtin_corpus_files",
    "builtin_dataset",
    "describe_token_dataset",
    "synthetic_dataset",
    "write_token_parquet",
]
