"""Lesson 03's oracle game: guess the victim's prompt, and watch the cache answer.

A victim tenant has sent one prompt.  The learner, as another tenant, types a guess and sends it as
a prompt of its own.  :func:`play_guess` does this on two engines side by side, forked from the
same weights: one with ``cache_isolation="shared"`` (UNSAFE) and one with ``"tenant"``.  The
engine reports ``cached_tokens`` (``RequestOutput.num_cached_tokens``), exactly as vLLM and the
OpenAI API report it to any client, and the time to first token.

* On the shared engine, every full block of the guess that matches the victim's prompt (from the
  start) is a hit: the count says how much of the guess was right, block by block.  That is the
  prefix oracle that lesson 04 turns into an extraction attack.
* On the tenant-isolated engine the guess can only hit blocks the *attacker* wrote: 0 here.

Why fresh engines for every guess?  A guess is cached too, in the attacker's own domain (shared:
in everyone's).  Probing the same engine twice, the second guess would hit the first one's
blocks -- "self-priming", which lesson 04 deals with.  The game keeps each guess independent.

``cached_tokens`` is deterministic; TTFT is a wall-clock measurement, so
:meth:`GuessResult.summary` holds only the counts, and every guess is played ``repeats`` times
(fresh engines each time): one pair of timings cannot tell a gap from noise, a distribution can.
With prompts this short (about 60 tokens on tiny-random, 30 on SmolLM2) the prefill a hit saves is
small next to the noise: the count oracle needs no long prompt, while the timing one does
(lesson 03, section 4).  ``OracleGame(llm)`` accepts the lesson's SmolLM2 ``LLM`` as well as
tiny-random.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from statistics import median, quantiles

from minikv.engine.config import UnsafeSettingWarning
from minikv.engine.sampling import SamplingParams
from minikv.viz.draw import figure_to_png, new_figure
from minikv.viz.layout import OKABE_ITO
from minikv.viz.plots import plot_bars, plot_timing_strip
from minikv.viz.whatif import _question_ids, default_llm, lines_html

VICTIM, ATTACKER = "victim", "attacker"
SECRET = "Please move 5000 EUR to account 4411-2093 today."
SUMMARY_CLASS = "minikv-oracle-summary"
REPEATS = 8  # timings per engine and guess: enough for quartiles


@dataclass(frozen=True)
class GuessResult:
    guess: str
    prompt_tokens: int  # tokens of the attacker's prompt (chat-formatted guess)
    shared_cached: int  # cached_tokens the shared engine reports
    isolated_cached: int  # cached_tokens the tenant-isolated engine reports
    shared_ttft_s: tuple[float, ...]  # one TTFT per repeat
    isolated_ttft_s: tuple[float, ...]

    def summary(self) -> str:
        return (f"guess {self.guess!r}: cached_tokens shared={self.shared_cached} "
                f"isolated={self.isolated_cached} (of {self.prompt_tokens} prompt tokens)")

    def timing(self) -> str:
        def quartiles(xs):
            q1, q2, q3 = quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else (xs[0],) * 3
            return f"median {1e3 * q2:.1f} ms (quartiles {1e3 * q1:.1f} ms to {1e3 * q3:.1f} ms)"
        return (f"TTFT over {len(self.shared_ttft_s)} repeats: shared {quartiles(self.shared_ttft_s)}, "
                f"isolated {quartiles(self.isolated_ttft_s)} (wall clock: varies run to run)")

    def ttft_ratio(self) -> float:
        """Median TTFT on the shared engine over the median on the isolated one."""
        return median(self.shared_ttft_s) / median(self.isolated_ttft_s)


def play_guess(llm, guess: str, secret: str = SECRET, block_size: int = 8,
               repeats: int = REPEATS) -> GuessResult:
    """The victim sends ``secret``, then the attacker sends ``guess``, on a fresh shared engine and
    a fresh tenant-isolated engine, ``repeats`` times; what the engines tell the attacker."""
    if not isinstance(guess, str) or not guess:
        raise ValueError(f"guess must be a non-empty str, got {guess!r}")
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be a positive int, got {repeats!r}")
    tok, params = llm.get_tokenizer(), SamplingParams(max_tokens=1, temperature=0.0)
    seen = {"shared": [], "isolated": []}
    for _ in range(repeats):
        for name, isolation in (("shared", "shared"), ("isolated", "tenant")):
            with warnings.catch_warnings():  # "shared" is UNSAFE on purpose: that is the game
                warnings.simplefilter("ignore", UnsafeSettingWarning)
                fork = llm.fork(num_blocks=64, enable_prefix_caching=True, block_size=block_size,
                                cache_isolation=isolation, max_cached_blocks_per_tenant="unlimited")
            fork.generate([_question_ids(tok, secret)], params, tenant=VICTIM)
            seen[name].append(fork.generate([_question_ids(tok, guess)], params, tenant=ATTACKER)[0])
    s, i = seen["shared"], seen["isolated"]
    return GuessResult(guess, len(s[0].prompt_token_ids), s[0].num_cached_tokens, i[0].num_cached_tokens,
                       tuple(o.metrics.ttft_s for o in s), tuple(o.metrics.ttft_s for o in i))


def draw_guess(res: GuessResult):
    """Shared beside isolated: cached_tokens (left, exact) and every repeat's TTFT (right)."""
    fig = new_figure(8.0, 2.8)
    left, right = fig.subplots(1, 2)
    colors = [OKABE_ITO["vermillion"], OKABE_ITO["blue"]]
    plot_bars(["shared", "isolated"], [res.shared_cached, res.isolated_cached], ax=left,
              colors=colors, value_fmt="{:.0f}", title=f"cached_tokens (of {res.prompt_tokens})")
    left.set_ylim(0, res.prompt_tokens)
    plot_timing_strip({"shared": [1e3 * t for t in res.shared_ttft_s],
                       "isolated": [1e3 * t for t in res.isolated_ttft_s]}, ax=right,
                      colors=colors, title="TTFT (wall clock)")
    return fig


class OracleGame:
    """A text box (press Enter to probe) and, below it, what both engines answered: the summary
    label (CSS class ``minikv-oracle-summary``), the timing line and the charts.  The picture
    stays hidden until the first guess: an Image widget with no data is a broken-image icon."""

    def __init__(self, llm=None, secret: str = SECRET, dpi: int = 80) -> None:
        import ipywidgets as w
        self.llm = llm if llm is not None else default_llm()
        self.secret, self.dpi, self.result = secret, dpi, None
        self.guess = w.Text(placeholder="type a guess of the victim's prompt, then Enter",
                            description="guess", continuous_update=False,
                            layout=w.Layout(width="560px"))
        self.guess.add_class("minikv-oracle-guess")
        self.summary = w.HTML(value=lines_html("(no guess yet)"), layout=w.Layout(width="auto"))
        self.summary.add_class(SUMMARY_CLASS)
        self.timing = w.HTML(layout=w.Layout(width="auto"))  # HTML, not Label: it wraps
        self.image = w.Image(format="png", layout=w.Layout(display="none"))
        self.image.add_class("minikv-oracle-image")
        self.widget = w.VBox([self.guess, self.summary, self.timing, self.image])
        self.guess.observe(lambda change: self.play(change["new"]) if change["new"] else None,
                           names="value")

    def play(self, guess: str) -> GuessResult:
        """Probe both engines with ``guess`` and redraw (what pressing Enter does)."""
        self.result = play_guess(self.llm, guess, self.secret)
        self.summary.value = lines_html(self.result.summary())
        self.timing.value = lines_html(self.result.timing())
        self.image.value = figure_to_png(draw_guess(self.result), dpi=self.dpi)
        self.image.layout.display = None  # shown from the first guess on
        return self.result

    def _ipython_display_(self) -> None:
        from IPython.display import display
        display(self.widget)
