"""Shared fixtures: tiny checkpoints of each architecture in both source formats, and their stores."""

import os
from pathlib import Path

import pytest

# mlx-lm is the oracle of most tests: compute with MLX's own kernels (subprocesses inherit this);
# the kernel tests select Edge0's explicitly.
os.environ.setdefault("EDGE0_KERNEL", "mlx")
# the servers the tests start listen on loopback, where no API key is needed; one in the environment is not theirs
os.environ.pop("EDGE0_API_KEY", None)

from edge0.model.convert import convert
from edge0.model.make import make_model

ARCHS = ("qwen3_moe", "qwen3_5_moe", "bailing_moe")


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    """Lazily made {(arch, fmt): checkpoint dir} and {(arch, fmt): store dir}, shared by the session."""
    root = tmp_path_factory.mktemp("models")
    made: dict = {}

    def get(arch: str, fmt: str = "mlx", what: str = "store") -> Path:
        key = (arch, fmt)
        if key not in made:
            src = make_model(arch, "tiny", root / f"{arch}-{fmt}", fmt=fmt, seed=0, progress=False)
            store = convert(src, root / f"{arch}-{fmt}-store", progress=False)
            made[key] = (Path(src), Path(store))
        return made[key][0 if what == "src" else 1]

    return get


@pytest.fixture(autouse=True)
def _kernel_choice():
    """Whatever a test selects, the next one starts from the pinned kernel."""
    yield
    from tests.helpers import undo_kernels

    undo_kernels()
