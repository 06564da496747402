"""edge0 export-gguf: the GGUF holds the store's very weights (Q4_1 read back with gguf's reader and
dequantized in numpy equals MLX's dequantization of the store, bit for bit), names and metadata are
llama.cpp's, and what cannot be exported is one line."""

import shutil
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf.quants import dequantize  # noqa: E402

from edge0.cli import main  # noqa: E402
from edge0.export.gguf import export_gguf  # noqa: E402
from edge0.io.manifest import read_manifest  # noqa: E402

PROJS = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}
RESIDENT = {"model.embed_tokens": "token_embd", "lm_head": "output", "model.norm": "output_norm",
            "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate": "ffn_gate_inp",
            "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
            "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}


def gguf_name(module: str) -> str:
    """llama.cpp's name of an mlx-lm module path of qwen3_moe (written out here, not taken from the exporter)."""
    if module in RESIDENT:
        return RESIDENT[module]
    _, _, i, rest = module.split(".", 3)
    return f"blk.{i}.{RESIDENT[rest]}"


def store_weights(store) -> dict:
    """{gguf name: float32 weights} of the store, dequantized by MLX with float32 scales (as served)."""
    config = read_manifest(store)
    res = mx.load(str(store / "resident.safetensors"))
    out = {}
    for name, w in res.items():
        module, _, leaf = name.rpartition(".")
        if leaf in ("scales", "biases"):
            continue
        if f"{module}.scales" in res:
            bits = 8 if module.endswith("mlp.gate") else 4
            w = mx.dequantize(w, res[f"{module}.scales"].astype(mx.float32), res[f"{module}.biases"].astype(mx.float32),
                              64, bits)
        out[f"{gguf_name(module)}.weight"] = np.array(w.astype(mx.float32))
    for entry in config.layers:
        layer = mx.load(str(store / entry.file))
        for proj, name in PROJS.items():
            parts = [mx.dequantize(layer[f"experts.{e}.{proj}.weight"],
                                   layer[f"experts.{e}.{proj}.scales"].astype(mx.float32),
                                   layer[f"experts.{e}.{proj}.biases"].astype(mx.float32), 64, 4)
                     for e in range(config.num_experts)]
            out[f"blk.{entry.layer}.{name}.weight"] = np.array(mx.stack(parts))
    return out


def read_back(path) -> tuple[dict, dict, gguf.GGUFReader]:
    """{name: float32 array (numpy shape)} and {name: type} of a GGUF file, dequantized by gguf in numpy."""
    r = gguf.GGUFReader(path)
    arrays = {t.name: np.asarray(dequantize(t.data, t.tensor_type)).reshape(tuple(reversed(t.shape.tolist())))
              for t in r.tensors}
    return arrays, {t.name: t.tensor_type for t in r.tensors}, r


def field(r: gguf.GGUFReader, key: str):
    return r.fields[key].contents()


def test_q4_1_export_holds_the_store_weights_bit_for_bit(models, tmp_path):
    store = models("qwen3_moe")
    out = tmp_path / "m.gguf"
    report = export_gguf(store, out, progress=False)
    got, types, r = read_back(out)
    want = store_weights(store)
    assert set(got) == set(want) and report.tensors == len(want) == 3 + 4 * 12
    for name, w in want.items():
        assert got[name].shape == w.shape, name
        assert np.array_equal(got[name].view(np.uint32), w.view(np.uint32)), name  # bit for bit
    assert types["blk.0.ffn_gate_exps.weight"] == Q.Q4_1 and types["token_embd.weight"] == Q.Q4_1
    assert types["blk.0.ffn_gate_inp.weight"] == Q.F32 and types["blk.0.attn_norm.weight"] == Q.F32
    assert report.fp16_inexact == 0 and report.fp16_values > 0
    config = read_manifest(store)
    assert field(r, "general.architecture") == "qwen3moe"
    assert field(r, "qwen3moe.expert_count") == config.num_experts == 16
    assert field(r, "qwen3moe.expert_used_count") == config.top_k == 4
    assert field(r, "qwen3moe.expert_feed_forward_length") == 64 and field(r, "qwen3moe.block_count") == 4
    assert len(field(r, "tokenizer.ggml.tokens")) == 1024 and field(r, "tokenizer.ggml.pre") == "gpt-2"
    assert field(r, "general.file_type") == gguf.LlamaFileType.MOSTLY_Q4_1


def test_q4_0_requantizes_only_the_experts(models, tmp_path):
    store = models("qwen3_moe")
    export_gguf(store, tmp_path / "q4_1.gguf", progress=False)
    export_gguf(store, tmp_path / "q4_0.gguf", qtype="q4_0", progress=False)
    exact, _, _ = read_back(tmp_path / "q4_1.gguf")
    got, types, r = read_back(tmp_path / "q4_0.gguf")
    assert field(r, "general.file_type") == gguf.LlamaFileType.MOSTLY_Q4_0
    for name, w in exact.items():
        if "_exps" in name:
            assert types[name] == Q.Q4_0
            blocks = w.reshape(-1, 32)
            step = np.abs(blocks).max(axis=1, keepdims=True) / 8  # Q4_0's step: the block's largest |w| / 8
            err = np.abs(got[name].reshape(-1, 32) - blocks)
            # rounded to the nearest level: half a step, or one where the block's far end is clipped at -8 or 7
            assert (err <= step * 1.001).all() and 0 < err.mean() <= (step / 4).mean(), name
        else:
            assert np.array_equal(got[name], w), name


def test_scales_fp16_cannot_hold_are_counted(models, tmp_path):
    """A bf16 scale below fp16's normal range (1e-7) is written rounded, and counted."""
    store = tmp_path / "store"
    shutil.copytree(models("qwen3_moe"), store)
    m = read_manifest(store)
    entry, scales = m.layers[1], next(p for p in m.pieces if p.name == "up_proj.scales")
    with open(store / entry.file, "r+b") as f:
        f.seek(entry.data_offset + 3 * m.bundle_stride + scales.offset + 2)  # expert 3, second scale
        f.write(np.array([1e-7], np.float32).view(np.uint16)[1:].tobytes())  # its bf16: the high half
    report = export_gguf(store, tmp_path / "m.gguf", progress=False)
    assert report.fp16_inexact == 1


def test_export_gguf_refuses_what_llama_cpp_cannot_take(models, tmp_path, capsys):
    out = tmp_path / "m.gguf"
    assert main(["export-gguf", str(models("qwen3_5_moe")), str(out)]) == 2
    err = capsys.readouterr().err
    assert err.strip() == (f"edge0: error: {models('qwen3_5_moe')}: a qwen3_5_moe store; export-gguf maps only "
                           "qwen3_moe to llama.cpp's architectures")
    assert not out.exists()
    out.write_bytes(b"mine")
    for force in ([], ["--force"]):  # nothing a user wrote is overwritten, even with --force
        assert main(["export-gguf", str(models("qwen3_moe")), str(out), "--quiet", *force]) == 2
        assert capsys.readouterr().err.strip() == (f"edge0: error: {out}: exists and is not a GGUF file (no GGUF "
                                                   "magic); only a GGUF file is replaced, with --force: choose another OUT")
        assert out.read_bytes() == b"mine"
    out.unlink()
    assert main(["export-gguf", str(models("qwen3_moe")), str(out), "--quiet"]) == 0
    first = out.read_bytes()
    assert main(["export-gguf", str(models("qwen3_moe")), str(out), "--quiet"]) == 2
    assert f"edge0: error: {out}: exists; pass --force to replace it" in capsys.readouterr().err
    assert main(["export-gguf", str(models("qwen3_moe")), str(out), "--quiet", "--force"]) == 0  # an earlier GGUF
    assert "tensors" in capsys.readouterr().err and out.read_bytes() == first
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".edge0-tmp")]


def test_export_gguf_cli_prints_one_summary_line(models, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "edge0.cli", "export-gguf", str(models("qwen3_moe")),
                           str(tmp_path / "m.gguf"), "--quiet"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.startswith(f"wrote {tmp_path / 'm.gguf'} (51 tensors, ") and len(proc.stderr.splitlines()) == 1
    assert "Q4_1 scales and biases: all" in proc.stderr


def test_export_gguf_checks_the_small_files_as_a_load_does(models, tmp_path, capsys):
    """A flipped byte in the resident weights is refused by name, not exported into llama.cpp's file."""
    store = tmp_path / "store"
    shutil.copytree(models("qwen3_moe"), store)
    res = store / "resident.safetensors"
    data = bytearray(res.read_bytes())
    data[-1] ^= 0x01
    res.write_bytes(bytes(data))
    out = tmp_path / "m.gguf"
    assert main(["export-gguf", str(store), str(out), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert str(res) in err and "edge0 verify" in err and len(err.strip().splitlines()) == 1
    assert not out.exists()
