"""The kernels' packed weight layout against the row layout in one process (csrc/qmv.h Packed): prefill and decode
of the engine's own generations on real text, the two layouts alternating round by round (kernels' set_packed:
the same tokens, only the time differs), for docs/lab/cpu-kernels.md.

    python tools/layout_ab.py [--store S] [--routing native] [--executor staged] [--slots N] [--rounds 9]
        [--prompt-tokens 256] [--max-tokens 65] [--bank-copies] [--io direct]

Each round generates --max-tokens tokens after a --prompt-tokens prompt cut from Python's json/decoder.py (greedy,
EOS ignored) once packed and once in the row layout; printed: each layout's median prefill and decode tok/s and the
median over rounds of packed / row within a round (the paired ratio: the host's drift cancels). The packed arm
uses the copies the engine keeps; the row arm turns their use off, not their upkeep (a slot bank's fill still
repacks). --bank-copies compares whether staged slot banks keep a packed copy at all (compute/runtime.py
PACK_BANK_BYTES, whatever the bundle size): an engine opened per arm and round, the copy's upkeep included;
--io direct reads every bundle from the disk there.
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import sys
from json import decoder


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--store", default=None, help="an Edge0 store (default: the built-in model)")
    p.add_argument("--routing", default=None, help="--routing (default: the engine's)")
    p.add_argument("--executor", default="auto",
                   help="--executor (default auto); staged: the slot banks' packed copies")
    p.add_argument("--slots", type=int, default=None, help="--slots, slots per staged bank (default 2K)")
    p.add_argument("--rounds", type=int, default=9, help="rounds, each generating once per layout (default 9)")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=65)
    p.add_argument("--bank-copies", action="store_true",
                   help="slot banks with a packed copy against banks without one (an engine per arm and round)")
    p.add_argument("--io", default="pread", choices=("pread", "direct"), help="--io (direct: every read from the disk)")
    a = p.parse_args()
    if min(a.rounds, a.prompt_tokens, a.max_tokens) < 1:
        p.error("--rounds, --prompt-tokens and --max-tokens must be at least 1")
    if a.bank_copies and a.executor != "staged":
        p.error("--bank-copies compares staged slot banks: give --executor staged")
    from edge0.compute import kernels
    from edge0.config import EngineConfig
    from edge0.errors import Edge0Error

    ext = kernels.load()
    if ext is None or not hasattr(ext, "set_packed"):
        sys.exit(f"layout_ab: the edge0 CPU kernels are {kernels.reason() or 'without a packed layout'}")
    config = EngineConfig(model=a.store, routing=a.routing, executor=a.executor, slots=a.slots, kernel="edge0",
                          prompt_cache_gib=0, io=a.io)
    try:
        figs = bank_copies(config, a) if a.bank_copies else layouts(config, a, ext)
    except Edge0Error as e:
        sys.exit(f"layout_ab: {e}")
    if [f.tokens for f in figs["packed"]] != [f.tokens for f in figs["row"]]:
        sys.exit("layout_ab: the layouts gave different tokens (they must not)")
    for what in ("prefill_tok_s", "decode_tok_s"):
        med = {k: statistics.median(getattr(f, what) for f in v) for k, v in figs.items()}
        ratio = statistics.median(getattr(x, what) / getattr(y, what) for x, y in zip(figs["packed"], figs["row"]))
        print(f"{what.split('_')[0]}: packed {med['packed']:.1f} tok/s, row {med['row']:.1f} tok/s, "
              f"packed / row {ratio:.3f}x (paired, {a.rounds} rounds)")
    return 0


def _request(engine, a):
    from edge0.generation import GenRequest

    ids = engine.encode_text(inspect.getsource(decoder))[:a.prompt_tokens]
    return GenRequest(prompt=ids, max_tokens=a.max_tokens, ignore_eos=True)


def layouts(config, a, ext) -> dict:
    """Rounds of one engine's generations with the packed copies used, then not."""
    from edge0.engine import open_engine

    with open_engine(config) as engine:
        req = _request(engine, a)
        engine.generate(req)  # warm-up
        figs = {"packed": [], "row": []}
        try:
            for _ in range(a.rounds):
                for layout in figs:
                    ext.set_packed(layout == "packed")
                    figs[layout].append(engine.generate(req))
        finally:
            ext.set_packed(True)
    return figs


def bank_copies(config, a) -> dict:
    """Rounds of generations by an engine whose slot banks keep a packed copy and one whose banks keep none (each
    opened for its run, after a warm-up generation), in turn."""
    from edge0.compute import runtime
    from edge0.engine import open_engine

    figs, threshold = {"packed": [], "row": []}, runtime.PACK_BANK_BYTES
    try:
        for i in range(a.rounds):
            for arm in list(figs)[::1 if i % 2 == 0 else -1]:
                runtime.PACK_BANK_BYTES = 0 if arm == "packed" else float("inf")
                with open_engine(config) as engine:
                    req = _request(engine, a)
                    engine.generate(req)
                    figs[arm].append(engine.generate(req))
    finally:
        runtime.PACK_BANK_BYTES = threshold
    return figs


if __name__ == "__main__":
    sys.exit(main())
