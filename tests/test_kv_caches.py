"""KV caches as mlx-lm's generate makes them (kv_bits, kv_group_size,
quantized_kv_start, max_kv_size): greedy DFlash output token-identical to
mlx-lm's own decode with the same cache settings, through rollbacks of
every length, on an attention, a hybrid and a Gemma-4 target (float32).

The tiny attention and hybrid targets get 64-wide heads here: a KV
quantization group (32, 64 or 128) must divide the head size.
"""

import copy
import itertools
import os

import mlx.core as mx
import numpy as np
import pytest
import tiny
from mlx_lm.generate import maybe_quantize_kv_cache
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache, make_prompt_cache
from tiny import ScriptedDrafter, prompt_of

import dflash_mlx
from dflash_mlx.cache import load_prompt_cache, prompt_cache_for, save_prompt_cache
from dflash_mlx.disk_cache import DiskPromptCache, pair_identity
from dflash_mlx.errors import ArgumentError, DFlashError
from dflash_mlx.targets import adapter_for
from dflash_mlx.targets.kv import KV_BITS, KV_GROUP_SIZES, KVSettings, kv_bytes
from dflash_mlx.targets.rows import check_joinable
from dflash_mlx.tree import build_tree

STEP = 16  # prefill_step_size on both sides: mlx-lm quantizes between its prefill chunks
WIDE = {"qwen3": dict(tiny.QWEN3, head_dim=64), "qwen3_5": dict(tiny.QWEN3_5, head_dim=64)}


@pytest.fixture(scope="module", params=sorted(WIDE))
def wide_pair(request, tmp_path_factory):
    return tiny.Pair(tmp_path_factory.mktemp(request.param), WIDE[request.param])


@pytest.fixture(scope="module")
def wide_qwen3(tmp_path_factory):
    return tiny.Pair(tmp_path_factory.mktemp("qwen3"), WIDE["qwen3"])


def scripted_run(pair, prompt, max_tokens, reference_kw, cache_kw, block=8):
    """mlx-lm's tokens with ``reference_kw``, and DFlash's from a prompt
    cache made with ``cache_kw`` and a drafter that plants a mistake at
    every slot in turn (so every rollback length happens)."""
    ref = pair.reference(prompt, max_tokens + block, eos_ids=[], prefill_step_size=STEP, **reference_kw)
    draft = ScriptedDrafter(ref, prompt, block, range(block), pair.vocab)
    cache = dflash_mlx.make_prompt_cache(pair.model, draft, **cache_kw)
    got, responses = pair.dflash(draft, prompt, eos_ids=[], block_size=block, max_tokens=max_tokens, prefill_step_size=STEP, prompt_cache=cache)
    assert {r.accepted for r in responses[1:]} == set(range(block))
    return got, ref[:max_tokens], cache


def test_settings_are_checked_as_mlx_accepts_them():
    """kv_bits and kv_group_size are what mx.quantize takes, every other
    value refused by name before any work; so are the bounds and the one
    combination mlx-lm cannot run (a quantized rotating cache)."""
    for bits in range(0, 10):
        try:
            mx.quantize(mx.zeros((2, 128)), group_size=64, bits=bits)
            takes = True
        except ValueError:
            takes = False
        assert (bits in KV_BITS) == takes
    for group in (16, 32, 64, 128, 256):
        try:
            mx.quantize(mx.zeros((2, 256)), group_size=group, bits=4)
            takes = True
        except ValueError:
            takes = False
        assert (group in KV_GROUP_SIZES) == takes
    with pytest.raises(ArgumentError, match="kv_bits must be one of 1, 2, 3, 4, 5, 6, 8"):
        KVSettings.of(kv_bits=7)
    with pytest.raises(ArgumentError, match="kv_bits must be one of"):
        KVSettings.of(kv_bits=True)
    with pytest.raises(ArgumentError, match="kv_group_size must be one of 32, 64, 128"):
        KVSettings.of(kv_bits=4, kv_group_size=16)
    with pytest.raises(ArgumentError, match="quantized_kv_start must be a whole number of at least 0"):
        KVSettings.of(kv_bits=4, quantized_kv_start=-1)
    with pytest.raises(ArgumentError, match="max_kv_size must be a whole number of at least 5"):
        KVSettings.of(max_kv_size=4)
    with pytest.raises(ArgumentError, match="kv_bits and max_kv_size cannot be used together"):
        KVSettings.of(kv_bits=4, max_kv_size=64)
    assert KVSettings.of() is None and KVSettings.of(kv_group_size=64, quantized_kv_start=5000) is None


def test_caches_are_refused_where_they_cannot_be_made(make_pair, tmp_path):
    """A group that does not divide the heads, and kv_bits on Gemma-4's
    sliding windows (mlx-lm's own decode fails there: RotatingKVCache has
    no quantized form), are refused when the cache is made."""
    narrow = make_pair("qwen3")  # 16-wide heads
    draft = dflash_mlx.load_draft(narrow.make_draft(tmp_path / "d"), narrow.model)
    with pytest.raises(ArgumentError, match="kv_group_size 32 does not divide this target's head size 16: leave kv_bits out"):
        dflash_mlx.make_prompt_cache(narrow.model, draft, kv_bits=4, kv_group_size=32)
    gemma = make_pair("gemma4_text")
    gemma_draft = dflash_mlx.load_draft(gemma.make_draft(tmp_path / "g"), gemma.model)
    with pytest.raises(ArgumentError, match="sliding-window caches"):
        dflash_mlx.make_prompt_cache(gemma.model, gemma_draft, kv_bits=4, kv_group_size=32)
    with pytest.raises(NotImplementedError):
        gemma.reference(prompt_of(9), 4, kv_bits=4, kv_group_size=32, quantized_kv_start=0)


@pytest.mark.parametrize("start", [0, 50, 64])
@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_kv_is_mlx_lm_decode(wide_pair, bits, start):
    """kv_bits with quantized_kv_start before the prompt's end (converted
    between prefill chunks) and inside the generation (verify blocks that
    cross it are split there, and rolled back into their float part)."""
    kw = dict(kv_bits=bits, kv_group_size=64, quantized_kv_start=start)
    got, ref, cache = scripted_run(wide_pair, prompt_of(40), 60, kw, kw)
    assert got == ref
    attention = [c for c in cache.target if not hasattr(c, "cache")]
    assert attention and all(isinstance(c, QuantizedKVCache) and c.bits == bits for c in attention)


def test_quantized_kv_changes_the_output(wide_pair):
    """The settings reach the target: 4-bit caches from the start decode
    otherwise than float ones (else the tests above could not fail)."""
    kw = dict(kv_bits=4, quantized_kv_start=0)
    assert scripted_run(wide_pair, prompt_of(40), 60, kw, kw)[0] != wide_pair.reference(prompt_of(40), 60, eos_ids=[], prefill_step_size=STEP)


def test_a_block_crossing_quantized_kv_start_is_split(wide_qwen3):
    """At the adapter: a verify block over quantized_kv_start gives the
    logits of mlx-lm's one-token steps with ``maybe_quantize_kv_cache``
    between them, not those of one forward on float caches; a rollback into
    its float part puts float caches back, one past it keeps quantized ones."""
    model = wide_qwen3.model
    target = adapter_for(model)
    prompt, block = prompt_of(30), mx.array([prompt_of(8, seed=3)])
    settings = KVSettings(4, 64, 33)
    cache = target.make_cache(settings)
    target.forward(mx.array([prompt]), cache, taps=[], record=False)
    logits, _ = target.forward(block, cache, taps=[])
    ref_cache = make_prompt_cache(model)
    model(mx.array([prompt]), cache=ref_cache)
    steps = []
    for t in block[0].tolist():
        maybe_quantize_kv_cache(ref_cache, 33, 64, 4)
        steps.append(model(mx.array([[t]]), cache=ref_cache)[0, -1])
    assert mx.abs(logits[0] - mx.stack(steps)).max().item() < 1e-4
    plain = target.make_cache()
    target.forward(mx.array([prompt]), plain, taps=[], record=False)
    unsplit, _ = target.forward(block, plain, taps=[])
    assert mx.abs(unsplit[0, 3:] - mx.stack(steps[3:])).max().item() > 1e-3
    target.rollback(cache, 2)
    assert all(type(c) is KVCache and c.offset == 32 for c in cache)
    target.forward(block, cache, taps=[])
    target.rollback(cache, 5)
    assert all(type(c) is QuantizedKVCache and c.offset == 37 for c in cache)
    with pytest.raises(DFlashError, match="draft tree crosses quantized_kv_start"):
        crossing = target.make_cache(KVSettings(4, 64, 33))
        target.forward(mx.array([prompt]), crossing, taps=[], record=False)
        target.forward(block[:, :6], crossing, taps=[], tree=chain_tree(6))
    assert crossing.rows_before_quantizing() == 3


def chain_tree(rows):
    """A draft tree of ``rows`` rows in one chain (``rows - 1`` deep)."""
    return build_tree(0, np.arange(rows - 1).reshape(-1, 1), np.zeros((rows - 1, 1)), rows)


def rotating_everywhere(model, size):
    """mlx-lm's caches for ``model`` with each full-attention ``KVCache``
    a ``RotatingKVCache(size, keep=4)``, as mlx-lm's make_prompt_cache makes
    them for a model without its own make_cache."""
    return [RotatingKVCache(size, keep=4) if type(c) is KVCache else c for c in make_prompt_cache(model)]


@pytest.mark.parametrize("name", ["qwen3", "qwen3_5", "gemma4_text"])
@pytest.mark.parametrize("size,prompt_len", [(24, 20), (12, 30)])
def test_max_kv_size_is_mlx_lm_decode(make_pair, name, size, prompt_len):
    """max_kv_size shorter than the generation (and than the prompt): every
    full-attention layer a rotating cache keeping its first 4 positions,
    decoded as mlx-lm decodes over those caches (for qwen3, mlx-lm's own
    max_kv_size makes them; mlx-lm 0.32.2 leaves it unused for models that
    make their own caches: qwen3.5, gemma4, llama)."""
    pair = make_pair(name)
    prompt = prompt_of(prompt_len)
    got, ref, cache = scripted_run(pair, prompt, 60, dict(prompt_cache=rotating_everywhere(pair.model, size)), dict(max_kv_size=size))
    assert got == ref
    assert ref != pair.reference(prompt, 60, eos_ids=[], prefill_step_size=STEP)
    if name == "qwen3":
        assert ref == pair.reference(prompt, 60, eos_ids=[], prefill_step_size=STEP, max_kv_size=size)
    assert [c.max_size for c in cache.target if isinstance(c, RotatingKVCache) and c.keep] and all(
        c.offset == cache.ran == len(prompt) + 59 for c in cache.target if isinstance(c, RotatingKVCache)
    )


class ScriptedTreeDrafter(tiny.TreeDoubleDrafter):
    """Slot logits that rank the reference continuation first and one
    other token second, except at one slot per cycle (in turn), where the
    other token comes first: walks go deep, through side branches too."""

    def __init__(self, reference, prompt, vocab, block_size=8):
        super().__init__(prompt, None, block_size)
        self.reference, self.vocab = list(reference), vocab
        self.mistakes = itertools.cycle(range(block_size - 1))

    def slot_head_logits(self, block, context, cache, slots=None):
        at = len(self.followed.tokens) - 1 - len(self.prompt)  # the anchor's index in the reference
        slot, rows = next(self.mistakes), np.zeros((block.shape[1] - 1, self.vocab), np.float32)
        for j, row in enumerate(rows):
            want = (self.reference[at + 1 + j : at + 2 + j] or [0])[0]
            row[want], row[(want + 1) % self.vocab] = 5.0, 6.0 if j == slot else 4.0
        return mx.array(rows)[None][:, :slots]


@pytest.mark.parametrize("name,kw", [("qwen3", dict(max_kv_size=12)), ("gemma4_text", dict(max_kv_size=12)), ("wide", dict(kv_bits=4, quantized_kv_start=0))])
def test_trees_with_kv_caches(make_pair, wide_qwen3, name, kw):
    """Draft trees every cycle, walked deep and through side branches (so
    rollbacks gather rows), over rotating caches that keep their first
    positions and over quantized caches."""
    pair = wide_qwen3 if name == "wide" else make_pair(name)
    lm_kw = dict(prompt_cache=rotating_everywhere(pair.model, 12)) if "max_kv_size" in kw else kw
    ref = pair.reference(prompt_of(20), 60, eos_ids=[], prefill_step_size=STEP, **lm_kw)
    drafter = ScriptedTreeDrafter(ref, prompt_of(20), pair.vocab)
    cache = drafter.follow(dflash_mlx.make_prompt_cache(pair.model, drafter, **kw))
    got, responses = pair.dflash(drafter, prompt_of(20), eos_ids=[], max_tokens=50, prefill_step_size=STEP, prompt_cache=cache, tree_budget=16)
    assert got == ref[:50]
    assert tiny.tokens_per_cycle(responses) >= 3 and all(r.tree_size == 16 for r in responses[1:-1])


def test_prompt_cache_keeps_its_settings(wide_qwen3, tmp_path):
    """A quantizing prompt cache saved and loaded (the disk tier's files)
    keeps its settings and continues as the one in memory; another
    call's settings for it, a batch and the disk tier of other settings
    refuse it."""
    pair = wide_qwen3
    draft = dflash_mlx.load_draft(pair.make_draft(tmp_path / "d"), pair.model)
    cache = dflash_mlx.make_prompt_cache(pair.model, draft, kv_bits=8, quantized_kv_start=30)
    pair.dflash(draft, prompt_of(20), max_tokens=20, prompt_cache=cache)
    save_prompt_cache(str(tmp_path / "c.safetensors"), cache)
    loaded = load_prompt_cache(str(tmp_path / "c.safetensors"), draft)
    assert loaded.target.kv == KVSettings(8, 64, 30) and loaded.tokens == cache.tokens
    assert copy.deepcopy(cache).target.kv == cache.target.kv  # the server's snapshots are copies
    assert [type(c) for c in loaded.target] == [QuantizedKVCache] * len(cache.target)
    more = [pair.dflash(draft, prompt_of(5, seed=2), max_tokens=15, prompt_cache=c)[0] for c in (cache, loaded)]
    assert more[0] == more[1]
    assert prompt_cache_for(pair.model, draft, cache, kv_bits=8) is cache
    with pytest.raises(ArgumentError, match="made with kv_bits=8, but this call asks for kv_bits=4"):
        prompt_cache_for(pair.model, draft, cache, kv_bits=4)
    with pytest.raises(ArgumentError, match="kv_bits cannot join a batch"):
        check_joinable(cache.target)
    rotating = dflash_mlx.make_prompt_cache(pair.model, draft, max_kv_size=64)
    with pytest.raises(ArgumentError, match="max_kv_size .* cannot join a batch"):
        check_joinable(rotating.target)
    classes = [type(c).__name__ for c in draft.target.make_cache()]
    for kv, found in ((KVSettings(8, 64, 30), True), (None, False)):
        disk = DiskPromptCache(str(tmp_path / f"disk{found}"), 1 << 30, pair_identity(pair.model, draft), draft, classes, kv)
        disk.put(cache)
        disk.flush()
        hit = disk.nearest(cache.tokens, 0)
        assert (hit is not None and hit[0].target.kv == kv) == found


def test_kv_bytes_of_a_quantized_cache(wide_qwen3, tmp_path):
    """kv_bytes counts the attention caches mlx-lm's way (nbytes): 4-bit
    caches (float32 scales and biases per 64) hold under a fifth of float32 ones."""
    pair = wide_qwen3
    draft = dflash_mlx.load_draft(pair.make_draft(tmp_path / "d"), pair.model)
    sizes = []
    for kw in ({}, dict(kv_bits=4, quantized_kv_start=0)):
        cache = dflash_mlx.make_prompt_cache(pair.model, draft, **kw)
        pair.dflash(draft, prompt_of(500), max_tokens=8, prompt_cache=cache)
        sizes.append(kv_bytes(cache.target))
    assert sizes[1] <= 0.2 * sizes[0]


@pytest.mark.skipif(os.environ.get("DFLASH_MLX_SMOLLM2") != "1", reason="downloads SmolLM2 (set DFLASH_MLX_SMOLLM2=1)")
def test_smollm2_kv_bits_4_on_a_long_prompt():
    """SmolLM2, a 4,000-token prompt, --kv-bits 4 (quantized from the
    start): the target's KV memory at most 0.35x the float cache's, the
    output mlx-lm's with the same settings."""
    from dflash_mlx.benchmark import documentation_text
    from dflash_mlx.pair import load_pair

    model, tokenizer, draft, _ = load_pair("smollm2")
    prompt = tokenizer.encode(documentation_text(), add_special_tokens=False)[:4000]
    kw = dict(kv_bits=4, kv_group_size=64, quantized_kv_start=0)
    ref = tiny.reference_tokens(model, tokenizer, prompt, 40, eos_ids=[], **kw)
    sizes = []
    for settings in ({}, kw):
        cache = dflash_mlx.make_prompt_cache(model, draft, **settings)
        got, _ = tiny.dflash_tokens(model, draft, tokenizer, prompt, eos_ids=[], max_tokens=40, prompt_cache=cache)
        sizes.append(kv_bytes(cache.target))
    assert got == ref
    assert sizes[1] <= 0.35 * sizes[0], sizes
