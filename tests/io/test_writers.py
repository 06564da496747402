"""Crash-safe writers: a full disk, an error or a signal leaves the old output or the whole new one and one
line; what a kill -9 leaves behind is removed by the next writer. Convert's flags that cannot apply are refused."""

import errno
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import mlx.core as mx
import pytest

from edge0.cli import main
from edge0.errors import Edge0Error
from edge0.io import atomic, layerfile
from edge0.io.atomic import atomic_dir, atomic_path, clean_stale, write_atomic
from edge0.io.manifest import read_manifest
from edge0.io.verify import verify_store
from edge0.model import convert as convert_module
from edge0.model.arch import read_config
from edge0.model.convert import convert, needed_bytes
from edge0.model.heads import HeadSet

CONVERT = "import sys; from edge0.cli import main; sys.exit(main(sys.argv[1:]))"


def leftovers(directory):
    return sorted(n for n in os.listdir(directory) if n.startswith(".edge0-"))


def cli(capsys, *argv):
    code = main([str(a) for a in argv])
    return code, capsys.readouterr().err


def sound(store, arch=None):
    """A complete store: every byte verifies (and, when given, it is the store of that architecture)."""
    report = verify_store(store)
    return report.problems == [] and (arch is None or read_manifest(store).arch == arch)


def dead_pid():
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_atomic_path_keeps_the_old_file_when_a_write_fails_part_way(tmp_path):
    path = tmp_path / "f.json"
    write_atomic(path, b"old")
    with pytest.raises(Edge0Error, match=rf"^{path}: no space left on device \(free [\d.]+ [KMGT]?B\)$"):
        with atomic_path(path) as tmp, open(tmp, "wb") as f:
            f.write(b"new, half of it")
            raise OSError(errno.ENOSPC, "No space left on device")
    with pytest.raises(ZeroDivisionError):  # any other failure passes through, cleaned up the same
        with atomic_path(path) as tmp:
            tmp.write_bytes(b"new")
            1 / 0
    assert path.read_bytes() == b"old" and leftovers(tmp_path) == []
    write_atomic(path, b"new")
    assert path.read_bytes() == b"new" and leftovers(tmp_path) == []


@pytest.mark.parametrize("exchange", [True, False])
def test_atomic_dir_replaces_only_when_complete(tmp_path, monkeypatch, exchange):
    if not exchange:  # filesystems without renameat2(RENAME_EXCHANGE): two renames
        monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    with pytest.raises(KeyboardInterrupt):
        with atomic_dir(out, replace=True) as tmp:
            (tmp / "new.txt").write_text("new")
            raise KeyboardInterrupt
    assert os.listdir(out) == ["old.txt"] and leftovers(tmp_path) == []
    with atomic_dir(out, replace=True) as tmp:
        (tmp / "new.txt").write_text("new")
    assert os.listdir(out) == ["new.txt"] and leftovers(tmp_path) == []


def test_stale_temporaries_are_removed_and_an_interrupted_swap_is_undone(tmp_path):
    dead = dead_pid()
    (tmp_path / f".edge0-tmp-{dead}-0a1b2c-store").mkdir()
    (tmp_path / f".edge0-tmp-{dead}-0a1b2c-store" / "resident.safetensors").write_bytes(b"x" * 100)
    (tmp_path / f".edge0-tmp-{dead}-0a1b2c-f.json").write_bytes(b"half")
    (tmp_path / f".edge0-tmp-{os.getpid()}-0a1b2c-busy").mkdir()  # a live writer's: kept
    (tmp_path / f".edge0-old-{dead}-0a1b2c-moved").mkdir()  # killed between its two renames: put back
    (tmp_path / f".edge0-old-{dead}-0a1b2c-moved" / "keep.txt").write_text("old output")
    (tmp_path / "other").mkdir()
    (tmp_path / f".edge0-old-{dead}-0a1b2c-other").mkdir()  # its new output landed: removed
    assert len(clean_stale(tmp_path)) == 3
    assert leftovers(tmp_path) == [f".edge0-tmp-{os.getpid()}-0a1b2c-busy"]
    assert (tmp_path / "moved" / "keep.txt").read_text() == "old output"


def failing_open(after_bytes):
    """open() for the layer writer: its writes fail with ENOSPC once after_bytes were written in all."""
    left = [after_bytes]

    class Full:
        def __init__(self, path, mode):
            self.f = open(path, mode)

        def write(self, data):
            view = memoryview(data).cast("B")
            if len(view) > left[0]:
                self.f.write(view[:left[0]])
                raise OSError(errno.ENOSPC, "No space left on device")
            left[0] -= len(view)
            return self.f.write(data)

        def __getattr__(self, name):
            return getattr(self.f, name)

    return Full


def test_convert_on_a_full_disk_is_one_line_and_leaves_the_old_output(models, capsys, tmp_path, monkeypatch):
    src = models("qwen3_moe", "mlx", "src")
    out = tmp_path / "out"
    monkeypatch.setattr(layerfile, "open", failing_open(100_000), raising=False)
    code, err = cli(capsys, "convert", "--quiet", src, out)
    lines = err.strip().splitlines()
    need = needed_bytes(src, read_config(src), 4, 64) / 1e6
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith(f"edge0: error: {out}: no space left on device (needed about {need:.1f} MB, free ")
    assert not out.exists() and leftovers(tmp_path) == []
    monkeypatch.undo()
    convert(models("bailing_moe", "mlx", "src"), out, progress=False)
    monkeypatch.setattr(layerfile, "open", failing_open(300_000), raising=False)
    code, err = cli(capsys, "convert", "--quiet", "--force", src, out)
    assert code == 2 and "no space left on device" in err
    assert sound(out, "bailing_moe") and leftovers(tmp_path) == []


@pytest.fixture
def tiny_fs(tmp_path):
    """A 1 MB tmpfs (root only; skipped where mounting is refused)."""
    where = tmp_path / "fs"
    where.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where)], capture_output=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.decode().strip()}")
    yield where
    subprocess.run(["umount", "-l", str(where)], check=True)


def test_a_real_full_filesystem(models, capsys, tiny_fs, monkeypatch):
    src = models("qwen3_moe", "mlx", "src")
    out = tiny_fs / "store"
    full = f"{out}: no space left on device (needed about {needed_bytes(src, read_config(src), 4, 64) / 1e6:.1f} MB, "
    code, err = cli(capsys, "convert", "--quiet", src, out)  # refused before anything is written
    assert code == 2 and full + "free 1.0 MB)" in err
    monkeypatch.setattr(convert_module, "free_bytes", lambda p: None)  # as if the estimate had fitted
    code, err = cli(capsys, "convert", "--quiet", src, out)  # the layer files fill the disk (Python's writes)
    assert code == 2 and full + "free 1.0 MB)" in err
    assert os.listdir(tiny_fs) == []
    (tiny_fs / "filler").write_bytes(bytes(900_000))
    code, err = cli(capsys, "convert", "--quiet", src, out)  # resident.safetensors fills it (MLX's writer)
    assert code == 2 and full + "free 147.5 KB)" in err, err  # 1 MiB less the filler's pages
    assert os.listdir(tiny_fs) == ["filler"]
    store = models("qwen3_moe")
    m = read_manifest(store)
    heads = HeadSet.create(m, read_config(store), top_k=m.top_k, hidden=512)
    with pytest.raises(Edge0Error, match=f"^{tiny_fs / 'heads.safetensors'}: no space left on device"):
        heads.save(tiny_fs / "heads.safetensors")
    assert os.listdir(tiny_fs) == ["filler"]


def test_a_failed_heads_save_keeps_the_old_file(models, tmp_path, monkeypatch):
    store = models("qwen3_moe")
    m = read_manifest(store)
    path = tmp_path / "heads-k4.safetensors"
    HeadSet.create(m, read_config(store), top_k=m.top_k, hidden=8).save(path)
    before = path.read_bytes()

    def cut(file, arrays, metadata=None):
        with open(file, "wb") as f:
            f.write(b"partial")
        raise RuntimeError("[write] Unable to write 4096 bytes to file.")

    monkeypatch.setattr(mx, "save_safetensors", cut)
    with pytest.raises(Edge0Error, match=rf"^{path}: cannot be written \(\[write\] Unable to write"):
        HeadSet.create(m, read_config(store), top_k=m.top_k, hidden=16).save(path)
    assert path.read_bytes() == before and leftovers(tmp_path) == []


def test_make_model_on_a_full_disk(tmp_path, monkeypatch):
    from edge0.model import make

    def full(out):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(make, "save_tokenizer", full)
    with pytest.raises(Edge0Error, match=rf"^{tmp_path / 'm'}: no space left on device \(needed about [\d.]+ MB"):
        make.make_model("qwen3_moe", "tiny", tmp_path / "m", progress=False)
    assert os.listdir(tmp_path) == []


def start_convert(src, out, *flags):
    # SIGINT as a terminal delivers it: a background job of a non-interactive shell (how CI may start the suite)
    # inherits it ignored, and Python then never raises KeyboardInterrupt
    return subprocess.Popen([sys.executable, "-c", CONVERT, "convert", "--quiet", *flags, str(src), str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            preexec_fn=lambda: [signal.signal(s, signal.SIG_DFL) for s in (signal.SIGINT, signal.SIGHUP)])


def signal_while_writing(runs):
    """runs: [(process, its OUT's parent, delay, signal)]; each gets its signal `delay` seconds after its
    convert's temporary appears (unless it finished first). Returns the exit codes."""
    deadline, due, sent = time.monotonic() + 120, {}, set()
    while any(run[0].poll() is None for run in runs):
        assert time.monotonic() < deadline
        for i, (proc, parent, delay, sig) in enumerate(runs):
            if i not in due and leftovers(parent):
                due[i] = time.monotonic() + delay
            if i in due and i not in sent and time.monotonic() >= due[i] and proc.poll() is None:
                proc.send_signal(sig)
                sent.add(i)
        time.sleep(0.002)
    return [run[0].wait() for run in runs]


def test_kill_9_during_convert_then_convert_again(models, tmp_path):
    src = models("qwen3_moe", "mlx", "src")
    rng = random.Random(12)
    delays = (0.0, rng.uniform(0, 0.15), rng.uniform(0.1, 0.3))
    dirs = [tmp_path / str(i) for i in range(len(delays))]
    for d in dirs:
        d.mkdir()
    codes = signal_while_writing([(start_convert(src, d / "store"), d, t, signal.SIGKILL)
                                  for d, t in zip(dirs, delays)])
    for d, code, delay in zip(dirs, codes, delays):
        out = d / "store"
        assert code in (0, -signal.SIGKILL) and (not out.exists() or sound(out)), (delay, code)  # none or all
        convert(src, out, force=True, progress=False)  # the next run cleans up after the killed one
        assert sound(out) and leftovers(d) == []


def test_a_killed_reconvert_with_force_leaves_the_old_store(models, tmp_path):
    old, new = models("qwen3_moe", "mlx", "src"), models("bailing_moe", "mlx", "src")
    delays = (0.0, random.Random(13).uniform(0, 0.3))
    dirs = [tmp_path / str(i) for i in range(len(delays))]
    for d in dirs:
        convert(old, d / "store", progress=False)
    codes = signal_while_writing([(start_convert(new, d / "store", "--force"), d, t, signal.SIGKILL)
                                  for d, t in zip(dirs, delays)])
    for d, code, delay in zip(dirs, codes, delays):
        out = d / "store"
        assert code in (0, -signal.SIGKILL) and (sound(out, "qwen3_moe") or sound(out, "bailing_moe")), (delay, code)
        convert(new, out, force=True, progress=False)
        assert sound(out, "bailing_moe") and leftovers(d) == []


def test_sigterm_and_ctrl_c_remove_the_temporary_themselves(models, tmp_path):
    src = models("qwen3_moe", "mlx", "src")
    runs = {signal.SIGTERM: 128 + signal.SIGTERM, signal.SIGINT: 130}
    for sig, want in runs.items():
        for attempt in range(5):  # a loaded machine can let the tiny convert finish before the signal lands (exit 0)
            parent = tmp_path / f"{sig.name}-{attempt}"
            parent.mkdir()
            proc = start_convert(src, parent / "store")
            [code] = signal_while_writing([(proc, parent, 0.0, sig)])
            if code != 0:
                break
            assert sound(parent / "store")  # finished whole: the signal came too late to test anything
        assert code == want and os.listdir(parent) == [] and "Traceback" not in proc.stderr.read().decode()


@pytest.mark.parametrize("fmt,flags,message", [
    ("hf", ["--group-size", "7"], "--group-size 7: mx.quantize takes group sizes 32, 64, 128"),
    ("hf", ["--bits", "7"], "--bits 7: mx.quantize takes 2, 3, 4, 5, 6, 8 bits"),
    ("hf", ["--group-size", "128"], "--group-size 128: the experts' input width 64 (moe_intermediate_size in"),
    ("mlx", ["--bits", "8"], "--bits 8: {src} is already quantized (4-bit, group size 64) and its experts are re-laid "
                             "byte-for-byte, not re-quantized; drop --bits, or convert from the float checkpoint"),
    ("mlx", ["--group-size", "32"], "--group-size 32: {src} is already quantized (4-bit, group size 64)"),
    ("mlx", ["OUT=SRC"], "OUT must differ from SRC"),
    ("mlx", ["OUT=SRC/sub"], "OUT is inside SRC"),
])
def test_convert_refuses_what_cannot_apply(models, capsys, tmp_path, fmt, flags, message):
    src = tmp_path / "src"
    shutil.copytree(models("qwen3_moe", fmt, "src"), src)
    out = {"OUT=SRC": src, "OUT=SRC/sub": src / "sub"}.get(flags[0], tmp_path / "out")
    flags = [f for f in flags if not f.startswith("OUT=")]
    before = sorted(os.listdir(src))
    code, err = cli(capsys, "convert", "--quiet", *flags, src, out)
    assert code == 2 and message.format(src=src) in err and "Traceback" not in err, err
    assert sorted(os.listdir(src)) == before and not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_convert_refuses_an_out_that_holds_src_and_accepts_the_sources_own_settings(models, capsys, tmp_path):
    outer = tmp_path / "outer"
    shutil.copytree(models("qwen3_moe", "mlx", "src"), outer / "src")
    code, err = cli(capsys, "convert", "--force", outer / "src", outer)
    assert code == 2 and f"{outer}: SRC {outer / 'src'} is inside OUT; choose another OUT" in err
    assert sorted(os.listdir(outer)) == ["src"]
    code, err = cli(capsys, "convert", "--quiet", "--bits", "4", "--group-size", "64", outer / "src", tmp_path / "out")
    assert code == 0 and sound(tmp_path / "out")


def test_a_log_line_cut_by_a_kill_does_not_stop_a_resume(tmp_path):
    from edge0.train.base import _truncate_log

    log = tmp_path / "log.jsonl"
    log.write_text('{"step": 1, "loss": 5.0}\n{"step": 2, "loss": 4.0}\n{"step": 3, "loss": 3.0}\n{"step": 4, "lo')
    _truncate_log(log, 2)
    assert log.read_text() == '{"step": 1, "loss": 5.0}\n{"step": 2, "loss": 4.0}\n' and leftovers(tmp_path) == []
