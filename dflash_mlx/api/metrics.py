"""``GET /metrics``: the server's counters in Prometheus' text format
(https://prometheus.io/docs/instrumenting/exposition_formats/)."""

import threading
from collections import Counter
from typing import Dict


class Metrics:
    """Counters of the requests served, updated by the handlers and the
    generation thread, read by ``/metrics``."""

    def __init__(self):
        self.lock = threading.Lock()
        self.requests: Counter = Counter()  # by endpoint
        self.errors: Counter = Counter()  # 4xx/5xx answers, by endpoint
        self.totals: Counter = Counter()
        self.blocks: Counter = Counter()  # verify cycles by block size
        self.trees: Counter = Counter()  # tree cycles by their node count
        self.last_tokens_per_cycle = 0.0
        self.batches: Counter = Counter()  # batched cycles by the requests they verified
        self.last_batch = 0
        self.drafter = {"version": 0, "before": 0.0, "after": 0.0}  # --adapt's drafter in use

    def cycle(self, batch: int):
        """A batched cycle verified ``batch`` requests together."""
        with self.lock:
            self.batches[batch] += 1
            self.last_batch = batch

    def drafter_in_use(self, version: int, scores: Dict):
        """An adapted drafter was swapped in: its version and held-out tokens
        per cycle, the drafter it replaced (before) and its own (after)."""
        with self.lock:
            self.drafter = {"version": version, "before": scores.get("before", 0.0), "after": scores.get("after", 0.0)}

    def request(self, endpoint: str):
        with self.lock:
            self.requests[endpoint] += 1

    def error(self, endpoint: str):
        with self.lock:
            self.errors[endpoint] += 1

    def served(self, prompt_tokens: int, cached_tokens: int, generated_tokens: int, dflash: Dict):
        """A generation finished (or stopped): its tokens and DFlash cycles."""
        with self.lock:
            self.totals.update(
                generations=1, prompt_tokens=prompt_tokens, cached_tokens=max(0, cached_tokens),
                generated_tokens=generated_tokens, cycles=dflash.get("cycles", 0),
                accepted_draft_tokens=dflash.get("accepted_draft_tokens", 0),
                accepted_copied_tokens=dflash.get("accepted_copied_tokens", 0),
            )
            self.blocks.update(dflash.get("block_sizes", {}))
            self.trees.update(dflash.get("tree_sizes", {}))
            self.last_tokens_per_cycle = dflash.get("tokens_per_cycle", 0.0)

    def render(self, queued: int, busy: bool) -> str:
        """The text exposition of every metric; ``queued``: requests waiting
        for the generation thread, ``busy``: whether it is generating."""
        lines = []

        def metric(name, kind, help_text, samples):
            lines.extend([f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"])
            for labels, value in samples:
                label_text = ",".join(f'{k}="{v}"' for k, v in labels.items())
                lines.append(f"{name}{{{label_text}}} {value}" if label_text else f"{name} {value}")

        with self.lock:
            t = self.totals
            metric("dflash_requests_total", "counter", "HTTP requests received, by endpoint.",
                   [({"endpoint": e}, n) for e, n in sorted(self.requests.items())])
            metric("dflash_request_errors_total", "counter", "Requests answered with an error, by endpoint.",
                   [({"endpoint": e}, n) for e, n in sorted(self.errors.items())])
            metric("dflash_generations_total", "counter", "Generations run (finished or stopped).", [({}, t["generations"])])
            metric("dflash_prompt_tokens_total", "counter", "Prompt tokens of the generations.", [({}, t["prompt_tokens"])])
            metric("dflash_cached_prompt_tokens_total", "counter", "Prompt tokens restored from the prompt cache.",
                   [({}, t["cached_tokens"])])
            metric("dflash_generated_tokens_total", "counter", "Tokens generated.", [({}, t["generated_tokens"])])
            metric("dflash_cycles_total", "counter", "DFlash draft-and-verify cycles.", [({}, t["cycles"])])
            metric("dflash_accepted_draft_tokens_total", "counter", "Drafted tokens the target accepted.",
                   [({}, t["accepted_draft_tokens"])])
            metric("dflash_accepted_draft_tokens_by_source_total", "counter",
                   "Drafted tokens the target accepted, by where they came from (the drafter, or copied from the context).",
                   [({"source": "drafter"}, t["accepted_draft_tokens"] - t["accepted_copied_tokens"]),
                    ({"source": "copy"}, t["accepted_copied_tokens"])])
            metric("dflash_verify_blocks_total", "counter", "Verify cycles by the block size chosen.",
                   [({"block_size": str(b)}, n) for b, n in sorted(self.blocks.items())])
            metric("dflash_verify_trees_total", "counter", "Verify cycles that checked a draft tree, by its node count.",
                   [({"tree_size": str(k)}, n) for k, n in sorted(self.trees.items())])
            metric("dflash_batch_cycles_total", "counter", "Batched decode cycles, by the requests each verified together.",
                   [({"batch_size": str(b)}, n) for b, n in sorted(self.batches.items())])
            metric("dflash_batch_size", "gauge", "Requests the latest batched cycle verified together.", [({}, self.last_batch)])
            metric("dflash_last_tokens_per_cycle", "gauge", "Tokens committed per cycle in the latest generation.",
                   [({}, self.last_tokens_per_cycle)])
            metric("dflash_drafter_version", "gauge", "Adapted drafters swapped in (0: the one the server started with).",
                   [({}, self.drafter["version"])])
            metric("dflash_drafter_heldout_tokens_per_cycle", "gauge",
                   "Held-out tokens per cycle of the drafter an adaptation replaced (before) and of its own (after).",
                   [({"drafter": k}, self.drafter[k]) for k in ("before", "after")])
        metric("dflash_queued_requests", "gauge", "Requests waiting for the generation thread.", [({}, queued)])
        metric("dflash_generating", "gauge", "1 while the generation thread serves a request.", [({}, int(busy))])
        return "\n".join(lines) + "\n"
