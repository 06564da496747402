"""`edge0 train PHASE`: the demo model (base), prerouter heads (Phase 1), the recovery adapter (Phase 2), its
on-policy distillation (Phase 3), and how much of an adapter survives merging into the int4 weights (merge).

    edge0 train heads --model STORE --out STORE/heads-k4.safetensors
"""

from __future__ import annotations

import argparse
import json
import sys


def add_args(p: argparse.ArgumentParser) -> None:
    train = p.add_subparsers(dest="phase", required=True, metavar="PHASE")
    for name, (help_, phase_args, _) in PHASES.items():
        phase_args(train.add_parser(name, help=help_))


def main(args: argparse.Namespace) -> int:
    return PHASES[args.phase][2](args)


def _base_args(p: argparse.ArgumentParser) -> None:
    from ..train.base import PRESETS

    p.add_argument("--out", required=True, help="run directory: data, checkpoints, log, exported fp and store")
    p.add_argument("--preset", default="demo", choices=sorted(PRESETS), help="model size and schedule")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default: the preset's)")
    p.add_argument("--seed", type=int, default=0, help="initialisation and batch order")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in OUT/ckpt")
    p.add_argument("--no-export", action="store_true", help="skip writing OUT/fp and OUT/store")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")


def _base(args: argparse.Namespace) -> int:
    from ..train.base import train_base
    from ..train.loop import World

    summary = train_base(args.out, preset=args.preset, steps=args.steps, seed=args.seed, resume=args.resume,
                         export=not args.no_export, progress=not args.json)
    if World.init().rank:  # rank 0 reports
        return 0
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"{summary['steps']} steps, {summary['tokens']:,} tokens in {summary['train_s']:.0f} s; "
              f"held-out loss {summary['heldout_loss']:.3f} (ppl {summary['heldout_ppl']:.1f}); BLAS: {summary['blas']}")
        if "store" in summary:
            print(f"fp checkpoint {summary['fp']}, Edge0 store {summary['store']}")
    return 0


def _heads_args(p: argparse.ArgumentParser) -> None:
    from ..model.heads import HIDDEN

    p.add_argument("--model", required=True, metavar="DIR", help="the Edge0 store the heads serve")
    p.add_argument("--out", required=True, metavar="FILE", help="head file to write (safetensors)")
    p.add_argument("--data", metavar="FILE_OR_DIR", help="training text (.py files); default the stdlib train split")
    p.add_argument("--heldout", metavar="FILE_OR_DIR", help="held-out text; default the stdlib held-out split")
    p.add_argument("--k", type=int, default=None, help="routed experts per token the heads serve (default the model's)")
    p.add_argument("--steps", type=int, default=300, help="training windows (default 300)")
    p.add_argument("--hidden", type=int, default=HIDDEN, help=f"head width (default {HIDDEN})")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="continue from OUT.ckpt")


def _heads(args: argparse.Namespace) -> int:
    from ..train.head_phase import train_heads
    from ..train.loop import World

    report = train_heads(args.model, args.out, data=args.data, heldout=args.heldout, top_k=args.k, steps=args.steps,
                         hidden=args.hidden, lr=args.lr, seed=args.seed, resume=args.resume)
    if World.init().rank:  # rank 0 reports
        return 0
    print(f"heads for K={report['top_k']} on consumer layers {report['consumers']} -> {args.out}", file=sys.stderr)
    print(f"{'layer':>6} {'repeat':>8} {'next-router':>12} {'heads':>8}")
    for c, r in report["recall"].items():
        print(f"{c:>6} {r['repeat']:8.3f} {r['next-router']:12.3f} {r['heads']:8.3f}")
    return 0


def _lora_args(p: argparse.ArgumentParser) -> None:
    from ..train.lora_phase import LOSSES, Hyper

    h = Hyper()
    p.add_argument("--model", required=True, metavar="DIR", help="the Edge0 store the adapter serves")
    p.add_argument("--out", required=True, metavar="FILE",
                   help="adapter to write (safetensors); STORE/lora-k{K}.safetensors is the one served by default")
    p.add_argument("--heads", metavar="FILE", help="the heads that route it (default STORE/heads-k{K}.safetensors)")
    p.add_argument("--k", type=int, default=None, help="routed experts per token (default the model's)")
    p.add_argument("--candidates", type=int, default=None, metavar="M",
                   help="experts each head names, its layer's router choosing K of them, as `--candidates` serves "
                        "(default 2K: the default over resident experts)")
    p.add_argument("--teacher", metavar="DIR",
                   help="the float checkpoint (default: the demo's fp for the demo store, else the store's source)")
    p.add_argument("--loss", choices=LOSSES, default=h.loss,
                   help="ce: next-token cross-entropy on the windows (default); kd: the teacher scores every window "
                        "and the loss is KL(teacher || student) over its --top tokens and a tail bucket; ce+kd: the "
                        "sum of both")
    p.add_argument("--top", type=int, default=h.top, help=f"--loss kd: teacher tokens of the KL besides the tail "
                                                          f"(default {h.top})")
    p.add_argument("--data", metavar="FILE_OR_DIR",
                   help="text of one's own (.py files, .npy ids, or `stdlib`: the whole stdlib train split): the "
                        "prompts come from it, and it is trained on besides the teacher's text (default: prompts from "
                        "the stdlib train split's first 400 files, teacher text only)")
    p.add_argument("--heldout", metavar="FILE_OR_DIR", help="held-out text; default the stdlib held-out split")
    p.add_argument("--steps", type=int, default=h.steps, help=f"optimizer steps (default {h.steps})")
    p.add_argument("--batch", type=int, default=h.batch, help=f"windows per step (default {h.batch})")
    p.add_argument("--seq-len", type=int, default=h.seq_len, help=f"tokens per window (default {h.seq_len})")
    p.add_argument("--rank", type=int, default=h.rank, help=f"LoRA rank r (default {h.rank})")
    p.add_argument("--alpha", type=float, default=h.alpha,
                   help=f"LoRA alpha; the branch is scaled by alpha/r (default {h.alpha:g})")
    p.add_argument("--lr", type=float, default=h.lr, help=f"peak learning rate (default {h.lr:g})")
    p.add_argument("--temp", type=float, default=h.temp, help="the teacher's sampling temperature (default 1)")
    p.add_argument("--samples", type=int, default=0, metavar="N",
                   help="windows the teacher writes, drawn from in turn (default steps x batch: each used once)")
    p.add_argument("--seed", type=int, default=h.seed)
    p.add_argument("--eval-every", type=int, default=50, metavar="N", help="held-out perplexity every N steps (default 50)")
    p.add_argument("--eval-windows", type=int, default=4, metavar="N", help="held-out windows scored (default 4)")
    p.add_argument("--resume", action="store_true", help="continue from OUT.ckpt")
    p.add_argument("--init", metavar="FILE",
                   help="start from this adapter of the store (e.g. another K's) instead of a fresh one")


def _check_lora(args: argparse.Namespace) -> None:
    """Every numeric flag, before anything loads (K against the model's experts when the store is read)."""
    from ..config.checks import check_seed, positive, refuse_together, routed_k, whole
    from ..train.lora_phase import Hyper

    if args.loss == "ce" and args.top != Hyper().top:  # --top sizes the teacher's KL, which ce alone never takes
        refuse_together("--top", "--loss ce", "--top is the KL's teacher tokens (--loss kd or ce+kd)")
    routed_k(args.k)
    whole("--candidates", args.candidates, 1)
    for flag, value, lo in (("--steps", args.steps, 1), ("--batch", args.batch, 1), ("--seq-len", args.seq_len, 2),
                            ("--rank", args.rank, 1), ("--samples", args.samples, 0), ("--top", args.top, 1),
                            ("--eval-every", args.eval_every, 1), ("--eval-windows", args.eval_windows, 1)):
        whole(flag, value, lo)
    for flag, value in (("--alpha", args.alpha), ("--lr", args.lr), ("--temp", args.temp)):
        positive(flag, value)
    check_seed(args.seed)


def _lora(args: argparse.Namespace) -> int:
    from ..train.loop import World
    from ..train.lora_phase import train_lora

    _check_lora(args)
    r = train_lora(args.model, args.out, teacher=args.teacher, data=args.data, heldout=args.heldout, heads=args.heads,
                   top_k=args.k, candidates=args.candidates, loss=args.loss, top=args.top, steps=args.steps, batch=args.batch, seq_len=args.seq_len, rank=args.rank,
                   alpha=args.alpha, lr=args.lr, seed=args.seed, temp=args.temp, samples=args.samples,
                   eval_every=args.eval_every, eval_windows=args.eval_windows, resume=args.resume, init=args.init)
    if World.init().rank:  # rank 0 reports
        return 0
    b = r["heldout_ppl_before"]
    print(f"adapter for K={r['top_k']} -> {args.out} ({r['train_s']:.0f} s, {r['ranks']} rank(s))", file=sys.stderr)
    start = "" if args.init is None else " + the --init adapter"
    print(f"held-out ppl on the student path: native{start} {b['native']:.2f}, predicted{start} {b['predicted']:.2f}, "
          f"predicted + the adapter trained {r['heldout_ppl']:.2f}")
    return 0


def _distill_args(p: argparse.ArgumentParser) -> None:
    from ..train.distill import Hyper

    h = Hyper()
    p.add_argument("--model", required=True, metavar="DIR", help="the Edge0 store the adapter serves")
    p.add_argument("--out", required=True, metavar="FILE", help="adapter to write (safetensors)")
    p.add_argument("--init", metavar="FILE", help="the Phase 2 adapter to start from (default STORE/lora-k{K}.safetensors)")
    p.add_argument("--heads", metavar="FILE", help="the heads that route it (default STORE/heads-k{K}.safetensors)")
    p.add_argument("--k", type=int, default=None, help="routed experts per token (default the model's)")
    p.add_argument("--candidates", type=int, default=None, metavar="M",
                   help="experts each head names, its layer's router choosing K of them, as `--candidates` serves "
                        "(default 2K: the default over resident experts)")
    p.add_argument("--teacher", metavar="DIR",
                   help="the float checkpoint (default: the demo's fp for the demo store, else the store's source)")
    p.add_argument("--data", metavar="FILE_OR_DIR",
                   help="text the prompts are cut from: .py files, .npy ids, or `stdlib` (the whole stdlib train "
                        "split; default its first 400 files)")
    p.add_argument("--heldout", metavar="FILE_OR_DIR", help="held-out text; default the stdlib held-out split")
    p.add_argument("--steps", type=int, default=h.steps, help=f"optimizer steps (default {h.steps})")
    p.add_argument("--batch", type=int, default=h.batch, help=f"generations per step (default {h.batch})")
    p.add_argument("--prompt-len", type=int, default=h.prompt_len, help=f"prompt tokens (default {h.prompt_len})")
    p.add_argument("--new", type=int, default=h.new, help=f"tokens sampled per generation (default {h.new})")
    p.add_argument("--top", type=int, default=h.top, help=f"teacher tokens of the KL besides the tail (default {h.top})")
    p.add_argument("--lr", type=float, default=h.lr, help=f"peak learning rate (default {h.lr:g})")
    p.add_argument("--temp", type=float, default=h.temp, help="the student's sampling temperature (default 1)")
    p.add_argument("--seed", type=int, default=h.seed)
    p.add_argument("--eval-every", type=int, default=20, metavar="N", help="held-out figures every N steps (default 20)")
    p.add_argument("--eval-windows", type=int, default=4, metavar="N", help="held-out windows scored (default 4)")
    p.add_argument("--resume", action="store_true", help="continue from OUT.ckpt")


def _check_distill(args: argparse.Namespace) -> None:
    """Every numeric flag, before anything loads (K against the model's experts when the store is read)."""
    from ..config.checks import check_seed, positive, routed_k, whole

    routed_k(args.k)
    whole("--candidates", args.candidates, 1)
    for flag, value, lo in (("--steps", args.steps, 1), ("--batch", args.batch, 1), ("--prompt-len", args.prompt_len, 1),
                            ("--new", args.new, 1), ("--top", args.top, 1), ("--eval-every", args.eval_every, 1),
                            ("--eval-windows", args.eval_windows, 1)):
        whole(flag, value, lo)
    for flag, value in (("--lr", args.lr), ("--temp", args.temp)):
        positive(flag, value)
    check_seed(args.seed)


def _distill(args: argparse.Namespace) -> int:
    from ..train.distill import train_distill
    from ..train.loop import World

    _check_distill(args)
    r = train_distill(args.model, args.out, init=args.init, teacher=args.teacher, data=args.data, heads=args.heads,
                      heldout=args.heldout, top_k=args.k, candidates=args.candidates, steps=args.steps, batch=args.batch,
                      prompt_len=args.prompt_len, new=args.new, top=args.top, lr=args.lr, temp=args.temp,
                      seed=args.seed, eval_every=args.eval_every, eval_windows=args.eval_windows, resume=args.resume)
    if World.init().rank:  # rank 0 reports
        return 0
    b, a = r["heldout_before"], r["heldout_after"]
    print(f"adapter for K={r['top_k']} -> {args.out} ({r['train_s']:.0f} s, {r['ranks']} rank(s))", file=sys.stderr)
    for name in ("ppl", "reverse_kl", "top1_agreement"):
        print(f"held-out {name}: {b[name]:.4f} (Phase 2) -> {a[name]:.4f}")
    return 0


def _merge_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, metavar="DIR", help="the Edge0 store")
    p.add_argument("--lora", required=True, metavar="FILE", help="its adapter")
    p.add_argument("--heads", metavar="FILE", help="the heads it was trained with (default STORE/heads-k{K})")
    p.add_argument("--windows", type=int, default=4, help="held-out windows of 256 tokens for the logits (default 4)")


def _merge(args: argparse.Namespace) -> int:
    from ..train.merge import merge_survival

    print(json.dumps(merge_survival(args.model, args.lora, heads=args.heads, windows=args.windows), indent=1))
    return 0


def _affinity_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--traces", required=True, nargs="+", metavar="FILE",
                   help="routing traces of one model shape (MoE layers, experts, K): --record-routes files or public "
                        "layouts (docs/USAGE.md, Routing traces)")
    p.add_argument("--out", required=True, metavar="FILE", help="the table to write (NPZ)")
    p.add_argument("--heldout", metavar="FILE", default=None,
                   help="a trace not learned from: report how many of each layer's experts the table names from the "
                        "layer before, against the layer's own experts at the token before")
    p.add_argument("--force", action="store_true", help="replace an existing table at --out")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")


def _affinity(args: argparse.Namespace) -> int:
    from ..train.affinity_phase import train_affinity

    s = train_affinity(args.traces, args.out, heldout=args.heldout, force=args.force)
    if args.json:
        print(json.dumps(s))
        return 0
    print(f"affinity table of {s['layers']} MoE layers x {s['experts']} experts (K {s['top_k']}) from {s['tokens']} "
          f"tokens -> {args.out}")
    for n, r in s.get("recall", {}).items():
        print(f"held-out {args.heldout}: the table's {n} likeliest name {r['affinity']:.3f} of a layer's experts; "
              f"the layer's own at the token before {r['previous']:.3f}")
    return 0


# `edge0 train PHASE`: phase -> (help, add_args, main)
PHASES = {
    "base": ("train a small MoE LM from scratch on the stdlib's source", _base_args, _base),
    "heads": ("distil prerouter heads on a store (Phase 1)", _heads_args, _heads),
    "lora": ("train the recovery adapter on the student path (Phase 2)", _lora_args, _lora),
    "distill": ("distil the adapter on-policy from the teacher (Phase 3)", _distill_args, _distill),
    "affinity": ("learn the affinity predictor's co-activation table from routing traces", _affinity_args, _affinity),
    "merge": ("how much of an adapter's delta survives merge-and-requantize (a measurement, JSON)", _merge_args, _merge),
}
