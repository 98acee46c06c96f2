"""A victim and an attacker, each a client process of its own, for the availability benchmarks.

Both fairness sections (:mod:`minikv.bench.fairness`: oversized and overlong requests;
:mod:`minikv.bench.availability`: the red-team modes) measure the same thing the same way: one
tenant's latency while another floods the server.  What differs is only what each client sends,
so each section passes its two client functions and this module owns the processes:

* ``victim_fn(*args) -> dict``: runs to completion and returns what it measured;
* ``attack_fn(*args, ready, stop) -> dict``: sets ``ready`` once its connections are answered,
  loops until ``stop`` is set, then returns its counts.

Why processes, spawned once and reused by every row: the clients' Python work (JSON, SSE parsing,
thread switches) must not take the server's GIL, or the server would look slower than it is; and
starting a fresh interpreter per row would put seconds of imports inside the measurement window.
Both functions must be importable at module level (spawn pickles them by name).
"""
from __future__ import annotations

import math
import multiprocessing as mp
import queue


def _worker(victim_fn, attack_fn, commands, results, ready, stop) -> None:
    """Process entry: run ``("victim", args)`` / ``("attack", args)`` commands until ``None``."""
    for role, args in iter(commands.get, None):
        try:
            out = victim_fn(*args) if role == "victim" else attack_fn(*args, ready, stop)
        except Exception as exc:  # noqa: BLE001 -- reported to the parent, which raises
            out = {"error": f"{type(exc).__name__}: {exc}"}
        results.put(out)


class Clients:
    """The victim's and the attacker's processes; a context manager that ends both."""

    def __init__(self, victim_fn, attack_fn, timeout: float = 1800):
        ctx = mp.get_context("spawn")
        self.ready, self.stop, self.timeout = ctx.Event(), ctx.Event(), timeout
        self._procs = {}
        for role in ("victim", "attacker"):
            commands, results = ctx.Queue(), ctx.Queue()
            proc = ctx.Process(target=_worker, name=f"minikv-bench-{role}", daemon=True,
                               args=(victim_fn, attack_fn, commands, results, self.ready, self.stop))
            proc.start()
            self._procs[role] = (proc, commands, results)

    def _result(self, role: str) -> dict:
        try:
            out = self._procs[role][2].get(timeout=self.timeout)
        except queue.Empty:
            raise RuntimeError(f"the {role} client did not answer within {self.timeout:.0f} s") from None
        if out.get("error"):
            raise RuntimeError(f"the {role} client failed: {out['error']}")
        return out

    def victim(self, *args) -> dict:
        """Run the victim alone and return what it measured."""
        self._procs["victim"][1].put(("victim", args))
        return self._result("victim")

    def under_attack(self, attack_args: tuple, victim_args: tuple, what: str, ready_s: float = 900) -> dict:
        """Start the attacker, wait until it is being answered, run the victim, then stop the attacker.

        ``what`` names the attack in the error raised when the attacker's connections get no
        answer within ``ready_s`` (a server that never answers would otherwise hang the run)."""
        self.ready.clear()
        self.stop.clear()
        self._procs["attacker"][1].put(("attack", attack_args))
        try:
            if not self.ready.wait(ready_s):
                raise RuntimeError(f"{what}: the attacker's connections got no answer within {ready_s:.0f} s")
            res = self.victim(*victim_args)
        finally:
            self.stop.set()
        return {**res, "attacker": self._result("attacker")}

    def close(self) -> None:
        self.stop.set()
        for _, commands, _ in self._procs.values():
            commands.put(None)
        for proc, _, _ in self._procs.values():
            proc.join(60)
            if proc.is_alive():
                proc.terminate()

    def __enter__(self) -> "Clients":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0-100): a value that was actually observed."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]
