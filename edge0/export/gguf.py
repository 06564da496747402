"""`edge0 export-gguf STORE OUT.gguf`: an Edge0 store as a GGUF file that llama.cpp runs, written with the
`gguf` package one tensor at a time (no whole-model copy in memory, no torch, no bf16 detour).

    edge0 export-gguf ~/stores/q3-paper ~/q3-paper.gguf             # q4_1: the store's very weights
    edge0 export-gguf ~/stores/q3-paper ~/q3-paper-q4_0.gguf --type q4_0

What each tensor becomes is plan.py's; the file is written beside OUT and renamed into place when whole.
"""

from __future__ import annotations

import time
from pathlib import Path

from ..errors import Edge0Error
from ..io.atomic import atomic_path, free_bytes, human
from ..io.manifest import read_manifest
from ..io.verify import check_at_load
from ..log import log
from ..io.outputs import GGUF_KIND, check_file_out, refuse_inputs
from ..model.arch import read_config
from .plan import SUPPORTED, Report, check_exportable, expert_jobs, resident_jobs
from .source import Resident
from .vocab import add_vocab

HEADER_ROOM = 1 << 24  # bytes allowed for metadata and the tensor index in the free-space check


def export_gguf(store: str | Path, out: str | Path, *, qtype: str = "q4_1", force: bool = False,
                progress: bool = True) -> Report:
    """Write STORE as the GGUF file OUT; returns what was written. Bad input raises Edge0Error."""
    import gguf

    t0 = time.perf_counter()
    root, out = Path(store), Path(out)
    manifest = read_manifest(root)
    config = read_config(root)
    check_exportable(root, config, manifest, qtype)
    for warning in check_at_load(root, manifest):
        log.warning(warning)
    _check_out(root, out, force)
    arch = getattr(gguf.MODEL_ARCH, SUPPORTED[manifest.arch])
    name_map = gguf.get_tensor_name_map(arch, config["num_hidden_layers"])
    report = Report(out, qtype)
    jobs = resident_jobs(Resident(root), config, name_map, report) + expert_jobs(root, manifest, qtype, name_map, report)
    total = sum(j.nbytes for j in jobs)
    free = free_bytes(out.parent)
    if free is not None and free < total + HEADER_ROOM:
        raise Edge0Error(f"{out}: not enough space (needed about {human(total + HEADER_ROOM)}, free {human(free)})")
    with atomic_path(out, needed=total + HEADER_ROOM) as tmp:
        writer = gguf.GGUFWriter(tmp, gguf.MODEL_ARCH_NAMES[arch])
        try:
            _metadata(writer, root, config, manifest, qtype)
            for j in jobs:
                writer.add_tensor_info(j.name, j.shape, j.dtype, j.nbytes, raw_dtype=j.qtype)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            _write_tensors(writer, jobs, total, progress)
        finally:
            writer.close()
    report.tensors, report.bytes, report.seconds = len(jobs), out.stat().st_size, time.perf_counter() - t0
    return report


def _check_out(root: Path, out: Path, force: bool) -> None:
    if out.is_dir():
        raise Edge0Error(f"{out}: is a directory; name the .gguf file to write")
    refuse_inputs(out, {"STORE": root})
    check_file_out(out, force, GGUF_KIND)
    if not out.parent.is_dir():
        raise Edge0Error(f"{out}: directory {out.parent} does not exist")


def _write_tensors(writer, jobs, total: int, progress: bool) -> None:
    """Each tensor made, written and dropped in turn: memory holds one tensor (a layer's experts of one
    projection) at a time."""
    import numpy as np
    from tqdm import tqdm

    with tqdm(total=total, unit="B", unit_scale=True, desc="export-gguf", disable=not progress) as bar:
        for j in jobs:
            data = j.make()
            if data.shape != j.shape or data.dtype != np.dtype(j.dtype):
                raise AssertionError(f"{j.name}: made {data.shape} {data.dtype}, planned {j.shape} {j.dtype}")
            writer.write_tensor_data(data)
            bar.update(data.nbytes)


def _metadata(writer, root: Path, config: dict, manifest, qtype: str) -> None:
    """general.*, the architecture's hyper-parameters (llama.cpp's keys for qwen3moe) and the vocabulary."""
    import gguf

    writer.add_name(root.resolve().name)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_1 if qtype == "q4_1" else gguf.LlamaFileType.MOSTLY_Q4_0)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_expert_count(manifest.num_experts)
    writer.add_expert_used_count(config["num_experts_per_tok"])
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    add_vocab(writer, root, config["vocab_size"], config.get("eos_token_id"))
