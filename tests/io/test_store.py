"""The converter round trip and the store's checks: bytes, checksums, headers, bad input."""

import json
import os
import shutil

import mlx.core as mx
import pytest
from safetensors import safe_open

from edge0.cli import main
from edge0.io.manifest import read_manifest, record_files, write_manifest
from edge0.io.reader import BundleReader
from edge0.io.verify import verify_store

from tests.conftest import ARCHS


def stacked_source(src, arch, layer):
    """The source checkpoint's experts of one layer as {piece: (E, ...) array}, in mlx-lm's names."""
    weights = {}
    for f in sorted(src.glob("model*.safetensors")):
        weights.update(mx.load(str(f)))
    out = {}
    for key, value in weights.items():
        marker = f"layers.{layer}.mlp."
        if marker not in key:
            continue
        rest = key.split(marker, 1)[1]
        if rest.startswith("switch_mlp."):
            out[rest.removeprefix("switch_mlp.")] = value
        elif rest.startswith("experts.") and rest.split(".")[1].isdigit():  # hf per-expert
            _, e, name = rest.split(".", 2)
            out.setdefault(name, {})[int(e)] = value
        elif rest == "experts.gate_up_proj":  # hf fused (qwen3_5_moe)
            h = value.shape[-2] // 2
            out["gate_proj.weight"], out["up_proj.weight"] = value[..., :h, :], value[..., h:, :]
        elif rest == "experts.down_proj":
            out["down_proj.weight"] = value
    return {k: mx.stack([v[e] for e in sorted(v)]) if isinstance(v, dict) else v for k, v in out.items()}


def store_pieces(store, layer_file, expert):
    with safe_open(str(store / layer_file), "numpy") as f:
        names = [k for k in f.keys() if k.startswith(f"experts.{expert}.") and not k.endswith(".pad")]
        return {k.split(".", 2)[2]: f.get_slice(k) for k in names}, f


@pytest.mark.parametrize("arch", ARCHS)
def test_mlx_source_round_trip_is_byte_identical(models, arch):
    src, store = models(arch, "mlx", "src"), models(arch, "mlx")
    manifest = read_manifest(store)
    assert verify_store(store).problems == []
    for entry in manifest.layers:
        assert entry.data_offset % 4096 == 0 and manifest.bundle_stride % 4096 == 0
        source = stacked_source(src, arch, entry.layer)
        assert set(source) == {p.name for p in manifest.pieces}
        reader = BundleReader(store, manifest)
        for e in range(manifest.num_experts):
            bufs = [bytearray(p.nbytes) for p in manifest.pieces]
            reader.read_into(entry.layer, e, bufs)
            for p, buf in zip(manifest.pieces, bufs):
                assert bytes(memoryview(source[p.name][e])) == bytes(buf), (entry.layer, e, p.name)
        reader.close()
        with safe_open(str(store / entry.file), "numpy") as f:  # a valid safetensors file
            assert sum(1 for k in f.keys() if not k.endswith(".pad")) == manifest.num_experts * len(manifest.pieces)


@pytest.mark.parametrize("arch", ARCHS)
def test_hf_source_round_trip_equals_mx_quantize(models, arch):
    src, store = models(arch, "hf", "src"), models(arch, "hf")
    manifest = read_manifest(store)
    assert verify_store(store).problems == []
    entry = manifest.layers[-1]
    source = stacked_source(src, arch, entry.layer)
    reader = BundleReader(store, manifest)
    for e in (0, manifest.num_experts - 1):
        bufs = [bytearray(p.nbytes) for p in manifest.pieces]
        reader.read_into(entry.layer, e, bufs)
        got = dict(zip([p.name for p in manifest.pieces], bufs))
        for proj in ("gate_proj", "up_proj", "down_proj"):
            w, scales, biases = mx.quantize(source[f"{proj}.weight"][e], 64, 4)
            for kind, arr in (("weight", w), ("scales", scales), ("biases", biases)):
                assert bytes(memoryview(arr)) == bytes(got[f"{proj}.{kind}"]), (e, proj, kind)
    reader.close()


def copy_store(models, tmp_path):
    dst = tmp_path / "store"
    shutil.copytree(models("qwen3_moe", "mlx"), dst)
    return dst


def run_cli(capsys, *argv):
    code = main(list(argv))
    err = capsys.readouterr().err
    return code, err


def test_missing_model_dir(capsys, tmp_path):
    code, err = run_cli(capsys, "run", "--model", str(tmp_path / "nope"))
    assert code == 2 and "no such model directory" in err and "Traceback" not in err


def write_config(path, config):
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    (path / "model.safetensors").write_bytes(b"")
    return path


def test_dense_architecture_refused(capsys, tmp_path):
    src = write_config(tmp_path / "llama", {"model_type": "llama", "hidden_size": 64})
    code, err = run_cli(capsys, "convert", str(src), str(tmp_path / "out"))
    assert code == 2 and "dense model" in err and "qwen3_moe" in err
    assert not (tmp_path / "out").exists()


def test_unsupported_moe_refused(capsys, tmp_path):
    src = write_config(tmp_path / "dbrx", {"model_type": "dbrx", "num_local_experts": 8})  # experts mlx-lm loops over
    code, err = run_cli(capsys, "convert", str(src), str(tmp_path / "out"))
    assert code == 2 and "'dbrx' is not supported" in err
    for arch in ARCHS:
        assert arch in err


def test_truncated_layer_file(models, capsys, tmp_path):
    store = copy_store(models, tmp_path)
    f = store / "experts" / "layer_001.safetensors"
    os.truncate(f, f.stat().st_size - 100)
    code, err = run_cli(capsys, "run", "--model", str(store), "--max-tokens", "2")
    assert code == 2 and "layer_001.safetensors" in err and "truncated" in err


def test_corrupt_header(models, capsys, tmp_path):
    store = copy_store(models, tmp_path)
    f = store / "experts" / "layer_000.safetensors"
    with open(f, "r+b") as fh:
        fh.seek(8)
        fh.write(b"garbage!")
    code, err = run_cli(capsys, "run", "--model", str(store), "--max-tokens", "2")
    assert code == 2 and "layer_000.safetensors" in err and "header" in err


def test_checksum_mismatch_found_by_verify_and_run(models, capsys, tmp_path):
    store = copy_store(models, tmp_path)
    manifest = read_manifest(store)
    entry = manifest.layers[0]
    with open(store / entry.file, "r+b") as fh:  # damage every bundle of the layer: whichever is routed fails
        for e in range(manifest.num_experts):
            fh.seek(entry.data_offset + e * manifest.bundle_stride + 17)
            byte = fh.read(1)
            fh.seek(-1, 1)
            fh.write(bytes([byte[0] ^ 0xFF]))
    code, err = run_cli(capsys, "verify", str(store))
    assert code == 1 and "checksum mismatch" in err and entry.file in err
    code, err = run_cli(capsys, "run", "--model", str(store), "--max-tokens", "2", "--verify")
    assert code == 2 and "checksum mismatch" in err
    code, err = run_cli(capsys, "run", "--model", str(store), "--max-tokens", "2")
    assert code == 0  # without --verify the read path does not checksum


def test_newer_manifest_version(models, capsys, tmp_path):
    store = copy_store(models, tmp_path)
    m = json.loads((store / "edge0.json").read_text())
    m["format_version"] = 99
    (store / "edge0.json").write_text(json.dumps(m))
    code, err = run_cli(capsys, "run", "--model", str(store))
    assert code == 2 and "version 99 is newer" in err


def test_out_not_empty_is_not_overwritten(models, capsys, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("keep me")
    src = models("qwen3_moe", "mlx", "src")
    for force in ([], ["--force"]):  # not a store: never replaced
        code, err = run_cli(capsys, "convert", "--quiet", *force, str(src), str(out))
        assert code == 2 and f"{out}: exists, is not empty and is not an Edge0 store (no edge0.json)" in err
        assert (out / "mine.txt").read_text() == "keep me"
    (out / "mine.txt").unlink()
    assert run_cli(capsys, "convert", "--quiet", str(src), str(out))[0] == 0
    code, err = run_cli(capsys, "convert", "--quiet", str(src), str(out))
    assert code == 2 and f"{out}: exists and is not empty; pass --force to replace it" in err
    code, err = run_cli(capsys, "convert", "--quiet", "--force", str(src), str(out))  # an earlier store: replaced
    assert code == 0 and verify_store(out).problems == []


def test_checkpoint_given_to_run_is_named(models, capsys):
    code, err = run_cli(capsys, "run", "--model", str(models("qwen3_moe", "mlx", "src")))
    assert code == 2 and "not an Edge0 store" in err and "edge0 convert" in err


def test_prompt_longer_than_context(models, capsys):
    store = models("qwen3_moe", "mlx")
    limit = json.loads((store / "config.json").read_text())["max_position_embeddings"]
    code, err = run_cli(capsys, "run", "--model", str(store), "--prompt", "x " * limit, "--max-tokens", "4")
    assert code == 2 and "exceed the model's context" in err


def test_routing_flags_that_cannot_apply(models, capsys):
    store = models("qwen3_moe", "mlx")
    for flags, message in ((["--routing", "predicted"], "no prerouter heads next to this store"),
                           (["--routing", "prefetch", "--predictor", "heads"], "no prerouter heads next to this store"),
                           (["--heads", "h.safetensors"], "h.safetensors: no such head file"),  # they would route
                           (["--routing", "native", "--heads", "h.safetensors"], "--heads: used with --routing predicted"),
                           (["--routing", "predicted", "--heads", "missing.safetensors"], "no such head file"),
                           (["--routing", "prefetch", "--executor", "hot"], "does not apply"),
                           (["--k", "99"], "--k 99: must be between 1")):
        code, err = run_cli(capsys, "run", "--model", str(store), "--max-tokens", "2", *flags)
        assert code == 2 and message in err and "Traceback" not in err, flags


def test_heads_for_another_k_are_named(capsys):
    """The demo store has heads for K = 4 and 2: asked for K = 3, the refusal names the K and the heads it has."""
    code, err = run_cli(capsys, "run", "--routing", "predicted", "--k", "3", "--max-tokens", "2")
    assert code == 2 and "no prerouter heads for K = 3" in err and "heads-k2.safetensors, heads-k4.safetensors" in err
    assert "edge0 train heads --model" in err and len(err.strip().splitlines()) == 1


def test_store_without_tokenizer(models, capsys, tmp_path):
    store = copy_store(models, tmp_path)
    (store / "tokenizer.json").unlink()
    code, err = run_cli(capsys, "run", "--model", str(store), "--max-tokens", "2")
    assert code == 2 and f"{store / 'tokenizer.json'}: missing (the manifest lists it)" in err
    m = read_manifest(store)
    m.files.pop("tokenizer.json")  # a manifest that lists no tokenizer: the load looks for one of its own
    write_manifest(store, m)
    code, err = run_cli(capsys, "run", "--model", str(store), "--max-tokens", "2")
    assert code == 2 and "no tokenizer" in err and str(store) in err


def test_verify_reports_a_truncated_layer_without_traceback(models, capsys, tmp_path):
    store = copy_store(models, tmp_path)
    f = store / "experts" / "layer_000.safetensors"
    os.truncate(f, f.stat().st_size - 4096)
    code, err = run_cli(capsys, "verify", str(store))
    assert code == 1 and "layer_000.safetensors" in err and "Traceback" not in err


@pytest.mark.parametrize("flags,message", [
    (["--seed", "-1"], "--seed -1: must be at least 0"),
    (["--kernel-threads", "0"], "--kernel-threads 0: must be at least 1"),
    (["--io-workers", "0", "--routing", "prefetch"], "--io-workers 0: must be at least 1"),
    (["--top-p", "5"], "--top-p 5.0: must be at most 1"),
    (["--temp", "-1"], "--temp -1.0: must be at least 0 (0 is greedy)"),
    (["--routing", "prefetch", "--predictor", "repeat", "--heads", "h.safetensors"], "does not read heads"),
    (["--replay", "REPLAY_OOV"], "token id 99999999 is outside the model's vocabulary of"),
    (["--replay", "REPLAY_KEYS"], "and nothing else"),
    (["--replay", "missing.json"], "no such file"),
    (["--trace", "TMP"], "not a writable file path"),
])
def test_bad_run_flags_are_one_clear_error(models, capsys, tmp_path, flags, message):
    (tmp_path / "oov.json").write_text('{"prompt": [1, 99999999], "tokens": []}')  # once a segfault
    (tmp_path / "keys.json").write_text('{"prompt": [1, 2], "toks": [3]}')  # once silently free-running
    subst = {"REPLAY_OOV": str(tmp_path / "oov.json"), "REPLAY_KEYS": str(tmp_path / "keys.json"),
             "TMP": str(tmp_path), "missing.json": str(tmp_path / "missing.json")}
    code, err = run_cli(capsys, "run", "--model", str(models("qwen3_moe")), "--max-tokens", "2",
                        *[subst.get(f, f) for f in flags])
    assert code == 2 and message in err and "Traceback" not in err, err


def _edit_json(path, edit):
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("damage,message", [  # each gave a traceback before
    (lambda s: _edit_json(s / "config.json", lambda c: c.pop("hidden_size")) or record_files(s, ["config.json"]),
     "config.json: does not describe"),  # edited, and its checksum refreshed
    (lambda s: _edit_json(s / "edge0.json", lambda m: m["layers"][0].update(checksums=None)), "malformed manifest"),
    (lambda s: _edit_json(s / "edge0.json", lambda m: m["layers"][0].update(file_size="1")), "malformed manifest"),
    (lambda s: _edit_json(s / "edge0.json", lambda m: m.update(quantization={"mode": "affine"})), "malformed manifest"),
    (lambda s: _edit_json(s / "edge0.json", lambda m: m["layers"].append(m["layers"][0])), "a layer is listed twice"),
])
def test_damaged_store_is_one_clear_error(models, capsys, tmp_path, damage, message):
    store = copy_store(models, tmp_path)
    damage(store)
    cmds = [["run", "--model", str(store), "--max-tokens", "2"]] + ([["verify", str(store)]] if "manifest" in message
                                                                    or "twice" in message else [])
    for cmd in cmds:
        code, err = run_cli(capsys, *cmd)
        assert code == 2 and message in err and "Traceback" not in err, (cmd, err)


def test_damaged_source_or_unwritable_out_is_one_clear_error(models, capsys, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(models("qwen3_moe", "mlx", "src"), src)
    (src / "model.safetensors").write_bytes((src / "model.safetensors").read_bytes()[:5000])  # a cut download
    code, err = run_cli(capsys, "convert", str(src), str(tmp_path / "out"))
    assert code == 2 and "cannot load as a qwen3_moe checkpoint" in err and not (tmp_path / "out").exists()
    (tmp_path / "afile").write_text("not a directory")
    code, err = run_cli(capsys, "convert", str(models("qwen3_moe", "mlx", "src")), str(tmp_path / "afile" / "out"))
    assert code == 2 and f"cannot be written ({tmp_path / 'afile'} is not a directory)" in err
