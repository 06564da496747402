"""The processes of `edge0 bench`'s arms, optionally inside a memory cgroup (`--memory-cap GIB`).

A cgroup's memory limit counts the page cache its processes bring in, so under a cap a checkpoint larger
than the cap behaves as on a smaller machine: cgroup v2 `memory.max` where the memory controller is there,
else v1 `memory.limit_in_bytes`. Each run gets a fresh child of this process's own cgroup. Pages already
cached belong to whoever read them first, so under a cap the arm's files are evicted before every run and
a warm cache is made by reading them inside the run's cgroup (as much of them as the cap keeps); the peak is
reset after that read (v1). An arm the kernel kills for memory is a result ("killed: out of memory at N GiB").

Every run, capped or not, reports its major page faults and the bytes it read from disk (its rusage).
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import Edge0Error
from ..io.atomic import signals_deferred, signals_raise
from ..io.cgroup import memory_cgroup
from ..io.cgroup import read_text as _read

GIB = 2**30
INSTEAD = ("or run each arm under a cap you can set, e.g. `systemd-run --user --scope -p MemoryMax=8G edge0 run "
           "--model STORE --replay replay.json --json`")


@dataclass
class ArmRun:
    """What one arm process did."""

    returncode: int
    stdout: str
    stderr: str
    major_faults: int  # ru_majflt: pages the process waited on the disk for
    disk_read_bytes: int  # ru_inblock * 512: bytes read from block devices
    peak_cgroup_bytes: int | None = None  # the run's cgroup peak (page cache included); None uncapped
    oom_killed: bool = False


class MemoryCap:
    """A memory cgroup setup: fresh child cgroups of this process's own, limited to `limit` bytes."""

    def __init__(self, gib: float | None):
        """gib None: no limit (each run's peak is still measured)."""
        self.gib = gib
        self.limit = str(int(gib * GIB)) if gib is not None else None
        self.parent, self.v2 = own_memory_cgroup()
        self.count = 0
        probe = self._make()  # refuse now, before any arm runs, if a child cannot be made and limited
        _remove(probe)

    def _make(self) -> Path:
        self.count += 1
        path = self.parent / f"edge0-bench-{os.getpid()}-{self.count}"
        try:
            path.mkdir()
            limit = self.limit or ("max" if self.v2 else "-1")
            (path / ("memory.max" if self.v2 else "memory.limit_in_bytes")).write_text(limit)
        except OSError as e:
            if path.exists():
                _remove(path)
            raise Edge0Error(f"--memory-cap: cannot create a memory cgroup under {self.parent} ({e.strerror}); "
                             f"run the bench as a user who may (root, or a delegated cgroup), {INSTEAD}") from None
        return path

    def run(self, cmd: list[str], warm: list[Path] | None = None) -> ArmRun:
        """cmd inside a fresh cgroup; `warm` files are read inside it first (their pages then count). The cgroup is
        removed however the run ends, SIGTERM included (it raises SystemExit here; the arm is killed first)."""
        with signals_raise():
            return self._run(cmd, warm)

    def _run(self, cmd: list[str], warm: list[Path] | None) -> ArmRun:
        group = self._make()
        try:
            join = _joiner(group / "cgroup.procs")
            if warm:
                launch(["cat", *map(str, warm)], preexec_fn=join, output=False)
                if not self.v2:
                    (group / "memory.max_usage_in_bytes").write_text("0")  # the peak of the arm, not of the read
            run = launch(cmd, preexec_fn=join)
            run.peak_cgroup_bytes = _peak(group, self.v2)
            run.oom_killed = run.returncode < 0 and _oom_kills(group, self.v2) > 0
            return run
        finally:
            _remove(group)


def own_memory_cgroup() -> tuple[Path, bool]:
    """(this process's memory cgroup directory, whether it is cgroup v2), from /proc/self/cgroup."""
    found = memory_cgroup()
    if found is None:
        raise Edge0Error(f"--memory-cap: no memory cgroup controller is mounted for this process; {INSTEAD}")
    return found


def launch(cmd: list[str], preexec_fn=None, output: bool = True) -> ArmRun:
    """Run cmd to its end; its output (unless output=False), exit status and rusage (wait4: faults and block
    reads of it). A signal that interrupts it (SIGTERM raises SystemExit under signals_raise) kills the child
    first, also one that comes while the child starts: held back until `proc` exists."""
    def child() -> None:  # the child unblocks what the parent held back around its start
        signal.pthread_sigmask(signal.SIG_SETMASK, set())
        if preexec_fn is not None:
            preexec_fn()

    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = None
        try:
            with signals_deferred():
                proc = subprocess.Popen(cmd, stdout=out if output else subprocess.DEVNULL, stderr=err,
                                        preexec_fn=child)
            _, status, usage = os.wait4(proc.pid, 0)
        except BaseException:  # interrupted: the arm does not outlive the bench (nor keep its cgroup)
            if proc is not None:
                proc.kill()
                proc.wait()
            raise
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
        out.seek(0)
        err.seek(0)
        return ArmRun(proc.returncode, out.read().decode(errors="replace"), err.read().decode(errors="replace"),
                      usage.ru_majflt, usage.ru_inblock * 512)


def _joiner(procs: Path):
    def join() -> None:  # runs in the child between fork and exec: move itself into the cgroup
        with open(procs, "w") as f:
            f.write(str(os.getpid()))
    return join


def _peak(group: Path, v2: bool) -> int | None:
    text = _read(group / ("memory.peak" if v2 else "memory.max_usage_in_bytes")).strip()
    return int(text) if text.isdigit() else None


def _oom_kills(group: Path, v2: bool) -> int:
    for line in _read(group / ("memory.events" if v2 else "memory.oom_control")).splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill" and value.strip().isdigit():
            return int(value)
    return 1 if not v2 and int(_read(group / "memory.failcnt").strip() or 0) > 0 else 0


def _remove(group: Path) -> None:
    """Remove a cgroup whose processes have exited (its charged page cache moves to the parent). Right after a
    kill the kernel may still count the exiting task (EBUSY): retried for up to 10 s (1 s was seen to fall short
    on a loaded machine: a fresh-clone test run left an empty cgroup behind)."""
    for _ in range(500):
        try:
            group.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.02)
