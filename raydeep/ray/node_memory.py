"""How much memory a process on this node can still take: what the snapshot store and the offload
actors holding snapshot parts weigh their copies against (``raydeep.ray.memory_snapshots``)."""
from __future__ import annotations


def available_memory() -> int | None:
    """Bytes of memory a process here can still take: Linux's MemAvailable, less where the
    cgroup (a container's limit, as on KubeRay) leaves less; None where neither can be read."""
    found = []
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
    except OSError:
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as limit, open("/sys/fs/cgroup/memory.current") as used:
            text = limit.read().strip()
            if text != "max":
                found.append(int(text) - int(used.read()))
    except (OSError, ValueError):
        pass
    return min(found) if found else None
