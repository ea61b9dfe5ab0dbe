"""How much more memory this rank may allocate: what its device has available, under the rank's
own limit (`cpchat rank --memory-limit`, or $CPCHAT_MEMORY_LIMIT for the ranks a front end starts)."""

from __future__ import annotations

import re
from pathlib import Path

import mlx.core as mx
import psutil

UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
NO_LIMIT = 1 << 62  # cgroups write "max" or a number near 2^63 for no limit


def parse_size(text: str) -> int:
    """'8G', '512M', '1.5G', '1000000' (bytes) -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?\s*", text, re.IGNORECASE)
    if not match:
        raise ValueError(f"not a size: {text!r} (expected bytes, or a number with K, M, G or T)")
    return int(float(match[1]) * UNITS[match[2].upper()])


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


def host_available() -> int:
    """The host's available memory (Linux: MemAvailable), within this process's cgroup limit."""
    available = psutil.virtual_memory().available
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        limit, usage = _read_int(limit_file), _read_int(usage_file)
        if limit is not None and usage is not None and limit < NO_LIMIT:
            available = min(available, max(limit - usage, 0))
    return available


def _read_int(path: str) -> int | None:
    try:
        return int(Path(path).read_text().strip())
    except (OSError, ValueError):  # absent, or "max"
        return None
