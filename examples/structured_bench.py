"""Structured outputs on JSON-extraction requests: DFlash held to each
request's JSON schema against mlx-lm's own decode with the same mask, and
against DFlash without a schema, in one process (issue 60's measurements).

    python examples/structured_bench.py --model smollm2 --json structured.json
    python examples/structured_bench.py --num-prompts 2 --max-tokens 16   # the bundled pair, a quick look

Each request of the ``json_extract`` prompt set (a chat turn, its schema
shown in it unless ``--no-schema-in-prompt``) runs, greedy, with the order
rotating per round:

- ``mlx-lm``: mlx-lm's ``stream_generate`` with the schema's llguidance mask as
  a logits processor (``Constraint.processor()``, a fresh constraint per run);
- ``dflash``: DFlash with ``response_format`` (the same schema);
- ``free``: DFlash without a constraint;
- ``verify-only``: DFlash with the grammar in the verify only, as a logits
  processor would hold it (:class:`VerifyOnly`: the drafter's block
  unmasked, no token forced ahead of a cycle, copies not held to the
  grammar): the same text as ``dflash``, so its tokens per cycle against
  ``dflash``'s count what masked drafts and forced tokens add on the same
  answer (``free`` decodes another text: prose, or the schema echoed).

A schema compiles with llguidance's defaults
(``LLMatcher.grammar_from_json_schema(schema)``: flexible whitespace), so the
reference can be rebuilt anywhere. Reported per request and pooled: tokens
per cycle of ``dflash`` (forced tokens included) over ``free``'s, and pooled
over ``verify-only``'s (the same text; also over the held answers that end
by themselves, which no repeat up to ``--max-tokens`` inflates); wall clock
(prefill included) and decode speed of ``dflash`` over ``mlx-lm``'s; whether
the two gave the same tokens; whether each answer validates against its
schema (with the ``jsonschema`` package where installed, else only
``json.loads`` and llguidance's completion: the answer ended at eos once the
grammar was complete); the share of forced tokens; and the mask's share of a
cycle: the host seconds of the constraint's calls in the loop (its
``block`` / ``tree`` / ``draft_block`` / ``forced`` / ``takes`` / ``commit``, the
drafter's forward inside ``draft_block`` left out) over the decode's
seconds. That share is an upper bound: the host work may overlap the
device's. Exits 1 where a held answer is not mlx-lm's.
"""

import argparse
import importlib.metadata
import json
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm import stream_generate as mlx_lm_stream_generate

from dflash_mlx import cli, stream_generate
from dflash_mlx.benchmark import compile_block_lengths
from dflash_mlx.generate import encode_prompt
from dflash_mlx.pair import as_chat, load_pair, structured_set
from dflash_mlx.structured import Constraint, bridge, grammar_of

DECODERS = ("mlx-lm", "dflash", "free", "verify-only")
BARS = {"tokens_per_cycle_ratio": 1.3, "wall_speedup": 1.2, "mask_share": 0.05}  # issue 60's (the share: at most)


class TimedConstraint(Constraint):
    """A :class:`Constraint` that adds the host seconds of the loop's calls
    on it to ``seconds`` (the drafter forward that ``draft_block`` asks for is
    evaluated and left out)."""

    seconds = 0.0

    def timed(self, method, *args, **kwargs):
        tic = time.perf_counter()
        out = method(*args, **kwargs)
        self.seconds += time.perf_counter() - tic
        return out

    def block(self, logits, proposal):
        return self.timed(super().block, logits, proposal)

    def tree(self, logits, tokens, parents):
        return self.timed(super().tree, logits, tokens, parents)

    def forced(self, limit):
        return self.timed(super().forced, limit)

    def takes(self, tokens):  # (a copied span cut, a tree's path held)
        return self.timed(super().takes, tokens)

    def commit(self, tokens):
        return self.timed(super().commit, tokens)

    def draft_block(self, slots, logits, *args, **kwargs):
        drafter = [0.0]

        def drafted():
            tic = time.perf_counter()
            out = logits()
            mx.eval(out)
            drafter[0] += time.perf_counter() - tic
            return out

        out = self.timed(super().draft_block, slots, drafted, *args, **kwargs)
        self.seconds -= drafter[0]
        return out


def json_schema(entry) -> dict:
    return {"type": "json_schema", "json_schema": {"name": entry["name"], "schema": entry["schema"], "strict": True}}


class VerifyOnly(Constraint):
    """The grammar in the verify only: the drafter's block as it drafts it
    (greedy, unmasked), no token forced ahead of a cycle, a copied span not
    cut where the grammar refuses it; row i of a verify is still masked by
    its own path, so the answer is the held one."""

    def forced(self, limit):
        return []

    def takes(self, tokens):
        return len(tokens)

    def draft_block(self, slots, logits, vocab_size, sampling=None, key=None):
        self.plan = None
        return mx.argmax(logits(), axis=-1).tolist()[:slots], None


def run_mlx_lm(model, tokenizer, ids, grammar, max_tokens) -> dict:
    """mlx-lm's greedy decode with the grammar's mask as its logits processor."""
    processor = Constraint(grammar, bridge(tokenizer)).processor()
    tic, out, start = time.perf_counter(), [], 0.0
    for r in mlx_lm_stream_generate(model, tokenizer, ids, max_tokens=max_tokens, logits_processors=[processor]):
        if not out:
            start = time.perf_counter()
        out.append(r)
    end = time.perf_counter()
    tokens = [r.token for r in out if not (r.finish_reason == "stop" and r.token in tokenizer.eos_token_ids)]
    return {"tokens": tokens, "finish": out[-1].finish_reason, "wall_s": end - tic, "decode_s": end - start}


def run_dflash(model, draft, tokenizer, ids, grammar, max_tokens, block_size, held=TimedConstraint) -> dict:
    """One DFlash generation (``grammar`` None: unconstrained; ``held``: the
    constraint's kind): its tokens, cycles and forced tokens, and with a
    grammar the mask's host seconds over the cycles (from the prefill's
    token on, as the decode's seconds)."""
    constraint = held(grammar, bridge(tokenizer)) if grammar else None
    tic, out, mask0, start = time.perf_counter(), [], 0.0, 0.0
    for r in stream_generate(model, draft, tokenizer, ids, max_tokens=max_tokens, block_size=block_size, response_format=constraint):
        if not out:
            mask0, start = getattr(constraint, "seconds", 0.0), time.perf_counter()
        out.append(r)
    end = time.perf_counter()
    return {
        "tokens": [t for r in out for t in r.tokens], "finish": out[-1].finish_reason, "wall_s": end - tic,
        "decode_s": end - start,
        "committed": [r.committed for r in out[1:]], "forced": sum(r.forced for r in out),
        "mask_s": getattr(constraint, "seconds", 0.0) - mask0, "text": tokenizer.decode([t for r in out for t in r.tokens]),
    }


def validator():
    """``(name, validate(instance, schema) -> error or None)``: jsonschema's
    where installed, else None (llguidance's completion and ``json.loads`` only)."""
    try:
        import jsonschema
    except ImportError:
        return "json.loads and llguidance's completion (jsonschema not installed)", None
    checker = jsonschema.validators.validator_for

    def validate(instance, schema):
        error = jsonschema.exceptions.best_match(checker(schema)(schema).iter_errors(instance))
        return None if error is None else error.message

    return f"jsonschema {importlib.metadata.version('jsonschema')}", validate


def schema_error(text: str, finish, schema: dict, validate) -> str:
    """Why an answer does not validate against ``schema`` ("" where it does):
    cut at ``max_tokens``, not JSON, or (with ``validate``) the schema's error."""
    try:
        instance = json.loads(text)
    except ValueError as e:
        return "cut at --max-tokens" if finish == "length" else f"not JSON: {e}"
    if validate is not None:
        return validate(instance, schema) or ""
    return "" if finish == "stop" else "the grammar did not end"


def request_runs(model, draft, tokenizer, entry, ids, args, turn: int) -> dict:
    """``args.repeats`` rounds of the three decoders on one request, the
    order rotating by one per round from ``turn``."""
    grammar = grammar_of(json_schema(entry))
    runs = {name: [] for name in DECODERS}
    for r in range(args.repeats):
        k = (turn + r) % len(DECODERS)
        for name in DECODERS[k:] + DECODERS[:k]:
            if name == "mlx-lm":
                runs[name].append(run_mlx_lm(model, tokenizer, ids, grammar, args.max_tokens))
            else:
                held = None if name == "free" else grammar
                kind = VerifyOnly if name == "verify-only" else TimedConstraint
                runs[name].append(run_dflash(model, draft, tokenizer, ids, held, args.max_tokens, args.block_size, kind))
    return runs


def per_cycle(committed: list, cycles: list, name: str) -> float:
    """Tokens per cycle of decoder ``name``, pooled over requests' counts."""
    return sum(c[name] for c in committed) / max(1, sum(c[name] for c in cycles))


def request_row(entry, runs, validate) -> dict:
    """One request's figures (tokens, cycles and outputs from its first round; seconds pooled)."""
    a, b, c = runs["mlx-lm"][0], runs["dflash"][0], runs["free"][0]
    cycles = {n: sum(len(r["committed"]) for r in runs[n]) for n in DECODERS[1:]}
    committed = {n: sum(sum(r["committed"]) for r in runs[n]) for n in DECODERS[1:]}
    return {
        "name": entry["name"],
        "tokens": len(b["tokens"]),
        "forced": b["forced"],
        "produced": 1 + sum(b["committed"]),  # (the prefill's token, and every cycle's, its eos included)
        "tokens_per_cycle": per_cycle([committed], [cycles], "dflash"),
        "free_tokens_per_cycle": per_cycle([committed], [cycles], "free"),
        "verify_only_tokens_per_cycle": per_cycle([committed], [cycles], "verify-only"),
        "cycles": cycles, "committed": committed,
        "mlx_lm_wall_s": sum(r["wall_s"] for r in runs["mlx-lm"]),
        "dflash_wall_s": sum(r["wall_s"] for r in runs["dflash"]),
        "mlx_lm_decode_s": sum(r["decode_s"] for r in runs["mlx-lm"]),
        "mask_s": sum(r["mask_s"] for r in runs["dflash"]),
        "decode_s": sum(r["decode_s"] for r in runs["dflash"]),
        "identical": all(r["tokens"] == a["tokens"] and r["finish"] == a["finish"] for r in runs["mlx-lm"] + runs["dflash"] + runs["verify-only"]),
        "finish": b["finish"],
        "schema_error": schema_error(b["text"], b["finish"], entry["schema"], validate),
        "free_schema_error": schema_error(c["text"].strip(), c["finish"], entry["schema"], validate),
        "answer": b["text"], "free_answer": c["text"], "free_finish": c["finish"],
    }


def summary(rows) -> dict:
    """The pooled figures, against issue 60's bars."""
    total = {k: sum(r[k] for r in rows) for k in ("forced", "produced", "mlx_lm_wall_s", "dflash_wall_s", "mlx_lm_decode_s", "mask_s", "decode_s")}
    cycles = sum(r["cycles"]["dflash"] for r in rows)
    tpc, free, verify = (per_cycle([r["committed"] for r in rows], [r["cycles"] for r in rows], n) for n in DECODERS[1:])
    ended = [r for r in rows if r["finish"] == "stop"]  # held answers that end by themselves (no repeat to the cut)
    ended_held, ended_verify = (per_cycle([r["committed"] for r in ended], [r["cycles"] for r in ended], n) for n in ("dflash", "verify-only"))
    out = {
        "tokens_per_cycle": tpc,
        "free_tokens_per_cycle": free,
        "tokens_per_cycle_ratio": tpc / free if free else 0.0,
        "verify_only_tokens_per_cycle": verify,
        "same_text_ratio": tpc / verify if verify else 0.0,
        "ended": len(ended),
        "same_text_ratio_ended": ended_held / ended_verify if ended_verify else 0.0,
        "wall_speedup": total["mlx_lm_wall_s"] / total["dflash_wall_s"],
        "decode_speedup": total["mlx_lm_decode_s"] / total["decode_s"] if total["decode_s"] else 0.0,
        "forced_share": total["forced"] / total["produced"],
        "mask_ms_per_cycle": 1e3 * total["mask_s"] / max(1, cycles),
        "cycle_ms": 1e3 * total["decode_s"] / max(1, cycles),
        "mask_share": total["mask_s"] / total["decode_s"] if total["decode_s"] else 0.0,
        "outputs_identical": all(r["identical"] for r in rows),
        "valid": sum(not r["schema_error"] for r in rows),
        "free_valid": sum(not r["free_schema_error"] for r in rows),
        "requests": len(rows),
    }
    out["bars_met"] = {k: (out[k] <= bar if k == "mask_share" else out[k] >= bar) for k, bar in BARS.items()}
    return out


def warm_up(model, draft, tokenizer, entry, ids, args) -> None:
    """Every decoder once on the first request, untimed, and the verify
    compiled at every block length (one-time costs, as the main bench's)."""
    grammar = grammar_of(json_schema(entry))
    run_mlx_lm(model, tokenizer, ids, grammar, 16)
    run_dflash(model, draft, tokenizer, ids, grammar, 16, args.block_size)
    run_dflash(model, draft, tokenizer, ids, None, 16, args.block_size)
    run_dflash(model, draft, tokenizer, ids, grammar, 16, args.block_size, VerifyOnly)
    compile_block_lengths(draft, ids, args.block_size or draft.block_size)


def print_table(rows, total) -> None:
    head = f"{'request':<12} {'tokens':>6} {'forced':>7} {'tok/cyc':>8} {'free':>6} {'ratio':>6} {'mlx-lm s':>9} {'DFlash s':>9} {'speedup':>8} {'mask':>6}  same  valid"
    print(head)
    for r in rows:
        ratio = r["tokens_per_cycle"] / r["free_tokens_per_cycle"] if r["free_tokens_per_cycle"] else 0.0
        print(
            f"{r['name']:<12} {r['tokens']:6d} {r['forced'] / r['produced']:6.1%} {r['tokens_per_cycle']:8.2f} "
            f"{r['free_tokens_per_cycle']:6.2f} {ratio:5.2f}x {r['mlx_lm_wall_s']:9.2f} {r['dflash_wall_s']:9.2f} "
            f"{r['mlx_lm_wall_s'] / r['dflash_wall_s']:7.2f}x {r['mask_s'] / max(r['decode_s'], 1e-9):6.1%}  "
            f"{'yes' if r['identical'] else 'NO':<4}  {'yes' if not r['schema_error'] else r['schema_error'][:40]}"
        )
    t = total
    print(
        f"{'all':<12} {sum(r['tokens'] for r in rows):6d} {t['forced_share']:6.1%} {t['tokens_per_cycle']:8.2f} "
        f"{t['free_tokens_per_cycle']:6.2f} {t['tokens_per_cycle_ratio']:5.2f}x {sum(r['mlx_lm_wall_s'] for r in rows):9.2f} "
        f"{sum(r['dflash_wall_s'] for r in rows):9.2f} {t['wall_speedup']:7.2f}x {t['mask_share']:6.1%}  "
        f"{'yes' if t['outputs_identical'] else 'NO':<4}  {t['valid']}/{t['requests']}"
    )
    print(f"same text, the grammar in the verify only: {t['verify_only_tokens_per_cycle']:.2f} tokens per cycle; "
          f"held {t['same_text_ratio']:.2f}x that ({t['same_text_ratio_ended']:.2f}x over the {t['ended']} answers that end by themselves)")
    print(f"decode only (from the first token): {t['decode_speedup']:.2f}x mlx-lm's masked decode; "
          f"mask {t['mask_ms_per_cycle']:.2f} ms of a {t['cycle_ms']:.2f} ms cycle; "
          f"unconstrained answers valid: {t['free_valid']}/{t['requests']}; validator: {t['validator']}")
    print("bars (issue 60): " + ", ".join(f"{k} {'met' if ok else 'NOT met'}" for k, ok in t["bars_met"].items()))


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_pair_arguments(p)
    p.add_argument("--num-prompts", type=cli.positive_int, default=None, help="the first N requests of the set")
    p.add_argument("--max-tokens", "-m", type=cli.positive_int, default=256, help="new tokens per answer at most")
    p.add_argument("--repeats", type=cli.positive_int, default=1, help="timed rounds per request (the order rotates)")
    cli.add_block_size_argument(p)
    p.add_argument(
        "--schema-in-prompt", action=argparse.BooleanOptionalAction, default=True,
        help="show each request's schema in its prompt (default; without it only the grammar knows the fields, "
        "and the unconstrained answers cannot echo the schema)",
    )
    p.add_argument("--json", default=None, help="write the report here")
    return p


def main(argv=None) -> int:
    args = setup_arg_parser().parse_args(argv)
    if args.json and not Path(args.json).resolve().parent.is_dir():
        raise SystemExit(f"error: --json {args.json}: its directory does not exist")
    model, tokenizer, draft, draft_path = load_pair(args.model, args.draft_model)
    entries = structured_set("json_extract")[: args.num_prompts]
    requests = [e["prompt"] if args.schema_in_prompt else e["request"] for e in entries]
    prompts = [encode_prompt(tokenizer, p) for p in as_chat(tokenizer, requests)]
    name, validate = validator()
    draft.bind(model)
    warm_up(model, draft, tokenizer, entries[0], prompts[0], args)
    rows = []
    for i, (entry, ids) in enumerate(zip(entries, prompts)):
        rows.append(request_row(entry, request_runs(model, draft, tokenizer, entry, ids, args, i), validate))
    total = {**summary(rows), "validator": name}
    print_table(rows, total)
    report = {**total, "model": str(args.model), "draft_model": str(draft_path), "max_tokens": args.max_tokens,
              "repeats": args.repeats, "block_size": args.block_size, "schema_in_prompt": args.schema_in_prompt, "mlx": mx.__version__,
              "device": str(mx.default_device()), "rows": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0 if total["outputs_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
