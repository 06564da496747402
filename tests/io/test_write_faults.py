"""Every writing command on a read-only or a full filesystem (real ones: a read-only bind mount, a 1 MB tmpfs)
says one line naming its output, with no traceback and no temporary left; a signal mid-write removes the
temporary; a writer's data reaches the disk (fsync) before its rename, and the rename before the command ends."""

import os
import signal
import subprocess
import sys

import pytest

from edge0.cli import main
from edge0.export import gguf as gguf_module
from edge0.io.atomic import atomic_dir, write_atomic
from edge0.io.manifest import read_manifest
from edge0.model import convert as convert_module
from edge0.bench import workload as workload_module
from edge0.bench.workload import hidden_of
from tests.io.test_writers import leftovers, tiny_fs  # noqa: F401 (tiny_fs: a fixture)


@pytest.fixture
def read_only(tmp_path):
    """A directory on a read-only bind mount: root ignores file modes, so chmod cannot make one (skipped where
    mounting is refused)."""
    backing, where = tmp_path / "backing", tmp_path / "ro"
    backing.mkdir()
    where.mkdir()
    proc = subprocess.run(["mount", "--bind", str(backing), str(where)], capture_output=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot bind-mount here: {proc.stderr.decode().strip()}")
    try:
        proc = subprocess.run(["mount", "-o", "remount,bind,ro", str(where)], capture_output=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot remount read-only here: {proc.stderr.decode().strip()}")
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=True)


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("trace") / "t.json"
    assert main(["run", "--prompt", "def f(x):", "--max-tokens", "6", "--ignore-eos", "--json", "--trace",
                 str(path)]) == 0
    return path


def command(name, where, models, trace):
    """(argv, the output it names) of a writing command whose output goes in `where`."""
    store = models("qwen3_moe")
    width = 2 * hidden_of(read_manifest(store))
    return {
        "export-gguf": (["export-gguf", "--quiet", store, where / "m.gguf"], where / "m.gguf"),
        "convert": (["convert", "--quiet", models("qwen3_moe", "mlx", "src"), where / "store"], where / "store"),
        "make-model": (["make-model", "--arch", "qwen3_moe", where / "m"], where / "m"),
        "make-workload": (["make-workload", "--quiet", "--base", store, "--expert-width", width, "--heads-steps", 1,
                           where / "wl"], where / "wl"),
        "train base": (["train", "base", "--preset", "tiny", "--steps", 1, "--no-export", "--out", where / "run"],
                       where / "run"),
        "trace --plot": (["trace", "summarize", trace, "--plot", where / "p.png"], where / "p.png"),
    }[name]


def cli(capsys, argv):
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    return code, [line for line in err.replace("\r", "\n").splitlines() if line.startswith("edge0: error")], err


COMMANDS = ("export-gguf", "convert", "make-model", "make-workload", "train base", "trace --plot")


@pytest.mark.parametrize("name", COMMANDS)
def test_a_read_only_filesystem_is_one_line(name, models, trace_file, read_only, capsys):
    argv, out = command(name, read_only, models, trace_file)
    code, errors, err = cli(capsys, argv)
    assert code == 2 and errors == [f"edge0: error: {out}: cannot be written (Read-only file system)"], err
    assert "Traceback" not in err and os.listdir(read_only) == []


@pytest.mark.parametrize("name", COMMANDS)
def test_a_full_filesystem_is_one_line(name, models, trace_file, tiny_fs, capsys, monkeypatch):  # noqa: F811
    for module in (gguf_module, convert_module, workload_module):  # as if the estimates had fitted: the write fills it
        monkeypatch.setattr(module, "free_bytes", lambda p: None)
    # what each leaves free: the plot (about 30 KB) and train base's corpus (numpy's writer) do not fit
    filler = {"trace --plot": 1_040_000, "train base": 1_000_000}.get(name)
    if filler:
        (tiny_fs / "filler").write_bytes(bytes(filler))
    argv, out = command(name, tiny_fs, models, trace_file)
    code, errors, err = cli(capsys, argv)
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, err
    named = errors[0].removeprefix("edge0: error: ").split(": no space left on device")[0]
    assert named == str(out) or named.startswith(f"{out}/"), errors  # the output or a file of it
    assert "(free " in errors[0] or ", free " in errors[0]
    assert sorted(os.listdir(tiny_fs)) == (["filler"] if filler else []) + (
        ["run"] if name == "train base" else [])  # a run directory keeps what it wrote before (--resume)


WRITER = """
import sys, time
from edge0.export import gguf
write = gguf._write_tensors
def held(writer, jobs, total, progress):  # the first tensor written, then held mid-file
    write(writer, jobs[:1], total, progress)
    writer.fout[0].flush()
    print("writing", flush=True)
    time.sleep(60)
gguf._write_tensors = held
from edge0.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 128 + signal.SIGTERM), (signal.SIGHUP, 128 + signal.SIGHUP),
                                      (signal.SIGINT, 130)])
def test_a_signal_during_export_gguf_removes_its_temporary(models, tmp_path, sig, code):
    out = tmp_path / "m.gguf"
    # the signal as a terminal delivers it (a background job may inherit SIGINT ignored, one under nohup SIGHUP)
    proc = subprocess.Popen([sys.executable, "-c", WRITER, "export-gguf", "--quiet", str(models("qwen3_moe")),
                             str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(sig, signal.SIG_DFL))
    try:
        assert proc.stdout.readline() == b"writing\n"
        (tmp,) = leftovers(tmp_path)
        assert (tmp_path / tmp).stat().st_size > 0  # a real half-written file
        proc.send_signal(sig)
        assert proc.wait(timeout=30) == code
    finally:
        proc.kill()
    assert os.listdir(tmp_path) == [] and b"Traceback" not in proc.stderr.read()


def spied(monkeypatch, atomic):
    """Record fsync (of which path), rename/replace and the directory swap, still calling the real ones."""
    calls = []
    real_fsync, real_replace, real_rename, real_exchange = os.fsync, os.replace, os.rename, atomic._exchange

    def fsync(fd):
        calls.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def rename(real):
        def moved(a, b, *args, **kw):
            calls.append(("rename", os.path.realpath(a), os.path.realpath(os.path.dirname(b)), os.path.basename(b)))
            return real(a, b, *args, **kw)
        return moved

    def exchange(a, b):
        calls.append(("rename", os.path.realpath(a), os.path.realpath(os.path.dirname(b)), os.path.basename(b)))
        return real_exchange(a, b)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", rename(real_replace))
    monkeypatch.setattr(os, "rename", rename(real_rename))
    monkeypatch.setattr(atomic, "_exchange", exchange)
    return calls


def check_durable(calls, target, files):
    """Durability as POSIX gives it: each file's data and its directory are fsynced before the rename that
    publishes them, and the parent directory after it (else a crash can publish an empty or missing file)."""
    (i,) = [n for n, c in enumerate(calls) if c[0] == "rename" and c[2:] == (str(target.parent), target.name)]
    tmp = calls[i][1]
    synced_before = {c[1] for c in calls[:i] if c[0] == "fsync"}
    assert {os.path.join(tmp, f) if f else tmp for f in files} <= synced_before, calls
    assert ("fsync", str(target.parent)) in calls[i + 1:], calls


def test_writers_fsync_their_data_before_the_rename_and_the_directory_after(tmp_path, monkeypatch):
    from edge0.io import atomic

    root = tmp_path.resolve()
    calls = spied(monkeypatch, atomic)
    write_atomic(root / "f.json", b"new")
    check_durable(calls, root / "f.json", [""])
    for replace in (False, True):  # a new directory, then one swapped in over the old
        calls.clear()
        with atomic_dir(root / "d", replace=replace) as tmp:
            (tmp / "sub").mkdir()
            (tmp / "sub" / "a.bin").write_bytes(b"a" * 10)
            (tmp / "b.bin").write_bytes(b"b")
        check_durable(calls, root / "d", ["", "sub", "sub/a.bin", "b.bin"])
    assert (root / "f.json").read_bytes() == b"new" and (root / "d" / "sub" / "a.bin").read_bytes() == b"a" * 10
    assert leftovers(root) == []
