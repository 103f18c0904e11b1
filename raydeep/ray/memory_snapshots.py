"""In-memory snapshots: the run's recent state in another process's memory, for a restart that
loses no step since the last storage checkpoint (``raydeep.memory_snapshot_every``).

A snapshot *is* a checkpoint, written by the engine's own checkpointer to a filesystem whose
files live in a :class:`SnapshotStore` actor: the same files, manifest and sha256s, the same
commit protocol (the manifest, written last, commits a tag; a tag without one is never loaded),
the same resharding on load at another world size, the same ``client_state`` (the sample ledger
and the run's counters, so exactly-once holds). Only where the bytes go differs.

The driver creates the store (:func:`start_store`) and kills it when the run ends, so it outlives
every worker group of the run and dies with the driver. Storage checkpoints stay the durable tier
on their own cadence; a restart loads whichever of the newest intact snapshot and the newest
checkpoint is further along, and falls back to the checkpoint (with a warning naming what was
lost) when the store cannot be read.

With the actor tier the store is also the owner of the offload actors
(:mod:`raydeep.ray.snapshot_holders`): they outlive the rank that uses them, and each keeps the
part files it writes into a snapshot as objects on its CPU node, where the store only records who
holds them. A snapshot's masters and optimizer states never travel to the driver's node; a
restart's actors read them where they are.

>>> import ray  # doctest: +SKIP
>>> store = start_store()  # doctest: +SKIP
>>> storage = snapshot_storage(store, "run")  # doctest: +SKIP
>>> storage.write("a/b", b"hi"); storage.read("a/b")  # doctest: +SKIP
b'hi'
"""
from __future__ import annotations

import io
import posixpath
from typing import NamedTuple

import pyarrow as pa
import pyarrow.fs as pafs
import ray

from raydeep.ray.node_memory import available_memory
from raydeep.storage import Storage

KEEP = 2  # snapshots kept: the newest, and the one before it while the newest is written


class Held(NamedTuple):
    """A file an offload actor holds: the actor, its name (for messages), the file's size and the
    object that is the file, which the actor owns."""

    holder: object
    name: str
    size: int
    content: object


@ray.remote(num_cpus=0, max_restarts=0)
class SnapshotStore:
    """Files by path, in this process's memory or held by the offload actors that wrote them;
    directories are the paths' prefixes and the ones created explicitly. Also the owner of the
    run's offload actors (``create_offload_actors``), which therefore outlive the ranks that use
    them and die with the store."""

    def __init__(self):
        self.files: dict[str, bytes] = {}
        self.held: dict[str, Held] = {}
        self.dirs: set[str] = {"/"}
        # The offload actors: the current attempt's by rank, and the previous attempt's not yet adopted.
        self.attempt: str | None = None
        self.ranks: dict[int, list] = {}
        self.spare: dict[int, list] = {}
        self.orphans: set = set()  # retired actors that still hold files (handles hash by actor id)

    def put(self, path: str, data: bytes) -> None:
        self._forget(path)
        self._make_dir(posixpath.dirname(path))
        self.files[path] = data

    def put_held(self, path: str, holder, name: str, size: int, content: list) -> None:
        """Record that offload actor ``holder`` (``name``) keeps file ``path`` (``size`` bytes) as
        the object ``content[0]`` (a list, so that Ray passes the reference, not the bytes), which
        it owns: the object lives while this entry does and its holder is alive."""
        self._forget(path)
        self._make_dir(posixpath.dirname(path))
        self.held[path] = Held(holder, name, size, content[0])

    def get(self, path: str):
        """A file's bytes, or ``(holder's name, [its object])`` for a file an offload actor holds
        (the reader takes the object from the holder's node: the bytes do not pass through here)."""
        if path in self.files:
            return self.files[path]
        if path in self.held:
            return self.held[path].name, [self.held[path].content]
        raise FileNotFoundError(path)

    def info(self, paths: list[str]) -> list[tuple[str, int]]:
        """("file", size), ("dir", 0) or ("none", 0) for each path."""
        return [("file", self._size(p)) if self._size(p) is not None else ("dir", 0) if p in self.dirs else ("none", 0)
                for p in paths]

    def children(self, base: str, recursive: bool) -> list[tuple[str, str, int]]:
        """(path, kind, size) under ``base``; None when ``base`` is no directory."""
        if base not in self.dirs:
            return None
        prefix = base.rstrip("/") + "/"
        out = [(d, "dir", 0) for d in self.dirs if d.startswith(prefix) and d != prefix]
        out += [(f, "file", self._size(f)) for f in [*self.files, *self.held] if f.startswith(prefix)]
        if not recursive:
            out = [entry for entry in out if "/" not in entry[0][len(prefix):]]
        return out

    def make_dir(self, path: str) -> None:
        self._make_dir(path)

    def delete(self, path: str, contents_only: bool = False) -> None:
        prefix = path.rstrip("/") + "/"
        self.files = {f: d for f, d in self.files.items() if not f.startswith(prefix) and f != path}
        for f in [f for f in self.held if f.startswith(prefix) or f == path]:
            self._forget(f)
        self.dirs = {d for d in self.dirs if not d.startswith(prefix) and (contents_only or d != path)}

    def move(self, src: str, dst: str) -> None:
        if src in self.files or src in self.held:
            self._move_file(src, dst)
            return
        prefix = src.rstrip("/") + "/"
        for f in [f for f in [*self.files, *self.held] if f.startswith(prefix)]:
            self._move_file(f, dst + f[len(src):])
        self.dirs = {dst + d[len(src):] if d == src or d.startswith(prefix) else d for d in self.dirs}

    def bytes_held(self) -> int:
        """Bytes of the files in this process (not those the offload actors hold)."""
        return sum(len(d) for d in self.files.values())

    def bytes_held_by_actors(self) -> int:
        return sum(entry.size for entry in self.held.values())

    def room(self) -> tuple[int, int | None]:
        """(bytes of the largest snapshot held here, bytes of memory still available on this
        node, or None where it cannot be read)."""
        sizes: dict[str, int] = {}
        for path, data in self.files.items():
            sizes[_tag_of(path)] = sizes.get(_tag_of(path), 0) + len(data)
        return max(sizes.values(), default=0), available_memory()

    def holders(self) -> list[tuple]:
        """``(holder, bytes of the largest snapshot it holds part of)`` for each offload actor
        holding files."""
        sizes: dict = {}
        for path, entry in self.held.items():
            by_tag = sizes.setdefault(entry.holder, {})
            by_tag[_tag_of(path)] = by_tag.get(_tag_of(path), 0) + entry.size
        return [(holder, max(by_tag.values())) for holder, by_tag in sizes.items()]

    # --- the offload actors' owner (raydeep.ray.snapshot_holders) ---------------------------------------
    def create_offload_actors(self, attempt: str, rank: int, world_size: int, options: list[dict],
                              args: list[tuple]) -> tuple[list, int]:
        """Offload actors for rank ``rank`` of ``attempt``, owned here (the handles are kept, so
        they live until the rank kills them or this store dies): ``(actors, adopted)``, the first
        ``adopted`` of them the previous attempt's, which the caller resets to ``args``.

        A new attempt's rank adopts its predecessor's actors first (they hold that rank's parts
        of the snapshots: a restart at the same world size reads them where they are, and needs
        no new CPUs), then those of ranks the new attempt no longer has, and creates the rest.
        What no rank adopts is retired: killed at once when it holds no snapshot file, else told
        to drop its training state and killed once its last file is deleted."""
        from raydeep.ray.snapshot_holders import HoldingOffloadActor

        if attempt != self.attempt:  # the previous attempt's actors, by rank, are up for adoption
            # (what an attempt that failed half-way through creating left unadopted is retired)
            self._retire([actor for left in self.spare.values() for actor in left])
            self.attempt, self.spare, self.ranks = attempt, self.ranks, {}
        adopted = []
        for r in [rank] + sorted(r for r in self.spare if r >= world_size):
            while len(adopted) < len(options) and self.spare.get(r):
                adopted.append(self.spare[r].pop(0))
        self._retire(self.spare.pop(rank, []))
        remote = ray.remote(HoldingOffloadActor)
        made = adopted + [remote.options(**o).remote(*a) for o, a in zip(options[len(adopted):], args[len(adopted):])]
        self.ranks[rank] = list(made)
        if len(self.ranks) >= world_size:  # every rank has its actors: nobody adopts the rest
            self._retire([actor for left in self.spare.values() for actor in left])
            self.spare = {}
        return made, len(adopted)

    def replace_offload_actor(self, rank: int, lost, option: dict, args: tuple):
        """A new actor for rank ``rank`` in place of ``lost``, an adopted one that could not be reset."""
        from raydeep.ray.snapshot_holders import HoldingOffloadActor

        actor = ray.remote(HoldingOffloadActor).options(**option).remote(*args)
        self.ranks[rank] = [actor if a == lost else a for a in self.ranks.get(rank, [])]
        self.orphans.discard(lost)
        return actor

    def close(self) -> None:
        """Kill every offload actor this store created, before the store itself is killed (Ray
        kills an owner's actors with it too, but not always at once)."""
        for actor in {a for actors in [*self.ranks.values(), *self.spare.values()] for a in actors} | self.orphans:
            ray.kill(actor, no_restart=True)
        self.ranks, self.spare, self.orphans, self.held = {}, {}, set(), {}

    def _retire(self, actors: list) -> None:
        for actor in actors:
            self.orphans.add(actor)
            actor.retire.remote()
        self._kill_idle_orphans()

    def _kill_idle_orphans(self) -> None:
        idle = self.orphans - {entry.holder for entry in self.held.values()}
        for actor in idle:
            ray.kill(actor, no_restart=True)
        self.orphans -= idle

    def _size(self, path: str) -> int | None:
        if path in self.files:
            return len(self.files[path])
        return self.held[path].size if path in self.held else None

    def _move_file(self, src: str, dst: str) -> None:
        if src in self.files:
            self.put(dst, self.files.pop(src))
        else:
            entry = self.held.pop(src)
            self.put_held(dst, entry.holder, entry.name, entry.size, [entry.content])

    def _forget(self, path: str) -> None:
        """Drop file ``path`` (a held one's object is freed with the last reference to it)."""
        self.files.pop(path, None)
        entry = self.held.pop(path, None)
        if entry is not None and entry.holder in self.orphans:
            self._kill_idle_orphans()

    def _make_dir(self, path: str) -> None:
        while path and path not in self.dirs:
            self.dirs.add(path)
            path = posixpath.dirname(path)


def _tag_of(path: str) -> str:
    return "/".join(path.split("/")[:3])  # /snapshots/<tag>


def no_room(store: tuple[int, int | None], holders: list[tuple[str, int, int | None]]) -> str | None:
    """Why ``KEEP`` snapshots of the sizes held do not fit (None: they do). ``store`` is the
    store's ``room()``; ``holders`` lists ``(node id, largest, available)`` for each offload actor
    holding snapshot files, whose parts on one node add up there."""
    problems = []
    largest, available = store
    if too_big_to_keep(largest, available):
        problems.append(f"{KEEP} snapshots of {largest / 2**30:.2f} GiB would take more than half of the "
                        f"{(available + largest) / 2**30:.2f} GiB the driver's node has for them")
    by_node: dict[str, list] = {}
    for node, size, free in holders:
        found = by_node.setdefault(node, [0, free])
        found[0] += size
    for node, (size, free) in by_node.items():
        if too_big_to_keep(size, free):
            problems.append(f"{KEEP} copies of the offload actors' parts of a snapshot ({size / 2**30:.2f} GiB) "
                            f"would take more than half of the {(free + size) / 2**30:.2f} GiB offload node "
                            f"{node[:12]} has for them")
    return "; ".join(problems) or None


def too_big_to_keep(largest: int, available: int | None) -> bool:
    """Whether ``KEEP`` snapshots of ``largest`` bytes would take more than half of what the
    store's node has for them (what it holds now, which it can reuse, and what is still free)."""
    return available is not None and KEEP * largest > 0.5 * (available + largest)


def start_store():
    """The run's store, made by the driver: its owner, so the store outlives every worker group
    and dies with the driver. Pinned to the driver's node (as the run monitor is), which is not a
    rank's node on a cluster whose head trains nothing: losing a worker node never loses it."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = ray.get_runtime_context().get_node_id()
    return SnapshotStore.options(scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False)).remote()


class _Upload(io.RawIOBase):
    """A file being written: the whole of it goes to the store when it is closed."""

    def __init__(self, store, path: str):
        self.store, self.path, self.chunks = store, path, []

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        self.chunks.append(bytes(data))
        return len(data)

    def close(self) -> None:
        if not self.closed:
            from raydeep.ray import snapshot_holders

            chunks, self.chunks = self.chunks, []
            if snapshot_holders.holding_here():  # an offload actor keeps its own part files
                ray.get(self.store.put_held.remote(self.path, *snapshot_holders.hold(chunks)))
            else:
                ray.get(self.store.put.remote(self.path, b"".join(chunks)))
        super().close()


class StoreHandler(pafs.FileSystemHandler):
    """A pyarrow filesystem over a :class:`SnapshotStore`: what :class:`Storage` needs of one."""

    def __init__(self, store):
        self.store = store

    def get_type_name(self) -> str:
        return "raydeep-snapshots"

    def normalize_path(self, path: str) -> str:
        return path

    def get_file_info(self, paths):
        kinds = ray.get(self.store.info.remote(list(paths)))
        return [_info(p, kind, size) for p, (kind, size) in zip(paths, kinds)]

    def get_file_info_selector(self, selector):
        found = ray.get(self.store.children.remote(selector.base_dir, selector.recursive))
        if found is None:
            if selector.allow_not_found:
                return []
            raise FileNotFoundError(selector.base_dir)
        return [_info(p, kind, size) for p, kind, size in found]

    def create_dir(self, path: str, recursive: bool) -> None:
        ray.get(self.store.make_dir.remote(path))

    def delete_dir(self, path: str) -> None:
        ray.get(self.store.delete.remote(path))

    def delete_dir_contents(self, path: str, missing_dir_ok: bool = False) -> None:
        ray.get(self.store.delete.remote(path, True))

    def delete_root_dir_contents(self) -> None:
        ray.get(self.store.delete.remote("/", True))

    def delete_file(self, path: str) -> None:
        ray.get(self.store.delete.remote(path))

    def move(self, src: str, dest: str) -> None:
        ray.get(self.store.move.remote(src, dest))

    def copy_file(self, src: str, dest: str) -> None:
        ray.get(self.store.put.remote(dest, self._read(src)))

    def open_input_stream(self, path: str):
        return pa.BufferReader(self._read(path))

    def open_input_file(self, path: str):
        return pa.BufferReader(self._read(path))

    def _read(self, path: str) -> bytes:
        found = ray.get(self.store.get.remote(path))
        if isinstance(found, bytes):
            return found
        from raydeep.ray.snapshot_holders import read_held

        return read_held(path, *found)

    def open_output_stream(self, path: str, metadata=None):
        return pa.PythonFile(_Upload(self.store, path), mode="w")

    def open_append_stream(self, path: str, metadata=None):
        raise NotImplementedError("snapshot files are written whole")


def _info(path: str, kind: str, size: int) -> pafs.FileInfo:
    kinds = {"file": pafs.FileType.File, "dir": pafs.FileType.Directory, "none": pafs.FileType.NotFound}
    return pafs.FileInfo(path, kinds[kind], size=size if kind == "file" else None)


def snapshot_storage(store, run_name: str) -> Storage:
    """The store as a run directory the checkpointer writes to and reads from."""
    return Storage(pafs.PyFileSystem(StoreHandler(store)), "/snapshots", f"memory://{run_name}/snapshots")
