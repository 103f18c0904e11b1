"""A run's directory on any ``pyarrow.fs`` filesystem -- local paths, ``file://``, ``s3://``,
``gs://``, ``hdfs://`` -- for what a run writes: checkpoints, step metrics, reports.

Two kinds of filesystem need two commit protocols, and this class hides which one applies:

- local (POSIX) directories support atomic renames, so a checkpoint is written into a staging
  directory, every file is fsynced, and the staging directory is renamed into place;
- object stores have no rename, but a single object write is atomic, so files are written in
  place and the manifest, written last, is the commit marker.

>>> import tempfile
>>> store = Storage.open(tempfile.mkdtemp())
>>> store.write("a/b.txt", b"hi"); store.read("a/b.txt"), store.exists("a/c.txt")
(b'hi', False)
"""
from __future__ import annotations

import os
import posixpath

import pyarrow.fs as pafs


class Storage:
    """A directory tree rooted at ``root`` on a pyarrow filesystem; paths are relative to it."""

    def __init__(self, fs: pafs.FileSystem, root: str, uri: str):
        self.fs, self.root, self.uri = fs, root.rstrip("/") or "/", uri

    @staticmethod
    def open(uri: "str | os.PathLike | Storage") -> "Storage":
        if isinstance(uri, Storage):  # one opened already (e.g. raydeep.ray.memory_snapshots')
            return uri
        uri = os.fspath(uri)
        if not uri:
            raise ValueError("checkpoint directory is empty: pass a local path or a URI such as s3://bucket/run")
        if "://" in uri:
            fs, root = pafs.FileSystem.from_uri(uri)
        else:
            fs, root = pafs.LocalFileSystem(), os.path.abspath(uri)
        return Storage(fs, root, uri)

    @property
    def is_local(self) -> bool:
        return isinstance(self.fs, pafs.LocalFileSystem)

    def path(self, rel: str = "") -> str:
        return posixpath.join(self.root, rel) if rel else self.root

    def describe(self, rel: str = "") -> str:
        """A path as the user wrote it, for messages: scheme kept, query options (which may
        carry credentials) dropped."""
        base = self.uri.split("?", 1)[0].rstrip("/")
        return posixpath.join(base, rel) if rel else base

    # --- files ----------------------------------------------------------------------------------
    def write(self, rel: str, data: bytes | list, fsync: bool = True) -> None:
        """Write a whole file from bytes or a list of buffers; on local disks it is fsynced
        before returning unless ``fsync=False`` (then a process crash still cannot lose it, but
        a machine crash can)."""
        path = self.path(rel)
        chunks = [data] if isinstance(data, (bytes, bytearray, memoryview)) else data
        self.fs.create_dir(posixpath.dirname(path), recursive=True)
        if self.is_local:
            with open(path, "wb") as f:
                for chunk in chunks:
                    f.write(chunk)
                f.flush()
                if fsync:
                    os.fsync(f.fileno())
        else:
            with self.fs.open_output_stream(path) as f:
                for chunk in chunks:
                    f.write(chunk)

    def write_atomic(self, rel: str, data: bytes) -> None:
        """Replace a small file so readers see the old or the new content, never a mix."""
        if not self.is_local:
            self.write(rel, data)  # a single object PUT is atomic
            return
        tmp = rel + ".tmp"
        self.write(tmp, data)
        os.replace(self.path(tmp), self.path(rel))
        self._fsync_dir(posixpath.dirname(self.path(rel)))

    def read(self, rel: str) -> bytes:
        with self.fs.open_input_stream(self.path(rel)) as f:
            return f.read()

    def exists(self, rel: str) -> bool:
        return self.fs.get_file_info(self.path(rel)).type != pafs.FileType.NotFound

    def is_dir(self, rel: str) -> bool:
        return self.fs.get_file_info(self.path(rel)).type == pafs.FileType.Directory

    def list_dirs(self, rel: str = "") -> list[str]:
        """Names of the sub-directories of ``rel`` (empty when it does not exist)."""
        if not self.is_dir(rel):
            return []
        infos = self.fs.get_file_info(pafs.FileSelector(self.path(rel), allow_not_found=True))
        return sorted(posixpath.basename(i.path) for i in infos if i.type == pafs.FileType.Directory)

    # --- directories -----------------------------------------------------------------------------
    def make_dir(self, rel: str) -> None:
        self.fs.create_dir(self.path(rel), recursive=True)

    def delete_dir(self, rel: str) -> None:
        if self.exists(rel):
            self.fs.delete_dir(self.path(rel))

    def rename_dir(self, src: str, dst: str) -> None:
        """Atomic on local disks (the commit of a staged checkpoint); only called when ``is_local``."""
        os.rename(self.path(src), self.path(dst))
        self._fsync_dir(posixpath.dirname(self.path(dst)))

    @staticmethod
    def _fsync_dir(path: str) -> None:
        # A rename is durable only once the directory entry itself reaches the disk.
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
