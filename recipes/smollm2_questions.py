"""Requests the SmolLM2 target writes itself, offline, from the request set's topics.

    python recipes/smollm2_questions.py --requests ~/.cache/dflash_mlx/smollm2/requests.json

For every training topic (never a held-out one) the target is asked, in a few
phrasings, greedily and in batches, for questions about it; each line of its
answer that reads as a question becomes a request under the topic's key
(kind ``written``). A question that names a held-out subject, or equals a
held-out request, is dropped, so the held-out requests (the benchmark's
prompts) stay unseen. The new requests go after the file's training list
(shards made from the earlier ones stay valid); the file is rewritten
atomically, once (``written_questions`` records it). Until then the
questions so far wait in ``requests-questions.json`` beside it, saved
after every ``--chunk`` prompts, and a new run continues from there.
"""

import argparse
import json
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from smollm2_distill import greedy_answers, load_target  # noqa: E402

WRITE_ASKS = [
    "Write five different questions a curious student might ask about {subject}. Write one question per line.",
    "List five questions someone could ask an expert about {subject}, one per line.",
    "Write five practical how-to questions about {subject}, one per line.",
]
NUMBERING = re.compile(r"^\s*(?:[-*\u2022]|\d+[.)]|Q\d*[:.])?\s*")


def subject(topic: str) -> str:
    """What a topic key is about, in words."""
    kind, name = topic.split(":", 1)
    return {"stdlib": f"the Python module {name}", "task": f"Python code that {name}"}.get(kind, name)


def questions(text: str):
    """The lines of ``text`` that read as questions, numbering stripped."""
    for line in text.splitlines():
        q = NUMBERING.sub("", line).strip()
        if q.endswith("?") and 15 <= len(q) <= 300:
            yield q


def names_any(text: str, names) -> bool:
    return any(re.search(rf"\b{re.escape(n)}\b", text, re.IGNORECASE) for n in names)


def written_requests(model, tokenizer, data: dict, args, progress: Path) -> list:
    """The target's questions on the training topics, minus any touching a
    held-out one. Asked ``--chunk`` prompts at a time; after each chunk the
    questions so far and the count of prompts asked go to ``progress``
    (atomically), so an interrupted run continues at the next chunk."""
    heldout_topics = {r["topic"] for r in data["heldout"]}
    heldout_names = {t.split(":", 1)[1] for t in heldout_topics}
    heldout_text = {r["request"] for r in data["heldout"]}
    topics = sorted({r["topic"] for r in data["train"]} - heldout_topics)[: args.limit]
    asks = [(t, ask.format(subject=subject(t))) for t in topics for ask in WRITE_ASKS]
    state = json.loads(progress.read_text()) if progress.exists() else {"asked": 0, "questions": []}
    out = state["questions"]
    seen = {r["request"] for r in out}
    for start in range(state["asked"], len(asks), args.chunk):
        chunk = asks[start : start + args.chunk]
        prompts = [tokenizer.apply_chat_template([{"role": "user", "content": a}], add_generation_prompt=True) for _, a in chunk]
        for (topic, _), ids in zip(chunk, greedy_answers(model, tokenizer, prompts, args)):
            for q in questions(tokenizer.decode(ids)):
                if q in seen or q in heldout_text or names_any(q, heldout_names):
                    continue
                seen.add(q)
                out.append({"topic": topic, "kind": "written", "request": q})
        write_atomically(progress, {"asked": start + len(chunk), "questions": out})
        print(f"asked {start + len(chunk)} of {len(asks)}: {len(out)} questions", flush=True)
    return out


def write_atomically(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="target directory (default: the smollm2 pair's)")
    p.add_argument("--requests", required=True, help="requests.json of recipes/smollm2_requests.py, extended in place")
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--chunk", type=int, default=128, help="prompts asked between two saves of the progress")
    p.add_argument("--limit", type=int, default=None, help="only the first N training topics")
    p.add_argument(
        "--fast-target", action=argparse.BooleanOptionalAction, default=True,
        help="approximate softmax / SiLU in the target (CPU float32)",
    )
    args = p.parse_args(argv)
    path = Path(args.requests).expanduser()
    data = json.loads(path.read_text())
    if data.get("written_questions"):
        print(f"{path} holds the target's questions already")
        return
    _, model, tokenizer = load_target(args)
    progress = path.with_name(path.stem + "-questions.json")
    new = written_requests(model, tokenizer, data, args, progress)
    data["train"] += new
    data["written_questions"] = len(new)
    write_atomically(path, data)
    progress.unlink()
    print(f"{len(new)} questions written by the target -> {path}")


if __name__ == "__main__":
    main()
