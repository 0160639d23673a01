"""How long does one HF decode step take in a CUDA graph? (helpers of gemma3n_e2e.py and gemma3n_levers.py)

One decode step of an HF model captured in a CUDA graph: its capture, its check, its timing.

A decode step (one token per sequence, StaticCache) is captured from one cache state and replayed from
that state, the cache counters rewound before each replay, so every replay decodes the same position with
new token ids and can be checked bit for bit against the eager step. :func:`decode_graph` times one setup;
:func:`interleaved_graph_ms` times several setups of one model (different PLE modules, say) in rounds of
rotating order, one captured graph alive at a time, so drift in the GPU's clocks hits them alike.

HF's Gemma 3n builds a few tiny constants on the host at every forward; :class:`HostConstants` serves
them from device tensors recorded one eager forward earlier so the capture holds only device work.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Sequence

import torch

from uvaple.perf.timing import EventTimer as Timer

__all__ = ["HostConstants", "CapturedDecode", "decode_graph", "interleaved_graph_ms", "random_ids", "cache_kwarg"]


def random_ids(n_seq, length, high, device, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, high, (n_seq, length), generator=g).to(device)


def cache_kwarg(model) -> str:
    """The name forward() takes the KV cache under: transformers >= 5.24 renamed ``past_key_values`` to
    ``cache`` (the old name warns until 5.40)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"



class HostConstants(torch.overrides.TorchFunctionMode):
    """Serve a forward's tiny host-built constants from device tensors recorded one forward earlier.

    HF's Gemma 3n text model builds small constants on the host at every forward: the activation-sparsity
    target (``torch.tensor(..., device=cuda)``) and, in transformers < 5.24, an epsilon
    (``torch.tensor(1e-5).to(cuda)``). Each is a synchronous host-to-device copy, which CUDA graph capture
    refuses. This is a ``TorchFunctionMode`` (torch's own extension point, active only inside its
    ``with`` block on this thread; no torch function is replaced): inside ``record()`` an eager forward
    runs as usual and each such constant (a CPU value of at most ``MAX_NUMEL`` elements bound for
    ``device``) is kept by value; inside ``serve()`` (the captured forward) the kept tensor is returned
    instead, the constant folding torch.compile does. Everything else the capture holds is the model's own
    kernels; :func:`decode_graph` checks a replay against an eager step bit for bit.
    """

    MAX_NUMEL = 64

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = torch.device(device)
        self.kept: dict = {}
        self._mode: str | None = None

    def _freeze(self, data):
        if isinstance(data, (bool, int, float)):
            return (type(data).__name__, data)
        if isinstance(data, (list, tuple)) and len(data) <= self.MAX_NUMEL and all(
                isinstance(v, (bool, int, float)) for v in data):
            return (type(data).__name__, tuple(data))
        return None

    def _bound_here(self, target) -> bool:
        """Whether ``target`` is the capture device; a device without an index ("cuda") matches any index."""
        if target is None:
            return False
        target = torch.device(target)
        return target.type == self.device.type and (
            target.index is None or self.device.index is None or target.index == self.device.index)

    def _serve(self, key, make):
        if self._mode == "record":
            if key not in self.kept:
                self.kept[key] = make()
            return self.kept[key]
        if key not in self.kept:
            raise RuntimeError(f"host constant {key!r} first built during capture; run one forward under "
                               f"record() with the same shapes first")
        return self.kept[key]

    def _key(self, func, args, kwargs):
        """The constant's key when this call builds one we fold, else None."""
        if func is torch.tensor:
            data = args[0] if args else kwargs.get("data")
            frozen = self._freeze(data)
            if len(args) > 1 or frozen is None or not self._bound_here(kwargs.get("device")) or \
                    kwargs.get("requires_grad"):
                return None
            return ("tensor", frozen, kwargs.get("dtype"), str(torch.device(kwargs["device"])))
        if func is torch.Tensor.to and args and isinstance(args[0], torch.Tensor):
            t = args[0]
            if t.device.type != "cpu" or t.numel() > self.MAX_NUMEL or t.requires_grad:
                return None
            try:
                target, dtype, _, _ = torch._C._nn._parse_to(*args[1:], **kwargs)
            except Exception:  # noqa: BLE001 - not a form we fold; torch reports it
                return None
            if not self._bound_here(target):
                return None
            return ("to", (str(t.dtype), tuple(t.shape), tuple(t.flatten().tolist())), dtype, str(target))
        return None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        key = self._key(func, args, kwargs) if self._mode is not None else None
        if key is None:
            return func(*args, **kwargs)
        return self._serve(key, lambda: func(*args, **kwargs))

    @contextlib.contextmanager
    def _active(self, mode: str):
        self._mode = mode
        try:
            with self:
                yield self
        finally:
            self._mode = None

    def record(self):
        return self._active("record")

    def serve(self):
        return self._active("serve")


def _cache_counters(cache) -> list:
    """The positions a static cache keeps: each layer's device counter and, for sliding layers, its int."""
    return [(layer, layer.cumulative_length.clone() if isinstance(getattr(layer, "cumulative_length", None),
                                                                  torch.Tensor) else None,
             getattr(layer, "cumulative_length_int", None)) for layer in cache.layers]


def _rewind(counters) -> None:
    for layer, dev, n in counters:
        if dev is not None:
            layer.cumulative_length.copy_(dev)
        if n is not None:
            layer.cumulative_length_int = n


class CapturedDecode:
    """One decode step of ``model`` captured in a CUDA graph (see the module docstring).

    Prefill ``prompt [batch, prompt_len]``, then one eager step on ``first [batch]`` (which records the
    host constants, :class:`HostConstants`) and the capture, both from the same cache state: the cache
    counters are rewound after the eager step and before every replay, so the capture takes the branches
    the eager step took. The position must stay inside the sliding window: past it the cache rolls its
    contents, which no rewind undoes. :meth:`close` releases the graph.
    """

    @torch.no_grad()
    def __init__(self, model, prompt: torch.Tensor, first: torch.Tensor, *, device) -> None:
        from transformers import StaticCache

        batch, prompt_len = prompt.shape
        window = getattr(model.config, "sliding_window", None)
        if window is not None and prompt_len + 1 > window:
            raise ValueError(f"decode_graph decodes position {prompt_len}, past the sliding window ({window}); "
                             f"use a prompt of at most {window - 1} tokens")
        self.model, self.device, self.batch = model, torch.device(device), batch
        self._key = cache_kwarg(model)
        self.cache = StaticCache(config=model.config, max_cache_len=prompt_len + 8)
        self._step(prompt)
        self.counters = _cache_counters(self.cache)
        self.static_ids = first.view(batch, 1).clone()
        consts = HostConstants(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side), consts.record():
            self._step(self.static_ids)
        torch.cuda.current_stream(self.device).wait_stream(side)
        _rewind(self.counters)
        self.graph = torch.cuda.CUDAGraph()
        with consts.serve(), torch.cuda.graph(self.graph):
            self.out = self._step(self.static_ids)
        # the graph reads the kept constants at their addresses: they live as long as it does (dropped,
        # their blocks go back to the allocator, and the next capture's empty_cache() unmaps them)
        self._consts = consts

    def _step(self, x):
        return self.model(input_ids=x, use_cache=True, logits_to_keep=1, **{self._key: self.cache}).logits

    def load(self, tokens: torch.Tensor) -> None:
        """The next replay decodes ``tokens [batch]`` from the captured state."""
        self.static_ids.copy_(tokens.view(self.batch, 1))
        _rewind(self.counters)

    @torch.no_grad()
    def matches_eager(self, tokens: torch.Tensor) -> bool:
        """Whether a replay on ``tokens`` gives the eager step's logits from the same state, bit for bit."""
        self.load(tokens)
        self.graph.replay()
        replayed = self.out.clone()
        _rewind(self.counters)
        eager = self._step(tokens.view(self.batch, 1).clone())
        return bool(torch.equal(replayed, eager))

    def close(self) -> None:
        self.graph, self.out, self._consts = None, None, None
        _rewind(self.counters)


@torch.no_grad()
def decode_graph(model, batch, *, prompt_len, steps, warm, high, device, seed=21,
                 draw: Callable[[int, int, int], torch.Tensor] | None = None) -> dict:
    """One decode step (StaticCache) captured in a CUDA graph (:class:`CapturedDecode`), replayed and timed
    with CUDA events: each replay decodes position ``prompt_len`` from the captured state with new token
    ids, and one is checked against the eager step from that state bit for bit. ``draw(n, length, seed)``
    gives the ids (default: uniform below ``high``). Returns ``{"ms": median replay ms,
    "replay_equals_eager": bool}``.
    """
    draw = draw or (lambda n, length, s: random_ids(n, length, high, device, s))
    ids = draw(batch, prompt_len, seed)
    toks = draw(warm + steps + 2, batch, seed + 1)
    return interleaved_graph_ms(model, lambda _: None, ["one"], ids, toks, warm=warm, device=device,
                                rounds=1)["one"]


@torch.no_grad()
def interleaved_graph_ms(model, attach: Callable[[str], None], names: Sequence[str], prompt: torch.Tensor,
                         toks: torch.Tensor, *, warm: int, device, rounds: int = 4) -> dict:
    """Decode steps of several setups of ``model``, each captured in a CUDA graph, timed in interleaved rounds.

    ``attach(name)`` puts setup ``name`` in the model (its PLE module, say) for its capture and eager check.
    Every setup prefills ``prompt [batch, prompt_len]`` and decodes ``toks [2 + warm + steps, batch]``
    (``toks[0]`` is the captured step's, ``toks[1]`` the check's). The steps are split into ``rounds``; in
    each round every setup, in an order rotated by one per round, is captured, checked against its eager
    step, replayed ``warm`` times untimed and then over its share of the steps, and released before the next
    setup is captured: one graph of the model lives at a time (two live captures of one HF Gemma 3n model
    at batch > 1 were seen to fault on the H200, each alone ran clean), and drift in the GPU's clocks hits
    every setup alike. Returns ``{name: {"ms": median replay ms, "replay_equals_eager": bool}}``, the check
    true only when it held in every round.
    """
    names = list(names)
    steps = toks.shape[0] - 2 - warm
    if steps < 1:
        raise ValueError(f"toks has {toks.shape[0]} rows: 2 + warm ({warm}) + at least one timed step needed")
    rounds = max(1, min(rounds, steps))
    bounds = [steps * r // rounds for r in range(rounds + 1)]
    timers = {name: Timer(device) for name in names}
    same = dict.fromkeys(names, True)
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            attach(name)
            step = CapturedDecode(model, prompt, toks[0], device=device)
            try:
                same[name] = step.matches_eager(toks[1]) and same[name]
                for i in range(warm):
                    step.load(toks[2 + i])
                    step.graph.replay()
                for i in range(bounds[r], bounds[r + 1]):
                    step.load(toks[2 + warm + i])
                    timers[name](step.graph.replay)
            finally:
                step.close()
                del step
    return {name: {"ms": timers[name].median(skip=0), "replay_equals_eager": same[name]} for name in names}
