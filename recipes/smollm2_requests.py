"""Chat requests for the SmolLM2 pair, built offline and seeded.

    python recipes/smollm2_requests.py --out ~/.cache/dflash_mlx/smollm2/requests.json

Kinds, mixed: questions about the Python standard library written from its
own docstrings (the functions and classes of the modules this Python ships),
programming tasks, general questions, short asks (a sentence, a list, a
definition: answers of every length, not only long ones) and multi-turn
conversations (a request and one or two ``followups``). Every request carries
a topic key (the stdlib module, the task's subject, the question's subject);
the held-out requests (the benchmark's) take whole topics, so none of their
topics is seen in training, and the modules whose docstrings make the
long-prompt bench's document are left out. Most requests ask for long, worked answers, since
the drafter must hold its acceptance over long responses.
``recipes/smollm2_questions.py`` adds requests the target itself writes.
"""

import argparse
import ast
import hashlib
import json
import random
import sysconfig
from pathlib import Path

from dflash_mlx.benchmark import DOCUMENT_MODULES

STDLIB_ASKS = [
    "Explain in detail what `{name}` from the `{module}` module does, then show a complete, commented example program that uses it.",
    "I am learning Python. Walk me through `{module}.{short}` step by step: its arguments, what it returns, common mistakes, and two examples.",
    "The documentation of `{module}.{short}` says: \"{doc}\". Explain this in plain words and write a small program that demonstrates it.",
    "Write a tutorial section about `{module}.{short}` with several code examples and an explanation of each.",
]
TASK_ASKS = [
    "Write a Python function that {task}. Include a docstring, type hints, comments, and a few tests, then explain how it works.",
    "Implement a program that {task}. Explain your design first, then give the full code with comments.",
    "How would you write Python code that {task}? Show two different approaches with code and compare them.",
]
TASKS = [
    "reverses the words in a sentence", "checks whether a string is a palindrome", "counts word frequencies in a text file",
    "merges two sorted lists", "finds the longest common prefix of a list of strings", "computes the n-th Fibonacci number",
    "parses a CSV file and sums a column", "validates an email address", "flattens a nested list",
    "implements binary search", "implements a stack class", "implements a queue with two stacks",
    "removes duplicates from a list while keeping order", "converts Roman numerals to integers",
    "finds all prime numbers below n", "computes the greatest common divisor", "transposes a matrix",
    "implements a least-recently-used cache", "groups anagrams together", "checks balanced parentheses",
    "sorts a list of dictionaries by a key", "reads a JSON config file with defaults", "implements merge sort",
    "implements quicksort", "finds the shortest path in a grid", "counts the vowels in a string",
    "converts Celsius to Fahrenheit for a table of values", "implements a simple bank account class",
    "generates all permutations of a string", "computes the median of a list", "rotates a list by k positions",
    "finds the second largest number in a list", "implements a linked list", "detects a cycle in a linked list",
    "builds a word-guessing game", "implements a to-do list on the command line", "computes compound interest",
    "downloads nothing but simulates a retry loop with exponential backoff", "implements a binary search tree",
    "formats a number with thousands separators", "validates a sudoku board", "implements run-length encoding",
    "computes the edit distance between two strings", "finds the most common element in a list",
    "splits a list into chunks of size n", "implements a simple tokenizer for arithmetic expressions",
    "evaluates an arithmetic expression with operator precedence", "implements a priority queue with heapq",
    "walks a directory tree and reports file sizes", "implements the game of life", "converts a date string between formats",
    "implements a rate limiter", "serializes a class to JSON and back", "implements matrix multiplication",
    "computes a moving average", "implements a trie", "finds connected components in a graph",
    "implements topological sorting", "implements a simple state machine", "parses command-line arguments with argparse",
]
GENERAL_ASKS = [
    "Explain {topic} to a beginner, with examples, in several paragraphs.",
    "What are the most important things to know about {topic}? Give a detailed answer.",
    "Write a detailed essay about {topic}.",
    "Give me a step-by-step guide to {topic}.",
]
GENERAL_TOPICS = [
    "photosynthesis", "the water cycle", "how vaccines work", "the history of the printing press", "black holes",
    "climate change", "how the internet works", "compound interest", "the French Revolution", "volcanoes",
    "healthy sleep habits", "learning a new language", "the solar system", "how airplanes fly", "recycling",
    "the human heart", "machine learning", "starting a vegetable garden", "public speaking", "time management",
    "the Roman Empire", "electric cars", "earthquakes", "the immune system", "writing a good resume",
    "the theory of evolution", "renewable energy", "how computers store numbers", "baking bread", "the Moon",
    "the Industrial Revolution", "ocean tides", "how batteries work", "meditation", "the stock market",
    "saving money", "the history of mathematics", "dinosaurs", "how rainbows form", "writing a short story",
    "the scientific method", "bees and pollination", "the Great Wall of China", "personal fitness", "cloud computing",
    "the structure of DNA", "how to study for exams", "weather forecasting", "the history of music", "chess strategy",
]


SHORT_ASKS = [
    "In one sentence, what is {topic}?",
    "List five key facts about {topic}.",
    "Give a short definition of {topic} and one example.",
    "Write a short poem about {topic}.",
    "Summarize {topic} in three bullet points.",
]
FOLLOWUPS = [
    "Can you give another example?",
    "Explain that again more simply, as if I were ten years old.",
    "Summarize your answer in three bullet points.",
    "What are common mistakes or misconceptions about this?",
    "Can you go into more detail on the most important point?",
    "Write a short quiz with answers about what you just explained.",
]


def documented(tree: ast.Module):
    """(name, first docstring paragraph) of the public functions, classes and
    methods of a module."""
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.ClassDef)) or node.name.startswith("_"):
            continue
        inner = [n for n in node.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")]
        for item, name in [(node, node.name)] + [(n, f"{node.name}.{n.name}") for n in inner]:
            doc = ast.get_docstring(item)
            if doc and len(doc) > 30:
                yield name, " ".join(doc.split("\n\n")[0].split())[:300]


def stdlib_items(rng: random.Random, limit_per_module: int = 16):
    """(module, name, first docstring paragraph) from the stdlib sources of this Python."""
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = sorted(root.glob("*.py")) + sorted(root.glob("*/*.py"))
    for path in paths:
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        module = ".".join(parts)
        skip = ("test", "idlelib", "lib2to3", "site-packages", "this", "antigravity", "turtledemo")
        if any(p.startswith("_") or p in skip for p in parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        found = list(documented(tree))
        rng.shuffle(found)
        yield from ((module, name, doc) for name, doc in found[:limit_per_module])


def in_long_prompt_document(topic: str) -> bool:
    """Whether ``topic`` is a module whose docstrings make the long-prompt
    bench's document (``mlx-dflash bench --prompt-lengths``): those stay
    unseen in training, like the held-out requests."""
    module = topic.removeprefix("stdlib:") if topic.startswith("stdlib:") else None
    return module is not None and any(module == m or module.startswith(m + ".") for m in DOCUMENT_MODULES)


def requests(seed: int):
    rng = random.Random(seed)
    out = []
    for module, name, doc in stdlib_items(rng):
        ask = rng.choice(STDLIB_ASKS).format(name=name, module=module, short=name, doc=doc.replace('"', "'"))
        out.append({"topic": f"stdlib:{module}", "kind": "stdlib", "request": ask})
    for task in TASKS:
        for ask in TASK_ASKS:
            out.append({"topic": f"task:{task}", "kind": "task", "request": ask.format(task=task)})
    for topic in GENERAL_TOPICS:
        for ask in GENERAL_ASKS:
            out.append({"topic": f"general:{topic}", "kind": "general", "request": ask.format(topic=topic)})
    rng.shuffle(out)
    return out


def more_requests(seed: int):
    """Short asks and multi-turn conversations on the same topics, drawn
    apart from :func:`requests` so its list (and the held-out set, the
    benchmark's prompts) stays what it was; they go after it, so shards made
    from the old list stay valid."""
    rng = random.Random(f"more-{seed}")
    out = []
    for key, subject in [(f"general:{t}", t) for t in GENERAL_TOPICS] + [
        (f"task:{t}", f"writing Python code that {t}") for t in TASKS
    ]:
        for ask in SHORT_ASKS:
            out.append({"topic": key, "kind": "short", "request": ask.format(topic=subject)})
        first = rng.choice(GENERAL_ASKS).format(topic=subject)
        followups = rng.sample(FOLLOWUPS, rng.choice((1, 2)))
        out.append({"topic": key, "kind": "multi-turn", "request": first, "followups": followups})
    rng.shuffle(out)
    return out


KINDS = ("stdlib", "task", "general", "short", "multi-turn")


def is_heldout(topic: str, percent: int) -> bool:
    return int(hashlib.sha256(topic.encode()).hexdigest(), 16) % 100 < percent


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="requests.json to write")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--heldout-percent", type=int, default=3, help="share of topics held out for the benchmark")
    p.add_argument("--heldout-max", type=int, default=64, help="held-out requests kept (one per topic first)")
    args = p.parse_args(argv)
    reqs = requests(args.seed)
    train = [r for r in reqs if not is_heldout(r["topic"], args.heldout_percent) and not in_long_prompt_document(r["topic"])]
    pool = [r for r in reqs if is_heldout(r["topic"], args.heldout_percent)]
    firsts = list({r["topic"]: r for r in reversed(pool)}.values())  # one per topic first
    heldout = (firsts + [r for r in pool if r not in firsts])[: args.heldout_max]
    train += [r for r in more_requests(args.seed) if not is_heldout(r["topic"], args.heldout_percent)]
    assert not {r["topic"] for r in heldout} & {r["topic"] for r in train}
    out = Path(args.out).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"seed": args.seed, "train": train, "heldout": heldout}, indent=1))
    kinds = {k: sum(r["kind"] == k for r in train) for k in KINDS}
    print(f"{len(train)} training requests {kinds}, {len(heldout)} held out, -> {out}")


if __name__ == "__main__":
    main()
