"""`edge0 make-workload OUT`: a store where reads matter, for measuring the pipeline (docs/lab/pipeline.md).

    edge0 make-workload /tmp/wide                         # 1 GiB of experts, 5.4 MiB bundles (minutes)
    edge0 make-workload /tmp/wide1 --expert-width 2432 --base-heads /tmp/wide/workload/heads-k4-base.safetensors
    edge0 run --model /tmp/wide --replay /tmp/wide/workload/replay.json --ignore-eos --io direct --cold --json

What is trained and what is synthetic. The base store (default: the built-in demo model, trained on the
standard library) keeps its routers, attention and expert weights: the routing, its cross-token overlap
and the prerouter heads are learned from text. Its experts are then widened: each gets extra hidden
neurons whose gate, up and down weights, scales and biases are exactly zero. They add nothing to any
output (the command checks the wide store's logits against the base's: equal with MLX's kernels, within
1e-5 with the edge0 kernels' int8 activations), but every bundle grows to `width / H` times its size on
disk and in the expert products: reads and expert compute grow together, as in a real model of that
width. Heads for every MoE layer (the first one's owned by the last, a token earlier) are trained on the
base, where a training step takes a fraction of a second, and bound to the wide store, whose routing is
the base's. A head routes under --routing predicted only where its held-out recall reaches
--route-recall (default 0.4); below, it only reads ahead: the first layers' heads are weak (their inputs
move fastest), and routing by them costs far more quality than their reads (docs/lab/pipeline.md). With
--slots of at least 16, those layers hold every expert instead (--placement auto, pipeline/prefetch_runtime.py).

OUT is a complete store (edge0 verify checks it) plus OUT/workload/: replay.json (a held-out prompt and its
real continuation, for --replay), workload.json (what was made, the heads' held-out recall per layer, and
the routing's cross-token overlap) and the heads bound to the base (for `edge0 eval` on the base).
"""

from __future__ import annotations

import json
import shutil
import sys
import zlib
from pathlib import Path

import numpy as np
from tqdm import tqdm

from ..errors import Edge0Error
from ..io.atomic import atomic_dir, free_bytes, no_space
from ..io.layerfile import LayerFileWriter, bundle_layout
from ..io.manifest import FORMAT_VERSION, MANIFEST, LayerEntry, Manifest, file_entry, read_manifest, write_manifest
from ..io.outputs import STORE_KIND, check_dir_out, refuse_inputs
from ..io.reader import BundleReader
from ..model.arch import read_config

WIDENED = ("gate_proj", "up_proj")  # the hidden axis is their rows
NARROWED = ("down_proj",)  # the hidden axis is their (packed) columns
DEFAULT_GIB = 1.0  # expert bytes of the default workload
HEADS_STEPS = 300  # training windows of the heads
ROUTE_RECALL = 0.4  # a head routes (predicted routing) where its held-out recall reaches this; below, it reads ahead
NP_DTYPES = {"U32": np.uint32, "BF16": np.uint16, "F16": np.uint16, "F32": np.float32, "U8": np.uint8}
PROMPT_TOKENS, REPLAY_TOKENS = 128, 256
REPLAY_OFFSET = 20_000  # where in the held-out stream the replay starts


def hidden_of(manifest) -> int:
    """The experts' hidden width H (rows of gate_proj.weight)."""
    return next(p.shape[0] for p in manifest.pieces if p.name == "gate_proj.weight")


def default_width(manifest, gib: float) -> int:
    """The smallest width, a multiple of the group size, whose experts take at least `gib` GiB."""
    h, gs = hidden_of(manifest), manifest.quantization["group_size"]
    per_neuron = manifest.bundle_bytes / h * manifest.num_experts * len(manifest.layers)  # every piece is linear in H
    return max(h, int(-(-gib * 2**30 // (per_neuron * gs))) * gs)


def widened_pieces(manifest, width: int) -> list[tuple[str, str, list[int]]]:
    """(name, dtype, shape) of each piece at hidden width `width`."""
    h, out = hidden_of(manifest), []
    for p in manifest.pieces:
        proj = p.name.split(".")[0]
        if proj in WIDENED:
            shape = [width, *p.shape[1:]]
        elif proj in NARROWED:
            shape = [*p.shape[:-1], p.shape[-1] * width // h]
        else:
            raise Edge0Error(f"{p.name}: make-workload widens gate/up/down experts only (this store has fused pieces)")
        out.append((p.name, p.dtype, shape))
    return out


def check_width(manifest, width: int) -> None:
    h, q = hidden_of(manifest), manifest.quantization
    step = max(q["group_size"], 32 // q["bits"])
    if q.get("mode", "affine") != "affine":
        raise Edge0Error(f"make-workload: {q.get('mode')} experts are not supported (affine only)")
    if width < h or width % step or (width * q["bits"]) % 32:
        raise Edge0Error(f"--expert-width {width}: must be at least the base's {h} and a multiple of {step}")


def widen_experts(base: Path, out: Path, width: int, progress: bool = True) -> list[LayerEntry]:
    """Write OUT/experts/: every bundle of the base padded with zero neurons to `width` (bytes, not re-quantized)."""
    m = read_manifest(base)
    pieces, bundle_bytes, stride = bundle_layout(widened_pieces(m, width))
    reader = BundleReader(base, m, probe=False)
    (out / "experts").mkdir()
    entries = []
    bar = tqdm(total=len(m.layers) * m.num_experts * bundle_bytes, unit="B", unit_scale=True, desc="widen",
               disable=not progress, file=sys.stderr)
    try:
        bufs = [bytearray(p.nbytes) for p in m.pieces]
        for entry in m.layers:
            rel = f"experts/layer_{entry.layer:03d}.safetensors"
            writer = LayerFileWriter(out / rel, pieces, m.num_experts, bundle_bytes, stride,
                                     {"format": "edge0-experts", "layer": entry.layer, "arch": m.arch})
            for e in range(m.num_experts):
                reader.read_into(entry.layer, e, bufs)
                writer.write_bundle([_pad(b, p, q) for b, p, q in zip(bufs, m.pieces, pieces)])
                bar.update(bundle_bytes)
            size = writer.close()
            entries.append(LayerEntry(layer=entry.layer, file=rel, data_offset=writer.data_offset, file_size=size,
                                      checksums=writer.checksums, header_crc32=f"{zlib.crc32(writer.header):08x}"))
    finally:
        reader.close()
        bar.close()
    return entries


def _pad(buf: bytearray, old, new) -> np.ndarray:
    """A piece's bytes, zero-padded from old.shape to new.shape (zero weights, scales and biases: zero output)."""
    a = np.frombuffer(buf, dtype=NP_DTYPES[old.dtype]).reshape(old.shape)
    return np.ascontiguousarray(np.pad(a, [(0, n - o) for o, n in zip(old.shape, new.shape)]))


def widened_manifest(base: Path, base_manifest, entries: list[LayerEntry], width: int, root: Path) -> Manifest:
    pieces, bundle_bytes, stride = bundle_layout(widened_pieces(base_manifest, width))
    files = {p.relative_to(root).as_posix(): file_entry(p) for p in sorted(root.rglob("*"))
             if p.is_file() and not p.relative_to(root).as_posix().startswith("experts/") and p.name != MANIFEST}
    b = base_manifest
    return Manifest(format_version=FORMAT_VERSION, arch=b.arch, routing=b.routing, num_experts=b.num_experts,
                    top_k=b.top_k, quantization=b.quantization, pieces=pieces, bundle_bytes=bundle_bytes,
                    bundle_stride=stride, layers=entries, files=files,
                    source={**b.source, "widened_from": str(base.resolve()), "expert_width": width})


def write_config(base: Path, out: Path, width: int) -> None:
    """config.json with the experts' width set to `width` (in text_config where the model nests it)."""
    config = read_config(base)
    where = config["text_config"] if "moe_intermediate_size" in config.get("text_config", {}) else config
    if "moe_intermediate_size" not in where:
        raise Edge0Error(f"{base / 'config.json'}: no moe_intermediate_size to widen")
    where["moe_intermediate_size"] = width
    (out / "config.json").write_text(json.dumps(config, indent=4) + "\n")


def copy_resident(base: Path, out: Path) -> None:
    """Everything of the base but its experts, manifest, heads and adapters (bound to the base's bytes, and the
    adapters to its heads: the workload trains its own heads)."""
    for f in base.iterdir():
        if f.is_file() and f.name not in (MANIFEST, "config.json") and not f.name.startswith(("heads-", "lora-")):
            shutil.copy2(f, out / f.name)


def make_replay(base: Path, out: Path) -> dict:
    """A held-out prompt and its real continuation: {"prompt": ids, "tokens": ids} (edge0 run --replay)."""
    from ..train.corpus import token_stream

    stream, desc = token_stream(base, None)
    at = min(REPLAY_OFFSET, max(stream.size - PROMPT_TOKENS - REPLAY_TOKENS, 0))
    ids = stream[at: at + PROMPT_TOKENS + REPLAY_TOKENS].tolist()
    if len(ids) < PROMPT_TOKENS + 2:
        raise Edge0Error(f"{desc}: too little held-out text for a replay")
    replay = {"prompt": ids[:PROMPT_TOKENS], "tokens": ids[PROMPT_TOKENS:]}
    (out / "replay.json").write_text(json.dumps(replay))
    return {"source": desc, "offset": at, "prompt_tokens": PROMPT_TOKENS, "tokens": len(replay["tokens"]),
            "distinct_tokens": len(set(replay["tokens"]))}


def base_heads(base: Path, work: Path, *, steps: int, seed: int, progress: bool, given: str | None) -> tuple[Path, dict]:
    """Heads for every MoE layer of the base (the first one's owned by the last): trained now into `work`,
    or `given` (an earlier make-workload's heads-k{K}-base.safetensors, checked against the base)."""
    from ..model.heads import HeadSet

    m = read_manifest(base)
    path = work / f"heads-k{m.top_k}-base.safetensors"
    if given is not None:
        heads = HeadSet.load(given, m, read_config(base), top_k=m.top_k)  # refuses another model's heads
        if sorted(heads.owners) != sorted(e.layer for e in m.layers):
            raise Edge0Error(f"--base-heads {given}: heads for layers {sorted(heads.owners)}, not every MoE layer")
        shutil.copy2(given, path)
        report_path = Path(str(given) + ".json")
        report = json.loads(report_path.read_text()) if report_path.exists() else {}
        if report:
            shutil.copy2(report_path, Path(str(path) + ".json"))
        return path, report
    from ..train.head_phase import train_heads

    report = train_heads(base, path, steps=steps, seed=seed, progress=progress,
                         consumers=[e.layer for e in m.layers])
    shutil.rmtree(path.with_suffix(".ckpt"), ignore_errors=True)  # its resume checkpoint: not part of the store
    return path, report


def bind_heads(src: Path, base: Path, out: Path, routes: list[int]) -> Path:
    """The base's heads, bound to the wide store (its routing is the base's): the same weights, the wide
    store's fingerprint; `routes` (the consumers whose prediction is the routing) recorded in both files."""
    from ..model.heads import HeadSet, model_fingerprint

    m = read_manifest(base)
    heads = HeadSet.load(src, m, read_config(base), top_k=m.top_k)
    heads.routes = routes
    heads.save(src)
    heads.fingerprint = model_fingerprint(read_manifest(out), read_config(out))
    dest = out / f"heads-k{m.top_k}.safetensors"
    heads.save(dest, {"bound_from": src.name})
    if Path(str(src) + ".json").exists():
        shutil.copy2(Path(str(src) + ".json"), Path(str(dest) + ".json"))
    return dest


def same_logits(base: Path, out: Path, replay: dict, steps: int = 4) -> float:
    """Largest |difference| of the log-probabilities of the two stores (exact path) over a short replay."""
    from mlx_lm.sample_utils import make_sampler

    from ..decode.loop import generate_steps
    from ..model.load import load_store

    got = []
    for path in (base, out):
        store = load_store(path, executor="exact")
        try:
            steps_ = generate_steps(store.model, replay["prompt"][:8], max_tokens=steps, sampler=make_sampler(0.0),
                                    forced=replay["tokens"][:steps])
            got.append(np.stack([np.array(lp) for _, lp in steps_]))
        finally:
            store.close()
    return float(np.abs(got[0] - got[1]).max())


def make_workload(out: str, *, base: str | None = None, width: int | None = None, gib: float = DEFAULT_GIB,
                  heads_steps: int = HEADS_STEPS, seed: int = 0, base_heads_file: str | None = None, force: bool = False,
                  progress: bool = True, route_recall: float = ROUTE_RECALL) -> dict:
    """Write the workload store OUT (see the module docstring); returns workload.json's content."""
    from ..model.demo import DEMO_STORE

    check_workload_flags(width=width, gib=gib, heads_steps=heads_steps, route_recall=route_recall, seed=seed)
    base_path, out_path = Path(base) if base else DEMO_STORE, Path(out)
    m = read_manifest(base_path)
    width = width or default_width(m, gib)
    check_width(m, width)
    refuse_inputs(out_path, {"--base": base_path})  # --base-heads may lie in OUT: it is copied before the swap
    check_dir_out(out_path, force, STORE_KIND)
    needed = m.bundle_bytes // hidden_of(m) * width * m.num_experts * len(m.layers) * 1.01 + (64 << 20)
    where = next(p for p in (out_path, *out_path.parents) if p.exists())
    if (free_bytes(where) or needed) < needed:
        raise no_space(out_path, int(needed))
    with atomic_dir(out_path, replace=force, needed=int(needed)) as tmp:
        work = tmp / "workload"
        work.mkdir()
        write_config(base_path, tmp, width)
        copy_resident(base_path, tmp)
        entries = widen_experts(base_path, tmp, width, progress)
        info = {"base": str(base_path.resolve()), "expert_width": width, "base_width": hidden_of(m),
                "replay": make_replay(base_path, work)}
        write_manifest(tmp, widened_manifest(base_path, m, entries, width, tmp))  # the heads need its fingerprint
        src, report = base_heads(base_path, work, steps=heads_steps, seed=seed, progress=progress,
                                 given=base_heads_file)
        recall = report.get("recall", {})
        routes = sorted(int(c) for c, r in recall.items() if r["heads"] >= route_recall)
        bind_heads(src, base_path, tmp, routes)
        info["routes"], info["route_recall"] = routes, route_recall
        replay = json.loads((work / "replay.json").read_text())
        info.update(_figures(read_manifest(tmp), report), logits_max_abs_diff=same_logits(base_path, tmp, replay))
        if info["logits_max_abs_diff"] > 1e-4:
            raise Edge0Error(f"{out_path}: the widened store does not reproduce the base's logits "
                             f"(max difference {info['logits_max_abs_diff']:.3g})")
        (work / "workload.json").write_text(json.dumps(info, indent=1) + "\n")
        write_manifest(tmp, widened_manifest(base_path, m, entries, width, tmp))  # now covering every file
    return info


def _figures(m, report: dict) -> dict:
    """Sizes, and the routing figures of the heads' report (held-out recall of repeat = cross-token overlap)."""
    recall = report.get("recall", {})
    mean = (lambda name: float(np.mean([r[name] for r in recall.values()])) if recall else None)
    return {"bundle_mib": m.bundle_bytes / 2**20, "expert_gib": m.expert_bytes / 2**30, "moe_layers": len(m.layers),
            "experts": m.num_experts, "top_k": m.top_k, "consumers": sorted(int(c) for c in recall),
            "owners": report.get("owners"), "recall": recall, "overlap_mean": mean("repeat"),
            "heads_recall_mean": mean("heads"), "next_router_recall_mean": mean("next-router")}


def check_workload_flags(*, width, gib, heads_steps, route_recall, seed) -> None:
    """make-workload's numeric flags, before anything is read (the width against the base once it is)."""
    from ..config.checks import check_seed, fraction, positive, whole

    whole("--expert-width", width, 1)
    positive("--expert-gib", gib)
    whole("--heads-steps", heads_steps, 1)
    fraction("--route-recall", route_recall)
    check_seed(seed)
