"""What reading ahead by guesses can gain on a store's replay: a model of its banks and disk, not a measurement.

    python tools/lab/prefetch_model.py --store S --replay R [--heads F] [--slots 20,26] [--compute-ms 8.1]
        [--read-ms 4.3] [--layers 2,3,4,5] [--confident 0.1,0.2] [--pregate 4,8] [--recall 0.5,0.7,0.9,1.0]

The store's own routing of the replay (prompt and forced tokens in one forward, resident experts) and its heads'
scores for each consumer's next token are computed once; then each decode step is played over the streamed layers'
banks (S slots each, held from the prompt's routing, least recently used replaced on demand) against a disk that
reads one bundle at a time (--read-ms each, demand reads first): a step is --compute-ms of compute, a layer's
misses stall it until read, and a head's guesses for its consumer's next step are read as the owner's layer ends.
Policies: native (on demand only); the head's top n guesses with the least recently used or the lowest scored held
expert replaced (`pipeline/prefetch.py` reads the top K; fills replace the lowest scored since this tool was
written); with --confident P, only the top K guesses the head gives a probability of at least P; with --pregate N,
same-token pre-gating (each streamed layer's own router on the MoE input of the layer before it, at the same token,
names N experts read as soon as that layer has routed, after its reads on demand: a lead of one layer, alone and
beside the head's top K); and guesses of a given recall (each true expert named with that probability, else a wrong
one), which says what recall reading ahead by guesses needs on this disk. Printed: each policy's mean step, its ratio to native,
and bundles read a step (on demand, ahead). Calibrate --compute-ms (the resident arm's step) and --read-ms (one
bundle at the pool's rate) from `edge0 bench` on the same store. Its figures are in docs/lab/pipeline.md.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np


def routes(store_dir: str, replay: str, heads_file: str | None):
    """Per layer the routed ids (T, K) of the replay's tokens; per consumer its head's scores (T-1, E) for t+1; per
    MoE layer but the first its router's scores (T, E) on the layer before's input, same token (pre-gating); the layers
    whose heads route (the others hold every expert under --placement auto)."""
    import mlx.core as mx

    from edge0.cli.run import read_replay
    from edge0.errors import Edge0Error
    from edge0.model.heads import HeadSet
    from edge0.model.load import load_store
    from edge0.train.head_phase import window_features, window_targets

    store = load_store(store_dir, dtype="float32", executor="resident")
    try:
        m = store.manifest
        layers = [e.layer for e in m.layers]
        rp = read_replay(replay)
        if len(rp.get("tokens", [])) < 2:
            raise Edge0Error(f"--replay {replay}: needs at least 2 forced tokens (the decode steps played)")
        seq = np.array(rp["prompt"] + rp["tokens"], dtype=np.int32)
        heads = HeadSet.load(heads_file or f"{store_dir}/heads-k{m.top_k}.safetensors", m, store.config)
        data, blocks = window_targets(store.model, seq, layers)
        ids = {i: np.array(data[i][2]) for i in layers}
        scores = {}
        for c, o in heads.owners.items():
            h, _, inds = data[o]
            router = blocks[c].logits(h[:-1]).astype(mx.float32)
            scores[c] = np.array(heads.heads[c](window_features(h, inds, m.num_experts), router))
        pregate = {c: np.array(blocks[c].logits(data[b][0]).astype(mx.float32)) for b, c in zip(layers, layers[1:])}
        streamed = sorted(heads.routes if heads.routes is not None else heads.owners)  # held: the others (--placement)
        return len(rp["prompt"]), m.num_experts, layers, ids, scores, pregate, streamed
    finally:
        store.close()


class Replay:
    """One policy played over the decode steps."""

    def __init__(self, prompt, experts, layers, ids, scores, streamed, slots, pregate=None):
        self.prompt, self.E, self.layers, self.ids, self.scores = prompt, experts, layers, ids, scores
        self.streamed, self.S, self.pregate = streamed, slots, pregate or {}

    def run(self, compute_ms: float, read_ms: float, guesses: int = 0, evict: str = "lru", scores=None,
            least: float = 0.0, pregate: int = 0) -> dict:
        scores = self.scores if scores is None else scores
        steps = len(self.ids[self.layers[0]]) - self.prompt
        last = {c: {} for c in self.streamed}  # expert -> last step it was routed
        for c in self.streamed:
            for t in range(self.prompt):
                for e in self.ids[c][t]:
                    last[c][int(e)] = t
        bank = {c: set(sorted(last[c], key=lambda e: -last[c][e])[:self.S]) for c in self.streamed}
        clock, disk, landed = 0.0, 0.0, {}  # disk: when the reads queued so far end; landed: (layer, e) -> time
        times, demand, ahead = [], 0, 0
        per_layer = compute_ms / len(self.layers)
        for t in range(self.prompt, self.prompt + steps):
            t0 = clock
            for layer in self.layers:
                clock += 0.3 * per_layer  # attention before the MoE block
                if layer in self.streamed:
                    routed = {int(e) for e in self.ids[layer][t]}
                    need = [e for e in routed if e not in bank[layer]]
                    wait = max([clock] + [landed[(layer, e)] for e in routed - set(need) if (layer, e) in landed])
                    start = min(disk, clock + read_ms) if disk > clock else clock  # the read under way ends first
                    queued = max(0.0, disk - start)  # guesses not started: after the demand reads
                    for e in need:
                        start += read_ms
                        wait = max(wait, start)
                        self._replace(bank[layer], last[layer], routed, e, None)
                    demand += len(need)
                    if need and queued:
                        landed = {k: v + len(need) * read_ms if v > clock else v for k, v in landed.items()}
                    disk = start + queued
                    clock = wait
                    for e in routed:
                        last[layer][e] = t
                        landed.pop((layer, e), None)
                following = self.layers[self.layers.index(layer) + 1:][:1]
                if pregate and following and following[0] in self.streamed:  # the next layer's reads, a layer early
                    disk, landed, n = self._pregate(following[0], t, pregate, bank, last, clock, disk, landed, read_ms)
                    ahead += n
                clock += 0.7 * per_layer
                consumer = layer + 1
                if guesses and consumer in self.streamed and t + 1 < self.prompt + steps:
                    sc = scores[consumer][t]
                    prob = np.exp(sc - sc.max())  # the head's probabilities: a guess under `least` is not read
                    named = [int(e) for e in np.argsort(-sc)[:guesses] if prob[e] >= least * prob.sum()]
                    keep = {int(e) for e in self.ids[consumer][t]} | set(named)
                    for e in named:
                        if e in bank[consumer]:
                            continue
                        if not self._replace(bank[consumer], last[consumer], keep, e, sc if evict == "score" else None):
                            break
                        disk = max(disk, clock) + read_ms
                        landed[(consumer, e)] = disk
                        ahead += 1
            times.append(clock - t0)
        settled = times[min(32, steps // 2):]  # the banks settle from the prompt's routing first
        return {"step": float(np.mean(settled)), "demand": demand / steps, "ahead": ahead / steps}

    def _pregate(self, layer: int, t: int, n: int, bank: dict, last: dict, clock: float, disk: float, landed: dict,
                 read_ms: float) -> tuple[float, dict, int]:
        """At `clock`, once the layer before has routed (and waited for its reads on demand): read the top n of
        `layer`'s router on the layer before's input at token t that its bank lacks, after the read under way and ahead of the
        queued guesses. Returns (when the disk's queue ends, landed, reads)."""
        start = min(disk, clock + read_ms) if disk > clock else clock  # the read under way ends first
        queued = max(0.0, disk - start)
        named = [int(e) for e in np.argsort(-self.pregate[layer][t])[:n]]
        recent = {e for e in bank[layer] if last[layer].get(e, -1) >= t - 1}  # its last token's experts stay
        reads = 0
        for e in named:
            if e in bank[layer] or not self._replace(bank[layer], last[layer], recent | set(named), e, None):
                continue
            start += read_ms
            if queued:  # the guesses not started yet wait for it
                landed = {k: v + read_ms if v > start - read_ms else v for k, v in landed.items()}
            landed[(layer, e)] = start
            reads += 1
        return start + queued, landed, reads

    def _replace(self, bank: set, last: dict, keep: set, new: int, score) -> bool:
        """Put `new` in the bank, replacing (when full) the least recently used or lowest scored outside `keep`."""
        if len(bank) >= self.S:
            free = [e for e in bank if e not in keep]
            if not free:
                return False
            bank.discard(min(free, key=(lambda e: score[e]) if score is not None else (lambda e: last.get(e, -1))))
        bank.add(new)
        return True


def of_recall(ids: dict, scores: dict, experts: int, recall: float, seed: int = 0) -> dict:
    """Scores whose top K name each routed expert of the next token with probability `recall`, else a wrong one."""
    rng = np.random.default_rng(seed)
    out = {}
    for c, sc in scores.items():
        fake = np.zeros_like(sc)
        for t in range(sc.shape[0]):
            true = ids[c][t + 1]
            wrong = np.setdiff1d(np.arange(experts), true)
            for j, e in enumerate(true):
                fake[t, e if rng.random() < recall else rng.choice(wrong)] = len(true) - j
        out[c] = fake
    return out


def numbers(kind, least=None):
    """An argparse type: comma-separated numbers of `kind`, each above 0 (or at least `least`)."""
    def parse(text: str) -> list:
        try:
            got = [kind(x) for x in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated numbers") from None
        if min(got) <= 0 if least is None else min(got) < least:
            raise argparse.ArgumentTypeError(f"{text!r}: expected numbers " + ("above 0" if least is None else
                                                                              f"of at least {least}"))
        return got
    return parse


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--store", required=True)
    p.add_argument("--replay", required=True)
    p.add_argument("--heads", help="default: heads-kK.safetensors in the store")
    p.add_argument("--slots", type=numbers(int), default=[20, 26],
                   help="slots of each streamed layer's bank (comma-separated; default 20,26)")
    p.add_argument("--layers", type=numbers(int, 0), default=None, help="the streamed layers (default: those whose head routes, as --placement auto)")
    p.add_argument("--compute-ms", type=lambda t: numbers(float)(t)[0], default=8.1,
                   help="compute of a decode step, ms (default 8.1: the workload's resident step)")
    p.add_argument("--read-ms", type=lambda t: numbers(float)(t)[0], default=4.3,
                   help="one bundle read at the disk's rate, ms (default 4.3)")
    p.add_argument("--confident", type=numbers(float), default=[],
                   help="also: the head's top K read only where its probability is at least P (comma-separated)")
    p.add_argument("--pregate", type=numbers(int), default=[], metavar="N,...",
                   help="also model same-token pre-gating: each streamed layer's router on the layer before's input "
                        "names N experts, read one layer early (comma-separated; default none)")
    p.add_argument("--recall", type=numbers(float), default=[0.5, 0.7, 0.9, 1.0],
                   help="recalls of the modelled guesses (comma-separated; default 0.5,0.7,0.9,1.0)")
    a = p.parse_args()
    from edge0.errors import Edge0Error

    try:
        prompt, experts, layers, ids, scores, pregate, routed = routes(a.store, a.replay, a.heads)
        streamed = a.layers or routed
        if set(streamed) - set(scores):
            raise Edge0Error(f"--layers: {sorted(set(streamed) - set(scores))} consume no head of {a.heads or 'the store'} "
                             f"(those that do: {sorted(scores)})")
        k = ids[layers[0]].shape[-1]
        print(f"| slots | policy | step ms | x native | on demand / step | ahead / step |\n|---|---|---|---|---|---|")
        for s in a.slots:
            model = Replay(prompt, experts, layers, ids, scores, streamed, s, pregate)
            base = model.run(a.compute_ms, a.read_ms)
            rows = [("native", base)]
            for n in (k, 2 * k):
                for evict in ("lru", "score"):
                    rows.append((f"head top {n}, {evict}", model.run(a.compute_ms, a.read_ms, n, evict)))
            for n in a.pregate:
                rows.append((f"pregate {n}", model.run(a.compute_ms, a.read_ms, pregate=n)))
                rows.append((f"head top {k}, score + pregate {n}", model.run(a.compute_ms, a.read_ms, k, "score",
                                                                            pregate=n)))
            for least in a.confident:
                rows.append((f"head top {k}, p >= {least:g}, score", model.run(a.compute_ms, a.read_ms, k, "score",
                                                                           least=least)))
            for r in a.recall:
                rows.append((f"recall {r:.2f}, lru", model.run(a.compute_ms, a.read_ms, k, "lru",
                                                               of_recall(ids, scores, experts, r))))
            for name, x in rows:
                print(f"| {s} | {name} | {x['step']:.2f} | {base['step'] / x['step']:.2f} | {x['demand']:.2f} | "
                      f"{x['ahead']:.2f} |")
    except (Edge0Error, OSError) as e:  # a missing or bad store, replay or head file: one line
        print(f"prefetch_model: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
