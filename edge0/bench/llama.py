"""The llama.cpp arm of `edge0 bench`, run as `LLAMA_PYTHON llama.py GGUF REPLAY THREADS [mmap|no-mmap]` in an
interpreter that has llama_cpp (a separate venv: tools/llama_cpp_setup.py builds it); it imports only
llama_cpp and numpy, never Edge0. Prefill evaluates the prompt ids in one batch until the last
position's logits; decode evaluates the forced tokens one at a time, as Edge0's decode loop times them.
Prints one JSON object with the same figures as `edge0 run --json`.
"""

import json
import resource
import sys
import time

import llama_cpp
import numpy as np

GIB = 2**30


def load(gguf: str, prompt: list[int], tokens: list[int], n_threads: int, use_mmap: bool = True):
    t = time.perf_counter()
    llm = llama_cpp.Llama(model_path=gguf, n_ctx=len(prompt) + len(tokens) + 8, n_batch=max(len(prompt), 8),
                          n_ubatch=max(len(prompt), 8), n_threads=n_threads, n_threads_batch=n_threads,
                          use_mmap=use_mmap, logits_all=False, verbose=False)
    if max(prompt + tokens) >= llm.n_vocab():
        sys.exit(f"{gguf}: vocabulary of {llm.n_vocab()} tokens, the replay uses id {max(prompt + tokens)}")
    return llm, time.perf_counter() - t


def quant_name(llm) -> str:
    ftype = int(llm.metadata.get("general.file_type", -1))
    names = {getattr(llama_cpp, n): n.removeprefix("LLAMA_FTYPE_MOSTLY_") for n in dir(llama_cpp)
             if n.startswith("LLAMA_FTYPE_MOSTLY_")}
    return names.get(ftype, f"ftype {ftype}")


def replay(llm, prompt: list[int], tokens: list[int]) -> tuple[float, float, list[bool]]:
    """(prefill s, decode s, per step: the greedy token equals the replayed one)."""
    def top1():  # the last position's greedy token, as the other arms compute it before forcing the replayed one
        return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))))

    agree = []
    t0 = time.perf_counter()
    llm.eval(prompt)
    agree.append(top1() == tokens[0])
    t1 = time.perf_counter()
    for n, t in enumerate(tokens[:-1]):
        llm.eval([t])
        agree.append(top1() == tokens[n + 1])
    return t1 - t0, time.perf_counter() - t1, agree


def rss_file_gib() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("RssFile:"):
            return int(line.split()[1]) * 1024 / GIB
    return 0.0


def main() -> None:
    gguf, replay_path, n_threads = sys.argv[1], sys.argv[2], int(sys.argv[3])
    use_mmap = (sys.argv[4] if len(sys.argv) > 4 else "mmap") == "mmap"
    with open(replay_path) as f:
        data = json.load(f)
    prompt, tokens = data["prompt"], data["tokens"]
    llm, load_s = load(gguf, prompt, tokens, n_threads, use_mmap)
    quant = quant_name(llm)
    prefill_s, decode_s, agree = replay(llm, prompt, tokens)
    print(json.dumps({"tokens": tokens, "dtype": "float32", "kernel": f"llama.cpp {quant}" + ("" if use_mmap else " no-mmap"),
                      "quant": quant, "mmap": use_mmap,
                      "threads": n_threads, "llama_cpp": llama_cpp.__version__, "load_s": load_s,
                      "prompt_tokens": len(prompt), "prefill_tok_s": len(prompt) / prefill_s,
                      "decode_tok_s": (len(tokens) - 1) / decode_s if len(tokens) > 1 else 0.0,
                      "top1_agree_with_replay": sum(agree) / len(agree), "peak_mlx_gib": 0.0,
                      "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB,
                      "file_rss_gib": rss_file_gib(), "bytes_read": 0, "cold_fraction": 0.0, "hit_rate": 0.0,
                      "resident_expert_bytes": 0}))


if __name__ == "__main__":
    main()
