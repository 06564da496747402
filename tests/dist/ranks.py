"""One rank of the distributed tests (tests/dist), or one process as their reference: for each ROUTING:EXECUTOR
argument, generate from a fixed prompt and print one JSON line per rank.

    mlx.launch -n 2 --backend ring -- python tests/dist/ranks.py STORE native:staged predicted:staged
"""

import gc
import json
import os
import sys

import mlx.core as mx

from mlx.utils import tree_flatten

from edge0 import dist
from edge0.config import EngineConfig, IOConfig, RoutingConfig

PROMPT = "hello world, the"


def main(store: str, configs: list[str]) -> None:
    rank = int(os.environ.get("MLX_RANK", "0"))
    dies = os.environ.get("EDGE0_TEST_DIE_RANK") == str(rank)  # this rank exits mid-generation (killed-rank test)
    die_after = int(os.environ.get("EDGE0_TEST_DIE_AFTER", "0")) if dies else 0
    store = os.environ.get(f"EDGE0_TEST_STORE_{rank}", store)  # a rank given another store (mismatch test)
    for spec in configs:
        routing, executor = spec.split(":")
        config = EngineConfig(model=store, routing=RoutingConfig(mode=routing, lora="none"),
                              io=IOConfig(executor=executor))
        with dist.open_engine(config, quiet_others=False) as engine:
            pieces = []

            def emit(s: str) -> None:
                pieces.append(s)
                if die_after and len(pieces) >= die_after:
                    os._exit(int(os.environ.get("EDGE0_TEST_EXIT_CODE", "3")))

            at_first = []  # the store's bytes read when the first token came out (the prompt's reads before)

            def cancelled() -> bool:
                if not at_first:
                    at_first.append(engine.store.reader.stats.bytes)
                return False
            before = engine.store.reader.stats.bytes
            fig = engine.generate(engine.request(engine.encode_text(PROMPT), max_tokens=16), emit=emit,
                                  cancelled=cancelled)
            stage = getattr(engine, "stage", None)
            weights = sum(v.nbytes for _, v in tree_flatten(engine.store.model.parameters()))
            line = {"rank": rank, "config": spec, "tokens": fig.tokens, "text": fig.text, "bytes": fig.bytes_read, "decode_bytes": before + fig.bytes_read - at_first[0],
                    "prompt_bytes": at_first[0] - before,
                    "weights": weights, "peak_mlx": fig.peak_mlx_bytes, "sent": stage.bytes_sent if stage else 0, "messages": stage.messages if stage else 0,
                    "overlaps": engine.store.runtime.overlaps_steps}
        del engine, stage
        line["left_mlx"] = mx.get_active_memory()  # what the closed engine still holds without the garbage collector
        gc.collect()  # the prefetch runtimes' cycles (one process's too): the next config's peak is its own
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
