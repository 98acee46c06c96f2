"""scripts/measure.py: the wall clock and peak memory that ``make test`` prints at its end."""
import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "measure.py"
ALLOC = "import time; b = bytearray({n} << 20); b[::4096] = b'x' * len(b[::4096]); time.sleep(1.2)"


def measure(*cmd, extra=()):
    out = subprocess.run([sys.executable, str(SCRIPT), "--label", "t", *extra, "--", *cmd],
                         capture_output=True, text=True, timeout=60)
    return out.returncode, out.stdout


def gb(stdout, which):
    return float(re.search(rf"{which} (\d+\.\d) GB", stdout).group(1))


def test_reports_the_largest_process_and_the_tree_and_passes_the_exit_status_through():
    rc, out = measure(sys.executable, "-c", ALLOC.format(n=700) + "; raise SystemExit(3)")
    assert rc == 3 and "exit 3" in out
    assert 0.6 <= gb(out, "largest process") <= 1.0, out      # 700 MiB touched, plus the interpreter
    assert gb(out, "whole tree") >= 0.6, out


def test_pages_two_processes_share_count_twice_in_the_tree_and_once_proportionally():
    """A parent touches 600 MiB and forks: both processes hold every page (copy-on-write, never
    written again), so the summed RSS is about 1.2 GB, while the tree occupies about 0.6 GB.  They
    live 4.5 s after the fork, so the 2-second PSS samples see them at least once."""
    shared = ("import os, time; b = bytearray(600 << 20); b[::4096] = b'x' * len(b[::4096]); "
              "pid = os.fork(); time.sleep(4.5); (os.waitpid(pid, 0) if pid else os._exit(0))")
    rc, out = measure(sys.executable, "-c", shared)
    assert rc == 0, out
    tree = gb(out, "whole tree")
    once = float(re.search(r"\((\d+\.\d) GB with shared pages counted once\)", out).group(1))
    assert tree >= 1.1 and 0.55 <= once <= 0.8, out
    cost = float(re.search(r"sampling the tree used (\d+\.\d) s of CPU", out).group(1))
    assert cost < 4.5, out  # it printed what measuring cost: a fraction of the 4.5 s it watched


def test_a_small_command_is_small_and_the_budget_warns_only_above_it():
    rc, out = measure(sys.executable, "-c", "pass", extra=("--max-rss-gb", "4"))
    assert rc == 0 and gb(out, "largest process") < 0.2 and "WARNING" not in out
    rc, out = measure(sys.executable, "-c", ALLOC.format(n=400), extra=("--max-rss-gb", "0.2"))
    assert rc == 0 and "over the 0.2 GB budget" in out


def test_no_command_is_refused():
    out = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "no command given" in out.stderr


def test_make_test_runs_one_worker_per_core_and_8_gb():
    """scripts/test_workers.py: TEST_WORKERS' default.  Two or more workers only where both the cores and
    the memory (8 GB each) allow; otherwise 0, pytest in one process."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("test_workers", Path(__file__).resolve().parents[1] / "scripts" / "test_workers.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    G = 1 << 30
    assert mod.workers(2, 24 * G) == 2      # the course machine
    assert mod.workers(8, 16 * G) == 2      # a 16 GB laptop: memory decides
    assert mod.workers(16, 64 * G) == 8
    assert mod.workers(4, 8 * G) == 0       # one fits: no xdist at all
    assert mod.workers(1, 64 * G) == 0
    out = subprocess.run([sys.executable, str(Path(spec.origin))], capture_output=True, text=True, check=True).stdout
    assert re.fullmatch(r"\d+\n", out), out
    # and each worker's share of the cores, as OMP_NUM_THREADS: never more threads than cores in all
    assert mod.threads(2, 2) == 1 and mod.threads(16, 8) == 2 and mod.threads(8, 3) == 2
    assert mod.threads(4, 0) == 4 and mod.threads(1, 2) == 1  # no xdist: every core; never zero threads
    out = subprocess.run([sys.executable, str(Path(spec.origin)), "--threads", "2"], capture_output=True, text=True, check=True).stdout
    assert re.fullmatch(r"\d+\n", out) and int(out) >= 1, out
    bad = subprocess.run([sys.executable, str(Path(spec.origin)), "--threads", "two"], capture_output=True, text=True)
    assert bad.returncode != 0 and "'two'" in bad.stderr, bad.stderr


def test_over_budget_it_names_the_biggest_process_and_the_test_files_that_raised_the_peak(tmp_path):
    log = tmp_path / "rss.tsv"  # what tests/conftest.py writes: file, MB at its end, after clean-up, peak so far
    log.write_text("test_small\t300\t290\t310\ntest_engines\t2900\t800\t3100\ntest_after\t900\t850\t3100\n"
                   "test_lesson_like\t3500\t3400\t3600\n")
    rc, out = measure(sys.executable, "-c", ALLOC.format(n=300), extra=("--max-rss-gb", "0.1", "--rss-log", str(log)))
    assert rc == 0 and "WARNING: largest process over the 0.1 GB budget" in out
    assert re.search(r"0\.[3-9] GB  pid \d+: \S*python\S* -c import time", out), out  # the sampled process, by command
    lines = [x.strip() for x in out.splitlines() if "raised the peak" in x]
    assert lines[0].startswith("test_engines: raised the peak by 2.72 GB to 3.03 GB"), lines  # the largest rise first
    assert lines[1].startswith("test_lesson_like: raised the peak by 0.49 GB"), lines
    assert not any(x.startswith("test_after") for x in lines)  # raised nothing: not listed
