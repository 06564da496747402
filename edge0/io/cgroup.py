"""This process's memory cgroup: where it is (cgroup v1 or v2) and how much room its limit leaves.

A cgroup's limit counts the page cache its processes bring in, so a process under a cap has less room than
the machine's free memory says; `edge0 bench --memory-cap` makes such caps (bench/cap.py), and
`--executor auto` sizes its choice by the room left (compute/runtime.py).
"""

from __future__ import annotations

from pathlib import Path

V1_ROOT = Path("/sys/fs/cgroup/memory")
V2_ROOT = Path("/sys/fs/cgroup")
UNLIMITED = 2**62  # v1 reports "no limit" as a number near 2**63


def read_text(path: Path) -> str:
    """The file's text, or "" where it cannot be read."""
    try:
        return path.read_text()
    except OSError:
        return ""


def memory_cgroup() -> tuple[Path, bool] | None:
    """(this process's memory cgroup directory, whether it is cgroup v2) from /proc/self/cgroup; None where no
    memory controller is mounted for it."""
    lines = read_text(Path("/proc/self/cgroup")).splitlines()
    for line in lines:
        parts = line.split(":", 2)  # hierarchy-ID:controllers:path
        if len(parts) != 3:
            continue
        _, controllers, rel = parts
        if "memory" in controllers.split(",") and (V1_ROOT / rel.lstrip("/")).is_dir():
            return V1_ROOT / rel.lstrip("/"), False
    for line in lines:
        if line.startswith("0::"):
            path = V2_ROOT / line[3:].lstrip("/")
            if "memory" in read_text(V2_ROOT / "cgroup.controllers").split() and path.is_dir():
                return path, True
    return None


def memory_room() -> int | None:
    """Bytes this process's memory cgroup may still take (its limit less its usage, page cache included);
    None where it has no limit (or none can be read)."""
    found = memory_cgroup()
    if found is None:
        return None
    group, v2 = found
    limit = read_text(group / ("memory.max" if v2 else "memory.limit_in_bytes")).strip()
    usage = read_text(group / ("memory.current" if v2 else "memory.usage_in_bytes")).strip()
    if not limit.isdigit() or not usage.isdigit() or int(limit) >= UNLIMITED:
        return None  # "max" (v2), no limit (v1), or unreadable
    return max(int(limit) - int(usage), 0)
