"""What a store serves never changes without a word (issue 58), on real copies of the demo store: every load checks
the small files' checksums and each layer file's size and header; a file the manifest lists and lacks is an error,
not another mode; a store reads only inside itself; bytes that are not UTF-8, and a manifest that disagrees with
config.json, are one clear line."""

import os
import shutil
import zlib
from pathlib import Path

import pytest

from edge0.cli import main
from edge0.io.manifest import read_manifest, record_files, write_manifest
from edge0.model.demo import DEMO_STORE
from tests.io.test_integrity import as_format_1

@pytest.fixture
def store(tmp_path):
    return Path(shutil.copytree(DEMO_STORE, tmp_path / "store"))


def cli(capsys, *argv) -> tuple[int, str]:
    code = main([str(a) for a in argv])
    return code, capsys.readouterr().err


def run(capsys, store, *flags) -> tuple[int, str]:
    return cli(capsys, "run", "--model", store, "--prompt", "def f(x):", "--max-tokens", "1", *flags)


def error_line(code: int, err: str, want: int = 2) -> str:
    """The one error line of a refused command."""
    lines = [line for line in err.splitlines() if line.startswith("edge0: error: ")]
    assert code == want and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


def header_digit(path: Path) -> int:
    """The offset of a digit of expert 7's data offsets in a layer file's header: a change no parser notices and
    the start-up check of experts 0 and 1 never read."""
    data = path.read_bytes()
    return data.index(b'"data_offsets":[', data.index(b'"experts.7.gate_proj.weight"')) + len('"data_offsets":[') + 1


@pytest.mark.parametrize("name,where", [
    ("resident.safetensors", 0.5),
    ("lora-k4.safetensors", 0.5),  # the default run's adapter
    ("heads-k4.safetensors", 0.5),  # the default run's heads
    ("tokenizer.json", 0.5),
    ("config.json", b'"rms_norm_eps": 1e-0'),  # 1e-06 -> 1e-07: a valid config that serves other text
    ("experts/layer_003.safetensors", "header"),
])
def test_damage_is_refused_by_the_default_load(store, capsys, name, where):
    path = store / name
    if where == "header":
        offset = header_digit(path)
    elif isinstance(where, bytes):
        offset = path.read_bytes().index(where) + len(where)
    else:
        offset = int(path.stat().st_size * where)
    flip(path, offset)
    line = error_line(*run(capsys, store))
    assert line.startswith(f"edge0: error: {path}: checksum mismatch"), line
    assert "edge0 verify" in line or name.startswith("experts/")


def test_an_unused_heads_files_damage_blocks_only_the_runs_that_use_it(store, capsys):
    flip(store / "heads-k2.safetensors", 1000)
    assert run(capsys, store)[0] == 0  # K = 4 reads heads-k4 and lora-k4
    line = error_line(*run(capsys, store, "--k", "2"))
    assert f"{store / 'heads-k2.safetensors'}: checksum mismatch" in line


def test_swapped_layer_files_are_refused(store, capsys):
    a, b = store / "experts" / "layer_001.safetensors", store / "experts" / "layer_002.safetensors"
    a.rename(store / "swap")
    b.rename(a)
    (store / "swap").rename(b)
    want = f"{a}: holds the experts of layer 2, the manifest lists it as layer 1 (layer files swapped or renamed)"
    for flags in ([], ["--routing", "native", "--executor", "staged"]):
        assert error_line(*run(capsys, store, *flags)) == f"edge0: error: {want}"
    code, err = cli(capsys, "verify", store)
    assert code == 1 and want in err


def test_a_layer_file_that_grew_is_refused_by_verify_and_load(store, capsys):
    path = store / "experts" / "layer_003.safetensors"
    size = path.stat().st_size
    with open(path, "ab") as f:
        f.write(b"\0" * 4096)  # a whole page of zeros: the bundles and the header are untouched
    want = f"{path}: {size + 4096} bytes, manifest says {size} (truncated or damaged file)"
    code, err = cli(capsys, "verify", store)
    assert error_line(code, err, want=1) == f"edge0: error: {want}"
    assert error_line(*run(capsys, store)) == f"edge0: error: {want}"


@pytest.mark.parametrize("name,instead", [
    ("heads-k4.safetensors", "--routing native"),
    ("lora-k4.safetensors", "--lora none"),
])
def test_a_listed_file_that_is_missing_is_an_error_not_another_mode(store, capsys, name, instead):
    (store / name).unlink()
    line = error_line(*run(capsys, store))
    assert line == (f"edge0: error: {store / name}: missing, though {store / 'edge0.json'} lists it (restore it, or "
                    f"pass {instead} " + line.split(f"pass {instead} ")[1])
    code, err = run(capsys, store, *instead.split())  # asked for by name, the run goes on without it
    assert code == 0, err


@pytest.mark.parametrize("name", ["resident.safetensors", "config.json", "tokenizer_config.json"])
def test_a_missing_store_file_is_named(store, capsys, name):
    (store / name).unlink()
    line = error_line(*run(capsys, store, "--routing", "native"))
    assert line.startswith(f"edge0: error: {store / name}: missing"), line


def test_a_manifest_k_of_8_is_an_error_not_native_routing(store, capsys):
    raw = (store / "edge0.json").read_bytes()
    (store / "edge0.json").write_bytes(raw.replace(b'"top_k": 4', b'"top_k": 8'))  # edited by hand
    line = error_line(*run(capsys, store))
    assert line.startswith(f"edge0: error: {store / 'edge0.json'}: checksum mismatch (file damaged or edited)")
    m = read_manifest(store, own_checksum=False)
    write_manifest(store, m)  # its own checksum made to match: config.json still says 4
    line = error_line(*run(capsys, store))
    assert line == (f"edge0: error: {store / 'edge0.json'}: top_k 8 disagrees with config.json "
                    "num_experts_per_tok 4")


def _fewer_experts(m):
    m.num_experts = 16
    for e in m.layers:
        e.checksums = e.checksums[:16]


def _extra_layer(m):
    m.layers.append(type(m.layers[0])(**{**vars(m.layers[0]), "layer": 7}))


@pytest.mark.parametrize("edit,message", [
    (_fewer_experts, "num_experts 16 disagrees with config.json num_experts 32"),
    (lambda m: setattr(m, "layers", m.layers[:4]), "no expert file for MoE layers [4, 5] of config.json (4 of 6 listed)"),
    (_extra_layer, "layers [7] are not MoE layers of config.json"),
])
def test_a_manifest_that_disagrees_with_config_is_one_line_naming_both(store, capsys, edit, message):
    m = read_manifest(store)
    edit(m)
    write_manifest(store, m)  # a sound manifest of another model
    want = f"edge0: error: {store / 'edge0.json'}: {message}"
    for flags in ([], ["--routing", "native", "--executor", "staged"], ["--routing", "native", "--executor", "exact"]):
        assert error_line(*run(capsys, store, *flags)) == want, flags  # the default run blamed the heads


def _move_out(store: Path, rel: str) -> Path:
    """Move a file of the store to a sibling directory, where a path leaving the store finds it whole."""
    out = store.parent / "elsewhere" / Path(rel).name
    out.parent.mkdir(exist_ok=True)
    (store / rel).rename(out)
    return out


@pytest.mark.parametrize("how", ["dotdot", "absolute", "files-dotdot"])
def test_a_manifest_path_that_leaves_the_store_is_refused(store, capsys, how):
    m = read_manifest(store)
    if how == "files-dotdot":
        out = _move_out(store, "tokenizer_config.json")
        m.files["../elsewhere/tokenizer_config.json"] = m.files.pop("tokenizer_config.json")
        where, rel = "files", "../elsewhere/tokenizer_config.json"
    else:
        out = _move_out(store, m.layers[1].file)
        rel = "../elsewhere/layer_001.safetensors" if how == "dotdot" else str(out)
        m.layers[1].file, where = rel, "layers[1].file"
    write_manifest(store, m)
    want = (f"edge0: error: {store / 'edge0.json'}: {where} '{rel}' is not a path inside the store (a store reads "
            "only its own files)")
    assert error_line(*cli(capsys, "verify", store)) == want
    assert error_line(*run(capsys, store)) == want


@pytest.mark.parametrize("rel", ["experts/layer_001.safetensors", "resident.safetensors"])
def test_a_link_out_of_the_store_is_refused(store, capsys, rel):
    out = _move_out(store, rel)
    (store / rel).symlink_to(out)  # the same bytes, reached through a link that leaves the store
    want = f"{store / rel}: leads to {out.resolve()}, outside the store {store} (a store reads only its own files)"
    code, err = cli(capsys, "verify", store)
    assert error_line(code, err, want=1) == f"edge0: error: {want}"
    assert error_line(*run(capsys, store)).startswith(f"edge0: error: {want}")
    (store / "experts" / "inside").symlink_to(store / "config.json")  # a link that stays inside is no concern
    os.unlink(store / rel)
    out.rename(store / rel)
    assert run(capsys, store)[0] == 0


def _not_utf8(path: Path, old: bytes) -> int:
    data = path.read_bytes()
    at = data.index(old)
    path.write_bytes(data[:at] + b"\xff" + data[at + 1:])
    return at


def test_bytes_that_are_not_utf8_are_one_line(store, capsys):
    at = _not_utf8(store / "edge0.json", b"qwen3_moe")
    want = f"edge0: error: {store / 'edge0.json'}: not UTF-8 text (byte 0xff at offset {at})"
    assert error_line(*cli(capsys, "verify", store)) == want
    assert error_line(*run(capsys, store)) == want
    shutil.copy(DEMO_STORE / "edge0.json", store / "edge0.json")
    at = _not_utf8(store / "config.json", b"silu")
    want = f"{store / 'config.json'}: not UTF-8 text (byte 0xff at offset {at})"
    code, err = cli(capsys, "verify", store)
    assert code == 1 and f"edge0: error: {want}" in err and "Traceback" not in err
    record_files(store, ["config.json"])  # its checksum made to match: the load parses it
    assert error_line(*run(capsys, store)) == f"edge0: error: {want}"


def test_a_format_1_store_loads_with_a_note_of_what_is_unchecked(store, capsys):
    as_format_1(store)
    code, err = run(capsys, store)
    assert code == 0 and (f"edge0: warning: {store / 'resident.safetensors'}: no checksum recorded (store written by "
                          "an older edge0; re-convert to cover it); loaded unchecked") in err


def test_heads_for_another_k_only_say_why_routing_is_native(store, capsys):
    code, err = run(capsys, store, "--k", "3")
    assert code == 0 and "edge0: routing native: no prerouter heads for K = 3" in err
    assert "heads-k2.safetensors, heads-k4.safetensors" in err


def test_the_demo_store_is_what_its_manifest_records():
    """The committed demo store passes the load's checks and its manifest's own checksum (an independent crc32)."""
    m = read_manifest(DEMO_STORE)
    for name, want in m.files.items():
        data = (DEMO_STORE / name).read_bytes()
        assert want == {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}, name


@pytest.mark.parametrize("edit,message", [
    (lambda m: setattr(m, "top_k", 3), "top_k 3 disagrees with config.json (2 experts per token)"),
    (lambda m: [setattr(m, "num_experts", 4)] + [setattr(e, "checksums", e.checksums[:4]) for e in m.layers],
     "num_experts 4 disagrees with config.json (8 experts in layer 0)"),
])
def test_another_familys_experts_and_k_are_checked_against_its_config(models, tmp_path, capsys, edit, message):
    store = Path(shutil.copytree(models("mixtral"), tmp_path / "store"))  # E = 8, K = 2 in its config.json
    m = read_manifest(store)
    edit(m)
    write_manifest(store, m)
    line = error_line(*run(capsys, store, "--routing", "native", "--executor", "staged"))
    assert line == f"edge0: error: {store / 'edge0.json'}: {message}"


def test_a_tokenizer_file_added_after_the_store_was_written_is_named(store, capsys, tmp_path):
    (store / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")  # the tokenizer reads it: other text
    code, err = run(capsys, store)
    assert code == 0 and (f"edge0: warning: {store / 'chat_template.jinja'}: read at load, but edge0.json records no "
                          "checksum of it (added after the store was written)") in err
    (store / "chat_template.jinja").unlink()
    (tmp_path / "t.jinja").write_text("{{ 'elsewhere' }}")
    (store / "chat_template.jinja").symlink_to(tmp_path / "t.jinja")
    line = error_line(*run(capsys, store))
    assert line.startswith(f"edge0: error: {store / 'chat_template.jinja'}: leads to {tmp_path / 't.jinja'}, outside")


def test_export_gguf_refuses_swapped_layer_files_and_links_out(store, capsys, tmp_path):
    pytest.importorskip("gguf")
    a, b = store / "experts" / "layer_001.safetensors", store / "experts" / "layer_002.safetensors"
    a.rename(store / "swap")
    b.rename(a)
    (store / "swap").rename(b)
    out = tmp_path / "m.gguf"
    line = error_line(*cli(capsys, "export-gguf", store, out))
    assert line == f"edge0: error: {a}: holds the experts of layer 2, the manifest lists it as layer 1 (layer files " \
                   "swapped or renamed)"
    assert not out.exists()
    b.rename(store / "swap")
    a.rename(b)
    (store / "swap").rename(a)
    moved = _move_out(store, "resident.safetensors")
    (store / "resident.safetensors").symlink_to(moved)
    line = error_line(*cli(capsys, "export-gguf", store, out))
    assert line.startswith(f"edge0: error: {store / 'resident.safetensors'}: leads to {moved}, outside the store")

