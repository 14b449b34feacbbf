"""What an adversarial audit of the continuous-batching scheduler and the
engine's row bookkeeping found, one regression test each. References:
mlx-lm's own greedy decode, float32."""

import dflash_mlx
from test_batch import run_all
from tiny import prompt_of

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
