"""What a served model needs, as typed values: `EngineConfig` (the store, and its routing, I/O, kernel and
serving settings, each a nested dataclass) and `Sampling` (how tokens are drawn). Commands build these from their
flags (edge0/cli/flags.py); `open_engine` (edge0/engine.py) takes an EngineConfig. Values are checked here, once,
before anything is loaded; limits that need the store (K, slots) are checked when it is opened.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

from ..compute.choices import (DTYPES, EVICTIONS, EXECUTORS, IO_MODES, KERNELS, PLACEMENTS, PREDICTORS, READ_AHEAD, ROUTINGS,
                      Dtype, Eviction, Executor, IoMode, KernelChoice, Placement, Predictor, ReadAhead, Routing)
from ..compute.machine import machine_cores, memory_gib
from ..errors import Edge0Error, SettingError
from ..io.pool import IO_WORKERS  # io/ imports nothing above it, so its pool's default is defined there

MAX_IO_WORKERS = 64
MAX_BATCH = 64  # sequences in one decode step
MAX_TEMP = 2.0  # as OpenAI's API (the server's bound too): above it sampling is close to uniform noise


@dataclass(frozen=True)
class RoutingConfig:
    """Who decides each layer's experts, and what is read ahead for them."""

    mode: Routing | None = None  # native | prefetch | predicted; None: predicted when the store has heads
    predictor: Predictor | None = None  # what prefetch reads ahead with: repeat | next-router (default) | heads
    heads: str | None = None  # head file; None: heads-k{K}.safetensors next to the store
    guesses: int | None = None  # prefetch: experts read ahead per predicted set (the predictor's top N); None: K
    affinity: str | None = None  # predictor affinity: the co-activation table of `edge0 train affinity`
    candidates: int | None = None  # predicted: experts each head names ahead, the router choosing K; None: 2K resident, else K
    read_ahead: ReadAhead = "measured"  # measured: read ahead while it measures faster and reads come from the disk | always | never
    lora: str | None = None  # recovery adapter; None: lora-k{K}.safetensors next to the store with its heads; "none": off
    top_k: int | None = None  # routed experts per token; None: the model's own


@dataclass(frozen=True)
class IOConfig:
    """Where the experts wait (executor, slot banks, budget) and how the store is read."""

    executor: Executor = "auto"  # auto (native, predicted: resident when every expert fits, else staged) | exact | staged | hot | resident
    slots: int | None = None  # slots per staged bank; None: 2K
    placement: Placement = "auto"  # streamed, with heads: auto holds every expert of the layers no head routes | even
    evict: Eviction = "lfu"  # which held expert a slot bank replaces: lfu (least often used lately) | lru
    memory_budget_gib: float | None = None  # most expert bytes held resident
    mode: IoMode = "pread"  # pread | mmap | direct
    workers: int = IO_WORKERS  # I/O pool threads
    throttle_mbps: float | None = None  # cap on read bandwidth (experiments); None: none
    verify: bool = False  # check every bundle's and the resident files' checksums
    cold: bool = False  # evict the store from the page cache before loading

    def banks_asked(self) -> bool:
        """A setting that arranges slot banks was given: under executor auto they stream (staged) instead of being
        dropped where every expert would fit in memory."""
        return self.slots is not None or self.placement != "auto" or self.evict != "lfu"


@dataclass(frozen=True)
class KernelConfig:
    """What computes: the kernels, their threads, the dtype of non-quantized tensors."""

    name: KernelChoice | None = None  # auto | mlx | edge0; None: $EDGE0_KERNEL, else auto
    threads: int | None = None  # threads of the edge0 kernels; None: their default
    dtype: Dtype = "auto"  # compute dtype of non-quantized tensors


@dataclass(frozen=True)
class ServingConfig:
    """How generations are served: the name clients use, the prompt cache, the decode batch."""

    model_id: str | None = None  # the name clients use (serve); None: the store directory's name
    prompt_cache_gib: float = 1.0  # KV caches kept for prompts that share a prefix (0: off)
    max_batch: int = 1  # sequences decoded together in one step (serve); 1: one generation at a time


@dataclass(frozen=True)
class EngineConfig:
    """Everything `open_engine` needs, nested by concern; every field has the default a user gets with no flag.
    Settings are named by their path (routing.mode, io.slots) in SettingError's messages and cli/flags.py's
    SETTING_FLAGS: `EngineConfig(model="stores/q3", routing=RoutingConfig(mode="predicted"))`."""

    model: str | None = None  # Edge0 store directory; None: the built-in demo model
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    io: IOConfig = field(default_factory=IOConfig)
    kernel: KernelConfig = field(default_factory=KernelConfig)
    serving: ServingConfig = field(default_factory=ServingConfig)

    def __post_init__(self):
        for f in fields(self):  # the flat spelling (routing="predicted") would fail later, far from the cause
            if f.name != "model" and not isinstance(value := getattr(self, f.name), f.default_factory):
                raise TypeError(f"EngineConfig {f.name}={value!r}: expected {f.default_factory.__name__}(...), as in "
                                "routing=RoutingConfig(mode=\"predicted\")")

    @classmethod
    def of(cls, settings: dict) -> "EngineConfig":
        """The config of settings named by their paths ({"model": DIR, "routing.mode": "predicted", "io.slots": 4}),
        the rest defaults: how a table of settings builds one (the command line's, cli/flags.py SETTING_FLAGS)."""
        parts: dict[str, dict] = {}
        for path, value in settings.items():
            section, _, name = path.rpartition(".")
            parts.setdefault(section, {})[name] = value
        sections = {f.name: f.default_factory for f in fields(cls) if f.name != "model"}
        if unknown := sorted(set(parts) - {"", *sections}):
            raise TypeError(f"EngineConfig.of: no settings section {unknown[0]!r} (choose {', '.join(sections)})")
        return cls(**parts.get("", {}), **{s: sections[s](**kw) for s, kw in parts.items() if s})

    def check(self) -> "EngineConfig":
        """Raise SettingError naming the setting of the first bad value; returns self."""
        bad, r, io, k, s = SettingError, self.routing, self.io, self.kernel, self.serving
        _choice("{routing.mode}", r.mode, ROUTINGS, optional=True, error=bad)
        _choice("{routing.predictor}", r.predictor, PREDICTORS, optional=True, error=bad)
        _choice("{io.executor}", io.executor, EXECUTORS, error=bad)
        _choice("{io.mode}", io.mode, IO_MODES, error=bad)
        _choice("{routing.read_ahead}", r.read_ahead, READ_AHEAD, error=bad)
        _choice("{io.placement}", io.placement, PLACEMENTS, error=bad)
        _choice("{io.evict}", io.evict, EVICTIONS, error=bad)
        _choice("{kernel.dtype}", k.dtype, DTYPES, error=bad)
        _choice("{kernel.name}", k.name, KERNELS, optional=True, error=bad)
        _int("{routing.top_k}", r.top_k, 1, None, error=bad)
        _int("{routing.guesses}", r.guesses, 1, None, error=bad)
        _int("{routing.candidates}", r.candidates, 1, None, error=bad)
        _int("{io.slots}", io.slots, 1, None, error=bad)
        _int("{io.workers}", io.workers, 1, MAX_IO_WORKERS, error=bad)
        _int("{kernel.threads}", k.threads, 1, machine_cores(), "the machine's cores", error=bad)
        _float("{io.memory_budget_gib}", io.memory_budget_gib, 0.0, memory_gib(), "the machine's memory",
               lo_open=False, error=bad)
        _float("{serving.prompt_cache_gib}", s.prompt_cache_gib, 0.0, memory_gib(), "the machine's memory",
               lo_open=False, error=bad)
        _int("{serving.max_batch}", s.max_batch, 1, MAX_BATCH, error=bad)
        _float("{io.throttle_mbps}", io.throttle_mbps, 0.0, math.inf, "", lo_open=True,
               why=" (omit the flag for no cap)", error=bad)
        for name, given, banks in (("io.slots", io.slots is not None, ("staged",)),
                                   ("io.placement", io.placement != "auto", ("staged",)),
                                   ("io.evict", io.evict != "lfu", ("staged", "hot"))):
            if given and io.executor not in ("auto", *banks):  # it would be dropped without a word
                raise bad(f"{{{name}}} and {{io.executor}} {io.executor}: {{{name}}} arranges {' and '.join(banks)} "
                          f"slot banks; omit it, or use {{io.executor}} {banks[0]}")
        return self


HEADS_ROUTE_UNDER = ("auto", "staged", "resident")  # the executors under which heads route unless told otherwise


def heads_decide(c: EngineConfig) -> bool:
    """Whether the store's own heads, where they have them, decide c's routing: nothing names the routing, the heads
    or the predictor, and the executor lets heads route."""
    r = c.routing
    return r.mode is None and r.heads is None and r.predictor is None and c.io.executor in HEADS_ROUTE_UNDER


def combine(c: EngineConfig, routing: Routing | None) -> tuple[Routing, Predictor | None]:
    """c's routing and predictor, each default that follows from the other settings made explicit, every
    combination checked (SettingError naming the settings of the first that does not go together). routing:
    c.routing.mode, or "predicted" where the store's own heads decide it (heads_decide; the engine looks for them)."""
    predictor, heads = c.routing.predictor, c.routing.heads
    if routing is None and heads is not None and predictor is None and c.io.executor in HEADS_ROUTE_UNDER:
        routing = "predicted"  # the heads named route, as the store's own do by default
    if heads is not None and routing == "prefetch" and predictor is None:
        predictor = "heads"  # heads names what to read ahead with
    if heads is not None and routing == "prefetch" and predictor != "heads":
        raise SettingError(f"{{routing.heads}}: {{routing.predictor}} {predictor} does not read heads (use "
                           "{routing.predictor} heads)")
    if c.routing.affinity is not None and routing == "prefetch" and predictor is None:
        predictor = "affinity"  # the table names what to read ahead with
    routing = routing or "native"
    _check_routing(c, routing, predictor)
    if routing != "native":
        predictor = "heads" if routing == "predicted" else predictor or "next-router"
    return routing, predictor


def _check_routing(c: EngineConfig, routing: Routing, predictor: Predictor | None) -> None:
    """The settings that only some routings read, and the executors each routing fills."""
    r, executor, placement = c.routing, c.io.executor, c.io.placement
    if r.guesses is not None and routing != "prefetch":
        raise SettingError(f"{{routing.guesses}} {r.guesses}: only used with {{routing.mode}} prefetch (other routings "
                           "read what they route)")
    if r.read_ahead != "measured" and routing == "native":
        raise SettingError(f"{{routing.read_ahead}} {r.read_ahead}: only used with {{routing.mode}} prefetch or "
                           "predicted")
    if placement != "auto" and routing == "native":
        raise SettingError(f"{{io.placement}} {placement}: only used with {{routing.mode}} prefetch or predicted (and "
                           "heads)")
    if r.candidates is not None and routing != "predicted":
        raise SettingError(f"{{routing.candidates}} {r.candidates}: only used with {{routing.mode}} predicted")
    if r.affinity is not None and (routing != "prefetch" or predictor != "affinity"):
        raise SettingError("{routing.affinity}: only read by {routing.mode} prefetch {routing.predictor} affinity")
    if predictor == "affinity" and r.affinity is None:
        raise SettingError("{routing.predictor} affinity reads a co-activation table: give it {routing.affinity} FILE "
                           "(from `edge0 train affinity`)")
    if predictor is not None and routing == "native":
        raise SettingError(f"{{routing.predictor}} {predictor}: only used with {{routing.mode}} prefetch or predicted")
    if routing == "predicted" and predictor not in (None, "heads"):
        raise SettingError(f"{{routing.mode}} predicted routes with trained heads; {{routing.predictor}} {predictor} "
                           "does not apply")
    if routing == "prefetch" and executor not in ("auto", "staged"):
        raise SettingError(f"{{routing.mode}} prefetch fills staged slot banks; {{io.executor}} {executor} does not "
                           "apply")
    if routing == "predicted" and executor not in HEADS_ROUTE_UNDER:
        raise SettingError(f"{{routing.mode}} predicted fills staged slot banks (or, {{io.executor}} resident, routes "
                           f"every expert in memory); {{io.executor}} {executor} does not apply")
    if r.heads is not None and routing == "native":
        why = "" if r.mode else f" (heads route with {{io.executor}} auto, staged or resident, not {executor})"
        raise SettingError("{routing.heads}: used with {routing.mode} predicted or {routing.mode} prefetch "
                           "{routing.predictor} heads" + why)


@dataclass(frozen=True)
class Sampling:
    """How tokens are drawn when a request does not say."""

    max_tokens: int = 64  # tokens to generate
    temp: float = 0.0  # 0: greedy
    top_p: float = 1.0  # 1: off
    top_k: int = 0  # 0: off
    seed: int | None = 0  # None: continue the random state
    stop: tuple[str, ...] = field(default_factory=tuple)  # stop strings
    presence_penalty: float = 0.0  # 0: off
    frequency_penalty: float = 0.0  # 0: off

    def check(self) -> "Sampling":
        _int("--max-tokens", self.max_tokens, 1, None)
        _float("--temp", self.temp, 0.0, MAX_TEMP, "", lo_open=False, why=" (0 is greedy)")
        _float("--top-p", self.top_p, 0.0, 1.0, "", lo_open=True)
        _int("--top-k", self.top_k, 0, None)
        _int("--seed", self.seed, 0, 2**64 - 1)
        _float("--presence-penalty", self.presence_penalty, -2.0, 2.0, "", lo_open=False)
        _float("--frequency-penalty", self.frequency_penalty, -2.0, 2.0, "", lo_open=False)
        return self

    def check_context(self, context: int | None) -> "Sampling":
        """--max-tokens within what the model's context holds after a one-token prompt: run's and serve's one
        range check, once the model is loaded (context None: unknown, no bound)."""
        _int("--max-tokens", self.max_tokens, 1, context - 1 if context else None,
             f"the model's context of {context} tokens holds the prompt, at least one token, and the answer")
        return self

    def penalties(self) -> dict:
        """The GenRequest fields of the penalties."""
        return {"presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty}


def _choice(flag: str, value, allowed: tuple, optional: bool = False, error=Edge0Error) -> None:
    if (value is None and optional) or value in allowed:
        return
    raise error(f"{flag} {value}: choose {', '.join(allowed)}")


def _int(flag: str, value, lo: int, hi: int | None, hi_name: str = "", error=Edge0Error) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise error(f"{flag} {value!r}: expected an integer")
    if value < lo:
        raise error(f"{flag} {value}: must be at least {lo}")
    if hi is not None and value > hi:
        raise error(f"{flag} {value}: must be at most {hi}" + (f" ({hi_name})" if hi_name else ""))


def _float(flag: str, value, lo: float, hi: float, hi_name: str, *, lo_open: bool, why: str = "",
           error=Edge0Error) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise error(f"{flag} {value}: expected a finite number{why}")
    if value < lo or (lo_open and value == lo):
        raise error(f"{flag} {value}: must be {'more than' if lo_open else 'at least'} {lo:g}{why}")
    if value > hi:
        raise error(f"{flag} {value}: must be at most {hi:g}" + (f" ({hi_name}, GiB)" if hi_name else "") + why)
