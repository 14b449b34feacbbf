"""Structured outputs: an answer held to a JSON schema, a regular expression
or a Lark grammar, by masking the logits the decode loop samples from.

The grammar work is llguidance's (github.com/guidance-ai/llguidance): it
compiles the grammar, bridges the target's Hugging Face tokenizer and
computes, for a grammar state, the bitmask of the tokens that keep the
output inside the grammar. This module only gives the loop the few exact
operations it needs on one request's grammar state (:class:`Constraint`):

- ``mask`` / ``apply``: the allowed tokens now, as logits rows can use;
- ``block_masks``: the mask of every row of a verify, row i after the draft's
  first i tokens, and where the first draft token the grammar refuses is
  (acceptance ends there); the state is left where it was;
- ``commit`` / ``rollback``: move the state with the tokens the loop keeps;
- ``forced``: the tokens the grammar leaves no choice over (a mask with one
  token), which need no drafting and no verification;
- ``tree_masks``: each node of a draft tree masked by its own path;
- ``block`` / ``tree`` / ``commit`` / ``draft_block``: the decode loop's
  per-row control (:class:`dflash_mlx.decode.Request`'s ``controls``): a
  verify masked row by row along its draft, the forced tokens counted, and
  a drafter's block masked slot by slot along its own proposal;
- ``processor``: the same mask as an mlx-lm logits processor, for mlx-lm's
  own ``generate_step``: the reference a masked DFlash decode must equal.

Response formats are OpenAI's (``{"type": "json_schema", "json_schema":
{"name", "schema", "strict"}}``, ``{"type": "json_object"}``,
``{"type": "text"}``) and two more of the same shape, ``{"type": "regex",
"pattern": ...}`` and ``{"type": "grammar", "lark": ...}``. A JSON schema
compiles with llguidance's default options
(``LLMatcher.grammar_from_json_schema(schema)``), so anyone can rebuild the
reference.
"""

import copy
import threading
import weakref
from typing import Callable, List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np
from llguidance import LLMatcher, LLTokenizer
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from .errors import ArgumentError
from .sampling import processed_probs, sample

FORMAT_TYPES = ("text", "json_object", "json_schema", "regex", "grammar")

# "json_object": any JSON object, as OpenAI's JSON mode gives.
JSON_OBJECT = {"type": "object"}


def grammar_of(response_format) -> Optional[str]:
    """The llguidance grammar of a response format (None: plain text), checked
    by llguidance before any work: an :class:`ArgumentError` names what is wrong."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict) or response_format.get("type") not in FORMAT_TYPES:
        raise ArgumentError(
            "response_format must be an object whose type is one of " + ", ".join(FORMAT_TYPES)
            + ', e.g. {"type": "json_schema", "json_schema": {"name": "answer", "schema": {...}}}'
        )
    kind = response_format["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return checked(LLMatcher.grammar_from_json_schema(JSON_OBJECT), "JSON object")
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise ArgumentError('a json_schema response_format needs "json_schema": {"name": ..., "schema": {...}}')
        if spec.get("name") is not None and not isinstance(spec["name"], str):
            raise ArgumentError("json_schema.name must be a string")
        if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
            raise ArgumentError("json_schema.strict must be true or false")
        try:
            grammar = LLMatcher.grammar_from_json_schema(spec["schema"])
        except (ValueError, TypeError) as e:
            raise ArgumentError(f"the JSON schema cannot be read: {e}") from None
        return checked(grammar, "JSON schema")
    key = "pattern" if kind == "regex" else "lark"
    source = response_format.get(key)
    if not isinstance(source, str) or not source:
        raise ArgumentError(f'a {kind} response_format needs "{key}": a non-empty string')
    make = LLMatcher.grammar_from_regex if kind == "regex" else LLMatcher.grammar_from_lark
    return checked(make(source), "regular expression" if kind == "regex" else "Lark grammar")


def checked(grammar: str, what: str, tokenizer: Optional[LLTokenizer] = None) -> str:
    """``grammar`` if llguidance finds it valid, else an :class:`ArgumentError` with its message."""
    error = LLMatcher.validate_grammar(grammar, tokenizer)
    if error:  # (on one line: llguidance's source excerpts and carets left out)
        lines = [line.strip() for line in error.splitlines()]
        said = " ".join(line for line in lines if line and set(line) != {"^"} and not line.split("|")[0].strip().isdigit())
        raise ArgumentError(f"the {what} is invalid: {said}")
    return grammar


# Bridged tokenizers, by the tokenizer they bridge (building one takes a while).
BRIDGES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
BRIDGE_LOCK = threading.Lock()


def bridge(tokenizer) -> LLTokenizer:
    """llguidance's tokenizer for a Hugging Face fast tokenizer (or mlx-lm's
    wrapper of one), built from its ``tokenizer.json`` as llguidance.hf does,
    with every eos id mlx-lm stops on; cached per tokenizer."""
    with BRIDGE_LOCK:
        found = BRIDGES.get(tokenizer)
        if found is not None:
            return found
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise ArgumentError(
                f"structured outputs need a fast Hugging Face tokenizer (a tokenizer.json); "
                f"{type(tokenizer).__name__} has none"
            )
        backend = copy.copy(backend)
        backend.no_padding()
        backend.no_truncation()
        eos = sorted(getattr(tokenizer, "eos_token_ids", None) or [tokenizer.eos_token_id])
        try:
            built = LLTokenizer(backend.to_str(), eos_token=eos)
        except (ValueError, RuntimeError, TypeError) as e:
            raise ArgumentError(f"llguidance cannot read this tokenizer for structured outputs: {e}") from None
        BRIDGES[tokenizer] = built
        return built


def constraint_from_response_format(response_format, tokenizer) -> Optional["Constraint"]:
    """A fresh :class:`Constraint` for a response format over ``tokenizer``;
    None for none or ``{"type": "text"}``."""
    grammar = grammar_of(response_format)
    if grammar is None:
        return None
    return Constraint(grammar, bridge(tokenizer))


def constraint_for(response_format, tokenizer=None) -> Optional["Constraint"]:
    """A request's constraint, built before any work: a fresh
    :class:`Constraint` as given, or one for a response format over
    ``tokenizer`` (which a format that constrains needs); None for free text."""
    if isinstance(response_format, Constraint):
        if response_format.committed:
            raise ArgumentError("a Constraint passed as response_format must be fresh (nothing committed): build one per request")
        return response_format
    if grammar_of(response_format) is None:
        return None
    if tokenizer is None:
        raise ArgumentError("a response_format needs the target's tokenizer to hold its answer to: pass tokenizer=...")
    return constraint_from_response_format(response_format, tokenizer)


def allowed(words: np.ndarray, vocab_size: int) -> mx.array:
    """Bitmask rows ``[R, W]`` (llguidance's: bit t % 32 of word t // 32) as
    booleans ``[R, vocab_size]``; ids past the tokenizer's are disallowed
    (a model's vocabulary is often padded past its tokenizer's)."""
    words = np.atleast_2d(words)
    bits = np.unpackbits(words.view(np.uint8), axis=-1, bitorder="little")[:, :vocab_size]  # (little-endian words)
    if bits.shape[1] < vocab_size:
        bits = np.concatenate([bits, np.zeros((len(bits), vocab_size - bits.shape[1]), np.uint8)], axis=1)
    return mx.array(bits.view(np.bool_))


def masked(logits: mx.array, allow: mx.array) -> mx.array:
    """``logits`` with -inf where ``allow`` is False."""
    return mx.where(allow, logits, mx.array(-mx.inf, logits.dtype))


def held(logits: mx.array, allow: mx.array) -> mx.array:
    """A drafter's ``logits`` masked by ``allow``; uniform over the allowed
    tokens where the drafter gives every one of them -inf (a draft
    vocabulary without them), so a masked draft is always a distribution."""
    row = masked(logits, allow)
    return mx.where(mx.max(row) > -mx.inf, row, masked(mx.zeros_like(logits), allow))


def only_token(words: np.ndarray) -> Optional[int]:
    """The one token a bitmask row allows, or None if it allows several (or none)."""
    nonzero = np.flatnonzero(words)
    if len(nonzero) != 1:
        return None
    word = int(words[nonzero[0]]) & 0xFFFFFFFF
    if word & (word - 1):
        return None
    return int(nonzero[0]) * 32 + word.bit_length() - 1


class Constraint:
    """One request's grammar state: an llguidance matcher over the target's
    tokenizer, and the operations a decode loop needs on it.

    The state is at the tokens committed so far (:meth:`commit`). Every other
    operation leaves it there: they advance the matcher along a proposal and
    roll it back, which llguidance does exactly (its ``rollback``)."""

    def __init__(self, grammar: str, tokenizer: LLTokenizer):
        self.matcher = LLMatcher(tokenizer, grammar, log_level=0)
        if self.matcher.is_error():
            raise ArgumentError(f"the grammar is invalid for this tokenizer: {self.matcher.get_error()}")
        self.vocab = tokenizer.vocab_size
        self.eos = tuple(tokenizer.eos_tokens)
        self.committed = 0
        self.ended = False  # an eos taken after the grammar completed
        self.forced_count = 0  # committed tokens that were the only ones allowed
        self.seen: dict = {}  # path past the state -> whether its mask allows one token (from the last verify)
        self.plan = None  # the last drafted block and its rows' bitmasks, for the verify after it
        self.forced(1)  # a grammar too complex for llguidance's lexer fails on its first forced token: here, before any work
        if self.matcher.is_error():
            raise ArgumentError(f"llguidance cannot follow this grammar: {self.matcher.get_error().splitlines()[0]}; "
                                "simplify it (a long fixed repetition such as a{1000000} is too complex)")

    # -- the state ----------------------------------------------------------

    def words(self) -> np.ndarray:
        """The current state's bitmask row ``[W]`` (int32)."""
        out = allocate_token_bitmask(1, self.vocab)
        fill_next_token_bitmask(self.matcher, out)
        return out[0]

    def mask(self, vocab_size: Optional[int] = None) -> mx.array:
        """The tokens allowed now, ``[vocab_size]`` booleans (default: the tokenizer's vocabulary)."""
        return allowed(self.words(), vocab_size or self.vocab)[0]

    def apply(self, logits: mx.array) -> mx.array:
        """``logits`` (``[..., V]``) with the tokens the grammar refuses now at -inf."""
        return masked(logits, self.mask(logits.shape[-1]))

    def commit(self, tokens: Sequence[int]) -> int:
        """Advance the state over tokens the loop keeps (each one the mask
        allowed); how many of them were forced (the only token their mask
        allowed, as the last :meth:`block` or :meth:`tree` saw)."""
        tokens = [int(t) for t in tokens]
        forced = sum(bool(self.seen.get(tuple(tokens[:k]))) for k in range(len(tokens)))
        self.seen = {}
        taken = self.take(tokens)
        self.committed += taken
        if taken != len(tokens):
            if self.matcher.is_error():
                raise ArgumentError(f"llguidance stopped on the grammar: {self.matcher.get_error().splitlines()[0]}; simplify it")
            raise ValueError(f"the grammar refuses {tokens[taken]} of the committed {tokens}: a token was kept that its mask did not allow")
        self.forced_count += forced
        return forced

    def take(self, tokens: List[int]) -> int:
        """Advance the matcher over as many of ``tokens`` as the grammar takes;
        how many it took. An eos once the grammar is complete ends it: taken
        without moving the matcher (llguidance keeps no token for it), and
        nothing after it is."""
        if self.ended:
            return 0
        known = next((i for i, t in enumerate(tokens) if not 0 <= t < self.vocab), len(tokens))  # (padded ids: refused)
        n = self.matcher.try_consume_tokens(tokens[:known])
        if n < len(tokens) and tokens[n] in self.eos and self.matcher.is_stopped():
            self.ended = True
            n += 1
        return n

    def undo(self, n: int) -> None:
        """Take back the last ``n`` tokens :meth:`take` took."""
        if n and self.ended:
            self.ended, n = False, n - 1
        if n and not self.matcher.rollback(n):
            raise ValueError(f"llguidance cannot take back {n} tokens: {self.matcher.get_error()}")

    def rollback(self, n: int) -> None:
        """Take back the last ``n`` committed tokens."""
        if n > self.committed:
            raise ValueError(f"cannot take back {n} of {self.committed} committed tokens")
        self.undo(n)
        self.committed -= n

    def is_accepting(self) -> bool:
        """Whether the output so far is a complete answer (eos is allowed)."""
        return self.matcher.is_accepting()

    @property
    def finished(self) -> bool:
        """The grammar is complete and takes nothing more: only eos is allowed."""
        return self.matcher.is_stopped()

    def forced(self, limit: int) -> List[int]:
        """Up to ``limit`` tokens the grammar forces from here: while the mask
        allows exactly one token, that token (the target's masked choice is
        certain). The state is left where it was."""
        out: List[int] = []
        while len(out) < limit and not self.matcher.is_stopped() and self.matcher.compute_ff_bytes():
            token = only_token(self.words())  # (no forced bytes: several tokens start the answer)
            if token is None or token in self.eos or self.take([token]) != 1:
                break
            out.append(token)
        self.undo(len(out))
        return out

    # -- proposals ------------------------------------------------------------

    def takes(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens`` the grammar takes from the committed state
        before refusing one (a copied span is cut there: the target could
        never accept the rest). The state is left where it was."""
        taken = self.take([int(t) for t in tokens])
        self.undo(taken)
        return taken

    def forget_plan(self) -> None:
        """Drop the masks kept from the last drafted block: the row verifies
        something else in its place (a copied span), masked afresh."""
        self.plan = None

    def block_masks(self, drafts: Sequence[int], vocab_size: Optional[int] = None) -> Tuple[mx.array, int]:
        """Masks of a verify of ``[anchor, *drafts]`` (the anchor committed):
        ``[len(drafts) + 1, vocab_size]``, row i the state after the first i
        drafts; and how many drafts the grammar takes before refusing one.
        Rows past the refused draft are all True: acceptance ends before them."""
        rows, valid = self.block_words(drafts)
        return allowed(rows, vocab_size or self.vocab), valid

    def block_words(self, drafts: Sequence[int]) -> Tuple[np.ndarray, int]:
        """:meth:`block_masks` as bitmask rows ``[len(drafts) + 1, W]``."""
        drafts = [int(t) for t in drafts]
        rows = allocate_token_bitmask(len(drafts) + 1, self.vocab)  # (all ones: rows never used)
        valid = 0
        fill_next_token_bitmask(self.matcher, rows, 0)
        while valid < len(drafts) and self.take(drafts[valid:valid + 1]) == 1:
            valid += 1
            fill_next_token_bitmask(self.matcher, rows, valid)
        self.undo(valid)
        return rows, valid

    def tree_masks(self, tokens: Sequence[int], parents: Sequence[int], vocab_size: Optional[int] = None) -> Tuple[mx.array, np.ndarray]:
        """Masks of a tree verify: node 0 is the root (the committed anchor,
        parent -1), each other node's parent comes before it. Node i's row is
        the state after the tokens on its path below the root; ``valid[i]``:
        whether the grammar takes node i's token on its path (a refused node's
        subtree is never accepted: its rows are all True)."""
        rows, valid, _ = self.tree_words(tokens, parents)
        return allowed(rows, vocab_size or self.vocab), valid

    def tree_words(self, tokens: Sequence[int], parents: Sequence[int]) -> Tuple[np.ndarray, np.ndarray, List[List[int]]]:
        """:meth:`tree_masks` as bitmask rows, with each node's path below the root."""
        rows = allocate_token_bitmask(len(tokens), self.vocab)
        valid = np.zeros(len(tokens), dtype=bool)
        paths: List[List[int]] = [[]]
        fill_next_token_bitmask(self.matcher, rows, 0)
        valid[0] = True
        at: List[int] = []  # the path the matcher stands on (tokens below the root)
        for i in range(1, len(tokens)):
            p = parents[i]
            paths.append(paths[p] + [int(tokens[i])])
            if not valid[p]:
                continue
            common = next((k for k, (a, b) in enumerate(zip(at, paths[p])) if a != b), min(len(at), len(paths[p])))
            self.undo(len(at) - common)
            self.take(paths[p][common:])  # (a valid parent's path: all taken)
            at = paths[p]
            if self.take([int(tokens[i])]) == 1:
                valid[i] = True
                fill_next_token_bitmask(self.matcher, rows, i)
                self.undo(1)
        self.undo(len(at))
        return rows, valid, paths

    # -- the decode loop's per-row control (dflash_mlx.decode.Request.controls) --

    def block(self, logits: mx.array, proposal: Optional[mx.array]) -> mx.array:
        """A verify's logits ``[L, V]`` (the anchor's row, then ``proposal``'s
        ``[L - 1]``; None: the prefill's one row) masked row by row: row i by
        the state after the proposal's first i tokens. At the first token the
        grammar refuses, its row bans it, so acceptance ends there (the rows
        after it are left as they are: never read)."""
        n = 0 if proposal is None else proposal.shape[-1]
        plan, self.plan = self.plan, None
        if plan is not None and len(plan[0]) == n:  # (the block draft_block just drafted: no read)
            drafts, rows, valid = plan
        else:
            drafts = [int(t) for t in proposal.tolist()] if n else []
            rows, valid = self.block_words(drafts)
        self.seen = {tuple(drafts[:i]): only_token(rows[i]) is not None for i in range(valid + 1)}
        return masked(logits, allowed(rows, logits.shape[-1]))

    def tree(self, logits: mx.array, tokens: Sequence[int], parents: Sequence[int]) -> mx.array:
        """A tree verify's logits ``[R, V]``, each node's row masked by its own path (:meth:`tree_masks`)."""
        rows, valid, paths = self.tree_words(tokens, parents)
        self.plan = None
        self.seen = {tuple(paths[i]): only_token(rows[i]) is not None for i in np.flatnonzero(valid)}
        return masked(logits, allowed(rows, logits.shape[-1]))

    def draft_block(self, slots: int, logits: Callable[[], mx.array], vocab_size: int, sampling: Optional[dict] = None, key=None) -> Tuple[List[int], Optional[mx.array]]:
        """A drafted block of ``slots`` tokens that the grammar takes, and the
        distribution ``q [slots, vocab_size]`` each was drawn from (None:
        greedy). Slot j is masked by the state after the tokens chosen before
        it: a slot whose mask allows one token takes it (q a point mass);
        another takes the masked drafter's choice, from ``logits()`` (the
        drafter's ``[slots, V]``, called at most once: a block the grammar
        forces whole needs no drafter forward), its masked argmax, or a sample
        of :func:`~dflash_mlx.sampling.processed_probs` of its masked row with
        ``sampling``'s settings and ``key``. After an eos the block repeats
        it (never committed). The state is left where it was; the masks are
        kept for the verify (:meth:`block`)."""
        tokens, rows, qs, drafted, top = [], [], [], None, None
        keys = None if key is None or sampling is None else mx.random.split(key, slots)
        while len(tokens) < slots and not (tokens and tokens[-1] in self.eos):
            j, words, q = len(tokens), self.words(), None
            rows.append(words)
            token = only_token(words)
            if token is None:
                if drafted is None:
                    drafted = logits()
                    top = mx.argmax(drafted, axis=-1).tolist() if sampling is None else None
                if top is not None and self.allows(words, top[j]):
                    token = top[j]
                else:
                    row = held(drafted[j], allowed(words, drafted.shape[-1])[0])
                    if sampling is None:
                        token = int(mx.argmax(row))
                    else:
                        q = processed_probs(row, **sampling)
                        token = int(sample(q, None if keys is None else keys[j]))
            if self.take([token]) != 1:
                raise ValueError(f"the grammar refuses the drafted {token}, chosen from its own mask")
            tokens.append(token)
            qs.append(q)
        rows.append(self.words())
        self.undo(len(tokens))
        whole = len(tokens) == slots
        self.plan = (tokens, np.stack(rows), slots) if whole else None
        tokens = tokens + tokens[-1:] * (slots - len(tokens))
        if sampling is None:
            return tokens, None
        qs = qs + [None] * (slots - len(qs))
        return tokens, mx.stack([(mx.arange(vocab_size) == t).astype(mx.float32) if q is None else q for t, q in zip(tokens, qs)])

    def allows(self, words: np.ndarray, token: int) -> bool:
        """Whether a bitmask row allows ``token``."""
        return 0 <= token < self.vocab and bool((int(words[token >> 5]) >> (token & 31)) & 1)

    def processor(self) -> "MaskProcessor":
        """This constraint as an mlx-lm logits processor (it commits the tokens it is shown)."""
        return MaskProcessor(self)


class MaskProcessor:
    """An mlx-lm logits processor ``(tokens, logits) -> logits`` applying a
    :class:`Constraint`: the first call sees the prompt (nothing to commit),
    each later one the tokens generated since, which it commits before
    masking. The reference for a masked DFlash decode: mlx-lm's own
    ``generate_step`` / ``stream_generate`` with ``logits_processors=[this]``."""

    def __init__(self, constraint: Constraint):
        self.constraint, self.seen = constraint, None

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        if self.seen is not None:
            self.constraint.commit(tokens[self.seen:].tolist())
        self.seen = len(tokens)
        return self.constraint.apply(logits)


def batch_masks(constraints: Sequence[Optional[Constraint]], vocab_size: int) -> mx.array:
    """The masks of a batch's rows now, ``[B, vocab_size]``: each row its own
    constraint's, all True for a row without one."""
    rows = [c.mask(vocab_size) if c is not None else mx.ones((vocab_size,), mx.bool_) for c in constraints]
    return mx.stack(rows)
