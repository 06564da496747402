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


@pytest.fixture(scope="session")
def tied_store(models, tmp_path_factory) -> Path:
    """The tiny qwen3_moe with its output head tied to its embedding (no lm_head): the last rank holds the embedding
    too."""
    import json

    from edge0.model.convert import convert

    src = tmp_path_factory.mktemp("tied") / "src"
    shutil.copytree(models("qwen3_moe", what="src"), src)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    weights = mx.load(str(src / "model.safetensors"))
    mx.save_safetensors(str(src / "model.safetensors"), {k: v for k, v in weights.items() if not k.startswith("lm_head.")})
    index = json.loads((src / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if not k.startswith("lm_head.")}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    return Path(convert(src, src.parent / "store", progress=False))
