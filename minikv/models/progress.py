"""Progress bars for model builds: coarse steps of our own, transformers' bars on or off."""
from __future__ import annotations

import contextlib


@contextlib.contextmanager
def step_bar(total: int, progress: bool, desc: str):
    """A tqdm bar over coarse steps: ``step(name)`` closes the previous step."""
    from tqdm.auto import tqdm
    with tqdm(total=total, desc=desc, disable=not progress, unit="step") as bar:
        started = []

        def step(name: str) -> None:
            bar.update(1 if started else 0)
            started.append(name)
            bar.set_postfix_str(name)
        yield step
        bar.update(1)


@contextlib.contextmanager
def transformers_bars(enabled: bool):
    """Silence transformers' own progress bars when the caller asked for quiet."""
    from transformers.utils import logging as hf_logging
    was = hf_logging.is_progress_bar_enabled()
    if not enabled:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was and not enabled:
            hf_logging.enable_progress_bar()
