"""DFlash2 drafter (z-lab ``DFlash2DraftModel`` checkpoints).

DFlash1 plus two pieces (z-lab/dflash, ``DFlash2DraftModel``):

- a grouped *dynamic depthwise convolution* over the block slots around the
  attention and around the MLP of every layer (``attention_conv`` /
  ``mlp_conv``), and
- a *candidate selector* that replaces the independent per-slot argmax with
  a walk over the top-K candidates of each slot, scored by a low-rank
  predecessor/successor bilinear term.

Both are many tiny ops (launch-bound), so each has three implementations:
plain MLX ops, the same ops fused by ``mx.compile``, and a Metal kernel used
on Apple GPUs once a parity check against the ops has passed. A drafter's
``implementation`` attribute picks one for that drafter (``conv_mix`` and
``walk`` take it as an argument); ``mlx-dflash bench`` compares them
(``dflash_mlx.timing.conv_selector_share``).
"""

import warnings
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

from ..errors import ArgumentError
from ..ops.threads import compiled
from .dflash import DFlashConfig, DFlashDraftModel, DraftConfigError, DraftLayer

# "auto": Metal kernel where available and verified, else compiled ops.
IMPLEMENTATIONS = ("auto", "compiled", "ops")


# ---------------------------------------------------------------------------
# Grouped dynamic depthwise convolution


def conv_mix_ops(x: mx.array, base: mx.array, coef: mx.array) -> mx.array:
    """``y[p] = sum_{t < taps, t <= p} (base[t] + coef[p, t] per group) * x[p - t]``.

    x [B, L, H] (one block: slot 0 sees only itself), base [taps, H],
    coef [B, L, taps, G]; channel h uses group ``h // (H / G)``.
    """
    B, L, H = x.shape
    taps, groups = coef.shape[-2:]
    # float32 inside (fused away when compiled), like the Metal kernel.
    f32 = mx.float32
    x32, base, coef = x.astype(f32), base.astype(f32), coef.astype(f32)
    y = None
    for t in range(min(taps, L)):
        k = base[t].reshape(groups, H // groups) + coef[:, :, t, :, None]
        shifted = x32 if t == 0 else mx.pad(x32[:, : L - t], [(0, 0), (t, 0), (0, 0)])
        term = k.reshape(B, L, H) * shifted
        y = term if y is None else y + term
    return y.astype(x.dtype)


conv_mix_compiled = compiled(conv_mix_ops)

_CONV_SOURCE = """
    const uint i = thread_position_in_grid.x;
    const int L = x_shape[1];
    const int H = x_shape[2];
    const int G = H / GS;
    const int row = i / H;  // b * L + slot
    const int h = i % H;
    const int slot = row % L;
    float acc = 0.0f;
    for (int t = 0; t < TAPS && t <= slot; ++t) {
        float k = float(base[t * H + h]) + float(coef[(row * TAPS + t) * G + h / GS]);
        acc += k * float(x[(row - t) * H + h]);
    }
    y[i] = static_cast<T>(acc);
"""


_kernels: Dict[str, object] = {}


def _kernel(name: str, inputs, outputs, source: str):
    if name not in _kernels:
        _kernels[name] = mx.fast.metal_kernel(
            name=name, input_names=inputs, output_names=outputs, source=source
        )
    return _kernels[name]


def conv_mix_metal(x: mx.array, base: mx.array, coef: mx.array) -> mx.array:
    """One thread per output element; same contract as :func:`conv_mix_ops`."""
    taps, groups = coef.shape[-2:]
    n = x.size
    (y,) = _kernel("dflash2_conv_mix", ["x", "base", "coef"], ["y"], _CONV_SOURCE)(
        inputs=[x, base, coef],
        template=[("T", x.dtype), ("TAPS", taps), ("GS", x.shape[-1] // groups)],
        grid=(n, 1, 1),
        threadgroup=(min(256, n), 1, 1),
        output_shapes=[x.shape],
        output_dtypes=[x.dtype],
    )
    return y


# First-use verdicts of the Metal kernels, keyed by instantiation.
_metal_verdicts: Dict[tuple, bool] = {}


def _metal_usable(implementation: str) -> bool:
    return (
        implementation == "auto"
        and mx.metal.is_available()
        and mx.default_device().type == mx.DeviceType.gpu
    )


def kernel_verified(key: tuple, run_kernel: Callable, run_ops: Callable, same: Callable) -> bool:
    """Run the kernel against the ops once per ``key``; any failure means
    the ops from then on, with one warning saying why."""
    if key not in _metal_verdicts:
        try:
            got, want = run_kernel(), run_ops()
            mx.eval(got, want)
            ok, why = bool(same(got, want)), "differs from the MLX ops"
        except Exception as e:  # a kernel that does not build or run is not used
            ok, why = False, f"failed ({type(e).__name__}: {e})"
        _metal_verdicts[key] = ok
        if not ok:
            warnings.warn(f"DFlash2 Metal kernel {key} {why}: using the MLX ops instead", stacklevel=2)
    return _metal_verdicts[key]


def _conv_close(got, want) -> bool:
    tol = 1e-5 if want.dtype == mx.float32 else 1e-2  # one half-precision rounding
    return mx.allclose(got.astype(mx.float32), want.astype(mx.float32), rtol=tol, atol=tol).item()


def conv_mix(x: mx.array, base: mx.array, coef: mx.array, implementation: str = "auto") -> mx.array:
    """The conv in ``implementation`` (one of :data:`IMPLEMENTATIONS`)."""
    if _metal_usable(implementation):
        key = ("conv", x.dtype, base.dtype, coef.dtype, *coef.shape[-2:], x.shape[-1])
        if kernel_verified(
            key,
            lambda: conv_mix_metal(x, base, coef),
            lambda: conv_mix_ops(x, base, coef),
            _conv_close,
        ):
            return conv_mix_metal(x, base, coef)
    if implementation == "ops":
        return conv_mix_ops(x, base, coef)
    return conv_mix_compiled(x, base, coef)


class DynamicConv(nn.Module):
    """Grouped dynamic depthwise conv over the slots of one block.

    ``prepare`` mixes with side 0 of the kernel and returns the dynamic
    coefficients, so ``finish`` mixes with side 1 of the *same* coefficients
    (computed from prepare's input, as trained).
    """

    def __init__(self, hidden_size: int, taps: int, group_size: int):
        super().__init__()
        self.implementation = "auto"  # set for the whole drafter by DFlash2DraftModel
        self.taps = taps
        self.groups = hidden_size // group_size
        self.base_kernel = mx.zeros((2, taps, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * taps * self.groups, bias=False)

    def coefficients(self, x: mx.array) -> mx.array:
        """[B, L, 2 sides, taps, groups]."""
        B, L, _ = x.shape
        return self.kernel_projection(x).reshape(B, L, 2, self.taps, self.groups)

    def prepare(self, x: mx.array) -> Tuple[mx.array, mx.array]:
        coef = self.coefficients(x)
        return conv_mix(x, self.base_kernel[0], coef[:, :, 0], self.implementation), coef

    def finish(self, h: mx.array, coef: mx.array) -> mx.array:
        return conv_mix(h, self.base_kernel[1], coef[:, :, 1], self.implementation)


class DFlash2Layer(DraftLayer):
    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        args = (config.hidden_size, config.conv_kernel_size, config.conv_group_size)
        self.attention_conv = DynamicConv(*args)
        self.mlp_conv = DynamicConv(*args)

    def __call__(self, x, context, rope, cache):
        a, coef = self.attention_conv.prepare(self.input_layernorm(x))
        h = x + self.attention_conv.finish(self.self_attn(a, context, rope, cache), coef)
        m, coef = self.mlp_conv.prepare(self.post_attention_layernorm(h))
        return h + self.mlp_conv.finish(self.mlp(m), coef)


# ---------------------------------------------------------------------------
# Candidate selector


def top_candidates_ops(logits: mx.array, k: int) -> Tuple[mx.array, mx.array]:
    """Top-k ids and values per row, in a defined order.

    Order: descending logit, then ascending token id, so index 0 is the best
    unary and the walk's "lowest index wins" tie rule is deterministic. Ties
    at the k-th value keep the lowest ids. Returns (ids int32, values f32).
    """
    logits = logits.astype(mx.float32)
    V = logits.shape[-1]
    kth = mx.min(mx.topk(logits, k, axis=-1), axis=-1, keepdims=True)
    vocab = mx.arange(V)
    # Distinct positive priorities for exactly the k tokens to keep.
    priority = mx.where(logits > kth, 2 * V - vocab, mx.where(logits == kth, V - vocab, -1))
    ids = mx.argpartition(-priority, k - 1, axis=-1)[..., :k].astype(mx.int32)
    values = mx.take_along_axis(logits, ids, axis=-1)
    vi, vj = values[..., :, None], values[..., None, :]
    ahead = (vj > vi) | ((vj == vi) & (ids[..., None, :] < ids[..., :, None]))
    order = mx.argsort(ahead.sum(axis=-1), axis=-1)
    return mx.take_along_axis(ids, order, axis=-1), mx.take_along_axis(values, order, axis=-1)


top_candidates_compiled = compiled(top_candidates_ops)


def first_best(v: mx.array) -> mx.array:
    """Index of the row maximum; ties go to the lowest index."""
    K = v.shape[-1]
    best = mx.max(v, axis=-1, keepdims=True)
    return mx.min(mx.where(v == best, mx.arange(K), K), axis=-1).astype(mx.int32)


def walk_ops(unary, first, pair, noise, pick: Callable = first_best):
    """Slot-by-slot walk over the candidate lattice.

    unary [B, N, K], first [B, K] (pairwise term after the anchor), pair
    [B, N-1, K, K] (``pair[l][i, j]``: candidate j at slot l+1 after i at
    slot l), noise [B, N, K] added before picking (zeros: greedy; T * Gumbel:
    a sample of softmax(scores / T)). Returns (choice [B, N] int32, the
    realised score rows [B, N, K] given the chosen predecessor).
    """
    rows, picks = [], []
    for slot in range(unary.shape[1]):
        if slot == 0:
            prior = first
        else:
            prior = mx.take_along_axis(pair[:, slot - 1], picks[-1][:, None, None], axis=1)[:, 0]
        s = unary[:, slot] + prior
        rows.append(s)
        picks.append(pick(s + noise[:, slot]))
    return mx.stack(picks, axis=1), mx.stack(rows, axis=1)


walk_compiled = compiled(walk_ops)

_WALK_SOURCE = """
    const int b = thread_position_in_grid.x;
    const int N = unary_shape[1];
    const int K = unary_shape[2];
    int prev = 0;
    for (int slot = 0; slot < N; ++slot) {
        const int at = (b * N + slot) * K;
        int best = 0;
        float best_v = 0.0f;
        for (int j = 0; j < K; ++j) {
            float prior = slot == 0
                ? first_prior[b * K + j]
                : pair_prior[((b * (N - 1) + slot - 1) * K + prev) * K + j];
            float s = unary[at + j] + prior;
            rows[at + j] = s;
            float v = s + noise[at + j];
            if (j == 0 || v > best_v) {  // strict: ties keep the lowest index
                best = j;
                best_v = v;
            }
        }
        choice[b * N + slot] = best;
        prev = best;
    }
"""


def walk_metal(unary, first, pair, noise):
    """One thread per sequence walks all slots; same contract as :func:`walk_ops`
    (needs at least two slots: Metal gets no empty ``pair``)."""
    B, N, K = unary.shape
    return _kernel(
        "dflash2_selector_walk",
        ["unary", "first_prior", "pair_prior", "noise"],
        ["choice", "rows"],
        _WALK_SOURCE,
    )(
        inputs=[unary, first, pair, noise],
        grid=(B, 1, 1),
        threadgroup=(1, 1, 1),
        output_shapes=[(B, N), (B, N, K)],
        output_dtypes=[mx.int32, mx.float32],
    )


def _walk_same(got, want) -> bool:
    return mx.array_equal(got[0], want[0]).item() and mx.allclose(got[1], want[1]).item()


def walk(unary, first, pair, noise, implementation: str = "auto"):
    """The walk in ``implementation`` (one of :data:`IMPLEMENTATIONS`)."""
    if unary.shape[1] > 1 and _metal_usable(implementation):
        args = (unary, first, pair, noise)
        if kernel_verified(("walk",), lambda: walk_metal(*args), lambda: walk_ops(*args), _walk_same):
            return tuple(walk_metal(*args))
    if implementation == "ops":
        return walk_ops(unary, first, pair, noise)
    return walk_compiled(unary, first, pair, noise)


@dataclass
class Walk:
    """A selector walk: ids [B, N, K] candidates, choice [B, N] their index,
    tokens [B, N], rows [B, N, K] realised scores."""

    ids: mx.array
    choice: mx.array
    tokens: mx.array
    rows: mx.array

    def scatter(self, p: mx.array, vocab_size: int) -> mx.array:
        """Candidate probabilities [B, N, K] -> [B, N, vocab], zero elsewhere."""
        q = mx.zeros((*self.ids.shape[:2], vocab_size), dtype=mx.float32)
        return mx.put_along_axis(q, self.ids, p.astype(mx.float32), axis=-1)


class CandidateSelector(nn.Module):
    """Chooses each slot's token among its top-K drafter candidates.

    Score of candidate c at slot l after predecessor p:
    ``unary[l, c] + sum_r P[p, r] * g[l, r] * S[c, r]``, g =
    ``hidden_projection(hidden[l])``. The anchor is slot 1's predecessor.
    """

    def __init__(self, config: DFlashConfig):
        super().__init__()
        rank, vocab = config.selector_rank, config.vocab_size
        self.implementation = "auto"  # set for the whole drafter by DFlash2DraftModel
        self.top_k = min(config.selector_top_k, vocab)
        self.hidden_projection = nn.Linear(config.hidden_size, rank, bias=False)
        self.predecessor_codebook = nn.Embedding(vocab, rank)
        self.successor_codebook = nn.Embedding(vocab, rank)

    def candidates(self, logits: mx.array) -> Tuple[mx.array, mx.array]:
        fn = top_candidates_ops if self.implementation == "ops" else top_candidates_compiled
        return fn(logits, self.top_k)

    def score_tables(self, anchor, hidden, ids) -> Tuple[mx.array, mx.array]:
        """(first [B, K], pair [B, N-1, K, K]) pairwise terms, float32."""
        f32 = mx.float32
        g = self.hidden_projection(hidden).astype(f32)
        succ = g[:, :, None, :] * self.successor_codebook(ids).astype(f32)  # [B, N, K, R]
        pred_anchor = self.predecessor_codebook(anchor).astype(f32)  # [B, R]
        first = (succ[:, 0] @ pred_anchor[:, :, None])[..., 0]
        pred = self.predecessor_codebook(ids[:, :-1]).astype(f32)  # [B, N-1, K, R]
        return first, pred @ succ[:, 1:].swapaxes(-1, -2)

    def __call__(
        self,
        anchor: mx.array,
        hidden: mx.array,
        logits: mx.array,
        temperature: float = 0.0,
        pick: Optional[Callable] = None,
    ) -> Walk:
        """Walk slots 1..N from ``anchor`` [B] given the final hidden states
        [B, N, H] and drafter logits [B, N, V] of those slots.

        Greedy at temperature 0, else a Gumbel-max sample of scores / T per
        slot; ``pick`` (score row [B, K] -> index [B]) replaces both.
        """
        ids, unary = self.candidates(logits)
        first, pair = self.score_tables(anchor, hidden, ids)
        if pick is not None:
            choice, rows = walk_ops(unary, first, pair, mx.zeros_like(unary), pick=pick)
        else:
            noise = mx.zeros_like(unary)
            if temperature > 0:
                noise = temperature * mx.random.gumbel(unary.shape)
            choice, rows = walk(unary, first, pair, noise, self.implementation)
        tokens = mx.take_along_axis(ids, choice[..., None], axis=-1)[..., 0]
        return Walk(ids=ids, choice=choice, tokens=tokens, rows=rows)


# ---------------------------------------------------------------------------
# The drafter


class DFlash2DraftModel(DFlashDraftModel):
    """DFlash2 drafter: same contract as :class:`DFlashDraftModel`.

    ``draft(...)`` still returns every slot's logits; ``propose`` returns the
    selector's walk, and ``propose_with_probs`` also its realised proposal
    distribution (for speculative sampling).
    """

    layer_class = DFlash2Layer

    def __init__(self, config: DFlashConfig):
        need = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
        missing = [n for n in need if getattr(config, n) < 1]
        if missing:
            raise DraftConfigError(f"a DFlash2 drafter needs dflash_config {', '.join(missing)}")
        if config.hidden_size % config.conv_group_size:
            raise DraftConfigError(
                f"conv_group_size {config.conv_group_size} does not divide "
                f"hidden_size {config.hidden_size}"
            )
        super().__init__(config)
        self.candidate_selector = CandidateSelector(config)

    @property
    def implementation(self) -> str:
        """How the convs and the selector walk run, one of :data:`IMPLEMENTATIONS`."""
        return self.candidate_selector.implementation

    @implementation.setter
    def implementation(self, name: str) -> None:
        if name not in IMPLEMENTATIONS:
            raise ArgumentError(f"implementation must be one of {IMPLEMENTATIONS}, not {name!r}")
        for module in self.modules():
            if isinstance(module, (DynamicConv, CandidateSelector)):
                module.implementation = name

    def check_block_size(self, block_size: int) -> None:
        """Warn when running another block size than the trained one."""
        if block_size > 1 and block_size != self.block_size:
            warnings.warn(
                f"this DFlash2 drafter was trained for block_size {self.block_size}, "
                f"running with {block_size}: its convolution and candidate selector "
                "are trained for that one block size, so acceptance drops "
                "(output stays lossless)",
                stacklevel=2,
            )

    def select(self, block_tokens, target_hidden, cache, temperature=0.0, pick=None) -> Walk:
        """Draft the block and walk the selector over slots 1..L-1."""
        hidden = self.hidden_states(block_tokens, target_hidden, cache)[:, 1:]
        return self.candidate_selector(
            block_tokens[:, 0], hidden, self.compute_logits(hidden), temperature, pick
        )

    def propose(self, block_tokens, target_hidden, cache, slots: Optional[int] = None) -> mx.array:
        """The selector's greedy walk over slots 1..``slots`` (default L-1):
        [B, slots] (sampling uses :meth:`propose_with_probs`). The walk goes
        over every slot, as trained (and as Metal's walk needs); a prefix
        of a walk is the walk over that prefix."""
        return self.select(block_tokens, target_hidden, cache).tokens[:, :slots]

    def draw(self, block_tokens, target_hidden, cache, sampling: dict, slots: Optional[int] = None, key=None) -> Tuple[mx.array, mx.array]:
        """:meth:`sampled_walk`'s first ``slots`` slots (default all); the
        walk draws from ``mx.random``'s state, not ``key``, as its batched
        rows do (:meth:`draft_rows`)."""
        tokens, q = self.sampled_walk(block_tokens, target_hidden, cache, sampling)
        return tokens[:, :slots], q[:, :slots]

    def draft_rows(self, block_tokens, target_hidden, caches, slots: int, samplings, keys=None):
        """:meth:`DFlashDraftModel.draft_rows` one row at a time: the
        selector's walk and the layers' convolutions run per request (its
        sampled walk draws from ``mx.random``'s state, not ``keys``)."""
        tokens, qs = [], []
        for b, sampling in enumerate(samplings):
            block = block_tokens[b : b + 1]
            if sampling is None:
                tokens.append(self.propose(block, target_hidden[b], caches[b], slots=slots))
                qs.append(None)
            else:
                drafted, q = self.draw(block, target_hidden[b], caches[b], sampling, slots=slots)
                tokens.append(drafted)
                qs.append(q[0])
        return mx.concatenate(tokens), qs

    def slot_logits_rows(self, block_tokens, target_hidden, caches, slots: int) -> mx.array:
        """:meth:`slot_logits` one row at a time (its layers' convolutions run per request)."""
        return mx.concatenate([self.slot_logits(block_tokens[b : b + 1], target_hidden[b], caches[b], slots=slots)
                               for b in range(len(caches))])

    def sampled_walk(self, block_tokens, target_hidden, cache, sampling: dict) -> Tuple[mx.array, mx.array]:
        """(tokens [B, L-1], q [B, L-1, vocab]): the walk and the distribution
        each token was drawn from, for speculative sampling.

        q is softmax(realised scores / T) over the slot's K candidates given
        the chosen predecessor, zero elsewhere; top-p / min-p / top-k filter
        that row as mlx-lm's sampler filters the target's. Temperature 0 is
        the greedy walk with a point mass q.
        """
        temperature, top_p, top_k, min_p = (sampling[k] for k in ("temperature", "top_p", "top_k", "min_p"))
        vocab = self.config.vocab_size
        if temperature <= 0:
            w = self.select(block_tokens, target_hidden, cache)
            K = w.rows.shape[-1]
            return w.tokens, w.scatter(mx.arange(K) == w.choice[..., None], vocab)
        K = self.candidate_selector.top_k
        top_k = top_k if top_k < K else 0  # keeping all K is no filter
        if 0 < top_p < 1 or min_p != 0 or top_k > 0:
            from ..sampling import processed_probs

            def processed(s):
                return processed_probs(s, temperature, top_p, top_k, min_p)

            def pick(s):
                return mx.random.categorical(mx.log(processed(s))).astype(mx.int32)

            w = self.select(block_tokens, target_hidden, cache, temperature, pick)
            return w.tokens, w.scatter(processed(w.rows), vocab)
        w = self.select(block_tokens, target_hidden, cache, temperature)
        return w.tokens, w.scatter(mx.softmax(w.rows / temperature, axis=-1), vocab)
