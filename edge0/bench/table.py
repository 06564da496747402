"""`edge0 bench`'s medians and its markdown table (results.md)."""

from __future__ import annotations

from .harness import median

LLAMA_ARM = "llama.cpp"


def is_llama(arm: str) -> bool:
    """llama.cpp or llama.cpp:no-mmap."""
    return arm.split(":")[0] == LLAMA_ARM

FIGURES = ("decode_tok_s", "prefill_tok_s", "peak_mlx_gib", "peak_rss_gib", "file_rss_gib", "bytes_read",
           "cold_fraction", "hit_rate", "resident_expert_bytes", "stall_ms_per_token", "recall", "loads_per_step",
           "load_cold_fraction", "peak_cgroup_gib", "major_faults", "disk_read_bytes")


def summarize(runs: dict[str, list[dict]], cost: dict) -> dict:
    """Medians per arm/cache over the runs that finished, with the step's read time and the pipeline's limit;
    `killed` says how many runs the memory cap killed and why."""
    summary = {}
    for key, rs in runs.items():
        done = [x for x in rs if "killed" not in x] or rs
        s = {f: median(done, f, missing=0.0) for f in FIGURES}
        s.update(dtype=done[0]["dtype"], kernel=done[0].get("kernel", "mlx"), threads=done[0].get("threads"),
                 runs=len(rs), killed=sum("killed" in x for x in rs),
                 killed_why=next((x["killed"] for x in rs if "killed" in x), None))
        s["step_ms"] = 1e3 / s["decode_tok_s"] if s["decode_tok_s"] else 0.0
        summary[key] = s
    for key, s in summary.items():
        arm, cache = key.rsplit("/", 1)
        cf = s["load_cold_fraction"]
        par = "_parallel" if "cold_parallel_ms" in cost else ""  # a layer's reads run together on the I/O pool
        s["read_ms_per_step"] = s["loads_per_step"] * (cf * cost[f"cold{par}_ms"] + (1 - cf) * cost[f"warm{par}_ms"])
        floor = summary.get(f"resident/{cache}") or summary.get("resident/warm")
        # llama.cpp's limit is not Edge0's pipeline; a floor on other threads is not this arm's (bench --threads)
        if floor and not is_llama(arm) and not floor["killed"] and floor["threads"] == s["threads"]:
            s["compute_ms_per_step"] = floor["step_ms"]
            s["limit_ms_per_step"] = max(floor["step_ms"], s["read_ms_per_step"])
    return summary


def table(summary: dict, meta: dict) -> list[str]:
    """The markdown table of results.md: one row per arm and cache state; a killed arm's row says so."""
    cost = meta["read_cost"]
    throttle = f", read throttle {meta['io_throttle_mbps']} MB/s" if meta["io_throttle_mbps"] else ""
    cap = meta.get("memory_cap_gib")
    capped = (f"; every arm in a memory cgroup of {cap:g} GiB (page cache counted)" if cap else
              "; every arm in a memory cgroup without a limit" if meta.get("cgroup") else "")
    lines = [f"cores {meta['cores']}, BLAS: {meta['blas']}, {meta['rounds']} rounds, "
             f"prompt {meta['prompt_tokens']} tokens, {meta['max_tokens']} decode tokens (replayed), medians{throttle}"
             f"{capped}; one bundle read: {cost['cold_ms']:.2f} ms cold, {cost['warm_ms']:.2f} ms warm"
             + (f" alone, {cost['cold_parallel_ms']:.2f} / {cost['warm_parallel_ms']:.2f} ms per bundle K at a time "
                f"on the I/O pool (the limit's rate)" if "cold_parallel_ms" in cost else "")
             + (f", --io {meta['io']}" if meta.get("io") else "")
             + (f", --slots {meta['slots']} (the streamed arms' banks)" if meta.get("slots") else "") + "; "
             f"threads: the edge0 kernels' and llama.cpp's (- : MLX's own kernels)", "",
             "| arm | dtype | kernel | threads | cache | decode tok/s | step ms | limit ms | stall ms/tok | recall | loads/step | "
             "prefill tok/s | peak MLX GiB | peak RSS GiB | peak cgroup GiB | major faults | MiB from disk | MiB read | "
             "cold | slot hits | resident experts MiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for key, s in summary.items():
        arm, cache = key.rsplit("/", 1)
        if s["killed"] == s["runs"]:
            lines.append(f"| {arm} | - | - | - | {cache} | killed: {s['killed_why']} |" + " - |" * 15)
            continue
        limit = f"{s['limit_ms_per_step']:.0f}" if "limit_ms_per_step" in s else "-"
        killed = f" (killed in {s['killed']} of {s['runs']} runs)" if s["killed"] else ""
        cgroup = f"{s['peak_cgroup_gib']:.2f}" if s["peak_cgroup_gib"] else "-"
        lines.append(f"| {arm} | {s['dtype']} | {s['kernel']} | {s['threads'] or '-'} | {cache} | {s['decode_tok_s']:.2f}{killed} | "
                     f"{s['step_ms']:.0f} | {limit} | {s['stall_ms_per_token']:.1f} | {s['recall']:.2f} | "
                     f"{s['loads_per_step']:.1f} | {s['prefill_tok_s']:.1f} | {s['peak_mlx_gib']:.3f} | "
                     f"{s['peak_rss_gib']:.3f} | {cgroup} | {s['major_faults']:.0f} | {s['disk_read_bytes'] / 2**20:.1f} | "
                     f"{s['bytes_read'] / 2**20:.1f} | {s['cold_fraction']:.2f} | {s['hit_rate']:.2f} | "
                     f"{s['resident_expert_bytes'] / 2**20:.0f} |")
    return lines
