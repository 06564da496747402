"""Crash-safe writes: a reader sees the old output or the whole new one, never a part of either.

    write_atomic(path, data)                       # small files
    with atomic_path(path) as tmp:                 # a writer that wants a path (mx.save_safetensors, np.save)
        mx.save_safetensors(str(tmp), arrays)
    with atomic_dir(out, replace=force) as tmp:    # a directory built whole (convert, make-model, exports)
        ...

A temporary lives beside its target, so the final rename stays on one filesystem and is atomic:
`.edge0-tmp-<pid>-<tag>-<name>`. A writer removes its temporary when it fails, on Ctrl-C, and on
SIGTERM/SIGHUP too (where nobody else handles them). What a kill -9 leaves behind is removed
by the next writer into the same directory once the pid in its name is gone. A directory replaced with
--force is swapped in by one renameat2(RENAME_EXCHANGE) where the kernel offers it; elsewhere the old one is
moved aside as `.edge0-old-<pid>-<tag>-<name>` for the moment between two renames, and put back by the next
writer if the process died in between.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import re
import secrets
import shutil
import signal
import threading
from pathlib import Path

from ..errors import Edge0Error

PREFIX = ".edge0-tmp-"
OLD_PREFIX = ".edge0-old-"
_NAME = re.compile(r"^\.edge0-(tmp|old)-(\d+)-[0-9a-f]+-(.+)$")
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
_UNWRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO, errno.ENOENT, errno.ENOTDIR, errno.EISDIR)
_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def temp_for(path: Path, prefix: str = PREFIX) -> Path:
    """A fresh temporary name beside path; it ends with path's name, so suffix-adding writers keep it."""
    return path.with_name(f"{prefix}{os.getpid()}-{secrets.token_hex(3)}-{path.name}")


def clean_stale(directory: str | os.PathLike) -> list[Path]:
    """Remove the temporaries of dead writers in directory (restore an output caught between two renames)."""
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        m = _NAME.match(name)
        if not m or _alive(int(m.group(2))):
            continue
        path = Path(directory) / name
        target = path.with_name(m.group(3))
        try:
            if m.group(1) == "old" and not os.path.lexists(target):
                os.rename(path, target)  # the old output, moved aside by a writer killed before its new one landed
                continue
            _remove(path)
            removed.append(path)
        except OSError:
            pass  # another writer cleaning at the same time, or not ours to remove
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove(path: Path) -> None:
    """Remove a temporary if it was made; a cleanup that fails (a read-only disk) never hides the error it follows."""
    if not os.path.lexists(path):  # never made: unlinking it anyway fails with EROFS on a read-only filesystem
        return
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink()


def free_bytes(directory: str | os.PathLike) -> int | None:
    """Bytes an unprivileged writer may still use on directory's filesystem (None if it cannot be asked)."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def human(n: float | None) -> str:
    if n is None:
        return "unknown"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return ""


def no_space(where: Path, needed: int | None = None) -> Edge0Error:
    """The one line for a full disk: what, how much was needed (when known) and how much is free."""
    free = free_bytes(where if where.is_dir() else where.parent)
    need = f"needed about {human(needed)}, " if needed else ""
    return Edge0Error(f"{where}: no space left on device ({need}free {human(free)})")


def disk_full(exc: BaseException, where: Path) -> bool:
    """Whether a failed write ran out of space; ask while the partial output still holds its space."""
    if isinstance(exc, OSError) and exc.errno is not None:
        return exc.errno in _NO_SPACE
    # MLX's writer and numpy's tofile ("N requested and M written") give no errno: ask the filesystem
    if isinstance(exc, OSError) or (isinstance(exc, RuntimeError) and "Unable to write" in str(exc)):
        free = free_bytes(where if where.is_dir() else where.parent)
        return free is not None and free < (1 << 22)
    return False


def write_error(where: Path, exc: BaseException, needed: int | None = None, full: bool = False) -> Edge0Error | None:
    """An Edge0Error for a failed write (disk full, read-only, no permission), or None for other failures."""
    if full or disk_full(exc, where):
        return no_space(where, needed)
    if isinstance(exc, OSError) and exc.errno in _UNWRITABLE:
        return Edge0Error(f"{where}: cannot be written ({exc.strerror})")
    if isinstance(exc, RuntimeError) and "Unable to write" in str(exc):
        return Edge0Error(f"{where}: cannot be written ({exc})")
    return None


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, *, fsync: bool = True, needed: int | None = None):
    """Yield a temporary path beside `path`; on success it becomes `path`, on any failure it is removed.

    A failed write (disk full, read-only filesystem) is raised as one Edge0Error naming `path`.
    """
    path = Path(path)
    clean_stale(path.parent)
    tmp = temp_for(path)
    with signals_raise():  # SIGTERM/SIGHUP raise, so the temporary is removed below as on Ctrl-C
        try:
            yield tmp
            if fsync:
                _fsync(tmp)
            os.replace(tmp, path)
        except BaseException as e:
            full = disk_full(e, path)
            with _signals_ignored():
                _remove(tmp)
            err = write_error(path, e, needed, full)
            if err is not None:
                raise err from None
            raise
    if fsync:
        _fsync(path.parent)


def write_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Write a file so that readers see either the old or the whole new content."""
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(data)


@contextlib.contextmanager
def atomic_dir(out: str | os.PathLike, *, replace: bool = False, needed: int | None = None):
    """Yield an empty temporary directory beside `out`; on success it becomes `out` (replacing an old `out`
    only when replace is set), on failure or SIGINT/SIGTERM/SIGHUP it is removed and `out` is untouched.
    """
    out = Path(out)
    tmp = temp_for(out)
    with signals_raise():  # before the temporary exists: a signal at any later moment finds it to remove
        try:
            _make_temp_dir(out, tmp, needed)
            yield tmp
            _fsync_tree(tmp)
            with signals_deferred():  # the swap is never cut in half
                _swap_in(tmp, out, replace)
        except BaseException as e:
            full = disk_full(e, out)
            with _signals_ignored():
                _remove(tmp)
            err = write_error(out, e, needed, full)
            if err is not None:
                raise err from None
            raise


def _make_temp_dir(out: Path, tmp: Path, needed: int | None) -> None:
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        clean_stale(out.parent)
        tmp.mkdir()
    except OSError as e:
        blocked = next((p for p in out.parents if p.exists() and not p.is_dir()), None)
        why = f"{blocked} is not a directory" if blocked else e.strerror
        raise write_error(out, e, needed) or Edge0Error(f"{out}: cannot be written ({why})") from None


def _swap_in(tmp: Path, out: Path, replace: bool) -> None:
    """Move the finished tmp to out; an existing out is removed only once the new one is in place."""
    if not os.path.lexists(out) or (out.is_dir() and not out.is_symlink() and not any(out.iterdir())):
        if out.is_dir() and not out.is_symlink():
            out.rmdir()
        os.rename(tmp, out)
    elif not replace:
        raise Edge0Error(f"{out}: appeared while it was being written; left as it is")
    elif _exchange(tmp, out):
        _remove(tmp)  # tmp now holds the old output
    else:
        old = temp_for(out, OLD_PREFIX)
        os.rename(out, old)
        os.rename(tmp, out)
        _remove(old)
    _fsync(out.parent)


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux renameat2); False where the system or filesystem cannot."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for directory, _, files in os.walk(root):
        for name in files:
            _fsync(Path(directory) / name)
        _fsync(Path(directory))


def _raise_exit(signum, frame):
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def signals_raise():
    """Make SIGTERM/SIGHUP raise SystemExit (so cleanup runs) while they have their default action."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    mine = [s for s in _SIGNALS if signal.getsignal(s) == signal.SIG_DFL]  # never take over a server's handler
    for s in mine:
        signal.signal(s, _raise_exit)
    try:
        yield
    finally:
        for s in mine:
            signal.signal(s, signal.SIG_DFL)


@contextlib.contextmanager
def signals_deferred():
    """Hold SIGINT/SIGTERM/SIGHUP back for a few system calls; they are delivered right after."""
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, *_SIGNALS})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


@contextlib.contextmanager
def _signals_ignored():
    """A second signal must not cut the cleanup of the first short."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.getsignal(s) for s in (*_SIGNALS, signal.SIGINT)}
    for s in old:
        signal.signal(s, signal.SIG_IGN)
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
