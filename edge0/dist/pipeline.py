"""Pipeline parallel: each rank runs a contiguous range of decoder layers; the hidden state goes rank to rank.

Rank 0 embeds the tokens; each rank runs its layers and sends the hidden state (and the features of a prerouter
head whose consumer is the next rank's first MoE layer, dist/boundary.py) to the next; the last rank alone holds the
final norm and output head (and the embedding, where the head is tied to it) and its logits of a decode step go to
every rank with one all_gather, so every rank runs the same decode loop on the same bits (temperature sampling too:
one seed). Shapes: B rows, T tokens, D hidden, V vocabulary.

The model is mlx-lm's own, its embedding, final norm and head wrapped (Entry, Exit, Head): the decode loop needs no
change.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..errors import Edge0Error
from ..model.load import decoder, embed_name, head_owner

_DTYPES = (mx.float32, mx.float16, mx.bfloat16)  # a hidden state's or logits' dtype, by index between ranks


class Wire:
    """What a rank sends its successor each forward: the hidden state, then each crossing head's features; all as
    one message of bytes (one send, one latency on the link), split again on the other side."""

    def __init__(self, hidden: int, dtype: mx.Dtype, top_k: int, heads: int):
        self.hidden, self.dtype, self.top_k, self.heads = hidden, dtype, top_k, heads

    def parts(self, b: int, t: int) -> list[tuple[tuple, mx.Dtype]]:
        """(shape, dtype) of each part of a message for B rows of T tokens: h, then (x, inds, prev) per head on
        a decode step (T = 1: heads predict one token ahead)."""
        out = [((b, t, self.hidden), self.dtype)]
        if t == 1:
            for _ in range(self.heads):
                out += [((b, 1, self.hidden), self.dtype), ((b, 1, self.top_k), mx.uint32),
                        ((b, 1, self.top_k), mx.uint32)]
        return out

    def nbytes(self, b: int, t: int) -> int:
        return sum(_count(shape) * dtype.size for shape, dtype in self.parts(b, t))

    def pack(self, arrays: list[mx.array]) -> mx.array:
        return mx.concatenate([a.reshape(-1).view(mx.uint8) for a in arrays]) if len(arrays) > 1 else \
            arrays[0].reshape(-1).view(mx.uint8)

    def unpack(self, raw: mx.array, b: int, t: int) -> list[mx.array]:
        out, at = [], 0
        for shape, dtype in self.parts(b, t):
            n = _count(shape) * dtype.size
            out.append(raw[at:at + n].view(dtype).reshape(shape))
            at += n
        return out


def _count(shape: tuple) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


class Entry(nn.Module):
    """The embedding on rank 0; on the other ranks, the hidden state received from the rank before. A tied output
    head's logits on every rank (the last rank's, gathered)."""

    def __init__(self, embed: nn.Module | None, stage: "Stage"):
        super().__init__()
        self.embed = embed  # None on a rank that neither embeds nor runs a tied head
        self._stage = stage

    def as_linear(self, x: mx.array) -> mx.array:
        return self._stage.logits(x, self.embed.as_linear if self.embed is not None else None)

    def __call__(self, inputs: mx.array) -> mx.array:
        st = self._stage
        st.begin(inputs.shape)
        if st.rank == 0:
            return self.embed(inputs)
        b, t = inputs.shape
        raw = mx.distributed.recv((st.wire_in.nbytes(b, t),), mx.uint8, st.rank - 1, group=st.group)
        h, *features = st.wire_in.unpack(raw, b, t)
        st.received(features)
        st.bytes_received += raw.size
        return h


class Exit(nn.Module):
    """The final norm on the last rank; on the others, the hidden state sent on to the next rank."""

    def __init__(self, norm: nn.Module | None, stage: "Stage"):
        super().__init__()
        self.norm = norm  # None but on the last rank
        self._stage = stage

    def __call__(self, h: mx.array) -> mx.array:
        st = self._stage
        if st.rank == st.size - 1:
            return self.norm(h)
        b, t = h.shape[0], h.shape[1]
        msg = st.wire_out.pack([h, *st.outgoing(b, t)])
        st.count(msg.size)
        st.sent = mx.distributed.send(msg, st.rank + 1, group=st.group)
        h = mx.depends(h, st.sent)
        _tie(st.cache or [], h)  # a prompt chunk evaluates only the cache: the send with it
        return h


class Head(nn.Module):
    """The output head (untied) on the last rank; on every rank the last rank's logits, gathered."""

    def __init__(self, head: nn.Module | None, stage: "Stage"):
        super().__init__()
        self.head = head  # None but on the last rank
        self._stage = stage

    def __call__(self, x: mx.array) -> mx.array:
        return self._stage.logits(x, self.head)


def _tie(cache: list, out: mx.array) -> None:
    """A prompt chunk evaluates only the cache: one of its arrays (a KV cache's keys, or a linear attention's state)
    made to depend on the message, so that it is sent."""
    for c in reversed(cache):
        if getattr(c, "keys", None) is not None:
            c.keys = mx.depends(c.keys, out)
            return
        state = getattr(c, "cache", None)
        if isinstance(state, list) and state and state[-1] is not None:
            state[-1] = mx.depends(state[-1], out)
            return


class Stage:
    """One rank's place in the pipeline: its group, its layers, its wires and the crossing heads' hooks."""

    def __init__(self, group, layers: range, hidden: int, dtype: mx.Dtype, top_k: int, boundary=None,
                 vocab: int = 0, logits_dtype: mx.Dtype = mx.float32):
        self.group, self.rank, self.size = group, group.rank(), group.size()
        self.vocab, self.logits_dtype = vocab, logits_dtype
        self.sent = None  # this forward's send to the next rank (a rank before the last)
        self.layers = layers
        self.boundary = boundary  # dist/boundary.py Boundary, or None (no head crosses)
        heads_in = len(boundary.incoming) if boundary is not None else 0
        heads_out = len(boundary.outgoing) if boundary is not None else 0
        self.wire_in = Wire(hidden, dtype, top_k, heads_in)
        self.wire_out = Wire(hidden, dtype, top_k, heads_out)
        self.cache = None
        self.bytes_sent = 0  # bytes this rank put on the links (its sends, its all_gather share)
        self.bytes_received = 0  # bytes of hidden states it received from the rank before (its all_gather's not counted)
        self.messages = 0  # messages it sent (a send, an all_gather)

    def count(self, nbytes: int, messages: int = 1) -> None:
        self.bytes_sent += int(nbytes)
        self.messages += messages

    def logits(self, x: mx.array, head) -> mx.array:
        """The last rank's logits of the last position, (B, 1, V), on every rank: one all_gather (the other ranks'
        rows zeros, after their send). A prompt chunk's are never read (decode/prefill.py), so never gathered."""
        b, t = x.shape[0], x.shape[1]
        if self.rank == self.size - 1:
            out = head(x[:, -1:] if t > 1 else x)
        else:
            out = mx.depends(mx.zeros((b, 1, self.vocab), dtype=self.logits_dtype), self.sent)
        if t == 1:
            self.count(out.nbytes * (self.size - 1))
        whole = mx.distributed.all_gather(out, group=self.group)  # (size*B, 1, V)
        return whole[(self.size - 1) * b:]

    def begin(self, shape) -> None:
        if self.boundary is not None:
            self.boundary.begin()

    def received(self, features: list) -> None:
        if self.boundary is not None and features:
            self.boundary.received(features)

    def outgoing(self, b: int, t: int) -> list:
        if self.boundary is None or t != 1 or not self.boundary.outgoing:
            return []
        return self.boundary.sent(b)


class PipelineModel(nn.Module):
    """mlx-lm's model on one rank: its layers only, the hidden state passed on (model(tokens, cache) -> logits on
    every rank, as one process's)."""

    def __init__(self, model: nn.Module, stage: Stage):
        super().__init__()
        self.model = model
        self._stage = stage
        inner = decoder(model)
        embed = embed_name(inner)
        if embed not in inner or "norm" not in inner:
            raise Edge0Error(f"{type(model).__module__}: edge0's pipeline needs an embedding and a final norm by their "
                             "mlx-lm names (embed_tokens or word_embeddings, norm)")
        inner.layers = [layer for layer in inner.layers[stage.layers.start:stage.layers.stop]]
        if hasattr(inner, "fa_idx") or hasattr(inner, "ssm_idx"):  # qwen3_5: masks from this rank's first layer of a kind
            inner.ssm_idx = next((i for i, m in enumerate(inner.layers) if m.is_linear), None)
            inner.fa_idx = next((i for i, m in enumerate(inner.layers) if not m.is_linear), None)
        inner[embed] = Entry(_held(inner[embed]), stage)
        inner["norm"] = Exit(_held(inner["norm"]), stage)
        owner = head_owner(model)
        if owner is not None:  # untied: its own head (a tied one runs as Entry.as_linear)
            owner["lm_head"] = Head(_held(owner["lm_head"]), stage)

    @property
    def layers(self):
        return decoder(self.model).layers

    def make_cache(self):
        if hasattr(self.model, "make_cache"):  # its layers are this rank's already
            return self.model.make_cache()
        from mlx_lm.models.cache import KVCache

        return [KVCache() for _ in self.layers]

    def __call__(self, inputs: mx.array, cache=None, **kw) -> mx.array:
        self._stage.cache = cache
        try:
            return self.model(inputs, cache=cache, **kw)
        finally:
            self._stage.cache = None


def _held(module: nn.Module) -> nn.Module | None:
    """The module, or None where this rank loaded none of it (model/load.py: an empty module in its place)."""
    return module if module.parameters() else None


def make_stage(model: nn.Module, group, layers: range, top_k: int, boundary=None) -> Stage:
    """This rank's Stage: the hidden state's width and dtype from rank 0's embedding, the logits' from the last
    rank's norm and head run on it, each shared with one all_sum (the other ranks hold neither)."""
    inner, rank, last = decoder(model), group.rank(), group.size() - 1
    width = [0, 0]
    if rank == 0:
        probe = inner[embed_name(inner)](mx.array([[0]]))
        width = [probe.shape[-1], _DTYPES.index(probe.dtype)]
    hidden, dt = _shared(group, width, rank == 0)
    vocab = [0, 0]
    if rank == last:
        x = inner["norm"](mx.zeros((1, 1, hidden), dtype=_DTYPES[dt]))
        owner = head_owner(model)
        probe = owner["lm_head"](x) if owner is not None else inner[embed_name(inner)].as_linear(x)
        vocab = [probe.shape[-1], _DTYPES.index(probe.dtype)]
    v, lt = _shared(group, vocab, rank == last)
    return Stage(group, layers, hidden, _DTYPES[dt], top_k, boundary, vocab=v, logits_dtype=_DTYPES[lt])


def _shared(group, values: list[int], mine: bool) -> list[int]:
    """`values` of the one rank where `mine`, on every rank."""
    a = mx.array(values if mine else [0] * len(values), dtype=mx.int64)
    return mx.distributed.all_sum(a, group=group, stream=mx.cpu).tolist()
