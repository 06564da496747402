"""What a prerouter head sees when served is what it was trained on: the same features (h, the owner's routed
set at t, at t-1) for the same token, and training pairs the features at t with the consumer's router at t+1."""

import mlx.core as mx
import numpy as np

from edge0.config import EngineConfig, RoutingConfig
from edge0.engine import open_engine
from edge0.model.heads import Head, HeadSet, features
from edge0.train.head_phase import head_loss, window_features, window_targets

from tests.pipeline.test_identity import real_text

E = 32  # the demo model's experts


def test_served_features_are_the_training_features(monkeypatch):
    ids = real_text(n=48)
    served = []  # features of what each served head was given, in the order the pipeline gives it
    predict = Head.predict

    def recording(head, h, inds, prev, router):
        served.append(features(h, inds, prev, E))  # predict's own features (tests/model/test_heads.py: one node = these)
        return predict(head, h, inds, prev, router)

    monkeypatch.setattr(Head, "predict", recording)
    prompt = 24  # every step predicts (read_ahead always), warm store or not
    with open_engine(EngineConfig(routing=RoutingConfig(mode="prefetch", predictor="heads",
                                                        read_ahead="always"))) as engine:
        owners = sorted(set(engine.store.runtime.heads.owners.values()))
        with engine.kernel.active():
            from mlx_lm.sample_utils import make_sampler

            from edge0.decode.loop import generate_steps

            for _ in generate_steps(engine.store.model, ids[:prompt], max_tokens=len(ids) - prompt,
                                    sampler=make_sampler(0.0), runtime=engine.store.runtime, forced=ids[prompt:]):
                pass
            data, _ = window_targets(engine.store.model, np.array(ids, dtype=np.int32), owners)
    steps = len(ids) - prompt
    assert len(served) == steps * len(owners)
    for i, f in enumerate(served):
        step, owner = divmod(i, len(owners))
        h, _, inds = data[owners[owner]]
        want = np.array(window_features(h, inds, E))[prompt - 1 + step]  # step 0 is the prompt's last token
        got = np.array(f).reshape(-1)
        d = h.shape[-1]
        assert np.array_equal(got[d:], want[d:]), (step, owner)  # multi-hot at t and t-1, exactly
        assert np.allclose(got[:d], want[:d], rtol=1e-3, atol=1e-3), (step, owner)  # h: one token vs a window


def test_training_targets_the_consumers_router_at_the_next_token():
    """With its trainable parts at zero a head is router_M(h_N): its loss must be KL(router_M at t+1 || that at t)."""
    rng = np.random.default_rng(0)
    t, d = 12, 16

    class Manifest:
        num_experts = E
        layers = [type("L", (), {"layer": i, "checksums": []})() for i in (0, 1)]

    heads = HeadSet.create(Manifest(), {"hidden_size": d}, top_k=4, consumers=[1])
    gate = mx.array(rng.normal(size=(E, d)).astype(np.float32))

    class Block:
        def logits(self, x):
            return x @ gate.T

    h0 = mx.array(rng.normal(size=(t, d)).astype(np.float32))
    target = mx.array(rng.normal(size=(t, E)).astype(np.float32))
    inds = mx.array(rng.integers(0, E, size=(t, 4)).astype(np.uint32))
    data = {0: (h0, None, inds), 1: (None, target, None)}
    loss = float(head_loss(heads, heads.module(), data, {1: Block()}, E))
    logq = log_softmax(Block().logits(h0[:-1]))
    want = float((mx.exp(log_softmax(target[1:])) * (log_softmax(target[1:]) - logq)).sum(-1).mean())
    assert abs(loss - want) < 1e-5
    shifted = float((mx.exp(log_softmax(target[:-1])) * (log_softmax(target[:-1]) - logq)).sum(-1).mean())
    assert abs(loss - shifted) > 1e-2  # the target at t would give another loss


def log_softmax(x: mx.array) -> mx.array:
    return x - mx.logsumexp(x, axis=-1, keepdims=True)
