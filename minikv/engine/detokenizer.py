"""Incremental detokenization: each step prints the text of the new token, in O(1) work.

Decoding the whole output again after every token costs O(length) per step, O(length^2) per
request.  Decoding only the new token does not work either: a token is not always whole
characters.  Byte-level BPE (SmolLM2's tokenizer, GPT-2's) splits a multi-byte UTF-8
character -- an emoji, most CJK -- across tokens, and a piece decoded alone is U+FFFD ("\ufffd");
SentencePiece tokenizers print a token's leading space only after a previous token.

So each step decodes a short *window*: the tokens printed last time (context) plus those not
printed yet, and prints what the window adds beyond its context -- unless that ends in "\ufffd",
in which case it waits for the rest of the character.  Two offsets into the output remember
where the window starts (``prefix``) and what is printed (``read``).  vLLM and Hugging Face TGI
detokenize the same way (their ``prefix_offset``/``read_offset``).  When the request finishes,
:func:`flush` prints whatever is still held back, so the final text is what one ``decode`` of
all output tokens gives (tests/test_engine_scaling.py checks it, and counts the work).
"""
from __future__ import annotations

from .sequence import Sequence, stop_reason

REPLACEMENT = "\ufffd"  # what a decoder prints for bytes that are not (yet) a whole character


def _decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


def detokenize(tokenizer, seq: Sequence) -> str:
    """Append the text of ``seq``'s not-yet-printed output tokens to ``seq.output_text``;
    return the new text ("" while a character is incomplete)."""
    ids = seq.output_token_ids
    prefix, read = seq.detok_offsets
    context = _decode(tokenizer, ids[prefix:read])
    window = _decode(tokenizer, ids[prefix:])
    if len(window) <= len(context) or window.endswith(REPLACEMENT):
        return ""  # nothing printable yet: keep the offsets, widen the window next step
    new = window[len(context):]
    seq.detok_offsets = (read, len(ids))
    seq.output_text += new
    return new


def flush(tokenizer, seq: Sequence) -> str:
    """At the end: print what :func:`detokenize` held back (an incomplete character prints as
    U+FFFD, as a one-shot decode prints it).  Returns the text added."""
    ids = seq.output_token_ids
    prefix, read = seq.detok_offsets
    if read == len(ids):
        return ""
    new = _decode(tokenizer, ids[prefix:])[len(_decode(tokenizer, ids[prefix:read])):]
    seq.detok_offsets = (read, len(ids))
    seq.output_text += new
    return new


def advance_text(tokenizer, seq: Sequence, tok: int, eos_token_ids, max_model_len: int) -> str | None:
    """After ``tok`` joined ``seq``'s output: print its text (:func:`detokenize`), then return why
    the request stops (``sequence.stop_reason``), or None.  A request that stops anywhere but at a
    stop string prints what was held back (:func:`flush`)."""
    new = detokenize(tokenizer, seq)
    text_len = len(seq.output_text)
    reason = stop_reason(seq, tok, eos_token_ids, max_model_len, new_chars=len(new))
    if reason and len(seq.output_text) == text_len:  # not cut at a stop string: print all
        flush(tokenizer, seq)
    return reason
