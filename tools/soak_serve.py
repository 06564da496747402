"""Soak test of `edge0 serve`: 100 sequential and 8 x 10 concurrent requests (streaming and not) against a server
subprocess with the given flags (default: none, the built-in model); prints failures and tracebacks in its log.

    python tools/soak_serve.py                  # the default server
    python tools/soak_serve.py --max-batch 8
"""
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import openai

PORT = 8931
PROMPTS = ["def fibonacci(n):\n    if n", "import os", "class Stack:\n    def push(self, item", "x", "for i in range(10):"]


def main() -> int:
    proc = subprocess.Popen([sys.executable, "-m", "edge0.cli", "serve", "--port", str(PORT), *sys.argv[1:]],
                            stderr=subprocess.PIPE, text=True)
    for _ in range(600):
        if "serving" in proc.stderr.readline():
            break
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{PORT}/v1", api_key="none", max_retries=0, timeout=300)
    model = client.models.list().data[0].id  # whatever store it serves, under its own name

    def ask(i: int):
        try:
            if i % 2 == 0:
                stream = client.chat.completions.create(model=model, max_tokens=16, stream=True,
                                                        messages=[{"role": "user", "content": PROMPTS[i % 5]}])
                return "".join((c.choices[0].delta.content or "") for c in stream if c.choices)
            return client.completions.create(model=model, prompt=PROMPTS[i % 5], max_tokens=16).choices[0].text
        except Exception as e:  # a failed request is counted, not raised
            return e

    t0 = time.time()
    sequential = [ask(i) for i in range(100)]
    with ThreadPoolExecutor(8) as pool:
        concurrent = list(pool.map(ask, range(80)))
    proc.terminate()
    log = proc.communicate(timeout=120)[1]
    failed = [sum(isinstance(r, Exception) for r in rs) for rs in (sequential, concurrent)]
    print(f"sequential 100: {failed[0]} failures; concurrent 8x10: {failed[1]} failures; "
          f"tracebacks in the log: {log.count('Traceback')}; {time.time() - t0:.0f} s; exit {proc.returncode}")
    return int(any(failed) or "Traceback" in log)


if __name__ == "__main__":
    sys.exit(main())
