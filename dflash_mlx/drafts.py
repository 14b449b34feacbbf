"""The draft step of the engine (:mod:`dflash_mlx.decode`): what a cycle
verifies past each row's anchor. The drafter's block (its whole block of
masks, whatever length is verified), a grammar's own blocks (drafts that obey
it, and the tokens it forces), one row's draft tree, and spans copied from
the context in place of the drafter's block (the sizing continues a lone
row's drafted block with its copy: :class:`dflash_mlx.decode.Sizing`).
"""

from typing import List, Optional, Tuple

import mlx.core as mx

from .adaptive import TreeChoice
from .models.dflash import masked_blocks
from .tree import build_tree, candidates


def grammar(r):
    """The row's grammar (a control that forces tokens), or None."""
    return next((c for c in r.controls if hasattr(c, "forced")), None)


def drafting(r):
    """The row's control that drafts its blocks itself (``draft_block``):
    its grammar (drafts that obey it), else its logits processors (the
    drafter's block processed along itself), or None."""
    return grammar(r) or next((c for c in r.controls if hasattr(c, "draft_block")), None)


class Drafts:
    """Each cycle's proposals for its rows, from one drafter (``settle``: the :class:`~dflash_mlx.decode.Decoder`'s)."""

    def __init__(self, target, draft, max_block: int, settle):
        self.target, self.draft, self.max_block, self.settle = target, draft, max_block, settle

    def propose(self, rows: List, slots: int, plans: List, drafts: bool) -> Tuple[mx.array, list, Optional[list]]:
        """Every row's proposal ``[B, slots]``, the q its drafted tokens were
        sampled from, and per row ``(drafted slots, proposed slots, copy
        class)`` (None: the drafter's block in every row): a row with a
        copied span (``plans[b]``: tokens, class) verifies it in place of the
        drafter's block, padded to the others' length (its acceptance capped
        at its span); without one, the drafter's block where the drafter
        drafts (``drafts``), else nothing (a plain step's row)."""
        proposal, qs = None, [None] * len(rows)
        if drafts:
            proposal, qs = self.chains(rows, slots)
            self.settle(proposal)
            if not any(plans):
                return proposal, qs, None
        spans, copied = [], []
        for b, (r, plan) in enumerate(zip(rows, plans)):
            tokens, klass = plan if plan is not None else ([], 0)
            copied.append((tokens + [r.anchor] * slots)[:slots])  # padding: never accepted
            if plan is not None:
                qs[b] = None  # point masses
                if grammar(r) is not None:  # its drafted block's masks are not its copy's
                    grammar(r).forget_plan()
            spans.append((0, len(tokens), klass) if plan is not None or not drafts else (slots, slots, 0))
        copied = mx.array(copied, dtype=mx.int32)
        if drafts:
            copied = mx.where(mx.array([p is not None for p in plans])[:, None], copied, proposal)
        return copied, qs, spans

    def forced_choice(self, rows: List, choice):
        """``choice``, or a longer chain where every row's grammar forces the
        tokens ahead (the only ones it allows): those need no drafting, so
        the cycle verifies them all and the target's token after them."""
        grammars = [grammar(r) for r in rows]
        if not all(grammars):
            return choice
        most = min([r.room for r in rows] + [r.block_limit for r in rows if r.block_limit])
        block = min(most, 1 + min(len(g.forced(self.max_block - 1)) for g in grammars))
        if block <= 1:
            return choice
        return block if isinstance(choice, TreeChoice) else max(choice, block)

    def chains(self, rows: List, slots: int) -> Tuple[mx.array, list]:
        """Every row's drafted tokens ``[B, slots]`` from the tap states its
        drafter has not seen, and per row the q they were sampled from (None:
        greedy). The drafter fills its whole block of masks whatever length
        is verified: a shorter block of masks makes its early slots worse."""
        if any(drafting(r) for r in rows):
            return self.held(rows, slots)
        blocks = masked_blocks(self.draft, [r.anchor for r in rows], self.max_block)
        if len(rows) == 1:
            r = rows[0]
            if r.rule.drafting is None:
                proposal, qs = self.draft.propose(blocks, r.cache.target_hidden, r.cache.draft, slots=slots), [None]
            else:
                proposal, q = self.draft.propose_with_probs(
                    blocks, r.cache.target_hidden, r.cache.draft, **r.rule.drafting, slots=slots, key=r.next_key()
                )
                qs = [q[0]]
        else:
            proposal, qs = self.draft.draft_rows(
                blocks, [r.cache.target_hidden for r in rows], [r.cache.draft for r in rows], slots,
                [r.rule.drafting for r in rows], [r.next_key() for r in rows],
            )
        for r in rows:
            r.cache.target_hidden = None  # injected into its drafter context
        return proposal.astype(mx.int32), qs

    def held(self, rows: List, slots: int) -> Tuple[mx.array, list]:
        """:meth:`chains` where some rows' controls draft their own
        blocks (a grammar, logits processors): the other rows draft together
        as usual, these from their drafter logits (one forward for all of
        them, once one asks: a grammar that forces a whole block needs
        none), each masked or processed slot by slot along its own proposal
        by its control."""
        free = [b for b, r in enumerate(rows) if drafting(r) is None]
        tokens, qs = [None] * len(rows), [None] * len(rows)
        if free:
            proposal, free_qs = self.chains([rows[b] for b in free], slots)
            for i, b in enumerate(free):
                tokens[b], qs[b] = proposal[i], free_qs[i]
        shaped, drafted = [b for b in range(len(rows)) if tokens[b] is None], {}

        def logits(b: int) -> mx.array:  # every such row's, in one drafter forward, once one asks
            if not drafted:
                own = [rows[i] for i in shaped]
                blocks = masked_blocks(self.draft, [r.anchor for r in own], self.max_block)
                hidden, caches = [r.cache.target_hidden for r in own], [r.cache.draft for r in own]
                if len(own) == 1:
                    out = self.draft.slot_logits(blocks, hidden[0], caches[0], slots=slots)
                else:
                    out = self.draft.slot_logits_rows(blocks, hidden, caches, slots)
                for r in own:
                    r.cache.target_hidden = None  # injected into its drafter context
                drafted.update(zip(shaped, out))
            return drafted[b]

        for b in shaped:
            r = rows[b]
            block, qs[b] = drafting(r).draft_block(slots, lambda b=b: logits(b), self.target.vocab_size, r.rule.drafting, r.next_key())
            tokens[b] = mx.array(block, mx.int32)  # (host ids, or a lazy array)
        return mx.stack(tokens).astype(mx.int32), qs

    def tree(self, r, choice: TreeChoice, room: int):
        """One row's draft tree: the whole block's best candidates per slot
        (one host read: the tree is built on the host), ``choice.nodes``
        nodes at most ``room - 1`` deep, each on a path the row's grammar
        takes. Returns the tree and the candidates."""
        blocks = masked_blocks(self.draft, [r.anchor], self.max_block)
        head = self.draft.slot_head_logits(blocks, r.cache.target_hidden, r.cache.draft, slots=room - 1)
        r.cache.target_hidden = None  # injected into the drafter's context
        ids, logprobs = candidates(head[0], choice.nodes, self.draft.vocab_ids)
        g = grammar(r)
        takes = None if g is None else lambda path: g.takes(path) == len(path)
        return build_tree(r.anchor, ids, logprobs, choice.nodes, takes), ids
