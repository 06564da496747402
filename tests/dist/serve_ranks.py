"""One rank of the distributed serve tests (tests/dist/test_serve.py): rank 0 serves STORE on PORT and prints
'listening URL'; the others follow it. EDGE0_TEST_DIE_RANK's rank leaves (exit 0) after EDGE0_TEST_DIE_AFTER tokens, or hangs
with EDGE0_TEST_HANG; EDGE0_TEST_LEAVE_IDLE's rank leaves once its first generation is done.

    mlx.launch -n 2 --backend ring -- python tests/dist/serve_ranks.py STORE ROUTING PORT
"""

import asyncio
import os
import signal
import sys
import threading
import time

import edge0.dist.rank  # noqa: F401 (imports the engine's open_engine before it is replaced below)
import edge0.engine
from edge0 import dist
from edge0.config import EngineConfig, IOConfig, RoutingConfig, Sampling

edge0.engine.open_engine = dist.serving_engine  # what `edge0 serve` opens under mlx.launch


def follow(config) -> None:
    from edge0.dist.serve import follow as follow_rank0

    group = dist.world()
    with dist.open_engine(config, serving=True) as engine:
        if os.environ.get("EDGE0_TEST_LEAVE_IDLE") == str(group.rank()):  # leaves after its first generation
            generate_once = engine.generate

            def then_leave(*args, **kwargs):
                fig = generate_once(*args, **kwargs)
                threading.Timer(0.5, os._exit, (0,)).start()
                return fig
            engine.generate = then_leave
        if os.environ.get("EDGE0_TEST_DIE_RANK") == str(group.rank()):
            generate, after = engine.generate, int(os.environ["EDGE0_TEST_DIE_AFTER"])

            def dying(req, emit=lambda s: None, cancelled=lambda: False):
                count = [0]

                def check():
                    count[0] += 1
                    if count[0] >= after and os.environ.get("EDGE0_TEST_HANG"):
                        time.sleep(600)  # alive, never answering
                    if count[0] >= after:
                        os._exit(0)
                    return cancelled()
                return generate(req, emit, check)
            engine.generate = dying
        follow_rank0(engine, group)


async def serve(config, port: int) -> None:
    from edge0.serve.server import Server

    server = Server(config, Sampling(), host="127.0.0.1", port=port)
    await server.start()
    print("listening", server.url, flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop()
    print("stopped", flush=True)


def main(store: str, routing: str, port: int) -> None:
    config = EngineConfig(model=store, routing=RoutingConfig(mode=routing, lora="none"), io=IOConfig(executor="staged"))
    if dist.world().rank() != 0:
        follow(config)
        return
    asyncio.run(serve(config, port))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
