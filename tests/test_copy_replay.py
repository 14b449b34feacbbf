"""The copy source's constants come from a replay over a tuning set that
shares no text with the bench's held-out edit set: the set itself, the
priors' derivation (pooled shares made monotone) reproduced from the
committed answers, and the sized replay deciding as the loop does."""

import json
import runpy
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_mlx import copy_source
from dflash_mlx.copy_source import MATCH_CLASSES, MAX_COPY, CopyIndex, match_class
from dflash_mlx.pair import PROMPT_SETS, benchmark_prompts

ROOT = Path(__file__).resolve().parents[1]
REPLAY = runpy.run_path(str(ROOT / "examples" / "copy_replay.py"))
TUNING_ANSWERS = ROOT / "examples" / "results" / "smollm2_edit_tuning_answers.json"


def lines_of(requests):
    """Every line of the requests' given text long enough not to be boilerplate."""
    return {line.strip() for r in requests for line in r.splitlines() if len(line.strip()) >= 25}


def test_the_tuning_set_is_edit_shaped_and_shares_no_text_with_the_held_out_set():
    tuning, held_out = (json.loads(PROMPT_SETS[name].read_text()) for name in ("edit_tuning", "edit"))
    assert len(tuning) >= 12 and all(isinstance(r, str) and "\n\n" in r for r in tuning)
    code = sum("```" in r for r in tuning)
    fixes = sum(r.startswith(("Fix", "Correct", "One word")) for r in tuning)
    quotes = sum(r.startswith(("Answer by quoting", "Quote")) for r in tuning)
    assert code >= 4 and fixes >= 3 and quotes >= 2  # the three kinds
    assert not lines_of(tuning) & lines_of(held_out)
    assert not {r.split("\n\n")[0] for r in tuning} & {r.split("\n\n")[0] for r in held_out}
    assert benchmark_prompts("any", object(), "edit_tuning") == tuning


def test_match_classes_start_where_said():
    for length in range(0, 40):
        klass = match_class(length)
        assert MATCH_CLASSES[klass] <= max(length, 1)
        assert klass == len(MATCH_CLASSES) - 1 or length < MATCH_CLASSES[klass + 1]
    index = CopyIndex([5, 6, 7, 8, 9, 5, 6, 7])
    assert index.propose(3) == [8, 9, 5] and match_class(index.match_length) == match_class(3) == 1


pooled_classes = st.lists(st.tuples(st.integers(0, 50), st.integers(0, 400), st.integers(0, 50)), min_size=1, max_size=6)


@settings(max_examples=80, deadline=None)
@given(pooled_classes)
def test_priors_are_the_pooled_shares_made_monotone(pooled):
    """Pool adjacent violators: non-decreasing, each pooled run's weighted
    share the run's own, and the raw shares kept where they are in order."""
    priors = REPLAY["priors_of"](pooled)
    raw = [a / max(a + s, 1) for _, a, s in pooled]
    assert len(priors) == len(pooled)
    assert all(p <= q + 1e-12 for p, q in zip(priors, priors[1:]))
    start = 0
    for end in range(1, len(priors) + 1):  # each run of equal priors holds its classes' pooled share
        if end == len(priors) or abs(priors[end] - priors[start]) > 1e-12:
            accepted = sum(a for _, a, _ in pooled[start:end])
            reached = sum(a + s for _, a, s in pooled[start:end])
            if reached:
                assert abs(priors[start] - accepted / reached) < 1e-9
            start = end
    if all(p <= q for p, q in zip(raw, raw[1:])):
        assert priors == raw


def test_priors_pool_the_class_that_breaks_the_order():
    pooled = [(10, 5, 5), (10, 9, 1), (2, 1, 1), (4, 19, 1)]
    assert REPLAY["priors_of"](pooled) == [0.5, 10 / 12, 10 / 12, 0.95]


def test_the_priors_are_the_tuning_sets():
    """COPY_PRIORS is what the replay derives from the tuning set's
    committed answers at the loop's longest copy (rounded as written)."""
    answers = json.loads(TUNING_ANSWERS.read_text())
    runs = [REPLAY["replay"](a["prompt"], a["answer"], MAX_COPY + 1, copy_source.DEFAULT_MAX_NGRAM, copy_source.DEFAULT_MIN_MATCH)
            for a in answers]
    pooled = [[sum(r["classes"][k][i] for r in runs) for i in range(3)] for k in range(len(MATCH_CLASSES))]
    assert tuple(round(p, 2) for p in REPLAY["priors_of"](pooled)) == copy_source.COPY_PRIORS


def test_the_sized_replay_copies_where_rows_are_cheap_and_not_where_they_are_dear():
    """The loop's own rule over a copy source: an answer that repeats its
    prompt is copied in long cycles when a verified row costs nothing, and
    decoded by plain steps when each row costs a plain step's worth."""
    text = [int(t) for t in (list(range(10, 60)) * 2)[:80]]
    prompt, answer = [1, 2, 3] + text, text[:60]
    cheap = REPLAY["sized_replay"](prompt, answer, 0.0, 16, copy_source.DEFAULT_MAX_NGRAM, copy_source.DEFAULT_MIN_MATCH)
    dear = REPLAY["sized_replay"](prompt, answer, 1.0, 16, copy_source.DEFAULT_MAX_NGRAM, copy_source.DEFAULT_MIN_MATCH)
    assert cheap["tokens"] == dear["tokens"] == 59
    assert cheap["cycles"] <= 4 and cheap["copied"] >= 55
    assert dear["cycles"] == 59 and dear["proposing"] == 0 and dear["plain_steps"] == 59
