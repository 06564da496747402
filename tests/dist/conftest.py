"""The distributed tests' store."""

import shutil
from pathlib import Path

import mlx.core as mx
import pytest


@pytest.fixture(scope="session")
def dist_stores(models, tmp_path_factory):
    """arch -> its tiny store (4 layers: 0-1 and 2-3 on two ranks) with heads whose correction is not zero (so
    predicted routing differs from the router's), the head of layer 2 owned by layer 1: it crosses the ranks."""
    from edge0.io.manifest import read_manifest
    from edge0.model.arch import read_config
    from edge0.model.heads import HeadSet

    made = {}

    def get(arch: str) -> Path:
        if arch not in made:
            root = tmp_path_factory.mktemp("dist") / arch
            shutil.copytree(models(arch), root)
            m = read_manifest(root)
            heads = HeadSet.create(m, read_config(root), top_k=m.top_k, hidden=16)
            mx.random.seed(1)
            for head in heads.heads.values():
                head.delta.weight = mx.random.normal(head.delta.weight.shape) * 0.5
            heads.save(root / f"heads-k{m.top_k}.safetensors")
            assert heads.owners[2] == 1
            made[arch] = root
        return made[arch]

    return get


@pytest.fixture(scope="session")
def dist_store(dist_stores) -> Path:
    return dist_stores("qwen3_moe")
