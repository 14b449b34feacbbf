"""Domain shift: the smollm2 pair's drafter adapts to SQL requests it never saw.

The shipped SmolLM2 drafter was distilled on chat requests about Python's
standard library, programming tasks and general subjects. Here it serves
requests of a kind it was not trained on: "write a SQL query" over seeded
table schemas (:func:`sql_requests`; the held-out ones use schemas and tasks
of their own seeds, and half of each ask for the bare query). The stages,
each resumable (state in ~/.cache/dflash_mlx/traffic_bench/):

  requests  the SQL requests: ``--served`` to record, ``--held-out`` to measure
  serve     the served requests through ``stream_generate(record=...)``
            (what ``mlx-dflash server --learn DIR`` records), greedy
  held-out  the held-out SQL requests and the pair's own held-out chat
            requests (``prompts.json``), decoded at the fixed block 16 with
            the shipped drafter: their tokens per cycle before, and their
            answers (recorded in traffic directories of their own)
  replay    the drafter's original data, packed into rows (replay share)
  adapt     ``mlx-dflash train --from-traffic`` on the recorded traffic,
            ``--init-from`` the shipped drafter, at most ``--minutes`` of CPU,
            the trainer's defaults for a fine-tune (learning rate, warmup,
            replay share, draft vocabulary)
  score     tokens per cycle of both drafters on the held-out records, as
            the trainer predicts them (the exact target)
  after     the held-out requests decoded again with the adapted drafter:
            tokens per cycle after, the text checked identical
  curve     tokens per cycle of the held-out records against recorded tokens:
            the same run, ``--curve-steps`` long, on the first quarter, half
            and all of the traffic (against minutes: the adapt run's own curve)
  speed     DFlash (adaptive block) and mlx-lm's greedy decode on the held-out
            SQL and general requests, with each drafter: tok/s and their ratio
  report    the table (--json FILE: the run's entry under "runs" in FILE)

``--stage evaluate`` runs after, score, speed and report from the saved
state: the measurements, timings included, without training.

``--stage defaults`` (not part of ``all``; state in ``defaults/`` there) is
what a user gets with no tuning, on a kind of request of its own (fields of
a short sentence as JSON, :func:`json_requests`): ``--defaults-served``
requests served with recording (64 new tokens each), then
``mlx-dflash train --from-traffic`` with its default flags and
``--defaults-steps`` (wall time, seconds a step, peak memory), then
``--ratio-steps`` of it and of the bench's tuned flags on the same traffic
(their seconds a step and ratio), then ``--defaults-held-out`` held-out
requests at block 16 with the shipped and the adapted drafter: tokens per
cycle and texts against mlx-lm's greedy decode. On a quiet machine:

    python examples/traffic_adaptation.py --stage defaults --json examples/results/traffic_adaptation.json

    export LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0
    nohup nice -n 10 python examples/traffic_adaptation.py --stage all > bench.log 2>&1 &
"""

import argparse
import json
import os
import random
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
WORK = Path("~/.cache/dflash_mlx/traffic_bench").expanduser()
BLOCK = 16  # the drafter's trained block: tokens per cycle at a fixed width
STAGES = ("requests", "serve", "held-out", "replay", "adapt", "score", "after", "curve", "speed", "report")
EVALUATE = ("after", "score", "speed", "report")  # --stage evaluate: from saved state, no training

SCHEMAS = {
    "shop": {"customers": ["id", "name", "city", "signup_date"], "orders": ["id", "customer_id", "total", "status", "created_at"],
             "products": ["id", "name", "category", "price"], "order_items": ["order_id", "product_id", "quantity"]},
    "school": {"students": ["id", "name", "grade", "birth_date"], "courses": ["id", "title", "teacher_id", "credits"],
               "teachers": ["id", "name", "department"], "enrollments": ["student_id", "course_id", "score"]},
    "hospital": {"patients": ["id", "name", "age", "ward_id"], "doctors": ["id", "name", "specialty"],
                 "visits": ["id", "patient_id", "doctor_id", "visit_date", "cost"], "wards": ["id", "name", "floor"]},
    "library": {"books": ["id", "title", "author_id", "year", "genre"], "authors": ["id", "name", "country"],
                "loans": ["id", "book_id", "member_id", "loan_date", "returned"], "members": ["id", "name", "joined"]},
    "airline": {"flights": ["id", "origin", "destination", "departure", "aircraft_id"], "aircraft": ["id", "model", "seats"],
                "bookings": ["id", "flight_id", "passenger_id", "price"], "passengers": ["id", "name", "nationality"]},
    "company": {"employees": ["id", "name", "department_id", "salary", "hired"], "departments": ["id", "name", "budget"],
                "projects": ["id", "name", "department_id", "deadline"], "assignments": ["employee_id", "project_id", "hours"]},
    "music": {"artists": ["id", "name", "genre"], "albums": ["id", "artist_id", "title", "released"],
              "tracks": ["id", "album_id", "title", "seconds"], "plays": ["track_id", "user_id", "played_at"]},
    "fleet": {"vehicles": ["id", "plate", "model", "depot_id"], "depots": ["id", "city", "capacity"],
              "trips": ["id", "vehicle_id", "driver_id", "km", "started"], "drivers": ["id", "name", "licence_year"]},
}
TASKS = [
    "returns every row of {t0} where {c0} is above the average {c0}",
    "counts the rows of {t0} for each value of {c1}, largest count first",
    "joins {t0} and {t1} and lists {c0} with the matching {d0}",
    "finds the {n} rows of {t0} with the highest {c0}",
    "computes the total and the average {c0} of {t0} per {c1}, keeping groups with more than {n} rows",
    "creates the table {t0} with suitable column types and a primary key",
    "inserts three example rows into {t0}",
    "updates {t0}, setting {c0} to NULL where {c1} is missing",
    "deletes the rows of {t0} that have no matching row in {t1}",
    "ranks the rows of {t0} by {c0} within each {c1} using a window function",
    "lists the values of {c1} in {t0} that appear more than {n} times, using a subquery",
    "returns {c0} and {c1} of {t0} ordered by {c1}, skipping the first {n} rows",
    "uses a common table expression to find the {t0} rows whose {c0} exceeds the {c0} of every row in {t1}",
    "adds an index on {t0}.{c1} and explains when it helps",
]
STYLES = [
    "Write a SQL query that {task}.",
    "Write a SQL query that {task}. Reply with the query only.",
    "Using the schema above, give me SQL that {task}.",
    "I need a PostgreSQL statement that {task}. Explain it briefly.",
]


def sql_requests(seed: int, n: int, schemas, tasks):
    """``n`` seeded SQL requests over the given schema names and task templates."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        schema = SCHEMAS[rng.choice(schemas)]
        t0, t1 = rng.sample(sorted(schema), 2)
        cols = [c for c in schema[t0] if c != "id"] or schema[t0]
        c0, c1 = (rng.sample(cols, 2) if len(cols) > 1 else cols * 2)
        d0 = rng.choice(schema[t1])
        task = rng.choice(tasks).format(t0=t0, t1=t1, c0=c0, c1=c1, d0=d0, n=rng.randint(2, 10))
        ddl = "\n".join(f"{t}({', '.join(c)})" for t, c in schema.items())
        out.append(f"Tables:\n{ddl}\n\n" + rng.choice(STYLES).format(task=task))
    return out


def work() -> Path:
    WORK.mkdir(parents=True, exist_ok=True)
    return WORK


def read_json(name, default=None):
    p = WORK / name
    return json.loads(p.read_text()) if p.is_file() else default


def write_json(name, obj):
    from dflash_mlx.traffic import write_atomically

    write_atomically(WORK / name, json.dumps(obj, indent=1).encode())


def stage_requests(args):
    names = sorted(SCHEMAS)
    # Held out: two schemas and three task kinds no served request uses.
    held_schemas, held_tasks = names[-2:], TASKS[-3:]
    write_json("requests.json", {
        "served": sql_requests(0, args.served, names[:-2], TASKS[:-3]),
        "held_out": sql_requests(1, args.held_out, held_schemas, held_tasks)
        + sql_requests(2, args.held_out, names[:-2], TASKS[:-3]),
        "held_out_kinds": {"schemas": held_schemas, "tasks": held_tasks},
    })


def load_smollm2(draft_path=None):
    from dflash_mlx.pair import load_pair

    return load_pair("smollm2", draft_path)


def chat_prompt(tokenizer, request):
    return tokenizer.apply_chat_template([{"role": "user", "content": request}], add_generation_prompt=True)


def serve(requests, recorder, progress_name, model, tokenizer, draft, block_size=None, max_tokens=160):
    """Greedy generations of ``requests`` recorded by ``recorder``, resumable;
    returns per request its tokens per cycle and its answer tokens."""
    from dflash_mlx.generate import cycle_lengths, stream_generate

    done = read_json(progress_name, [])
    for i in range(len(done), len(requests)):
        rs = list(stream_generate(model, draft, tokenizer, chat_prompt(tokenizer, requests[i]), max_tokens=max_tokens,
                                  block_size=block_size, record=recorder))
        lengths = cycle_lengths(rs)
        done.append({"cycles": lengths, "tokens": [t for r in rs for t in r.tokens], "seconds": time.time()})
        write_json(progress_name, done)
        print(f"[{progress_name}] {i + 1}/{len(requests)}: {np.mean(lengths) if lengths else 0:.2f} tokens/cycle", flush=True)
    return done


def stage_serve(args):
    from dflash_mlx.traffic import Recorder

    model, tokenizer, draft, _ = load_smollm2()
    serve(read_json("requests.json")["served"], Recorder(WORK / "traffic"), "served.json", model, tokenizer, draft)


def held_out_sets(tokenizer):
    from dflash_mlx.pair import named_prompts

    return {"sql": read_json("requests.json")["held_out"], "general": named_prompts("smollm2")[: WORK_GENERAL]}


STEPS, CURVE_STEPS = 800, 120
WORK_GENERAL = 12  # of the pair's 64 held-out chat requests: enough cycles, an affordable decode


def stage_held_out(args, draft_path=None, tag="before"):
    from dflash_mlx.traffic import Recorder

    model, tokenizer, draft, _ = load_smollm2(draft_path)
    for name, requests in held_out_sets(tokenizer).items():
        rec = Recorder(WORK / f"held-out-{name}") if tag == "before" else None
        serve(requests, rec, f"{tag}-{name}.json", model, tokenizer, draft, block_size=BLOCK)


def stage_replay(args):
    """The drafter's original data (recipes/smollm2_shards), packed into rows."""
    sys.path.insert(0, str(REPO / "recipes"))
    from smollm2_distill import ordered_shards
    from smollm2_rows import pack

    rows, answers, _, _ = pack(ordered_shards(REPO / "recipes" / "smollm2_shards"), args.seq_len)
    np.save(WORK / "replay.npy", rows)
    np.save(WORK / "replay-answers.npy", answers)
    print(f"[replay] {len(rows)} rows of {args.seq_len}")


def adapted_dir(name="adapted") -> Path:
    return WORK / name


def adapt_argv(args, out, traffic, minutes, steps):
    """``mlx-dflash train --from-traffic`` as the bench runs it: the
    trainer's defaults for a fine-tune (the CPU levers: the target's
    outputs cached, the approximate target and softmax, float32 target, 16
    anchors; the learning rate, warmup and replay share unless given), the
    drafter's original rows replayed."""
    from dflash_mlx.pair import named_pair_paths

    target, draft = named_pair_paths("smollm2")
    given = [(flag, value) for flag, value in (("--learning-rate", args.learning_rate), ("--replay-share", args.replay_share)) if value is not None]
    return [
        "--from-traffic", str(traffic), "--init-from", str(draft), "--model", str(target), "--draft-model", str(out),
        "--steps", str(steps), "--max-minutes", str(minutes), "--seq-len", str(args.seq_len),
        *[str(x) for pair in given for x in pair],
        "--data", str(WORK / "replay.npy"), "--answer-mask", str(WORK / "replay-answers.npy"),
        "--eval-every", str(args.eval_every), "--save-every", str(args.eval_every),
    ]  # fmt: skip


def run_adapt(argv, result_name):
    """One adaptation run in this process; its scores and curve kept as JSON."""
    from dflash_mlx import train as T

    if read_json(result_name):
        return read_json(result_name)
    print("[adapt] mlx-dflash train " + " ".join(argv), flush=True)
    options = vars(T.setup_arg_parser().parse_args(argv))
    options["taps"] = T.parse_taps(options["taps"])
    tic = time.time()
    result = dict(T.adapt(T.TrainConfig(**options)), argv=argv, wall_seconds=round(time.time() - tic, 1))
    write_json(result_name, result)
    return result


def stage_adapt(args):
    run_adapt(adapt_argv(args, adapted_dir(args.name), WORK / "traffic", args.minutes, args.steps), f"{args.name}-result.json")


def stage_after(args):
    out = adapted_dir(args.name)
    if not (out / "config.json").is_file():
        print("[after] no adapted drafter (it did not beat the shipped one): nothing to measure")
        return
    stage_held_out(args, out, tag=f"{args.name}-after")


def scored(draft_path, records):
    """Tokens per greedy cycle at the fixed block 16 on ``records`` (the
    target's own answers), predicted by the training forward as the
    trainer's held-out evaluation predicts them (exact target here)."""
    import mlx.core as mx

    from dflash_mlx import train as T
    from dflash_mlx.targets import adapter_for

    model, tokenizer, draft, _ = load_smollm2(draft_path)
    adapter = adapter_for(model)
    taps = [T.target_pass(adapter, mx.array(r.tokens[None]), draft.config.target_layer_ids)[0] for r in records]
    lengths = T.held_out_cycles(draft, adapter, [r.tokens for r in records], [r.answer for r in records], taps)
    return round(float(np.mean(lengths)), 3), len(lengths)


def stage_score(args):
    """Both drafters on the held-out records (the answers the held-out stage recorded)."""
    from dflash_mlx.pair import named_pair_paths
    from dflash_mlx.traffic import read_traffic

    scores = read_json("scores.json", {})
    drafters = {"shipped": named_pair_paths("smollm2")[1], args.name: adapted_dir(args.name)}
    for kind in ("sql", "general"):
        records = read_traffic(WORK / f"held-out-{kind}")
        for name, path in drafters.items():
            if (path / "config.json").is_file() and f"{name}-{kind}" not in scores:
                scores[f"{name}-{kind}"] = scored(path, records)
                write_json("scores.json", scores)
                print(f"[score] {name} on held-out {kind}: {scores[f'{name}-{kind}']}", flush=True)


def stage_curve(args):
    """Tokens per cycle against recorded tokens: the same run, ``--curve-steps``
    long (its whole schedule), on the first 1/N of the traffic
    (``--curve-shares``), each drafter scored on the held-out SQL and general
    records as the score stage scores them. A run the trainer refuses
    (no better on its held-out tenth, or forgetting) leaves its trainer scores."""
    from dflash_mlx.traffic import RECORDS, check_traffic_dir, read_traffic

    records = sorted((WORK / "traffic" / RECORDS).glob("*.npz"))
    scores = read_json("curve.json", {})
    for share in args.curve_shares:
        name = f"{args.name}-first-{len(records) // share}"
        if name in scores:
            continue
        sub = WORK / f"traffic-{name}"
        if not sub.exists():
            check_traffic_dir(sub, create=True)
            for f in records[: len(records) // share]:
                (sub / RECORDS / f.name).write_bytes(f.read_bytes())
        out = adapted_dir(name)
        result = run_adapt(adapt_argv(args, out, sub, args.minutes, args.curve_steps), f"{name}-result.json")
        point = {"recorded_tokens": sum(len(r.tokens) for r in read_traffic(sub)), "conversations": len(records) // share, "result": result}
        if result["written"]:
            point.update({kind: scored(out, read_traffic(WORK / f"held-out-{kind}")) for kind in ("sql", "general")})
        scores[name] = point
        write_json("curve.json", scores)
        print(f"[curve] {name}: {point.get('sql')} on held-out SQL, {point.get('general')} on general", flush=True)


def speed_prompts(tokenizer):
    """The held-out SQL and general requests in the chat template, as JSON files for ``mlx-dflash bench``."""
    files = {}
    for kind, requests in held_out_sets(tokenizer).items():
        files[kind] = WORK / f"held-out-{kind}-prompts.json"
        files[kind].write_text(json.dumps([
            tokenizer.apply_chat_template([{"role": "user", "content": r}], add_generation_prompt=True, tokenize=False)
            for r in requests
        ]))  # fmt: skip
    return files


def stage_speed(args):
    """DFlash (adaptive block) against mlx-lm's greedy decode on the held-out
    SQL and general requests, with the shipped and the adapted drafter, each
    through ``mlx-dflash bench`` (tok/s of both decoders and their ratio;
    no draft-tree configurations beside them;
    timings: run it on a quiet machine)."""
    from transformers import AutoTokenizer

    from dflash_mlx.pair import named_pair_paths

    prompts = speed_prompts(AutoTokenizer.from_pretrained(str(named_pair_paths("smollm2")[0])))
    for kind, file in prompts.items():
        for name, path in (("shipped", None), (args.name, adapted_dir(args.name))):
            out = WORK / f"speed-{name}-{kind}.json"
            if out.is_file() or (path is not None and not (path / "config.json").is_file()):
                continue
            cmd = [sys.executable, "-m", "dflash_mlx.benchmark", "--model", "smollm2", "--prompts", str(file),
                   "--max-tokens", "160", "--repeats", "1", "--tree-budgets", "--json", str(out)]  # fmt: skip
            print(f"[speed] {name} drafter, held-out {kind}", flush=True)
            subprocess.run(cmd + (["--draft-model", str(path)] if path else []), check=True)


def speeds(adapted):
    """Per held-out kind and drafter: tok/s of both decoders and DFlash/AR."""
    out = {}
    for kind in ("sql", "general"):
        for name in ("shipped", adapted):
            report = read_json(f"speed-{name}-{kind}.json")
            if report:
                keep = ("autoregressive_tps", "dflash_tps", "speedup", "mean_tokens_per_cycle", "outputs_identical")
                out.setdefault(kind, {})[name] = {k: report[k] for k in keep if k in report}
    return out


def summary(adapted="adapted"):
    """Tokens per cycle of the shipped drafter and the run ``adapted`` (--name)."""
    rows = {}
    for name in ("sql", "general"):
        n = len(read_json(f"{adapted}-after-{name}.json") or []) or None  # a decode still under way: its requests only
        for tag, file in (("before", f"before-{name}.json"), ("after", f"{adapted}-after-{name}.json")):
            runs = (read_json(file) or [])[:n]
            if runs:
                lengths = [n for r in runs for n in r["cycles"]]
                rows.setdefault(name, {})[f"decoded_{tag}"] = round(float(np.mean(lengths)), 3)
        before, after = read_json(f"before-{name}.json"), read_json(f"{adapted}-after-{name}.json")
        if before and after:
            n = min(len(before), len(after))
            rows[name]["identical_text"] = all(before[i]["tokens"] == after[i]["tokens"] for i in range(n))
    for key, (tpc, cycles) in read_json("scores.json", {}).items():
        name, kind = key.rsplit("-", 1)
        if name in ("shipped", adapted):
            rows.setdefault(kind, {})[f"predicted_{'shipped' if name == 'shipped' else 'adapted'}"] = tpc
    for kind, row in rows.items():
        for how in ("decoded", "predicted"):
            a, b = row.get(f"{how}_{'before' if how == 'decoded' else 'shipped'}"), row.get(f"{how}_{'after' if how == 'decoded' else 'adapted'}")
            if a and b:
                row[f"{how}_ratio"] = round(b / a, 3)
    return rows


PEOPLE = ["Marta Lindqvist", "Daniel Okafor", "Aiko Tanaka", "Luis Ortega", "Priya Nair", "Tomasz Wrona", "Fatima Zahra",
          "Jonas Berg", "Chen Wei", "Amara Mensah", "Sofia Rossi", "Oliver Grant"]
CITIES = ["Lisbon", "Nairobi", "Osaka", "Lima", "Pune", "Gdansk", "Rabat", "Bergen", "Chengdu", "Accra", "Turin", "Leeds"]
ITEMS = ["desk lamp", "rain jacket", "coffee grinder", "phone case", "yoga mat", "bike helmet", "tea kettle", "backpack"]
JOBS = ["nurse", "welder", "teacher", "pilot", "chemist", "baker", "architect", "librarian"]
MONTHS = ["January", "March", "May", "July", "September", "November"]
SENTENCES = [
    ("{name} from {city} ordered {qty} of the {item} on {day} {month}.", "name, city, item, quantity, date"),
    ("{name} is a {age}-year-old {job} who lives in {city}.", "name, age, job, city"),
    ("On {day} {month}, {name} paid {price} euros for a {item} in {city}.", "name, item, price, city, date"),
    ("{name}, a {job}, will move to {city} on {day} {month}.", "name, job, city, date"),
]
ASKS = [
    'Extract the fields {fields} from this sentence as JSON: "{sentence}"',
    'Return a JSON object with the keys {fields} for: "{sentence}" Reply with the JSON only.',
    'Read "{sentence}" and give me {fields} as JSON.',
]


def json_requests(seed: int, n: int):
    """``n`` seeded requests of one kind: the fields of a short sentence as JSON."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        sentence, fields = rng.choice(SENTENCES)
        sentence = sentence.format(name=rng.choice(PEOPLE), city=rng.choice(CITIES), item=rng.choice(ITEMS), job=rng.choice(JOBS),
                                   qty=rng.randint(1, 9), age=rng.randint(19, 70), price=rng.randint(5, 400),
                                   day=rng.randint(1, 28), month=rng.choice(MONTHS))  # fmt: skip
        out.append(rng.choice(ASKS).format(fields=fields, sentence=sentence))
    return out


DEFAULTS = "defaults"  # --stage defaults' state, under WORK
# The bench's tuned flags (adapt_argv's levers), for the seconds-a-step ratio against the defaults.
TUNED = ["--target-dtype", "float32", "--approximate-target", "--approximate-softmax", "--cache-target", "--anchors-per-seq", "16"]


def user_train(args, name, extra, steps):
    """``mlx-dflash train --from-traffic`` on the stage's traffic from the
    shipped drafter, as a user types it (plus ``extra`` and --train-args), in
    a child process: its wall seconds, peak resident memory, and seconds a
    step and held-out scores from its last line; kept as JSON."""
    from dflash_mlx.pair import named_pair_paths

    done = read_json(f"{DEFAULTS}/{name}.json")
    if done:
        return done
    target, draft = named_pair_paths("smollm2")
    out = WORK / DEFAULTS / name
    cmd = [sys.executable, "-m", "dflash_mlx.train", "--from-traffic", str(WORK / DEFAULTS / "traffic"), "--init-from", str(draft),
           "--draft-model", str(out), "--model", str(target), "--steps", str(steps), *extra, *shlex.split(args.train_args)]  # fmt: skip
    print("[defaults] mlx-dflash train " + " ".join(cmd[3:]), flush=True)
    log = WORK / DEFAULTS / f"{name}.log"
    tic = time.time()
    with open(log, "w") as f:
        child = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO)
        _, status, usage = os.wait4(child.pid, 0)  # this child's own peak memory
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"[defaults] the training run failed: see {log}")
    line = re.search(r"held-out tokens per cycle: ([\d.]+) with .*, ([\d.]+) adapted \((\d+) steps, ([\d.]+) s a step\)", log.read_text())
    result = {
        "argv": cmd[3:], "wall_seconds": round(time.time() - tic, 1), "peak_rss_mb": round(usage.ru_maxrss / 1024, 1),
        "before": float(line[1]), "after": float(line[2]), "steps": int(line[3]), "seconds_per_step": float(line[4]),
        "written": (out / "config.json").is_file(),
    }  # fmt: skip
    write_json(f"{DEFAULTS}/{name}.json", result)
    print(f"[defaults] {name}: {json.dumps(result)}", flush=True)
    return result


def held_out_decode(args, requests, model, tokenizer):
    """The held-out requests at block 16 with the shipped and the adapted
    drafter (tokens per cycle, pooled), each text checked against mlx-lm's greedy decode."""
    from dflash_mlx.benchmark import mlx_lm_tokens
    from dflash_mlx.loading import load_draft
    from dflash_mlx.pair import float_dtype, named_pair_paths

    reference = [list(mlx_lm_tokens(model, tokenizer, chat_prompt(tokenizer, r), args.max_new)) for r in requests]
    rows = {}
    for name, path in (("shipped", named_pair_paths("smollm2")[1]), ("adapted", WORK / DEFAULTS / "adapted")):
        if not (path / "config.json").is_file():
            rows[name] = f"not written: the trainer refused it (see {WORK / DEFAULTS / 'adapted.log'})"
            continue
        draft = load_draft(path, model, dtype=float_dtype(model))
        runs = serve(requests, None, f"{DEFAULTS}/held-out-{name}.json", model, tokenizer, draft, block_size=BLOCK, max_tokens=args.max_new)
        cycles = [n for r in runs for n in r["cycles"]]
        rows[name] = {"tokens_per_cycle": round(float(np.mean(cycles)), 3),
                      "identical_to_mlx_lm": all(r["tokens"] == ref for r, ref in zip(runs, reference))}  # fmt: skip
    if all(isinstance(row, dict) for row in rows.values()):
        rows["ratio"] = round(rows["adapted"]["tokens_per_cycle"] / rows["shipped"]["tokens_per_cycle"], 3)
    return rows


def stage_defaults(args):
    """Issue 62's measurement: learning from traffic with the defaults a user gets (see the module docstring)."""
    from dflash_mlx.traffic import Recorder

    (WORK / DEFAULTS).mkdir(exist_ok=True)
    if not read_json(f"{DEFAULTS}/requests.json"):
        write_json(f"{DEFAULTS}/requests.json", {"served": json_requests(10, args.defaults_served), "held_out": json_requests(11, args.defaults_held_out)})
    requests = read_json(f"{DEFAULTS}/requests.json")
    model, tokenizer, draft, _ = load_smollm2()
    serve(requests["served"], Recorder(WORK / DEFAULTS / "traffic"), f"{DEFAULTS}/served.json", model, tokenizer, draft, max_tokens=args.max_new)
    default = user_train(args, "adapted", [], args.defaults_steps)
    ratio = {name: user_train(args, f"ratio-{name}", extra, args.ratio_steps) for name, extra in (("defaults", []), ("tuned", TUNED))}
    report = {
        "served": len(requests["served"]), "max_new_tokens": args.max_new, "default_run": default,
        "seconds_per_step": {k: v["seconds_per_step"] for k, v in ratio.items()},
        "defaults_over_tuned": round(ratio["defaults"]["seconds_per_step"] / ratio["tuned"]["seconds_per_step"], 3),
        "held_out": held_out_decode(args, requests["held_out"], model, tokenizer),
    }  # fmt: skip
    write_json(f"{DEFAULTS}/report.json", report)
    print(json.dumps(report, indent=1))
    if args.json:
        path = Path(args.json)
        results = json.loads(path.read_text()) if path.is_file() else {}
        results["defaults"] = report
        path.write_text(json.dumps(results, indent=1) + "\n")


def stage_report(args):
    report = {
        "run": args.name, "tokens_per_cycle": summary(args.name), "adapt": read_json(f"{args.name}-result.json"),
        "curve": read_json("curve.json"),
        "served": len(read_json("served.json", [])),
        "speed": speeds(args.name),
    }
    print(json.dumps(report, indent=1))
    if args.json:  # the run's entry in a results file that may hold others
        path = Path(args.json)
        results = json.loads(path.read_text()) if path.is_file() else {}
        results.setdefault("runs", {})[args.name] = report
        path.write_text(json.dumps(results, indent=1) + "\n")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--stage", choices=STAGES + ("all", "evaluate", "defaults"), default="all")
    p.add_argument("--served", type=int, default=200, help="SQL requests served with recording")
    p.add_argument("--held-out", type=int, default=12, help="held-out SQL requests per held-out group (two groups)")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=STEPS, help="the schedule's steps (--minutes may end the run first)")
    p.add_argument("--minutes", type=float, default=60.0, help="the adaptation's training minutes at most")
    p.add_argument("--curve-steps", type=int, default=CURVE_STEPS, help="each of the curve's runs")
    p.add_argument("--curve-shares", type=int, nargs="+", default=[4, 2, 1], help="the curve's runs: the first 1/N of the traffic each")
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--learning-rate", type=float, default=None, help="default: the trainer's for --from-traffic")
    p.add_argument("--replay-share", type=float, default=None, help="default: the trainer's")
    p.add_argument("--name", default="adapted", help="the adaptation run's name: its drafter, scores and decodes")
    p.add_argument("--json", default=None)
    p.add_argument("--defaults-served", type=int, default=32, help="--stage defaults: JSON requests served with recording")
    p.add_argument("--defaults-held-out", type=int, default=8, help="--stage defaults: held-out JSON requests")
    p.add_argument("--defaults-steps", type=int, default=300, help="--stage defaults: the default run's --steps")
    p.add_argument("--ratio-steps", type=int, default=20, help="--stage defaults: steps of each run the seconds-a-step ratio compares")
    p.add_argument("--max-new", type=int, default=64, help="--stage defaults: new tokens per request")
    p.add_argument("--train-args", default="", help="--stage defaults: more train flags for every run (a smoke test's --seq-len)")
    p.add_argument("--work", default=str(WORK), help="the state's directory (a smoke test's own)")
    args = p.parse_args(argv)
    globals()["WORK"] = Path(args.work).expanduser()
    work()
    todo = {"all": STAGES, "evaluate": EVALUATE}.get(args.stage, (args.stage,))
    for stage in todo:
        print(f"== {stage}", flush=True)
        globals()["stage_" + stage.replace("-", "_")](args)


if __name__ == "__main__":
    main()
