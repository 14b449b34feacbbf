"""A drafter that learns JSON from served structured traffic (issue 60).

The shipped SmolLM2 drafter was distilled on chat answers, none of them JSON.
Here the pair serves JSON-extraction requests held to their schemas (what
``mlx-dflash server --learn DIR`` records for clients sending
``response_format``), the drafter is fine-tuned on that traffic with
``mlx-dflash train --from-traffic`` and its defaults, and
``examples/structured_bench.py`` measures it on the bench's own requests,
which the traffic does not hold: its twelve kinds (contact, review, order,
recipe, job, flight, weather, citation, ticket, listing, minutes,
transaction) are none of the served kinds here. The stages, each resumable
(state in ~/.cache/dflash_mlx/structured_adaptation/):

  requests  ``--served`` seeded extraction requests with their schemas, half
            of them showing the schema in the prompt (as the bench's
            ``--schema-in-prompt``), half only the request
  serve     each through ``stream_generate(response_format=..., record=...)``,
            greedy, ``--max-tokens`` at most
  adapt     ``mlx-dflash train --from-traffic`` from the shipped drafter:
            ``--steps`` and ``--minutes`` at most, the trainer's fine-tune
            defaults otherwise
  bench     ``examples/structured_bench.py --draft-model ADAPTED``, with and
            without the schema in the prompt (``--json`` files under the
            state directory)

On a quiet machine:

    export LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0
    nohup python examples/structured_adaptation.py > adapt.log 2>&1 &
"""

import argparse
import json
import random
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WORK = Path("~/.cache/dflash_mlx/structured_adaptation").expanduser()
STAGES = ("requests", "serve", "adapt", "bench")

S, I, N, B = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}


def obj(props, required, **extra):
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False, **extra}


def array(items, **extra):
    return {"type": "array", "items": items, **extra}


PEOPLE = ["Ines Duarte", "Kwame Mensah", "Yuki Sato", "Olga Petrova", "Rahul Mehta", "Sofia Rossi", "Jonas Berg",
          "Amara Obi", "Chen Wei", "Lucia Gomez", "Henrik Dahl", "Nadia Haddad"]  # fmt: skip
CITIES = [("Porto", "Portugal"), ("Kumasi", "Ghana"), ("Sapporo", "Japan"), ("Kazan", "Russia"), ("Jaipur", "India"),
          ("Bologna", "Italy"), ("Tromso", "Norway"), ("Enugu", "Nigeria"), ("Xi'an", "China"), ("Cordoba", "Argentina")]  # fmt: skip
MONTHS = ["February", "April", "June", "August", "October", "December"]


def date(rng):
    return f"{rng.randint(1, 28)} {rng.choice(MONTHS)} {rng.randint(2019, 2027)}"


def event(rng):
    city, country = rng.choice(CITIES)
    tags = rng.sample(["music", "food", "outdoor", "family", "tech", "art", "charity"], rng.randint(1, 3))
    text = (f"The {rng.choice(['Spring', 'Harbour', 'Night', 'Old Town'])} {rng.choice(['Fair', 'Festival', 'Meetup'])} "
            f"takes place on {date(rng)} at {rng.choice(['the Arena', 'Central Park', 'the Old Mill'])} in {city}, {country}. "
            f"About {rng.randint(50, 5000)} people are expected; it is about {', '.join(tags)}. "
            f"Tickets cost {rng.randint(0, 60)} euros.")  # fmt: skip
    schema = obj({"name": S, "date": S, "venue": obj({"name": S, "city": S, "country": S}, ["name", "city"]),
                  "expected_attendance": {"type": "integer", "minimum": 0}, "tags": array(S), "ticket_eur": {"type": "number", "minimum": 0}},
                 ["name", "date", "venue"])  # fmt: skip
    return f"Extract the event from this announcement: \"{text}\"", schema


def profile(rng):
    name = rng.choice(PEOPLE)
    langs = rng.sample(["English", "French", "Hindi", "Swahili", "Japanese", "Spanish", "German"], rng.randint(1, 3))
    levels = ["basic", "fluent", "native"]
    text = (f"{name} is {rng.randint(21, 64)} and works as a {rng.choice(['data analyst', 'plumber', 'translator', 'surgeon'])}. "
            + " ".join(f"{p} {l} is {rng.choice(levels)}." for p, l in zip(["Their", "Their", "Their"], langs))
            + f" Skills: {', '.join(rng.sample(['Excel', 'welding', 'SQL', 'public speaking', 'first aid', 'Python'], 2))}.")  # fmt: skip
    schema = obj({"name": S, "age": {"type": "integer", "minimum": 16, "maximum": 100}, "occupation": S,
                  "languages": array(obj({"language": S, "level": {"enum": levels}}, ["language", "level"])), "skills": array(S)},
                 ["name", "languages"])  # fmt: skip
    return f"Build a profile from this text: \"{text}\"", schema


def product(rng):
    colors = rng.sample(["black", "white", "red", "sage", "navy", "sand"], rng.randint(1, 3))
    stock = rng.choice([True, False])
    text = (f"The {rng.choice(['Aero', 'Nimbus', 'Terra', 'Volt'])} {rng.choice(['blender', 'office chair', 'speaker', 'tent'])} "
            f"by {rng.choice(['Kestrel', 'Lumo', 'Brightfield'])} costs {rng.randint(19, 900)}.{rng.randint(0, 99):02d} dollars, "
            f"comes in {', '.join(colors)} and is {'in stock' if stock else 'sold out'}. It weighs {rng.randint(1, 30)} kg.")  # fmt: skip
    schema = obj({"name": S, "brand": S, "price_usd": {"type": "number", "minimum": 0}, "colors": array(S, minItems=1),
                  "in_stock": B, "weight_kg": N}, ["name", "price_usd", "in_stock"])  # fmt: skip
    return f"Turn this product description into JSON: \"{text}\"", schema


def match(rng):
    home, away = rng.sample(["Rovers", "United", "Athletic", "City", "Wanderers", "Rangers"], 2)
    hs, as_ = rng.randint(0, 4), rng.randint(0, 4)
    scorers = [f"{rng.choice(PEOPLE).split()[1]} ({rng.randint(2, 90)}')" for _ in range(min(hs + as_, 3))]
    text = (f"{home} {hs}, {away} {as_}, played on {date(rng)} in front of {rng.randint(900, 40000)} fans. "
            f"Goals: {', '.join(scorers) if scorers else 'none'}.")  # fmt: skip
    schema = obj({"home": S, "away": S, "home_score": {"type": "integer", "minimum": 0}, "away_score": {"type": "integer", "minimum": 0},
                  "result": {"enum": ["home_win", "away_win", "draw"]}, "scorers": array(obj({"player": S, "minute": I}, ["player"])),
                  "attendance": I}, ["home", "away", "home_score", "away_score", "result"])  # fmt: skip
    return f"Summarise this match report as JSON: \"{text}\"", schema


def booking(rng):
    name = rng.choice(PEOPLE)
    city, _ = rng.choice(CITIES)
    room = rng.choice(["single", "double", "suite"])
    text = (f"Please book a {room} room at the {rng.choice(['Grand', 'Riverside', 'Alpine'])} Hotel in {city} for {name}, "
            f"arriving {date(rng)}, {rng.randint(1, 14)} nights, {rng.randint(1, 4)} guests"
            f"{', breakfast included' if rng.random() < 0.5 else ''}.")  # fmt: skip
    schema = obj({"guest": S, "hotel": S, "city": S, "room": {"enum": ["single", "double", "suite"]}, "check_in": S,
                  "nights": {"type": "integer", "minimum": 1, "maximum": 30}, "guests": {"type": "integer", "minimum": 1},
                  "breakfast": B}, ["guest", "hotel", "room", "nights"])  # fmt: skip
    return f"Extract the booking: \"{text}\"", schema


def expense(rng):
    items = rng.sample([("taxi", 18), ("lunch", 24), ("train ticket", 57), ("hotel", 140), ("parking", 12), ("printing", 9)], rng.randint(1, 4))
    cur = rng.choice(["EUR", "USD", "GBP"])
    text = (f"{rng.choice(PEOPLE)} claims for a trip on {date(rng)}: "
            + ", ".join(f"{k} {v + rng.randint(0, 9)}.{rng.randint(0, 99):02d}" for k, v in items) + f", all in {cur}.")  # fmt: skip
    schema = obj({"employee": S, "date": S, "currency": {"enum": ["EUR", "USD", "GBP"]},
                  "items": array(obj({"description": S, "amount": {"type": "number", "exclusiveMinimum": 0}}, ["description", "amount"]), minItems=1),
                  "total": N}, ["employee", "currency", "items"])  # fmt: skip
    return f"Make an expense claim in JSON from: \"{text}\"", schema


def vehicle(rng):
    fuel = rng.choice(["petrol", "diesel", "electric", "hybrid"])
    text = (f"For sale: {rng.randint(2008, 2025)} {rng.choice(['Toyota Corolla', 'Skoda Octavia', 'Kia Niro', 'Ford Focus'])}, "
            f"{fuel}, {rng.randint(5, 240)} thousand km, {rng.choice(['manual', 'automatic'])} gearbox, "
            f"asking {rng.randint(2, 30)} {rng.randint(0, 9)}00 euros. Contact {rng.choice(PEOPLE)}.")  # fmt: skip
    schema = obj({"make": S, "model": S, "year": {"type": "integer", "minimum": 1950, "maximum": 2030},
                  "fuel": {"enum": ["petrol", "diesel", "electric", "hybrid"]}, "mileage_km": {"type": "integer", "minimum": 0},
                  "gearbox": {"enum": ["manual", "automatic"]}, "price_eur": N, "seller": S}, ["make", "model", "year", "fuel"])  # fmt: skip
    return f"Parse this car advert into JSON: \"{text}\"", schema


def shipment(rng):
    city, country = rng.choice(CITIES)
    carrier = rng.choice(["DHL", "UPS", "FedEx", "post"])
    text = (f"Parcel {rng.choice('ABCDEFGH')}{rng.randint(100000, 999999)} left the warehouse with {carrier} on {date(rng)}. "
            f"It weighs {rng.randint(1, 40)}.{rng.randint(0, 9)} kg and goes to {rng.choice(PEOPLE)}, {city}, {country}. "
            f"Status: {rng.choice(['in transit', 'delivered', 'held at customs'])}.")  # fmt: skip
    schema = obj({"tracking": S, "carrier": {"enum": ["DHL", "UPS", "FedEx", "post"]}, "shipped": S, "weight_kg": {"type": "number", "minimum": 0},
                  "recipient": obj({"name": S, "city": S, "country": S}, ["name", "country"]),
                  "status": {"enum": ["in_transit", "delivered", "held"]}}, ["tracking", "carrier", "recipient", "status"])  # fmt: skip
    return f"Extract the shipment details: \"{text}\"", schema


def course(rng):
    code = f"{rng.choice(['CS', 'BIO', 'ECO', 'HIS'])}{rng.randint(100, 499)}"
    pre = [f"{rng.choice(['CS', 'MAT', 'BIO'])}{rng.randint(100, 299)}" for _ in range(rng.randint(0, 2))]
    text = (f"{code}, {rng.choice(['Data Structures', 'Cell Biology', 'Macroeconomics', 'Medieval Europe'])}, is worth "
            f"{rng.randint(1, 10)} credits and meets on {', '.join(rng.sample(['Monday', 'Tuesday', 'Wednesday', 'Thursday', 'Friday'], 2))}. "
            f"Prerequisites: {', '.join(pre) if pre else 'none'}. Taught by {rng.choice(PEOPLE)}.")  # fmt: skip
    schema = obj({"code": S, "title": S, "credits": {"type": "integer", "minimum": 1, "maximum": 12}, "days": array(S),
                  "prerequisites": array(S), "teacher": S}, ["code", "title", "credits"])  # fmt: skip
    return f"Convert this catalogue entry to JSON: \"{text}\"", schema


def medication(rng):
    text = (f"{rng.choice(PEOPLE)} should take {rng.choice(['amoxicillin', 'ibuprofen', 'metformin', 'cetirizine'])} "
            f"{rng.choice([5, 10, 200, 400, 500])} mg {rng.randint(1, 3)} times a day "
            f"{rng.choice(['with food', 'before meals', 'at bedtime'])} for {rng.randint(3, 30)} days.")  # fmt: skip
    schema = obj({"patient": S, "drug": S, "dose_mg": {"type": "number", "exclusiveMinimum": 0},
                  "times_per_day": {"type": "integer", "minimum": 1, "maximum": 6}, "with_food": B,
                  "days": {"type": "integer", "minimum": 1}}, ["patient", "drug", "dose_mg", "times_per_day"])  # fmt: skip
    return f"Structure this prescription: \"{text}\"", schema


KINDS = (event, profile, product, match, booking, expense, vehicle, shipment, course, medication)


def served_requests(seed: int, n: int):
    """``n`` seeded entries ``{"kind", "request", "schema"}`` (the bench's shape)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        kind = KINDS[i % len(KINDS)]
        request, schema = kind(rng)
        out.append({"name": kind.__name__, "request": request, "schema": schema})
    return out


def stage_requests(args):
    entries = served_requests(0, args.served)
    for i, e in enumerate(entries):
        e["show_schema"] = i % 2 == 0
    write_json(args.work / "requests.json", entries)


def stage_serve(args):
    from dflash_mlx.generate import cycle_lengths, stream_generate
    from dflash_mlx.pair import as_chat, load_pair, set_request
    from dflash_mlx.traffic import Recorder

    model, tokenizer, draft, _ = load_pair(args.model)
    recorder = Recorder(args.work / "traffic")
    done = read_json(args.work / "served.json", [])
    entries = read_json(args.work / "requests.json")
    for i in range(len(done), len(entries)):
        e = entries[i]
        prompt = as_chat(tokenizer, [set_request(e) if e["show_schema"] else e["request"]])[0]
        fmt = {"type": "json_schema", "json_schema": {"name": e["name"], "schema": e["schema"], "strict": True}}
        rs = list(stream_generate(model, draft, tokenizer, prompt, max_tokens=args.max_tokens, response_format=fmt, record=recorder))
        lengths = cycle_lengths(rs)
        done.append({"tokens": sum(len(r.tokens) for r in rs), "cycles": len(lengths), "finish": rs[-1].finish_reason})
        write_json(args.work / "served.json", done)
        print(f"[serve] {i + 1}/{len(entries)} {e['name']}: {done[-1]['tokens']} tokens, "
              f"{done[-1]['tokens'] / max(1, len(lengths)):.2f} a cycle", flush=True)  # fmt: skip


def stage_adapt(args):
    from dflash_mlx.pair import resolve_pair

    if (args.work / "adapted" / "config.json").exists():
        return
    target, draft = resolve_pair(args.model)
    run([sys.executable, "-m", "dflash_mlx.train", "--from-traffic", str(args.work / "traffic"), "--init-from", str(draft),
         "--draft-model", str(args.work / "adapted"), "--model", str(target), "--steps", str(args.steps),
         "--max-minutes", str(args.minutes), *args.train_args])  # fmt: skip


def stage_bench(args):
    for shown in (False, True):
        name = "bench-schema-shown.json" if shown else "bench-request-only.json"
        run([sys.executable, str(REPO / "examples" / "structured_bench.py"), "--model", args.model, "--draft-model", str(args.work / "adapted"),
             "--schema-in-prompt" if shown else "--no-schema-in-prompt", "--json", str(args.work / name), *args.bench_args])  # fmt: skip


def run(cmd):
    print("$ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=REPO)


def read_json(p: Path, default=None):
    return json.loads(p.read_text()) if p.exists() else default


def write_json(p: Path, obj_):
    from dflash_mlx.traffic import write_atomically

    write_atomically(p, json.dumps(obj_, indent=1).encode())


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stage", choices=STAGES + ("all",), default="all")
    p.add_argument("--model", default="smollm2", help="a pair name or target path whose pair serves and adapts")
    p.add_argument("--served", type=int, default=160, help="requests served with recording")
    p.add_argument("--max-tokens", type=int, default=256, help="new tokens per served answer at most")
    p.add_argument("--steps", type=int, default=800, help="the fine-tune's steps (--minutes may end it first)")
    p.add_argument("--minutes", type=float, default=40.0, help="the fine-tune's training minutes at most")
    p.add_argument("--train-args", type=shlex.split, default=[], help="more train flags (a smoke test's --seq-len)")
    p.add_argument("--bench-args", type=shlex.split, default=[], help="more structured_bench flags (--num-prompts, --max-tokens)")
    p.add_argument("--work", type=Path, default=WORK, help="the state's directory")
    args = p.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    for stage in STAGES if args.stage == "all" else (args.stage,):
        print(f"== {stage}", flush=True)
        globals()[f"stage_{stage}"](args)


if __name__ == "__main__":
    main()
