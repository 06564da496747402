"""The engine: one opened store with its model, expert runtime, scheduler and kernel choice; it generates with
the decode loop (edge0/decode) that run, serve and chat share.

    from edge0.config import EngineConfig
    from edge0.engine import open_engine
    from edge0.decode.request import GenRequest

    with open_engine(EngineConfig(model="stores/q3")) as engine:
        req = engine.request(engine.encode_text("def fib(n):"), max_tokens=32)
        figures = engine.generate(req, emit=print)

Every method that touches MLX runs on the calling thread and blocks; an engine is used by one thread
at a time (the server gives it one worker thread).
"""

from __future__ import annotations

import dataclasses
import resource
import sys
from pathlib import Path
from typing import Callable

import mlx.core as mx

from .compute import kernels
from .compute.executors import evict_by
from .compute.kernel_choice import Kernel
from .config import EngineConfig
from .errors import ContextExceeded, Edge0Error, SettingError
from .decode.loop import generate
from .decode.request import Figures, GenRequest
from .log import log
from .model.arch import text_config, vocab_size
from .model.demo import DEMO_STORE
from .decode.cache import PromptCache
from .sched.trace import NULL


def demo_store() -> Path:
    """The built-in model: the project's own trained demo MoE (edge0/model/demo/MODEL_CARD.md)."""
    if not (DEMO_STORE / "edge0.json").exists():
        raise Edge0Error(f"{DEMO_STORE}: the built-in model is missing from this installation; reinstall edge0 "
                         "or pass --model")
    return DEMO_STORE


DEMO_NAME = "edge0-demo"  # the built-in model's name for clients (its store directory is called "store")


def model_name(store: Path) -> str:
    """The name clients use for a store's model when --model-id names none: the directory's name; the built-in
    model's is DEMO_NAME."""
    return DEMO_NAME if store.resolve() == DEMO_STORE.resolve() else store.name


def _heads_k(store: Path, k: int | None) -> int | None:
    """The K whose heads a store would serve: --k or the model's own; None where `store` is no Edge0 store."""
    from .io.manifest import read_manifest

    return (k or read_manifest(store).top_k) if (store / "edge0.json").exists() else None


def default_heads(store: Path, k: int | None) -> Path | None:
    """heads-k{K}.safetensors next to the store (K: --k or the model's own), if present."""
    k = _heads_k(store, k)
    path = store / f"heads-k{k}.safetensors" if k is not None else None
    return path if path is not None and path.exists() else None


def _own_heads(store: Path, k: int | None) -> Path | None:
    """default_heads where they decide the routing: heads the store's manifest lists but lacks are an error, not
    another routing."""
    from .io.manifest import read_manifest

    found = default_heads(store, k)
    name = f"heads-k{_heads_k(store, k)}.safetensors"
    if found is None and (store / "edge0.json").exists() and read_manifest(store).lists(name):
        raise Edge0Error(f"{store / name}: missing, though {store / 'edge0.json'} lists it (restore it, or pass "
                         "--routing native to route with the model's own router)")
    return found


def _no_heads(store: Path, k: int | None) -> str:
    """The refusal of heads routing where default_heads found none: for which K, and which heads there are."""
    k = _heads_k(store, k)
    others = sorted(p.name for p in store.glob("heads-k*.safetensors")) if k is not None else []
    if not others:
        return f"{store}: no prerouter heads next to this store; pass --heads FILE (train them with `edge0 train heads`)"
    return (f"{store}: no prerouter heads for K = {k} next to this store (it has {', '.join(others)}); pass --heads "
            f"FILE or another --k (or train them: `edge0 train heads --model {store} --k {k}`)")


def resolve(config: EngineConfig) -> EngineConfig:
    """The config with its defaults made explicit (store path, routing, predictor, heads), combinations
    checked (config.py's rules). Says on stderr when the routing default comes from heads found next to the store."""
    from .config import combine, heads_decide
    from .model.lora import resolve_lora

    config.check()
    c, r = config, config.routing
    path = Path(c.model) if c.model else demo_store()
    routing, heads = r.mode, r.heads
    if heads_decide(c):
        found = _own_heads(path, r.top_k)
        if found is not None:
            routing = "predicted"
            log.info("routing predicted by the prerouter heads", heads=str(found),
                     hint="--routing native to use the model's own router")
        elif others := sorted(p.name for p in path.glob("heads-k*.safetensors")):  # another K's: say why unused
            log.info(f"routing native: no prerouter heads for K = {_heads_k(path, r.top_k)}", has=", ".join(others),
                     hint="--k of those heads, or train heads for this K with `edge0 train heads`")
    routing, predictor = combine(c, routing)
    if predictor == "heads" and heads is None:
        found = _own_heads(path, r.top_k)
        if found is None:
            raise Edge0Error(_no_heads(path, r.top_k))
        heads = str(found)
    own = default_heads(path, r.top_k)
    lora = resolve_lora(r.lora, path, routing=routing, top_k=r.top_k,
                        default_heads=heads is not None and own is not None and Path(heads) == own)
    return dataclasses.replace(c, model=str(path), routing=dataclasses.replace(
        r, mode=routing, predictor=predictor, heads=heads, lora=lora))

class Engine:
    """A loaded store ready to generate; close it (or use `with`) to stop its threads and files."""

    def __init__(self, config: EngineConfig, store, kernel: Kernel):
        self.config, self.store, self.kernel = config, store, kernel
        self.model_id = config.serving.model_id or model_name(store.path)
        self.tokenizer = store.tokenizer
        self.eos = set(self.tokenizer.eos_token_ids)
        self.context = text_config(store.config).get("max_position_embeddings")
        self.vocab = vocab_size(store.config)  # valid token ids: [0, vocab)
        self.top_k = config.routing.top_k or store.manifest.top_k
        gib = config.serving.prompt_cache_gib
        self.prompt_cache = PromptCache(int(gib * 2**30)) if gib else None

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self, end_thread: bool = False) -> None:
        """Close the store. end_thread: also clear the calling thread's MLX streams, as a thread that used MLX
        must before the process exits; only when the process ends next (it breaks MLX on other threads)."""
        self.store.close()
        if end_thread:
            mx.clear_streams()

    # -- prompts (no MLX: any thread) -------------------------------------------------------------

    def encode_text(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """The tokenizer's chat template, or "role: content" paragraphs then "assistant:" without one."""
        tok = self.tokenizer
        if getattr(tok, "chat_template", None):
            return list(tok.apply_chat_template(messages, add_generation_prompt=True))
        text = "".join(f"{m['role']}: {m['content']}\n\n" for m in messages)
        return tok.encode(text + "assistant:")

    def check(self, req: GenRequest, what: str = "the prompt") -> None:
        """The request fits the model: a non-empty prompt of known token ids within the context; its logit bias
        names known tokens."""
        if not req.prompt:
            raise Edge0Error(f"{what} is empty (it encodes to no tokens)")
        ids = list(req.prompt) + list(req.forced or [])
        bad = [t for t in ids if not 0 <= t < (self.vocab or float("inf"))]
        if bad:
            raise Edge0Error(f"{what}: token id {bad[0]} is outside the model's vocabulary of {self.vocab}")
        bad = [t for t in (req.logit_bias or {}) if not 0 <= t < (self.vocab or float("inf"))]
        if bad:
            raise Edge0Error(f"logit_bias: token id {bad[0]} is outside the model's vocabulary of {self.vocab}")
        if self.context and len(req.prompt) + req.max_tokens > self.context:
            raise ContextExceeded(f"{what}'s {len(req.prompt)} tokens + max_tokens {req.max_tokens} exceed the "
                                  f"model's context of {self.context} tokens")

    # -- generation (MLX: the calling thread) ---------------------------------------------------------

    def generate(self, req: GenRequest, emit: Callable[[str], None] = lambda s: None,
                 cancelled: Callable[[], bool] = lambda: False) -> Figures:
        """Generate for `req`, calling emit(text) per decoded piece (see decode/loop.py generate)."""
        with self.kernel.active():
            return generate(self, req, emit, cancelled)

    def cached_prefix(self, req: GenRequest) -> tuple[list, int]:
        """(the KV cache to start from, prompt tokens it holds already): a fresh cache when nothing is reusable."""
        from mlx_lm.models.cache import make_prompt_cache

        if self.prompt_cache is not None and req.forced is None:
            cache, n = self.prompt_cache.take(req.prompt)
            if cache is not None:
                return cache, n
        return make_prompt_cache(self.store.model), 0

    def keep_prefix(self, req: GenRequest, tokens: list[int], cache: list) -> None:
        """After a generation: keep its KV cache, which holds `tokens`, for later prompts that share them."""
        if self.prompt_cache is not None and req.forced is None:
            self.prompt_cache.put(tokens, cache)

    def forced_logprobs(self, tokens: list[int]) -> mx.array:
        """(L-1, V) log-probabilities of tokens[1:] given the tokens before, decoded step by step exactly as
        served (predicted routing at t+1 depends on t); for scoring."""
        from mlx_lm.sample_utils import make_sampler

        from .decode.loop import generate_steps

        with self.kernel.active():
            steps = generate_steps(self.store.model, tokens[:1], max_tokens=len(tokens) - 1,
                                   sampler=make_sampler(0.0), runtime=self.store.runtime, forced=tokens[1:])
            return mx.stack([lp.astype(mx.float32) for _, lp in steps])

    def reset(self) -> None:
        """Bring the runtime back to a clean state after a failed generation (pending reads cancelled,
        banks consistent); raises when it cannot, and the engine should then not be used."""
        self.store.runtime.recover()

    def describe(self) -> dict:
        """What runs: routing, predictor, heads, executor, kernel, I/O (for --json and logs)."""
        c, r, rt = self.config, self.config.routing, self.store.runtime
        return {"routing": r.mode, "predictor": r.predictor if r.mode != "native" else None,
                "heads": r.heads if r.predictor == "heads" else None,
                "lora": None if r.lora in (None, "none") else r.lora, "top_k": self.top_k,
                "executor": rt.executor,
                "slots": rt.banks[0].slots if rt.banks and rt.executor in ("staged", "hot") else None,
                "held_layers": sorted(rt.held) if rt.held else None, "overlaps_steps": rt.overlaps_steps,
                "whole_layer_prefill": rt.prefill is not None, "io": self.store.reader.io,
                "io_throttle_mbps": c.io.throttle_mbps, "kernel": self.kernel.name,
                "kernel_threads": self.kernel.ext.num_threads() if self.kernel.edge0 else None,
                "dtype": str(self.store.dtype or "source").removeprefix("mlx.core."),
                "memory_budget_gib": c.io.memory_budget_gib, "model": str(self.store.path),
                "expert_gib": self.store.manifest.expert_bytes / 2**30}

    def request(self, prompt: list[int], **fields) -> GenRequest:
        return GenRequest(prompt=list(prompt), **fields)


def open_engine(config: EngineConfig, *, trace=NULL) -> Engine:
    """Load the store `config` names (the demo model by default) and build its runtime."""
    from .io.pagecache import evict
    from .model.load import load_store

    c = resolve(config)
    r, io = c.routing, c.io
    kernel = Kernel.choose(c.kernel.name)
    if c.kernel.threads:
        kernels.set_num_threads(c.kernel.threads)
    path = Path(c.model)
    slots = _slots(c, path)
    if io.cold and path.is_dir():
        for f in path.rglob("*.safetensors"):
            evict(f)
    with kernel.active():
        executor = "staged" if io.executor == "auto" and io.banks_asked() else io.executor
        store = load_store(path, dtype=c.kernel.dtype, verify=io.verify, executor=executor, slots=slots,
                           memory_budget=io.memory_budget_gib, io=io.mode, io_throttle=io.throttle_mbps,
                           build=_prefetch_builder(c, trace, slots) if r.mode != "native" else None,
                           using=[f for f in (r.heads, r.lora) if f not in (None, "none")])
    if not c.kernel.threads:  # the default for this runtime: both of 2 cores where no expert is read in decode
        kernels.set_num_threads(kernels.default_threads(resident=store.runtime.executor == "resident"),
                                kernels.default_prompt_threads())
    try:
        if io.executor == "auto" and store.runtime.executor == "resident":
            log.info("executor resident: every expert in memory", gib=round(store.runtime.resident_expert_bytes / 2**30, 3),
                     hint="--executor staged streams them from the store instead")
        if r.lora != "none":  # the adapter's branches, only when there is one: no cost otherwise
            from .model.lora import Adapter

            adapter = Adapter.load(r.lora, store.manifest, store.config, heads_file=r.heads)
            adapter.attach(store.model, Adapter.served_dtype(store.dtype))
        store.runtime.trace = trace
        evict_by(store.runtime.executors, io.evict)
        store.reader.pool.configure(workers=io.workers, trace=trace)  # every read of the store goes through it
        if r.top_k is not None:
            from .model.route_stats import moe_blocks

            for block in moe_blocks(store.model).values():
                block.top_k = r.top_k
    except BaseException:
        store.close()
        raise
    return Engine(c, store, kernel)


def _prefetch_builder(c: EngineConfig, trace, slots: int | None):
    """The runtime builder of scheduled routing (prefetch, predicted) for load_store."""
    from .model.arch import read_config
    from .model.heads import HeadSet
    from .pipeline.prefetch_runtime import build_prefetch_runtime

    r, budget = c.routing, c.io.memory_budget_gib

    def build(reader, cdtype):
        heads = None
        if r.predictor == "heads":
            heads = HeadSet.load(r.heads, reader.manifest, read_config(Path(c.model)), top_k=r.top_k).served()
        resident = r.mode == "predicted" and _resident(c, reader.manifest, cdtype)
        candidates = _candidates(c, reader.manifest, resident) if r.mode == "predicted" else None
        if resident:
            from .pipeline.resident import build_predicted_resident

            if r.read_ahead != "measured":
                log.info(f"--read-ahead {r.read_ahead}: every expert is resident, nothing is read ahead",
                         hint="--executor staged streams the experts")

            return build_predicted_resident(reader, cdtype, heads=heads, candidates=candidates,
                                            memory_budget_gib=budget)
        rt = build_prefetch_runtime(reader, cdtype, predictor=r.predictor, memory_budget_gib=budget,
                                    slots=slots, trace=trace, heads=heads, guesses=r.guesses, top_k=r.top_k,
                                    predicted_routing=r.mode == "predicted", candidates=candidates,
                                    read_ahead=r.read_ahead, placement=c.io.placement)
        if r.affinity is not None:  # the table of predictor affinity, checked against the store's layers and experts
            from .errors import SettingError as Bad
            from .pipeline.affinity import attach

            attach(rt, r.affinity, r.top_k or reader.manifest.top_k, Bad)
        return rt
    return build


def _candidates(c: EngineConfig, manifest, resident: bool) -> int:
    """The experts a head names ahead for its consumer under predicted routing, the consumer's router choosing K:
    --candidates, else 2K over resident experts (nothing is read, so more candidates cost nothing) and K when
    streamed (each candidate is read)."""
    k, e = c.routing.top_k or manifest.top_k, manifest.num_experts
    m = c.routing.candidates or (min(2 * k, e) if resident else k)
    if not k <= m <= e:
        raise SettingError(f"{{routing.candidates}} {m}: must be between K = {k} and the model's {e} experts")
    return m


def _resident(c: EngineConfig, manifest, cdtype) -> bool:
    """Predicted routing over every expert in memory: --executor resident, or auto (no bank flag) where they fit
    (compute/runtime.py auto_executor): nothing to read during decode, so nothing to schedule."""
    from .compute.runtime import auto_executor

    io = c.io
    if io.executor != "auto" or io.banks_asked():
        return io.executor == "resident"
    budget = None if io.memory_budget_gib is None else int(io.memory_budget_gib * 2**30)
    return auto_executor(manifest, cdtype, budget) == "resident"


def _slots(c: EngineConfig, path: Path) -> int | None:
    """Slots per staged bank, checked against the store before anything is allocated (K and slots at most
    E); a batch of B sequences gets 2K per sequence by default, up to E. None: the executors' default."""
    from .io.manifest import read_manifest

    top_k, slots, batch = c.routing.top_k, c.io.slots, c.serving.max_batch
    if not (path / "edge0.json").exists():
        return slots  # not a store: load_store says so
    m = read_manifest(path)
    e, k = m.num_experts, top_k or m.top_k
    if top_k is not None and top_k > e:
        raise SettingError(f"{{routing.top_k}} {top_k}: must be between 1 and the model's {e} experts")
    if slots is not None and slots > e:
        raise SettingError(f"{{io.slots}} {slots}: at most the model's {e} experts (more slots never hold more)")
    if slots is None and batch > 1:
        return min(e, 2 * k * batch)
    return slots


def memory_figures() -> dict:
    """Peak MLX allocation, peak RSS, and file-backed RSS now (GiB)."""
    gib = 2**30
    rss_file = 0
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssFile:"):
                    rss_file = int(line.split()[1]) * 1024
    except OSError:
        pass
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    return {"peak_mlx_gib": mx.get_peak_memory() / gib, "peak_rss_gib": peak_rss / gib, "file_rss_gib": rss_file / gib}
