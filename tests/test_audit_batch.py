"""What an adversarial audit of the continuous-batching scheduler and the
engine's row bookkeeping found, one regression test each. References:
mlx-lm's own greedy decode, float32."""

import time

import dflash_mlx
from test_agent_server import chat_pair  # noqa: F401 (the module's fixture)
from test_audit_server import live_server
from test_batch import run_all
from tiny import prompt_of
from tiny_chat import ASK

from dflash_mlx.api.turn import Turn
from dflash_mlx.batch import BatchGenerator


def test_a_request_cap_above_the_generators_block_caps_nothing(qwen3_pair, tmp_path):
    """A request's block_size above the generator's fixed block (a server
    run with --block-size 4, a request asking for 6): every row capped,
    the shortest cap was the cycle's block, longer than any the generator
    verifies, and weighing a copied span against the drafter's block read
    past the acceptance's slots (IndexError: the whole batch failed)."""
    pair = qwen3_pair
    draft = dflash_mlx.load_draft(pair.make_draft(tmp_path / "d", block_size=8), pair.model)
    prompt = prompt_of(12, seed=1)
    gen = BatchGenerator(pair.model, draft, block_size=4, copy_drafts=True)
    uid = gen.insert([prompt], 20, block_size=6, eos_token_ids=[[]])[0]
    seen = run_all(gen)
    assert seen.tokens[uid] == pair.reference(prompt, 20, eos_ids=[])
    assert max(block for block, _, _ in seen.cycles[uid]) <= 4


LONG = {"type": "json_schema", "json_schema": {"name": "long", "schema": {
    "type": "object", "properties": {"a": {"type": "string", "minLength": 1500, "pattern": "^[a-z]*$"}},
    "required": ["a"], "additionalProperties": False}}}


def test_a_request_whose_client_left_while_queued_is_dropped_unprefilled(chat_pair):  # noqa: F811
    """--decode-concurrency 1: a request waiting for the slot whose client
    went away was only asked about after a cycle gave it tokens, so it was
    prefilled and decoded for no one once the slot came free (mlx-lm's
    server drops such a request while its prompt is processed)."""
    with live_server(chat_pair, "--decode-concurrency", "1", "--max-tokens", "3000") as (_, server):
        generator = server.generator
        busy = Turn(generator, {"messages": ASK, "max_tokens": 3000, "response_format": LONG})
        busy.start()
        first = next(busy.responses)  # decoding: the one slot is taken
        waiting = Turn(generator, {"messages": [{"role": "user", "content": "Rome?"}], "max_tokens": 50})
        waiting.start()
        waiting.ctx.stop()  # its client left while it waited
        deadline = time.time() + 60
        while len(generator.serving) < 2:  # admitted, waiting for the slot
            assert time.time() < deadline
            time.sleep(0.01)
        busy.ctx.stop()
        assert first.token is not None
        list(busy.responses)
        assert list(waiting.responses) == []  # no token decoded for it
