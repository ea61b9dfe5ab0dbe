"""How much more memory this rank may allocate: what its device has available, under the rank's
own limit (`cpchat rank --memory-limit`, or $CPCHAT_MEMORY_LIMIT for the ranks a front end starts)."""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import mlx.core as mx
import psutil

NO_LIMIT = 1 << 62  # cgroups write "max" or a number near 2^63 for no limit
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
MMAP_THRESHOLD = 32 << 20  # the most glibc allows on 64-bit systems


def free_bytes(limit: int | None = None) -> int:
    """Bytes this process may still allocate on its device, at most `limit` minus what it holds (on a
    CPU its resident memory, on a GPU what MLX holds there). Buffers MLX keeps cached for reuse count
    as free: the device (or the host) sees them taken, but the next forward takes them first."""
    cached = mx.get_cache_memory()
    if mx.default_device() == mx.cpu:
        free, held = host_available(), psutil.Process().memory_info().rss
    else:
        info, held = mx.device_info(), mx.get_active_memory() + cached
        if "free_memory" in info:  # CUDA: the device's, whoever holds the rest
            free = int(info["free_memory"])
        else:  # Metal: what the system recommends a process keep on the GPU
            total = info.get("max_recommended_working_set_size") or info.get("memory_size") \
                or info.get("total_memory") or 0
            free = max(int(total) - held, 0)
    if limit is not None:
        free = min(free, max(limit - held, 0))
    return free + cached


def host_available(groups: list[tuple[Path, Path]] | None = None) -> int:
    """The host's available memory (Linux: MemAvailable), within the limits of this process's memory
    cgroup and of every group above it (`groups`: memory_groups())."""
    available = psutil.virtual_memory().available
    for limit_file, usage_file in memory_groups() if groups is None else groups:
        limit, usage = _read_int(limit_file), _read_int(usage_file)
        if limit is not None and usage is not None and limit < NO_LIMIT:
            available = min(available, max(limit - usage, 0))
    return available


def memory_groups(cgroup: Path = Path("/proc/self/cgroup"), root: Path = Path("/sys/fs/cgroup")
                  ) -> list[tuple[Path, Path]]:
    """The (limit, usage) files of the root memory cgroup, and of this process's group and each group
    above it as `cgroup` (/proc/self/cgroup) names them: cgroup v2's memory.max and memory.current,
    v1's memory.limit_in_bytes and memory.usage_in_bytes."""
    v2, v1 = (root, "memory.max", "memory.current"), (root / "memory", "memory.limit_in_bytes",
                                                        "memory.usage_in_bytes")
    groups = [(*v2, "/"), (*v1, "/")]
    try:
        lines = cgroup.read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        _, controllers, group = line.split(":", 2)
        if controllers == "":
            groups.append((*v2, group))
        elif "memory" in controllers.split(","):
            groups.append((*v1, group))
    pairs: list[tuple[Path, Path]] = []
    for top, limit, usage, group in groups:
        path = top / group.lstrip("/")
        for directory in (path, *path.parents):
            if directory != top and top not in directory.parents:
                break
            if (directory / limit, directory / usage) not in pairs:
                pairs.append((directory / limit, directory / usage))
            if directory == top:
                break
    return pairs


def _read_int(path: Path) -> int | None:
    try:
        return int(Path(path).read_text().strip())
    except (OSError, ValueError):  # absent, or "max"
        return None


def reuse_freed_blocks() -> None:
    """Have glibc's malloc keep freed blocks of up to 32 MiB for reuse from the first request on.
    Left to itself it maps every block over 128 KiB afresh (the kernel clears each page) and raises
    that threshold only as such blocks come back: in a fresh process the same attention tile took
    0.26 s, then 0.12 s once glibc had raised it (SmolLM2, 1024 x 2048 pairs), so a rank's load-time
    calibration measured a slower rank than its prefills ran. These are the values glibc's own rule
    ends at (the trim threshold twice the mapping one). Elsewhere (macOS, musl) nothing changes."""
    if not sys.platform.startswith("linux"):
        return
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is not None:
        mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
        mallopt(M_TRIM_THRESHOLD, 2 * MMAP_THRESHOLD)


def return_freed_blocks() -> None:
    """Give the pages of freed blocks back to the system (glibc's malloc_trim): what a conversation let
    go held then shows as free, where reuse_freed_blocks would keep it in the process, unseen by
    free_bytes. Elsewhere nothing changes."""
    if not sys.platform.startswith("linux"):
        return
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim(0)
