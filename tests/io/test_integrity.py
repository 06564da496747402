"""Every file of a store is covered: a changed byte anywhere is reported by `edge0 verify`, the manifest is
checked against config.json, `--verify` checks the resident files at load, and format 1 stores still load."""

import json
import shutil
import zlib

import pytest

from edge0.cli import main
from edge0.errors import Edge0Error
from edge0.io.manifest import read_manifest, record_files, write_manifest
from edge0.io.verify import verify_store
from edge0.model.arch import read_config
from edge0.model.consistency import config_problems, moe_layers
from edge0.model.heads import HeadSet
from edge0.model.load import load_store

from tests.conftest import ARCHS


@pytest.fixture
def store(models, tmp_path):
    """A copy of the tiny qwen3_moe store with untrained heads recorded in its manifest, as train heads does."""
    dst = tmp_path / "store"
    shutil.copytree(models("qwen3_moe"), dst)
    m = read_manifest(dst)
    HeadSet.create(m, read_config(dst), top_k=m.top_k, hidden=16).save(dst / "heads-k4.safetensors")
    record_files(dst, ["heads-k4.safetensors"])
    return dst


def cli(capsys, *argv):
    code = main([str(a) for a in argv])
    return code, capsys.readouterr().err


def flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


def test_sound_stores_verify_clean(models, capsys):
    for arch in ARCHS:
        store = models(arch)
        manifest, config = read_manifest(store), read_config(store)
        assert moe_layers(config) == [e.layer for e in manifest.layers]  # the rule agrees with mlx-lm's model
        assert config_problems(manifest, config) == []
        report = verify_store(store, config_check=config_problems)
        assert report.problems == [] and report.warnings == [], arch
        assert report.files == len(manifest.layers) + len(manifest.files)
    code, err = cli(capsys, "verify", models("qwen3_moe"))
    assert code == 0 and "9 files (4 expert layer files, 64 bundles) verified" in err
    code, err = cli(capsys, "verify")  # no STORE: the built-in model's, as run and eval default to
    assert code == 0 and "demo/store: " in err and "(6 expert layer files, 192 bundles) verified" in err


def layer_offset(store, what):
    m = read_manifest(store)
    entry = m.layers[1]
    return {"header": entry.data_offset - 100,  # inside the header's space padding: no parser would notice
            "bundle": entry.data_offset + 3 * m.bundle_stride + 17,
            "pad": entry.data_offset + 3 * m.bundle_stride + m.bundle_bytes + 5}[what]


@pytest.mark.parametrize("name,where,message", [
    ("experts/layer_001.safetensors", "bundle", "checksum mismatch in the bundle of expert 3"),
    ("experts/layer_001.safetensors", "header", "checksum mismatch in the safetensors header"),
    ("experts/layer_001.safetensors", "pad", "padding after the bundle of expert 3 is not zero"),
    ("resident.safetensors", 0.5, "checksum mismatch"),
    ("config.json", '"hidden_size"', "checksum mismatch"),
    ("tokenizer.json", 0.5, "checksum mismatch"),
    ("tokenizer_config.json", 0.5, "checksum mismatch"),
    ("special_tokens_map.json", 0.5, "checksum mismatch"),
    ("heads-k4.safetensors", 0.9, "checksum mismatch"),
    ("edge0.json", '"top_k": 4', "edge0.json: checksum mismatch (file damaged or edited)"),
])
def test_a_changed_byte_in_any_file_is_reported(store, capsys, name, where, message):
    path = store / name
    if isinstance(where, float):
        offset = int(path.stat().st_size * where)
    elif where.startswith('"'):
        offset = path.read_bytes().index(where.encode()) + len(where) - 1  # the value's last byte
    else:
        offset = layer_offset(store, where)
    flip(path, offset)
    code, err = cli(capsys, "verify", store)
    assert code == 1 and f"edge0: error: {path}: " in err and message in err and "Traceback" not in err, err


def test_a_malformed_manifest_is_one_line(store, capsys):
    flip(store / "edge0.json", 0)  # "{" -> "z"
    code, err = cli(capsys, "verify", store)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1
    assert lines[0].startswith(f"edge0: error: {store / 'edge0.json'}: not valid JSON")


@pytest.mark.parametrize("name", ["resident.safetensors", "config.json", "tokenizer.json"])
def test_missing_files_are_each_named(store, capsys, name):
    (store / name).unlink()
    code, err = cli(capsys, "verify", store)
    assert code == 1 and f"edge0: error: {store / name}: missing" in err
    assert err.count(f"{store / name}:") == 1  # named once, though the manifest lists it too


def rewrite(store, edit):
    """A manifest written wrong (its own checksum fresh): what verify must catch against config.json."""
    m = read_manifest(store)
    edit(m)
    write_manifest(store, m)


@pytest.mark.parametrize("edit,message", [
    (lambda m: setattr(m, "layers", m.layers[:2]),
     "no expert file for MoE layers [2, 3] of config.json (2 of 4 listed)"),
    (lambda m: m.layers.append(type(m.layers[0])(**{**vars(m.layers[0]), "layer": 7})),
     "layers [7] are not MoE layers of config.json"),
    (lambda m: setattr(m, "arch", "mixtral"), "architecture 'mixtral' is not one Edge0 serves; supported: qwen3_moe"),
    (lambda m: setattr(m, "arch", "bailing_moe"),
     "arch 'bailing_moe' disagrees with config.json model_type 'qwen3_moe'"),
    (lambda m: setattr(m, "top_k", 3), "top_k 3 disagrees with config.json num_experts_per_tok 4"),
    (lambda m: m.quantization.update(bits=8), "quantization bits 8 / group_size 64 do not match the gate_proj pieces"),
])
def test_manifest_is_checked_against_config(store, capsys, edit, message):
    rewrite(store, edit)
    code, err = cli(capsys, "verify", store)
    assert code == 1 and f"edge0: error: edge0.json: {message}" in err, err


@pytest.mark.parametrize("top_k", [0, 17, 99])
def test_top_k_beyond_the_experts_is_refused_everywhere(store, capsys, top_k):
    raw = json.loads((store / "edge0.json").read_text())
    raw["top_k"] = top_k
    (store / "edge0.json").write_text(json.dumps(raw))
    want = f"top_k {top_k} must be between 1 and num_experts 16"
    with pytest.raises(Edge0Error, match=want):
        read_manifest(store)
    for argv in (["verify", store], ["run", "--model", store, "--max-tokens", "1"]):
        code, err = cli(capsys, *argv)
        assert code == 2 and want in err and "Traceback" not in err, argv


@pytest.mark.parametrize("name", ["resident.safetensors", "config.json", "tokenizer.json"])
def test_every_load_checks_resident_files(store, name):
    path = store / name
    flip(path, path.read_bytes().index(b'"num_experts"') + 3 if name == "config.json" else path.stat().st_size // 2)
    for verify in (True, False):  # the small files are checked by every load, not only with --verify
        with pytest.raises(Edge0Error, match=f"^{path}: checksum mismatch"):
            load_store(store, verify=verify)


def test_run_verify_names_a_damaged_resident_file(store, capsys):
    flip(store / "resident.safetensors", 200_000)
    code, err = cli(capsys, "run", "--model", store, "--max-tokens", "1", "--verify")
    assert code == 2 and f"edge0: error: {store / 'resident.safetensors'}: checksum mismatch" in err


def as_format_1(store):
    raw = json.loads((store / "edge0.json").read_text())
    for key in ("files", "manifest_crc32"):
        raw.pop(key)
    for entry in raw["layers"]:
        entry.pop("header_crc32")
    raw["format_version"] = 1
    (store / "edge0.json").write_text(json.dumps(raw, indent=1))


def test_a_format_1_store_loads_and_verify_says_what_is_unchecked(store, capsys):
    as_format_1(store)
    code, err = cli(capsys, "verify", store)
    assert code == 0, err
    old = "no checksum recorded (store written by an older edge0; re-convert to cover it)"
    for name in ("resident.safetensors", "config.json", "tokenizer.json"):
        assert f"edge0: warning: {store / name}: {old}" in err
    assert "heads-k4.safetensors: no checksum recorded (heads and adapters are recorded when" in err
    assert "no checksum recorded for itself or the layer file headers" in err
    code, err = cli(capsys, "run", "--model", store, "--max-tokens", "1", "--verify", "--routing", "native")
    assert code == 0 and f"{store / 'resident.safetensors'}: {old}; loaded unchecked" in err
    flip(store / "experts" / "layer_001.safetensors", layer_offset(store, "bundle"))
    code, err = cli(capsys, "verify", store)  # bundles were covered in format 1 already
    assert code == 1 and "layer_001.safetensors: checksum mismatch in the bundle of expert 3" in err


def test_an_unrecorded_file_is_a_warning(store, capsys):
    (store / "notes.txt").write_text("mine")
    shutil.copy(store / "heads-k4.safetensors", store / "heads-k2.safetensors")
    code, err = cli(capsys, "verify", store)
    assert code == 0
    added = "no checksum recorded (added to the store after it was written)"
    assert f"edge0: warning: {store / 'notes.txt'}: {added}" in err
    assert f"{store / 'heads-k2.safetensors'}: no checksum recorded (heads and adapters" in err


def test_train_heads_records_its_output_in_the_store(store, tmp_path):
    from edge0.train.head_phase import train_heads

    text = tmp_path / "t.py"
    text.write_text("def f(x):\n    return [x * i for i in range(10)]\n" * 40)
    out = store / "heads-k4.safetensors"
    out.unlink()
    train_heads(store, out, data=text, heldout=text, steps=1, hidden=16, eval_windows=1, seq_len=32,
                progress=False)
    m = read_manifest(store)
    for name in ("heads-k4.safetensors", "heads-k4.safetensors.json"):
        data = (store / name).read_bytes()
        assert m.files[name] == {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}
    assert verify_store(store, config_check=config_problems).warnings == []  # heads-k4.ckpt/ is training state
