"""DFlash2: dynamic conv and candidate selector against plain numpy loops,
z-lab checkpoint loading, lossless greedy generation, Metal kernel parity."""

import warnings

import mlx.core as mx
import numpy as np
import pytest
import tiny
from mlx.utils import tree_flatten
from tiny import prompt_of

import dflash_mlx
from dflash_mlx.models import dflash2 as d2
from dflash_mlx.models.dflash import DFlashConfig, masked_block

IMPLS = ["ops", "compiled"]
metal = pytest.mark.skipif(
    not mx.metal.is_available(),
    reason="Metal is unavailable (no Apple GPU): kernels are checked against the ops on macOS",
)


@pytest.fixture(scope="module")
def draft2(qwen3_pair, tmp_path_factory):
    path = tiny.make_draft(tmp_path_factory.mktemp("d2"), qwen3_pair.dflash2_config(), seed=3)
    return path, dflash_mlx.load_draft(path, qwen3_pair.model)


# ---------------------------------------------------------------------------
# Dynamic convolution


def ref_conv(x, base, coef):
    """y[b, p, h] = sum_{t < taps, t <= p} (base[t, h] + coef[b, p, t, h // gs]) * x[b, p - t, h]."""
    B, L, H = x.shape
    taps, G = coef.shape[-2:]
    gs = H // G
    y = np.zeros((B, L, H))
    for b in range(B):
        for p in range(L):
            for t in range(min(taps, p + 1)):
                for h in range(H):
                    y[b, p, h] += (base[t, h] + coef[b, p, t, h // gs]) * x[b, p - t, h]
    return y


def conv_inputs(B=2, L=6, H=8, taps=3, G=4, seed=0):
    rng = np.random.default_rng(seed)
    return (
        rng.standard_normal((B, L, H)).astype(np.float32),
        rng.standard_normal((taps, H)).astype(np.float32),
        rng.standard_normal((B, L, taps, G)).astype(np.float32),
    )


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("L", [1, 2, 6])  # shorter and longer than the 3 taps
def test_conv_matches_loop_reference(impl, L):
    x, base, coef = conv_inputs(L=L)
    y = d2.conv_mix(mx.array(x), mx.array(base), mx.array(coef), impl)
    np.testing.assert_allclose(tiny.to_np(y), ref_conv(x, base, coef), rtol=1e-5, atol=1e-5)


def test_conv_mixes_only_earlier_slots_of_the_block():
    x, base, coef = conv_inputs(L=7)
    y0 = tiny.to_np(d2.conv_mix(mx.array(x), mx.array(base), mx.array(coef)))
    # Slot 0 sees only itself.
    slot0 = (base[0] + np.repeat(coef[:, 0, 0], 2, -1)) * x[:, 0]
    np.testing.assert_allclose(y0[:, 0], slot0, rtol=1e-6)
    x[:, 3] += 1.0
    y1 = tiny.to_np(d2.conv_mix(mx.array(x), mx.array(base), mx.array(coef)))
    changed = np.abs(y1 - y0).max(axis=(0, 2)) > 0
    assert changed.tolist() == [False, False, False, True, True, True, False]  # slots 3..3+taps-1


def test_groups_share_one_dynamic_coefficient():
    x, _, coef = conv_inputs(L=5, H=8, G=2)
    y = tiny.to_np(d2.conv_mix(mx.ones(x.shape), mx.zeros((3, 8)), mx.array(coef)))
    # With unit inputs and no base kernel, y is the coefficient sum: equal
    # across the 4 channels of a group, different between groups.
    groups = y.reshape(2, 5, 2, 4)
    assert np.allclose(groups, groups[..., :1])
    assert not np.allclose(groups[:, :, 0], groups[:, :, 1])


def test_prepare_and_finish_use_the_same_coefficients():
    rng = np.random.default_rng(1)
    H, taps, gs, B, L = 8, 3, 2, 2, 5
    conv = d2.DynamicConv(H, taps, gs)
    base = rng.standard_normal((2, taps, H)).astype(np.float32)
    proj = rng.standard_normal((2 * taps * (H // gs), H)).astype(np.float32) / 3
    conv.base_kernel = mx.array(base)
    conv.kernel_projection.weight = mx.array(proj)
    x = rng.standard_normal((B, L, H)).astype(np.float32)
    h = rng.standard_normal((B, L, H)).astype(np.float32)
    y, coef = conv.prepare(mx.array(x))
    out = tiny.to_np(conv.finish(mx.array(h), coef))
    cx = (x @ proj.T).reshape(B, L, 2, taps, H // gs)
    ch = (h @ proj.T).reshape(B, L, 2, taps, H // gs)
    np.testing.assert_allclose(tiny.to_np(y), ref_conv(x, base[0], cx[:, :, 0]), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(out, ref_conv(h, base[1], cx[:, :, 1]), rtol=1e-4, atol=1e-5)
    assert not np.allclose(out, ref_conv(h, base[1], ch[:, :, 1]), atol=1e-3)


# ---------------------------------------------------------------------------
# Candidate selector


def ref_candidates(logits, k):
    """Stable order: descending logit, then ascending id."""
    rows = logits.reshape(-1, logits.shape[-1])
    ids = np.stack([np.lexsort((np.arange(row.size), -row))[:k] for row in rows])
    ids = ids.reshape(*logits.shape[:-1], k)
    return ids, np.take_along_axis(logits, ids, -1)


def ref_walk(unary, first, pair, noise):
    """Loop walk; np.argmax returns the first (lowest) index of a tie."""
    B, N, K = unary.shape
    choice = np.zeros((B, N), dtype=np.int64)
    rows = np.zeros((B, N, K), dtype=np.float32)
    for b in range(B):
        for slot in range(N):
            prior = first[b] if slot == 0 else pair[b, slot - 1, choice[b, slot - 1]]
            rows[b, slot] = unary[b, slot] + prior
            choice[b, slot] = np.argmax(rows[b, slot] + noise[b, slot])
    return choice, rows


def ref_selector(anchor, hidden, logits, proj, P, S, k):
    """Greedy selector walk straight from the formula, in float64."""
    ids, unary = ref_candidates(logits, k)
    g = hidden @ proj.T
    B, N = ids.shape[:2]
    tokens = np.zeros((B, N), dtype=np.int64)
    for b in range(B):
        prev = anchor[b]
        for slot in range(N):
            cand = ids[b, slot]
            scores = unary[b, slot] + (P[prev] * g[b, slot] * S[cand]).sum(-1)
            prev = tokens[b, slot] = cand[np.argmax(scores)]
    return tokens


@pytest.mark.parametrize("impl", IMPLS)
def test_candidate_order_and_ties(impl):
    rng = np.random.default_rng(2)
    logits = rng.integers(-3, 4, size=(2, 3, 40)).astype(np.float32)  # many exact ties
    fn = d2.top_candidates_ops if impl == "ops" else d2.top_candidates_compiled
    ids, values = fn(mx.array(logits), 7)
    want_ids, want_values = ref_candidates(logits, 7)
    np.testing.assert_array_equal(np.array(ids), want_ids)
    np.testing.assert_array_equal(tiny.to_np(values), want_values)


@pytest.mark.parametrize("impl", IMPLS)
def test_walk_matches_loop_reference_with_ties(impl):
    rng = np.random.default_rng(3)
    B, N, K = 3, 5, 4
    unary = rng.integers(0, 3, (B, N, K)).astype(np.float32)
    first = rng.integers(0, 2, (B, K)).astype(np.float32)
    pair = rng.integers(0, 2, (B, N - 1, K, K)).astype(np.float32)
    for noise in (np.zeros((B, N, K), np.float32), rng.gumbel(size=(B, N, K)).astype(np.float32)):
        choice, rows = d2.walk(*map(mx.array, (unary, first, pair, noise)), implementation=impl)
        want_choice, want_rows = ref_walk(unary, first, pair, noise)
        np.testing.assert_array_equal(np.array(choice), want_choice)
        np.testing.assert_array_equal(np.array(rows), want_rows)


def test_ties_go_to_the_lowest_candidate_index():
    unary = mx.array([[[0.0, 2.0, 1.0, 2.0], [5.0, 5.0, 5.0, 5.0]]])
    choice, _ = d2.walk(unary, mx.zeros((1, 4)), mx.zeros((1, 1, 4, 4)), mx.zeros((1, 2, 4)))
    assert choice.tolist() == [[1, 0]]


def selector_weights(rng, H=16, R=4, V=30):
    return (
        rng.standard_normal((R, H)).astype(np.float32),
        rng.standard_normal((V, R)).astype(np.float32),
        rng.standard_normal((V, R)).astype(np.float32),
    )


def make_selector(proj, P, S, k):
    cfg = DFlashConfig(
        hidden_size=proj.shape[1], num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1,
        head_dim=proj.shape[1], intermediate_size=8, vocab_size=P.shape[0], target_layer_ids=[0],
        mask_token_id=0, selector_rank=proj.shape[0], selector_top_k=k,
    )
    sel = d2.CandidateSelector(cfg)
    sel.hidden_projection.weight = mx.array(proj)
    sel.predecessor_codebook.weight = mx.array(P)
    sel.successor_codebook.weight = mx.array(S)
    return sel


@pytest.mark.parametrize("impl", IMPLS)
def test_selector_matches_formula(impl):
    rng = np.random.default_rng(4)
    proj, P, S = selector_weights(rng)
    sel = make_selector(proj, P, S, k=5)
    hidden = rng.standard_normal((2, 6, 16)).astype(np.float32)
    logits = rng.standard_normal((2, 6, 30)).astype(np.float32)
    anchor = np.array([3, 17])
    sel.implementation = impl
    w = sel(mx.array(anchor), mx.array(hidden), mx.array(logits))
    want = ref_selector(anchor, hidden, logits, proj, P, S, 5)
    np.testing.assert_array_equal(np.array(w.tokens), want)


def test_first_slot_predecessor_is_the_anchor():
    rng = np.random.default_rng(5)
    proj, P, S = selector_weights(rng)
    sel = make_selector(proj, 10 * P, S, k=8)  # pairwise term dominates the unary
    hidden = rng.standard_normal((1, 3, 16)).astype(np.float32)
    logits = rng.standard_normal((1, 3, 30)).astype(np.float32)
    firsts = set()
    for a in range(30):
        tokens = sel(mx.array([a]), mx.array(hidden), mx.array(logits)).tokens
        want = ref_selector(np.array([a]), hidden, logits, proj, 10 * P, S, 8)
        np.testing.assert_array_equal(np.array(tokens), want)
        firsts.add(int(want[0, 0]))
    assert len(firsts) > 1  # the anchor really steers slot 1


def test_gumbel_walk_samples_the_realised_rows():
    rng = np.random.default_rng(6)
    n, K, T = 6000, 3, 0.7
    unary = np.tile(rng.standard_normal((1, 2, K)).astype(np.float32), (n, 1, 1))
    first = np.tile(rng.standard_normal((1, K)).astype(np.float32), (n, 1))
    pair = np.tile(rng.standard_normal((1, 1, K, K)).astype(np.float32), (n, 1, 1, 1))
    mx.random.seed(0)
    noise = T * mx.random.gumbel((n, 2, K))
    choice, rows = d2.walk(mx.array(unary), mx.array(first), mx.array(pair), noise)
    choice, rows = np.array(choice), np.array(rows)

    def softmax(v):
        e = np.exp((v - v.max()) / T)
        return e / e.sum()

    freq0 = np.bincount(choice[:, 0], minlength=K) / n
    np.testing.assert_allclose(freq0, softmax(unary[0, 0] + first[0]), atol=0.03)
    prev = np.bincount(choice[:, 0]).argmax()
    given = choice[choice[:, 0] == prev, 1]
    row1 = unary[0, 1] + pair[0, 0, prev]
    np.testing.assert_allclose(np.bincount(given, minlength=K) / given.size, softmax(row1), atol=0.04)
    np.testing.assert_allclose(rows[choice[:, 0] == prev][0, 1], row1, rtol=1e-6)


# ---------------------------------------------------------------------------
# The drafter


def test_loads_z_lab_layout(qwen3_pair, draft2):
    path, draft = draft2
    stored = mx.load(str(path / "model.safetensors"))
    assert "candidate_selector.predecessor_codebook" in stored
    assert "candidate_selector.successor_codebook.weight" not in stored
    assert stored["layers.1.mlp_conv.base_kernel"].shape == (2, 4, 64)
    assert stored["layers.0.attention_conv.kernel_projection.weight"].shape == (2 * 4 * 4, 64)
    assert isinstance(draft, d2.DFlash2DraftModel)
    loaded = dict(tree_flatten(draft.parameters()))
    for name, value in stored.items():
        key = name + ".weight" if name.endswith("_codebook") else name
        assert mx.array_equal(loaded[key], value), name


def test_draft_logits_and_propose_follow_the_selector(qwen3_pair, draft2):
    _, draft = draft2
    V = qwen3_pair.vocab
    rng = np.random.default_rng(7)
    block = mx.array([[65] + [draft.mask_token_id] * 7, [66] + [draft.mask_token_id] * 7])
    ctx = mx.array(rng.standard_normal((2, 11, draft.config.fc_input_size)).astype(np.float32))
    hidden = draft.hidden_states(block, ctx, draft.make_cache())
    logits = draft(block, ctx, draft.make_cache())
    assert logits.shape == (2, 8, V)
    # the target's head, then output_multiplier 0.8 and a softcap of 30
    head = tiny.to_np(qwen3_pair.model.model.embed_tokens.weight)  # tied
    want = 30.0 * np.tanh(tiny.to_np(hidden) @ head.T * 0.8 / 30.0)
    np.testing.assert_allclose(tiny.to_np(logits), want, rtol=1e-4, atol=1e-4)
    sel = draft.candidate_selector
    want = ref_selector(
        np.array([65, 66]), tiny.to_np(hidden[:, 1:]), tiny.to_np(logits[:, 1:]),
        tiny.to_np(sel.hidden_projection.weight), tiny.to_np(sel.predecessor_codebook.weight),
        tiny.to_np(sel.successor_codebook.weight), sel.top_k,
    )
    tokens = draft.propose(block, ctx, draft.make_cache())
    np.testing.assert_array_equal(np.array(tokens), want)
    assert draft.propose(block[:, :2], ctx, draft.make_cache()).shape == (2, 1)  # one slot
    greedy, q = draft.propose_with_probs(block, ctx, draft.make_cache(), 0.0)
    assert greedy.tolist() == tokens.tolist()
    np.testing.assert_array_equal(tiny.to_np(q), np.eye(V)[want])


def broadcast_row_rtol(draft, temperature: float) -> float:
    """How far two rows of one broadcast batch may differ in q: rounding only.

    A BLAS may block a batch's rows with different kernels, so identical rows
    need not sum their dot products in the same order. Each float32 dot
    product of length K is then off by up to K * u * sum|a_i b_i| (u = 2^-24,
    Higham's gamma_K), through every matmul on the path (fc, then per layer
    q/k/v, scores, values, o_proj, gate/up, down, the dynamic convolution,
    then the head); a logit error d moves q_i by at most a relative 2 d / T.
    Leakage between rows, the defect this check is for, moves q by O(1).
    """
    cfg = draft.config
    k = max(cfg.fc_input_size, cfg.hidden_size, cfg.intermediate_size)
    matmuls = 2 + 8 * cfg.num_hidden_layers
    return 2 / temperature * matmuls * k * 2.0**-24


@pytest.mark.parametrize("filters", [{}, {"top_k": 3}, {"top_p": 0.9}])
def test_sampled_proposal_distribution(qwen3_pair, draft2, filters):
    """q is the distribution each drafted token was drawn from: n walks of
    one block at T = 0.5, slot 1 (after the anchor) and slot 2 after the
    commonest slot-1 token, checked against q by total variation."""
    _, draft = draft2
    n, V = 6000, qwen3_pair.vocab
    block = mx.broadcast_to(mx.array([[70, draft.mask_token_id, draft.mask_token_id]]), (n, 3))
    ctx = np.random.default_rng(8).standard_normal((1, 5, draft.config.fc_input_size))
    ctx = mx.broadcast_to(mx.array(ctx, mx.float32), (n, 5, draft.config.fc_input_size))
    mx.random.seed(1)
    tokens, q = draft.propose_with_probs(block, ctx, draft.make_cache(), 0.5, **filters)
    tokens, q = np.array(tokens), tiny.to_np(q).astype(np.float64)
    assert tokens.shape == (n, 2) and q.shape == (n, 2, V)
    np.testing.assert_allclose(q.sum(-1), 1.0, rtol=1e-5)
    assert ((q > 0).sum(-1) <= filters.get("top_k", draft.config.selector_top_k)).all()
    first = tokens[:, 0] == np.bincount(tokens[:, 0]).argmax()
    for samples, rows in ((tokens[:, 0], q[:, 0]), (tokens[first, 1], q[first, 1])):
        np.testing.assert_allclose(rows, rows[:1].repeat(len(rows), 0), rtol=broadcast_row_rtol(draft, 0.5), atol=1e-7)
        assert tiny.tv(samples, rows[0]) < tiny.tv_bound(rows[0], samples.size)


def test_dtype_cast_keeps_selector_working(qwen3_pair, draft2):
    path, _ = draft2
    draft = dflash_mlx.load_draft(path, qwen3_pair.model, dtype=mx.bfloat16)
    assert draft.layers[0].attention_conv.base_kernel.dtype == mx.bfloat16
    block = masked_block(draft, 1, 8)
    ctx = mx.zeros((1, 3, draft.config.fc_input_size))
    assert draft.propose(block, ctx, draft.make_cache()).shape == (1, 7)


def test_bad_dflash2_config_is_explained(qwen3_pair):
    cfg = DFlashConfig.from_hf(qwen3_pair.dflash2_config(conv_group_size=24))
    with pytest.raises(ValueError, match="does not divide hidden_size"):
        d2.DFlash2DraftModel(cfg)


# ---------------------------------------------------------------------------
# Lossless greedy generation


@pytest.mark.parametrize("block_size", [8, 3, 12])  # trained size 8, then others
def test_greedy_is_lossless(pair, tmp_path, block_size, device, ran):
    """On the GPU the drafter runs its Metal kernels where there is Metal."""
    path = tiny.make_draft(tmp_path / "d2", pair.dflash2_config(), seed=5)
    draft = dflash_mlx.load_draft(path, pair.model)
    prompt = prompt_of(30)
    ref = pair.reference(prompt, 40)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, responses = pair.dflash(draft, prompt, block_size=block_size, max_tokens=40)
    assert got == ref
    off_size = [w for w in caught if "trained for block_size 8" in str(w.message)]
    assert len(off_size) == (block_size != 8)
    assert not [w for w in caught if "Metal kernel" in str(w.message)]
    assert max(r.committed for r in responses) <= block_size
    if device == "gpu" and mx.metal.is_available():
        ran("Metal kernels")


def test_implementation_is_per_drafter(qwen3_pair, draft2):
    path, draft = draft2
    other = dflash_mlx.load_draft(path, qwen3_pair.model)
    block = masked_block(draft, 5, 8)
    ctx = mx.random.normal((1, 6, draft.config.fc_input_size), key=mx.random.key(0))
    want = draft.propose(block, ctx, draft.make_cache())
    other.implementation = "ops"
    assert draft.implementation == "auto"
    convs = [m for _, m in other.named_modules() if isinstance(m, d2.DynamicConv)]
    assert len(convs) == 4 and all(c.implementation == "ops" for c in convs)
    assert other.candidate_selector.implementation == "ops"
    assert mx.array_equal(other.propose(block, ctx, other.make_cache()), want)
    with pytest.raises(ValueError, match="implementation must be one of"):
        other.implementation = "metal"


def test_conv_selector_share_reports_each_implementation(draft2):
    from dflash_mlx.timing import conv_selector_share

    _, draft = draft2
    draft.implementation = "compiled"
    result = conv_selector_share(draft, context_len=16, iters=2, warmup=1)
    assert draft.implementation == "compiled"  # restored
    draft.implementation = "auto"
    assert set(result) >= {"ops", "compiled"}
    for t in result.values():
        assert t["draft_s"] > 0 and t["conv_s"] > 0 and t["selector_s"] > 0
        assert t["share"] == pytest.approx((t["conv_s"] + t["selector_s"]) / t["draft_s"])


# ---------------------------------------------------------------------------
# Metal kernels (macOS); their fallback everywhere

# (B, L, H, taps, groups): one slot, fewer slots than taps, the trained
# block, a long block, groups of one and of many channels, a wide model
CONV_SHAPES = [(1, 1, 16, 3, 4), (2, 3, 64, 4, 4), (2, 8, 64, 4, 16), (3, 16, 48, 2, 3), (1, 12, 256, 4, 64)]


def strided(a: np.ndarray) -> mx.array:
    """The same values, laid out transposed in memory (a non-contiguous view)."""
    return mx.array(np.ascontiguousarray(np.swapaxes(a, 0, -1))).swapaxes(0, -1)


@metal
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("shape", CONV_SHAPES)
def test_conv_kernel_matches_ops(shape, dtype, layout, ran):
    B, L, H, taps, G = shape
    make = strided if layout == "strided" else mx.array
    x, base, coef = (make(a).astype(dtype) for a in conv_inputs(B=B, L=L, H=H, taps=taps, G=G))
    with mx.stream(mx.gpu):
        got, want = d2.conv_mix_metal(x, base, coef), d2.conv_mix_ops(x, base, coef)
        assert got.dtype == want.dtype == dtype
        # Both accumulate in float32 and round once to the dtype: a float32
        # result differs by summation order at most, a half one by one rounding.
        tol = 16 * tiny.EPS[mx.float32] if dtype == mx.float32 else 2 * tiny.EPS[dtype]
        np.testing.assert_allclose(tiny.to_np(got), tiny.to_np(want), rtol=tol, atol=tol)
    ran("Metal kernels")


@metal
@pytest.mark.parametrize("B, N, K", [(1, 2, 1), (1, 2, 4), (4, 7, 8), (3, 15, 16), (2, 3, 32)])
def test_walk_kernel_matches_ops(B, N, K, ran):
    rng = np.random.default_rng(9)
    unary = rng.integers(0, 3, (B, N, K)).astype(np.float32)  # exact ties
    first = rng.integers(0, 2, (B, K)).astype(np.float32)
    pair = rng.integers(0, 2, (B, N - 1, K, K)).astype(np.float32)
    with mx.stream(mx.gpu):
        for noise in (np.zeros((B, N, K), np.float32), rng.gumbel(size=(B, N, K)).astype(np.float32)):
            for make in (mx.array, strided):
                args = [make(a) for a in (unary, first, pair, noise)]
                got, want = d2.walk_metal(*args), d2.walk_ops(*args)
                np.testing.assert_array_equal(np.array(got[0]), np.array(want[0]))
                np.testing.assert_array_equal(np.array(got[1]), np.array(want[1]))
    ran("Metal kernels")


@metal
def test_auto_uses_verified_kernels_on_gpu(ran):
    x, base, coef = (mx.array(a) for a in conv_inputs(L=5, H=16, taps=3, G=4))
    with mx.stream(mx.gpu), warnings.catch_warnings():
        warnings.simplefilter("error")  # a kernel that failed its check would warn
        y = d2.conv_mix(x, base, coef, "auto")
        choice, _ = d2.walk(mx.zeros((1, 3, 4)), mx.zeros((1, 4)), mx.zeros((1, 2, 4, 4)), mx.zeros((1, 3, 4)), "auto")
    np.testing.assert_allclose(tiny.to_np(y), ref_conv(*map(tiny.to_np, (x, base, coef))), rtol=1e-5, atol=1e-5)
    assert choice.tolist() == [[0, 0, 0]]
    ran("Metal kernels")


def test_a_failing_kernel_means_the_ops_and_one_warning():
    """A kernel that raises (the real Metal one, where there is no Metal) or
    that computes something else is never used, and says so once."""
    x, base, coef = (mx.array(a) for a in conv_inputs())
    ops = lambda: d2.conv_mix_ops(x, base, coef)  # noqa: E731
    same = lambda a, b: mx.allclose(a, b).item()  # noqa: E731

    def raises():
        raise RuntimeError("kernel build failed")

    kernels = {"raises": raises, "wrong": lambda: ops() + 1.0}
    if not mx.metal.is_available():
        kernels["metal"] = lambda: d2.conv_mix_metal(x, base, coef)
    for name, kernel in kernels.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            verdicts = [d2.kernel_verified(("test", name), kernel, ops, same) for _ in range(3)]
        assert verdicts == [False] * 3, name
        assert len(caught) == 1 and "using the MLX ops instead" in str(caught[0].message), name
    assert d2.kernel_verified(("test", "right"), ops, ops, same)
