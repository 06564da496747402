"""Which BLAS training runs on, said where a user sees it: a one-line notice on the reference BLAS (about 5x slower
float matmuls than OpenBLAS on CPU), and the BLAS named in every training report."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from edge0.train import loop
from edge0.train.loop import OPENBLAS, World, blas_notice

linux = pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/self/maps (Linux)")


def blas_of_a_process(env: dict) -> str:
    code = "from edge0.compute.machine import blas; print(blas())"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                           check=True).stdout.strip()


@linux
def test_without_a_preload_it_is_the_reference_blas():
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    assert blas_of_a_process(env) == "reference BLAS (MLX's Linux CPU wheel)"


@linux
@pytest.mark.skipif(not Path(OPENBLAS).exists(), reason=f"{OPENBLAS} is not installed")
def test_a_preloaded_openblas_is_named_with_its_threads():
    found = blas_of_a_process({**os.environ, "LD_PRELOAD": OPENBLAS, "OPENBLAS_NUM_THREADS": "1"})
    assert found.startswith("OpenBLAS (/") and "openblas" in found and found.endswith("OPENBLAS_NUM_THREADS=1)")


@pytest.mark.parametrize("found, world, enabled, said", [
    ("reference BLAS (MLX's Linux CPU wheel)", World(0, 1), True, True),
    ("reference BLAS (MLX's Linux CPU wheel)", World(1, 2), True, False),  # rank 1 writes nothing
    ("reference BLAS (MLX's Linux CPU wheel)", World(0, 1), False, False),  # progress off (library calls, tests)
    ("OpenBLAS (/usr/lib/libopenblas.so.0, OPENBLAS_NUM_THREADS=1)", World(0, 1), True, False),
    ("MLX's own BLAS", World(0, 1), True, False),
])
def test_the_notice_is_one_line_on_the_reference_blas(monkeypatch, capsys, found, world, enabled, said):
    monkeypatch.setattr(loop, "blas", lambda: found)
    blas_notice(world, enabled)
    err = capsys.readouterr().err
    if said:
        assert err.count("\n") == 1 and "apt-get install libopenblas0-pthread" in err
        assert f"LD_PRELOAD={OPENBLAS}" in err
    else:
        assert err == ""
