"""`edge0 make-workload OUT`: a store where reads matter (edge0/bench/workload.py says what is made).

    edge0 make-workload /tmp/wide
"""

from __future__ import annotations

import argparse
import sys


def add_args(p: argparse.ArgumentParser) -> None:
    from ..bench.workload import DEFAULT_GIB, HEADS_STEPS, ROUTE_RECALL

    p.add_argument("out", metavar="OUT", help="store directory to write (must be empty or absent)")
    p.add_argument("--base", metavar="STORE", default=None, help="trained store to widen (default: the built-in model)")
    p.add_argument("--expert-width", type=int, default=None, metavar="H",
                   help=f"the experts' hidden width (default: the smallest giving {DEFAULT_GIB:g} GiB of experts)")
    p.add_argument("--expert-gib", type=float, default=None, metavar="GIB",
                   help=f"expert bytes to reach when --expert-width is not given (default {DEFAULT_GIB:g})")
    p.add_argument("--heads-steps", type=int, default=None, help=f"training windows of the heads (default {HEADS_STEPS})")
    p.add_argument("--base-heads", metavar="FILE", default=None,
                   help="heads for every layer of the base already trained (an earlier OUT/workload/heads-k*-base"
                        ".safetensors): no training")
    p.add_argument("--route-recall", type=float, default=ROUTE_RECALL, metavar="R",
                   help=f"a head's prediction is the routing (--routing predicted) where its held-out recall is at "
                        f"least R (default {ROUTE_RECALL}); below, the head only reads ahead")
    p.add_argument("--seed", type=int, default=None, help="the heads' training seed (default 0)")
    p.add_argument("--force", action="store_true", help="replace OUT if it is an earlier store (never other files)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")



def main(args: argparse.Namespace) -> int:
    from ..config.checks import refuse_together
    from ..bench.workload import DEFAULT_GIB, HEADS_STEPS, make_workload

    if args.expert_width is not None and args.expert_gib is not None:
        refuse_together("--expert-width", "--expert-gib", "give one (the width sets the experts' bytes)")
    for flag, value in (("--heads-steps", args.heads_steps), ("--seed", args.seed)):
        if args.base_heads is not None and value is not None:
            refuse_together("--base-heads", flag, "the heads given are not trained again")
    info = make_workload(args.out, base=args.base, width=args.expert_width,
                         gib=DEFAULT_GIB if args.expert_gib is None else args.expert_gib,
                         heads_steps=HEADS_STEPS if args.heads_steps is None else args.heads_steps,
                         seed=args.seed or 0, base_heads_file=args.base_heads, force=args.force,
                         progress=not args.quiet, route_recall=args.route_recall)
    print(f"wrote {args.out}: {info['moe_layers']} MoE layers x {info['experts']} experts, width {info['expert_width']} "
          f"(base {info['base_width']}), {info['bundle_mib']:.2f} MiB bundles, {info['expert_gib']:.3f} GiB of experts; "
          f"heads on layers {info['consumers']} (routing at {info['routes']}), held-out recall "
          f"{info['heads_recall_mean']:.3f} (next-router "
          f"{info['next_router_recall_mean']:.3f}, cross-token overlap {info['overlap_mean']:.3f}); logits as the "
          f"base's (max difference {info['logits_max_abs_diff']:.2g})", file=sys.stderr)
    return 0
