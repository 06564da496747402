"""The read-ahead gate (pipeline/gate.py): decode steps alternate between reading ahead and not in windows, paused
first, the faster mode holds (longer while the measurement confirms it), a probe losing decisively ends early, a
change of regime flips it, the steps right after a switch and the time between generations are not measured. In the runtime: a gated step reads nothing ahead
(the scheduler's reads ahead stop growing), prefetch still equals native bit for bit, and predicted routing
equals its run that never pauses. The clock is faked so that the choices are deterministic."""

import subprocess
import sys
from collections import deque

import numpy as np
import pytest

from edge0.config import EngineConfig, IOConfig, RoutingConfig, ServingConfig
from edge0.engine import open_engine
from edge0.pipeline.gate import CertainReads, NoReadAhead, ReadAheadGate

from .test_identity import real_text
from .test_pause import ahead, forced

G = ReadAheadGate
PROBE = G.SETTLE + G.WINDOW  # steps of a measured window, the settling ones included


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def drive(gate: ReadAheadGate, clock: Clock, cost, steps: int) -> list[bool]:
    """Run `steps` steps, each taking cost(i, ahead) seconds; returns each step's mode (True: read ahead)."""
    modes = []
    gate.step()  # the first boundary starts the clock
    for i in range(steps):
        modes.append(gate.ahead)
        clock.t += cost(i, gate.ahead)
        gate.step()
    return modes


def runs(modes: list[bool]) -> list[tuple[bool, int]]:
    """(mode, length) of each stretch of equal modes."""
    out = []
    for m in modes:
        if out and out[-1][0] == m:
            out[-1] = (m, out[-1][1] + 1)
        else:
            out.append((m, 1))
    return out


def test_the_faster_mode_holds_and_its_hold_doubles_while_confirmed():
    clock = Clock()
    gate = G(clock)
    modes = drive(gate, clock, lambda i, a: 0.0012 if a else 0.001, 400)  # reading ahead costs 20% (not DECISIVE)
    got = runs(modes)
    # paused (measured), ahead (the probe, slower: paused holds 64), ahead probed again, paused 128, ...
    assert got[:6] == [(False, PROBE), (True, PROBE), (False, 2 * G.HOLD), (True, PROBE), (False, 4 * G.HOLD),
                       (True, PROBE)]
    assert gate.choices == 3 and gate.flips == 0
    assert gate.summary()["ahead_step_ms"] == pytest.approx(1.2) and gate.summary()["paused_step_ms"] == pytest.approx(1.0)
    assert len(gate.summary()["history"]) == gate.choices


def test_a_mode_that_loses_decisively_is_probed_less_often():
    """Reading ahead twice as slow (over DECISIVE): each probe of it ends after ABORT_AFTER measured steps and each
    confirmation holds 4x the hold before, so over 256 steps (a generation of `edge0 run`) 10 read ahead, where
    whole probes and doubling holds read 30 ahead."""
    clock = Clock()
    gate = G(clock)
    modes = drive(gate, clock, lambda i, a: 0.002 if a else 0.001, 600)
    short = G.SETTLE + G.ABORT_AFTER
    assert runs(modes)[:6] == [(False, PROBE), (True, short), (False, 4 * G.HOLD), (True, short), (False, G.MAX_HOLD),
                               (True, short)]
    assert modes[:256].count(True) == 2 * short
    gate = G(clock := Clock())
    modes = drive(gate, clock, lambda i, a: 0.0012 if a else 0.001, 256)
    assert modes.count(True) == 3 * PROBE


def test_reading_ahead_that_pays_reads_ahead_nearly_always():
    clock = Clock()
    gate = G(clock)
    modes = drive(gate, clock, lambda i, a: 0.001 if a else 0.002, 3000)
    assert gate.flips == 1 and gate.ahead  # the first choice, after the paused first steps
    assert modes.count(False) <= 0.03 * len(modes)  # the probes of the other mode: short and ever rarer


def test_a_change_of_regime_flips_the_choice_and_the_hold_starts_over():
    clock = Clock()
    gate = G(clock)
    flip_at = 300  # reading ahead pays until the disk's regime changes (say, the store fell out of the page cache)
    modes = drive(gate, clock, lambda i, a: (0.001 if a else 0.002) if i < flip_at else (0.003 if a else 0.002), 900)
    after = modes[flip_at:]
    # at most one hold (MAX_HOLD) and a probe later, it pauses for a hold (probing the other mode after it)
    switched = next(i for i in range(len(after)) if not any(after[i:i + G.HOLD]))
    assert switched <= G.MAX_HOLD + PROBE
    assert gate.flips == 2 and not gate.ahead


@pytest.mark.parametrize("paused_cost, flips", [(0.95, 1), (0.8, 2)])
def test_a_probe_takes_over_only_when_faster_by_the_margin(paused_cost, flips):
    """A noisy disk's window is no proof: once a mode holds (here reading ahead, 20% faster at the first choice), a
    probe 5% faster (under MARGIN) keeps it, 20% faster takes over."""
    clock = Clock()
    gate = G(clock)
    first = 2 * PROBE  # the paused first steps and the probe of reading ahead
    drive(gate, clock, lambda i, a: 0.001 if a else (0.0012 if i < first else 0.001 * paused_cost), first + G.HOLD + PROBE)
    assert gate.choices == 2 and gate.flips == flips and gate.ahead == (flips == 1)
    assert gate.summary()["history"][-1] == (1.0, round(paused_cost, 2), flips == 1)


@pytest.mark.parametrize("ahead_cost", [0.95, 1.05])
def test_the_first_choice_takes_the_faster_mode(ahead_cost):
    """No mode holds yet at the first choice: the faster one is taken, by any margin (with MARGIN, the paused first
    steps would keep a disk that reading ahead helps by 5-10% from ever reading ahead)."""
    clock = Clock()
    gate = G(clock)
    drive(gate, clock, lambda i, a: 0.001 * ahead_cost if a else 0.001, 2 * PROBE)
    assert gate.choices == 1 and gate.ahead == (ahead_cost < 1)


def test_the_steps_after_a_switch_are_not_measured():
    """The first SETTLE steps after a switch cost what the previous mode left (nothing read ahead yet, or plans
    still consumed): taken as measured, they would choose the wrong mode here (a probe of WINDOW steps did)."""
    clock = Clock()
    gate = G(clock)
    since = {"mode": None, "n": 0}

    def cost(i, a):
        since["n"] = since["n"] + 1 if since["mode"] == a else 1
        since["mode"] = a
        if since["n"] <= G.SETTLE:
            return 0.010 if not a else 0.0005  # paused: its first steps slow; ahead: its first steps fast
        return 0.002 if a else 0.001

    drive(gate, clock, cost, PROBE * 2)
    assert gate.choices == 1 and not gate.ahead


def test_the_time_between_generations_is_not_measured():
    clock = Clock()
    gate = G(clock)
    gate.step()
    for i in range(PROBE * 2):
        if i == PROBE + G.SETTLE + 1:  # mid-probe of reading ahead: a new generation after a long idle
            clock.t += 60.0
            gate.restart()
            gate.step()  # the new generation's first boundary
        clock.t += 0.002 if gate.ahead else 0.001
        gate.step()
    assert gate.choices == 1 and not gate.ahead
    assert gate.summary()["paused_step_ms"] == pytest.approx(1.0)
    assert max(max(t) for t in gate.times.values()) < 1.0  # the idle minute is no step


def test_a_change_of_batch_size_late_in_a_hold_leaves_no_figure_to_beat():
    """A served batch shrank 3 steps before the hold's end (steps 4x faster after it): without starting the
    windows over, the held mode's window is mostly the big batch's steps and the probe (the small batch's) wins
    by far; with them started over, the held window is too short to judge and the held mode goes on."""
    for resized in (False, True):
        clock = Clock()
        gate = G(clock)
        gate.step()
        for i in range(2 * PROBE + 1):
            if i == PROBE - 3 and resized:
                gate.resize(2)  # a batch of 3 became 2 (as far as the gate knows: it was 1)
            big = i < PROBE - 3
            clock.t += (0.004 if big else 0.001) * (1.0 if gate.ahead else 1.1)  # reading ahead pays a little
            gate.step()
        assert (gate.choices, gate.flips, gate.ahead) == ((0, 0, False) if resized else (1, 1, True))


def test_a_change_of_batch_size_gives_up_a_probe_and_is_not_timed():
    clock = Clock()
    gate = G(clock)
    gate.step()
    modes = []
    for i in range(PROBE + 3 + G.HOLD + 2):
        if i == PROBE + 3:  # mid-probe of reading ahead: a sequence joins (its prompt took 5 s)
            gate.resize(2)
            clock.t += 5.0
        modes.append(gate.ahead)
        clock.t += 0.001 if gate.ahead else 0.002
        gate.step()
    # the held mode resumes for a hold (the step across the change untimed, so one more), then the probe again
    assert runs(modes) == [(False, PROBE), (True, 3), (False, G.HOLD + 1), (True, 1)]
    assert gate.choices == 0 and max(max(t, default=0) for t in gate.times.values()) < 1.0


def test_one_clients_requests_in_turn_keep_the_windows():
    """serve with one client: each request joins an idle batch (one row, as the one before it) after idle time;
    its prompt is not timed, and its steps add to the windows, so short answers still lead to a choice."""
    clock = Clock()
    gate = G(clock)
    for request in range(8):  # 6 decode steps each: none alone fills a probe
        clock.t += 30.0  # idle, then the prompt
        gate.restart()
        gate.resize(1)
        gate.step()
        for _ in range(6):
            clock.t += 0.002 if gate.ahead else 0.001
            gate.step()
    assert gate.choices >= 1 and not gate.ahead
    assert max(max(t, default=0) for t in gate.times.values()) < 1.0


class SteppedClock:
    """A fake clock for a real runtime: each step boundary reads it once; a step costs 1 ms in the mode named fast
    (paused or reading ahead), 2 ms in the other."""

    def __init__(self, rt, fast_mode_paused: bool):
        self.rt, self.paused_fast, self.t = rt, fast_mode_paused, 0.0

    def __call__(self):
        self.t += 0.001 if self.rt.paused == self.paused_fast else 0.002
        return self.t


@pytest.fixture(scope="module")
def text():
    ids = real_text(64)
    with open_engine(EngineConfig(routing=RoutingConfig(mode="native"), io=IOConfig(executor="staged"))) as engine:
        return ids, forced(engine, ids)


@pytest.mark.parametrize("routing", ["prefetch", "predicted"])
def test_gated_steps_read_nothing_ahead_and_change_no_output(text, routing):
    """Under a slow disk (every read costs: only the gate pauses) with a clock on which paused steps are the
    faster: the gate pauses but for its probe of reading ahead (ended early: it loses decisively), its steps plan no
    read ahead, and the log-probabilities are native's (prefetch) or those of predicted routing that always reads
    ahead."""
    ids, native = text
    config = {"routing.mode": routing, "io.throttle_mbps": 400}
    if routing == "prefetch":
        config["routing.predictor"] = "heads"
    else:
        config["io.executor"] = "staged"
    with open_engine(EngineConfig.of({"routing.read_ahead": "always", **config})) as engine:
        want = native if routing == "prefetch" else forced(engine, ids)
    with open_engine(EngineConfig.of(config)) as engine:
        rt = engine.store.runtime
        rt.gate.clock = SteppedClock(rt, fast_mode_paused=True)
        seen = []  # (step, paused, reads ahead so far)
        got = forced(engine, ids, lambda i, rt: seen.append((i, rt.paused, ahead(rt))))
    assert np.array_equal(got, want)
    steps = len(ids) - 1
    # steps 1-10 paused, 11-15 the probe of reading ahead (twice as slow, DECISIVE: ended after ABORT_AFTER measured
    # steps, the paused mode holds 4 HOLD, past the end)
    assert rt.gated_steps == rt.paused_steps == steps - G.SETTLE - G.ABORT_AFTER and steps == 63
    assert rt.gate.choices >= 1 and not rt.gate.ahead
    # a paused stretch (after its first step, which may consume what was planned before it) reads nothing ahead
    # under prefetch; under predicted routing only the routing heads' reads, planned at the step's end
    paused = [(i, n) for i, p, n in seen if p]
    later = [(i, n) for (i, n), (j, _) in zip(paused[1:], paused) if i == j + 1]
    grew = sum(n - m for (i, n), (j, m) in zip(later[1:], later) if i == j + 1 and n > m)
    if routing == "prefetch":
        assert later and grew == 0
    else:
        assert later


@pytest.mark.parametrize("routing", ["prefetch", "predicted"])
def test_read_ahead_never_pauses_every_step_and_changes_no_output(text, routing):
    """--read-ahead never under a slow disk: every decode step paused from the first; prefetch reads nothing ahead
    (native's reads, native's numbers), predicted routing only its heads' routing (its `always` run's numbers)."""
    ids, native = text
    config = {"routing.mode": routing, "io.throttle_mbps": 400}
    config |= {"routing.predictor": "heads"} if routing == "prefetch" else {"io.executor": "staged"}
    with open_engine(EngineConfig.of({"routing.read_ahead": "always", **config})) as engine:
        want = native if routing == "prefetch" else forced(engine, ids)
    with open_engine(EngineConfig.of({"routing.read_ahead": "never", **config})) as engine:
        rt = engine.store.runtime
        got = forced(engine, ids)
    assert np.array_equal(got, want)
    assert rt.paused_steps == rt.gated_steps == len(ids) - 1
    assert (ahead(rt) == 0) == (routing == "prefetch")


@pytest.mark.parametrize("predictor", ["next-router", "heads"])
def test_banks_that_hold_every_expert_read_nothing_ahead(text, predictor):
    """32 slots a layer on the demo (E = 32) under a slow disk: once filled, a bank holds every expert and nothing is
    left to read ahead, so the measured gate is `never` (the gate probed and read ahead at 79 of 256 steps from the
    disk, decoding at 0.88x native): no fill is read ahead, the log-probabilities stay native's. Predicted routing
    keeps its gate (its reads ahead are its routing's)."""
    ids, native = text
    with open_engine(EngineConfig(routing=RoutingConfig(mode="prefetch", predictor=predictor),
                                  io=IOConfig(executor="staged", slots=32, throttle_mbps=400))) as engine:
        rt = engine.store.runtime
        assert isinstance(rt.gate, NoReadAhead)
        summary = rt.gate.summary()  # --json's read_ahead says so (it said nothing of the mode)
        assert summary["mode"] == "never" and "every streamed bank holds every expert" in summary["why"]
        got = forced(engine, ids)
    assert np.array_equal(got, native) and ahead(rt) == 0 and rt.paused_steps == len(ids) - 1
    with open_engine(EngineConfig(routing=RoutingConfig(mode="prefetch", predictor=predictor),
                                  io=IOConfig(executor="staged", slots=28))) as engine:
        gate = engine.store.runtime.gate  # 28 slots: some layer's bank is short of E
        assert type(gate) is ReadAheadGate and gate.summary()["mode"] == "measured" and "why" not in gate.summary()
    with open_engine(EngineConfig(routing=RoutingConfig(mode="predicted"),
                                  io=IOConfig(executor="staged", slots=32))) as engine:
        assert not isinstance(engine.store.runtime.gate, NoReadAhead)


def test_reading_ahead_measured_faster_is_kept(text):
    ids, want = text
    with open_engine(EngineConfig(routing=RoutingConfig(mode="prefetch", predictor="heads"),
                                  io=IOConfig(throttle_mbps=400))) as engine:
        rt = engine.store.runtime
        rt.gate.clock = SteppedClock(rt, fast_mode_paused=False)
        got = forced(engine, ids)
    assert np.array_equal(got, want)
    # the paused first steps only (the first decode step's boundary starts the gate's clock: PROBE more)
    assert rt.gated_steps == 1 + PROBE and rt.gate.ahead and rt.gate.flips == 1


def test_read_ahead_over_resident_experts_says_it_reads_nothing():
    """The built-in model's default keeps every expert resident: --read-ahead has nothing to read, and says so."""
    out = subprocess.run([sys.executable, "-m", "edge0.run", "--read-ahead", "always", "--max-tokens", "2"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "--read-ahead always: every expert is resident, nothing is read ahead" in out.stderr


def test_a_served_batchs_joins_and_leaves_are_not_timed_as_steps():
    """serve --max-batch: a newcomer's prompt runs between two decode steps of the batch, and a step after a join
    or a leave computes another batch size: the gate times none of them as a step of its windows (here each
    join costs 10 s on the clock)."""
    from tests.test_batching import PROMPTS, run_batch

    # (32 slots, batch 4's default, read nothing ahead)
    with open_engine(EngineConfig(routing=RoutingConfig(mode="prefetch", predictor="heads"),
                                  io=IOConfig(throttle_mbps=400, slots=24),
                                  serving=ServingConfig(max_batch=4, prompt_cache_gib=0))) as engine:
        rt = engine.store.runtime
        clock, timed = Clock(), []

        class Recorded(deque):
            def append(self, x):
                timed.append(x)
                super().append(x)

        rt.gate.clock, rt.gate.times = clock, {m: Recorded(maxlen=G.WINDOW) for m in (True, False)}
        join = rt.join

        def slow_join(parts):
            clock.t += 10.0
            join(parts)

        def tick():
            clock.t += 0.001
            next_step()

        next_step, rt.join, rt.next_step = rt.next_step, slow_join, tick
        run_batch(engine, PROMPTS, max_batch=4, stagger=True)
    assert len(timed) >= 8 and max(timed) < 1.0


def test_certain_reads_always_read_ahead_and_pause_warm_only_for_small_bundles():
    small, big = CertainReads(50 * 1024), CertainReads(5 << 20)  # the demo's bundles, the workload's
    assert small.step() and big.step()  # nothing is guessed: every step reads ahead while reads come from the disk
    assert small.warm_pause and not big.warm_pause and ReadAheadGate().warm_pause
