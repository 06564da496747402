"""`edge0 run` as a user runs it: no flags beyond the length, no kernel pinned.

conftest.py pins EDGE0_KERNEL=mlx for every subprocess (mlx-lm is the oracle elsewhere); this test
removes it, so the default kernel choice (auto) and the default routing are what run.
"""

import os

import mlx.core as mx

from edge0.compute import kernels
from tests.helpers import run_json


def test_run_with_defaults():
    env = {k: v for k, v in os.environ.items() if k != "EDGE0_KERNEL"}
    r = run_json("--max-tokens", "8", "--ignore-eos", env=env)
    # The built-in demo model ships prerouter heads, so predicted routing is its default.
    assert r["routing"] == "predicted" and r["heads"], r
    assert len(r["tokens"]) == 8
    # auto: Edge0's CPU kernels when the extension is built (and MLX computes on the CPU), else MLX's.
    on_cpu = mx.default_device() == mx.cpu
    assert r["kernel"] == ("edge0" if kernels.available() and on_cpu else "mlx"), (r["kernel"], kernels.reason())
    # every expert resident: the kernels' default for that (on 2 cores both, the stream keeping one to itself)
    assert r["kernel_threads"] == (kernels.default_threads(resident=True) if r["kernel"] == "edge0" else None)


def test_the_summary_line_says_what_was_read():
    """Without --json the run ends with one line on stderr: resident experts say so (nothing read per token);
    streamed ones give the reads and the slot hit rate, and scheduled ones how many steps read ahead (and which layers
    hold every expert, --placement)."""
    import subprocess
    import sys

    for flags, said in (((), "every expert resident ("), (("--executor", "staged"), "% cold), slot hit rate "),
                        (("--executor", "staged", "--read-ahead", "never"), "read ahead at 0 of 4 steps"),
                        (("--executor", "staged", "--read-ahead", "always"), "read ahead at 4 of 4 steps"),
                        (("--executor", "staged", "--slots", "20"), "layers 0, 1, 5 holding every expert")):
        proc = subprocess.run([sys.executable, "-m", "edge0.run", "--max-tokens", "4", *flags], capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        line = proc.stderr.strip().splitlines()[-1]
        assert line.startswith("[edge0] predicted routing, ") and said in line, line


def test_naming_the_default_executor_keeps_the_default_routing():
    """`--executor resident` is what auto chooses for the demo store: naming it changes nothing (it ran native)."""
    from edge0.config import EngineConfig, IOConfig
    from edge0.engine import resolve

    auto, named = resolve(EngineConfig()), resolve(EngineConfig(io=IOConfig(executor="resident")))
    auto, named = auto.routing, named.routing
    assert (named.mode, named.heads, named.lora) == (auto.mode, auto.heads, auto.lora) == (
        "predicted", auto.heads, auto.lora) and auto.heads and auto.lora != "none"
    r = run_json("--max-tokens", "6", "--ignore-eos", "--executor", "resident")
    assert r["routing"] == "predicted" and r["tokens"] == run_json("--max-tokens", "6", "--ignore-eos")["tokens"]


def test_the_prompt_from_standard_input_or_a_file_is_the_prompt_given(tmp_path):
    """--prompt - reads standard input and --prompt-file FILE a file: the same prompt ids and tokens as --prompt
    TEXT (a multi-line prompt, as a file holds)."""
    import json
    import subprocess
    import sys

    text = "import os\n\ndef walk(root):\n    "
    (tmp_path / "prompt.py").write_text(text, encoding="utf-8")
    want = run_json("--prompt", text, "--max-tokens", "6", "--ignore-eos")
    got_file = run_json("--prompt-file", str(tmp_path / "prompt.py"), "--max-tokens", "6", "--ignore-eos")
    proc = subprocess.run([sys.executable, "-m", "edge0.run", "--prompt", "-", "--max-tokens", "6", "--ignore-eos",
                           "--json"], input=text, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    got_stdin = json.loads(proc.stdout.splitlines()[-1])
    assert want["prompt_tokens"] > 10 and len(want["tokens"]) == 6
    for got in (got_file, got_stdin):
        assert (got["prompt_tokens"], got["tokens"]) == (want["prompt_tokens"], want["tokens"])

