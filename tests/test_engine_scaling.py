"""Linear bookkeeping, checked by counting work, never by timing.

Before engine v2, ``Sequence.token_ids`` rebuilt the whole list on every read, hashing and hit
verification read it once per block, ``commit`` walked every block on every step, and every step
re-decoded the whole output: all O(length^2).  Here each is measured in tokens touched
(``BlockManager.work``, tokens passed to the tokenizer) at several lengths, and must grow in
proportion to the length.  (``python -m minikv.bench`` reports the times.)
"""
from __future__ import annotations

import random

import pytest

from minikv import LLM, SamplingParams
from minikv.engine.block_manager import BlockManager
from minikv.engine.detokenizer import detokenize, flush
from minikv.engine.sequence import Sequence
from minikv.security.hashing import make_hasher

BS = 16
P = SamplingParams(max_tokens=1)
LENGTHS = [1024, 2048, 4096, 8192]


def _prefill_and_repeat(n: int, decode: int = 0):
    """One n-token prompt is prefilled and committed, decoded ``decode`` tokens, freed, then
    sent again (a full hit).  Returns the block manager's work counts and per-decode-step
    commit work."""
    rng = random.Random(n)
    ids = [rng.randrange(50_000) for _ in range(n)]
    hasher_tokens = []
    sha = make_hasher("sha256", b"k" * 32)
    hasher = lambda parent, tokens, extra, key: hasher_tokens.append(len(tokens)) or sha(parent, tokens, extra, key)  # noqa: E731
    bm = BlockManager(2 * (n + decode) // BS + 4, BS, hasher=hasher, enable_caching=True)
    first = Sequence("a", ids, P, tenant="t", tenant_key=b"k" * 32)
    assert bm.allocate(first)
    first.num_computed_tokens = first.num_tokens
    bm.commit(first)
    steps = []
    for _ in range(decode):
        first.output_token_ids.append(rng.randrange(50_000))
        assert bm.append_slot(first)
        before = bm.work["committed"]
        first.num_computed_tokens = first.num_tokens
        bm.commit(first)
        steps.append(bm.work["committed"] - before)
    bm.free(first)
    again = Sequence("b", ids, P, tenant="t", tenant_key=b"k" * 32)
    assert bm.allocate(again) and again.num_cached_tokens == (n - 1) // BS * BS
    bm.check_invariants([again])
    assert sum(hasher_tokens) == bm.work["hashed"], "the work counter misses hashing"
    return bm.work, steps


def test_hashing_verification_and_commit_are_linear_in_prompt_length():
    work = {n: _prefill_and_repeat(n)[0] for n in LENGTHS}
    for n, w in work.items():
        # each block hashed once: the first prompt's full blocks, the repeat's hittable ones
        assert w["hashed"] == n // BS * BS + (n - 1) // BS * BS, (n, w)
        assert w["verified"] == (n - 1) // BS * BS, (n, w)  # one check per hit block
        assert w["committed"] <= n + BS, (n, w)
    for small, big in zip(LENGTHS, LENGTHS[1:]):
        for kind in ("hashed", "verified", "committed"):
            ratio = work[big][kind] / work[small][kind]
            assert ratio <= 2.05, f"{kind}: {work[small][kind]} tokens at {small}, {work[big][kind]} at {big}"


def test_a_decode_step_commits_only_the_block_it_wrote():
    for n in (512, 4096):
        _, steps = _prefill_and_repeat(n, decode=40)
        assert steps == [BS] * 40, f"prompt {n}: commit work per decode step {sorted(set(steps))}"


def test_token_ids_is_kept_not_rebuilt():
    seq = Sequence("s", [1, 2, 3], P)
    ids = seq.token_ids
    assert seq.token_ids is ids
    seq.output_token_ids.append(7)
    assert seq.token_ids is ids and ids == [1, 2, 3, 7]
    assert seq.block_tokens(1, 2) == (3, 7)


# ---------------------------------------------------------------- detokenization
class CountingTokenizer:
    """Wraps a tokenizer and counts the token ids passed to ``decode``."""

    def __init__(self, tok):
        self.tok, self.decoded = tok, 0

    def decode(self, ids, **kw):
        self.decoded += len(ids)
        return self.tok.decode(ids, **kw)


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_path)


def _stream(tok, ids):
    seq = Sequence("d", [0], P)
    for t in ids:
        seq.output_token_ids.append(t)
        detokenize(tok, seq)
    flush(tok, seq)
    return seq.output_text


def test_incremental_text_equals_one_decode(tiny_tokenizer):
    """Random byte-level tokens split multi-byte characters everywhere; special tokens are
    skipped.  The streamed text (after the final flush) is exactly one decode of all ids."""
    rng = random.Random(0)
    vocab = len(tiny_tokenizer)
    for _ in range(200):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        assert _stream(tiny_tokenizer, ids) == tiny_tokenizer.decode(ids, skip_special_tokens=True), ids


@pytest.mark.model
def test_incremental_text_equals_one_decode_smollm2(smollm2_path):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    text = "Paris, 東京 and 🙂🙃 -- naïve café, 42 × 7 = 294."
    ids = tok(text, add_special_tokens=False).input_ids
    assert _stream(tok, ids) == tok.decode(ids, skip_special_tokens=True) == text
    rng = random.Random(1)
    for _ in range(50):
        ids = [rng.randrange(len(tok)) for _ in range(30)]
        assert _stream(tok, ids) == tok.decode(ids, skip_special_tokens=True)


def test_detokenization_work_is_linear_in_output_length(tiny_path):
    """Tokens passed to decode over a whole generation: about 4 per step (a window of context +
    new token, decoded twice), not the whole output each step."""
    llm = LLM("tiny-random", device="cpu", dtype="float32")
    counting = CountingTokenizer(llm.engine.tokenizer)
    llm.engine.tokenizer = counting
    decoded = {}
    for m in (50, 200):
        counting.decoded = 0
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True,
                                                        stop=["never in this output \x00"]))[0]
        assert len(out.outputs[0].token_ids) == m
        decoded[m] = counting.decoded
        assert out.outputs[0].text == counting.tok.decode(out.outputs[0].token_ids, skip_special_tokens=True)
    assert decoded[200] <= 4.4 * decoded[50], decoded  # quadratic would be 16x
    assert decoded[200] <= 8 * 200, decoded


def test_stop_string_across_tokens_is_cut_where_it_starts(tiny_path):
    """The stop string is searched in the new text plus len(stop) - 1 characters before it:
    a stop string split across tokens is still found, and the text is cut where it starts."""
    llm = LLM("tiny-random", device="cpu", dtype="float32")
    tok = llm.get_tokenizer()
    free = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))[0]
    text = free.outputs[0].text
    start = len(text) // 2
    stop = text[start:start + 6]
    assert len(stop) == 6 and len(tok(stop, add_special_tokens=False).input_ids) >= 2
    cut = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=stop))[0]
    assert cut.outputs[0].finish_reason == "stop"
    assert cut.outputs[0].text == text[:text.find(stop)]
