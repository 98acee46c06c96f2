"""The engine's test-only seams: named places where a test or a lesson may swap in other behaviour.

Lesson 05 needs a *buggy* engine, and the failure-containment tests need a sequence that fails
on purpose.  Rather than patching private functions (which would make them API), the engine
offers four seams, each a plain attribute that is None on a normal engine:

* ``set_fault_injector(fn)``: ``fn(stage, seq)`` runs before each stage of each sequence in
  ``step()`` and raises to fail that sequence there (used by ``step_guard``);
* ``set_decode_mask(fn)``: ``fn(context_lens, max_len) -> [B, 1, 1, max_len]`` bool, the slots
  decode attention may attend to, in place of ``attention.context_mask``;
* ``set_kv_read_observer(fn)``: ``fn(layer, block_tables, context_lens, k, v)`` is called each
  time decode attention gathers its blocks (``k``, ``v``: ``[B, S, kv_heads, head_dim]``, every
  slot of every block read, masked or not);
* ``set_abort_release(fn)``: ``fn(block_manager, seq)`` lets go of an aborted running request's
  blocks first; the normal path (``BlockManager.free``) then releases whatever it left in
  ``seq.block_table``.

Installing one warns (:class:`SeamWarning`, a ``RuntimeWarning``); ``None`` removes it and the
engine is back to its correct behaviour.  No CLI flag or server option reaches them, and a
``fork()`` starts without any.  The mask and the observer travel to attention inside the
step's :class:`~minikv.engine.attention.AttentionMetadata`, never through a module global.
"""
from __future__ import annotations

import warnings
from typing import Callable

import torch

from .sequence import Sequence

FaultInjector = Callable[[str, Sequence], None]
DecodeMask = Callable[[torch.Tensor, int], torch.Tensor]
KVReadObserver = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
AbortRelease = Callable[[object, Sequence], None]


class SeamWarning(RuntimeWarning):
    """A test-only seam was installed on an engine: its behaviour is no longer the engine's own."""


def _install(engine, name: str, fn, effect: str) -> None:
    if fn is not None:
        if not callable(fn):
            raise TypeError(f"{name.replace('_', ' ')} must be callable or None, got {type(fn).__name__}")
        warnings.warn(f"minikv: a {name.replace('_', ' ')} is installed on this engine (test-only seam): "
                      f"{effect}", SeamWarning, stacklevel=3)
    setattr(engine, name, fn)


class EngineSeams:
    """Mixed into :class:`~minikv.engine.engine.LLMEngine`: the seams above, all off by default."""

    fault_injector: FaultInjector | None = None
    decode_mask: DecodeMask | None = None
    kv_read_observer: KVReadObserver | None = None
    abort_release: AbortRelease | None = None

    def set_fault_injector(self, fn: FaultInjector | None) -> None:
        """TEST-ONLY: ``fn(stage, seq)`` runs before each stage (``step_guard.STAGES``) of each
        sequence in ``step()`` and raises to make that sequence fail there."""
        _install(self, "fault_injector", fn, "requests may fail on purpose")

    def set_decode_mask(self, fn: DecodeMask | None) -> None:
        """TEST-ONLY: ``fn(context_lens, max_len)`` replaces ``attention.context_mask`` for decode."""
        _install(self, "decode_mask", fn, "decode attention may read slots a sequence does not own")

    def set_kv_read_observer(self, fn: KVReadObserver | None) -> None:
        """TEST-ONLY: ``fn(layer, block_tables, context_lens, k, v)`` sees every decode gather."""
        _install(self, "kv_read_observer", fn, "every decode gather of the KV pool is observed")

    def set_abort_release(self, fn: AbortRelease | None) -> None:
        """TEST-ONLY: ``fn(block_manager, seq)`` releases an aborted running request's blocks."""
        _install(self, "abort_release", fn, "aborted requests release their blocks another way")
