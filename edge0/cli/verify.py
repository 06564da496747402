"""`edge0 verify [STORE]`: check every file of a store against its manifest (default: the built-in model's)."""

from __future__ import annotations

import argparse
import sys


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("store", metavar="STORE", nargs="?", default=None, help="the store (default: the built-in model's)")


def main(args: argparse.Namespace) -> int:
    from ..model.consistency import config_problems
    from ..model.demo import DEMO_STORE

    return verify(args.store or str(DEMO_STORE), config_problems)


def verify(store: str, config_check=None) -> int:
    """Prints each problem as an error line and each warning; 1 when the store is unsound."""
    from pathlib import Path

    from tqdm import tqdm

    from ..io.manifest import read_manifest
    from ..io.verify import store_bytes, verify_store
    from ..log import log

    root = Path(store)
    manifest = read_manifest(root, own_checksum=False)
    with tqdm(total=store_bytes(root, manifest), unit="B", unit_scale=True, desc="verify", file=sys.stderr,
              disable=None) as bar:
        report = verify_store(root, config_check=config_check, progress=bar)
    for w in report.warnings:
        log.warning(w)
    for p in report.problems:
        log.error(p)
    if report.problems:
        return 1
    layers = len(manifest.layers)
    print(f"{store}: {report.files} files ({layers} expert layer files, {layers * manifest.num_experts} bundles) "
          f"verified, {report.bytes / 1e6:.1f} MB", file=sys.stderr)
    return 0
