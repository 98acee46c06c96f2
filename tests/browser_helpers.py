"""Helpers for the real-browser tests: a throwaway JupyterLab server and the system Chromium.

Why the system Chromium: ``playwright install`` (and Galata, JupyterLab's own UI-test tool)
download a browser build from a CDN, which machines that can only reach package registries
(CI included) cannot do.  ``make chromium`` installs Debian's ``chromium`` package instead and
playwright drives it through ``executable_path``.

Everything here runs on 127.0.0.1 only, with a random token, in a temporary directory, and is
torn down by process id (the server runs in its own session, so its kernels go with it).
"""
from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import nbformat

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def copy_notebook(src: Path, dest_dir: Path, extra_code: str | None = None,
                  stop_after=None) -> Path:
    """Copy ``src`` into ``dest_dir`` with outputs cleared, optionally keeping only the cells up
    to the first code cell for which ``stop_after(source)`` is true, and appending ``extra_code``
    as a last cell.  The committed notebook is never opened for writing."""
    nb = nbformat.read(src, as_version=4)
    cells = []
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
        cells.append(cell)
        if stop_after is not None and cell.cell_type == "code" and stop_after(cell.source):
            break
    if extra_code is not None:
        cells.append(nbformat.v4.new_code_cell(extra_code))
    nb.cells = cells
    nb.metadata.pop("widgets", None)
    dest = dest_dir / src.name
    nbformat.write(nb, dest)
    return dest


class JupyterLab:
    """``with JupyterLab(root) as lab:`` -- a JupyterLab server on 127.0.0.1 with a random token,
    serving ``root``, using this interpreter's kernel; ``lab.url(path)`` opens a file."""

    def __init__(self, root: Path, startup_timeout: float = 90.0):
        self.root = Path(root)
        self.port = free_port()
        self.token = secrets.token_hex(16)
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen | None = None
        self.home = self.root / ".jupyter-home"
        self.log_path = self.root / "jupyterlab.log"

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def url(self, path: str) -> str:
        return f"{self.base}/lab/tree/{path}?token={self.token}&reset"

    def api(self, path: str, method: str = "GET", body: dict | None = None):
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(f"{self.base}/api/{path}", method=method, data=data,
                                     headers={"Authorization": f"token {self.token}",
                                              "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            out = r.read()
        return json.loads(out) if out else None

    def start_kernel_for(self, path: str) -> str:
        """Start the notebook's kernel through the REST API (a session, as JupyterLab would), so
        that JupyterLab attaches to it instead of asking which kernel to use.  Returns its id."""
        session = self.api("sessions", "POST", {"path": path, "name": path, "type": "notebook",
                                                "kernel": {"name": "python3"}})
        return session["kernel"]["id"]

    def wait_kernel_idle(self, kernel_id: str, timeout: float = 90.0) -> None:
        """Wait until the server has seen the kernel go idle (it stays "starting" until a client
        such as the browser sends its first request)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.api(f"kernels/{kernel_id}").get("execution_state") == "idle":
                return
            time.sleep(0.5)
        raise RuntimeError(f"the kernel did not become idle within {timeout:.0f} s:\n{self.log()}")

    def __enter__(self) -> "JupyterLab":
        self.home.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        env.update(
            PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
            JUPYTER_CONFIG_DIR=str(self.home / "config"),      # ignore the user's settings
            JUPYTER_RUNTIME_DIR=str(self.home / "runtime"),
            JUPYTERLAB_SETTINGS_DIR=str(self.home / "lab-settings"),
            JUPYTERLAB_WORKSPACES_DIR=str(self.home / "lab-workspaces"),
            IPYTHONDIR=str(self.home / "ipython"),
            PYTHONHASHSEED="0",
            MPLBACKEND="module://matplotlib_inline.backend_inline",
            OMP_NUM_THREADS="1",   # one torch thread per kernel: far steadier on a shared CPU
        )
        cmd = [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ip=127.0.0.1",
               f"--port={self.port}", "--port-retries=0", f"--ServerApp.root_dir={self.root}",
               f"--IdentityProvider.token={self.token}", "--ServerApp.open_browser=False",
               "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
               "--LabApp.news_url=None", "--ServerApp.terminals_enabled=False"]
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            cmd.append("--allow-root")  # containers often run as root
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, cwd=self.root, env=env, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.__exit__(None, None, None)
                raise RuntimeError(f"JupyterLab exited with {self.proc.returncode}:\n{self.log()}")
            try:
                self.api("status")
                return self
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(0.5)
        self.__exit__(None, None, None)
        raise RuntimeError(f"JupyterLab did not answer within {self.startup_timeout:.0f} s:\n{self.log()}")

    def log(self) -> str:
        try:
            return self.log_path.read_text()[-4000:]
        except OSError:
            return ""

    def __exit__(self, *exc) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:  # shut kernels down through the API first, so none outlives the server
                for k in self.api("kernels") or []:
                    self.api(f"kernels/{k['id']}", method="DELETE")
            except Exception:  # noqa: BLE001 -- best effort; the signals below still apply
                pass
            self.proc.send_signal(signal.SIGTERM)   # by pid: the server we started
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)  # our own session: server + kernels
                self.proc.wait(timeout=10)
        self._log.close()
        self.proc = None
        shutil.rmtree(self.home, ignore_errors=True)


def launch_chromium(playwright):
    """Headless Debian Chromium through playwright (never a downloaded browser)."""
    return playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)


def accept_kernel_dialog(page) -> None:
    """If JupyterLab still asks which kernel to use, keep its (preselected) Python 3."""
    dialog = page.locator(".jp-Dialog")
    try:
        dialog.wait_for(timeout=3_000)
    except Exception:  # noqa: BLE001 -- no dialog: the kernel was attached directly
        return
    dialog.locator(".jp-Dialog-button.jp-mod-accept").click()


@dataclass
class OpenNotebook:
    """What :func:`open_and_run_all` yields: the browser page, the server, the notebook's kernel."""

    page: object
    lab: JupyterLab
    kernel_id: str


@contextmanager
def open_and_run_all(notebook: Path, failure_png: Path):
    """``with open_and_run_all(path, png) as nb:`` -- serve ``notebook``'s directory with
    JupyterLab, open the notebook in headless Chromium, wait until its kernel answers, and
    start Run > Run All Cells through the menu bar, as a learner would.  The body waits for
    whatever output it needs (the cells are still running when it starts).  If the body fails,
    a screenshot goes to ``failure_png`` and the server's log is printed; the browser and the
    server are shut down either way."""
    from playwright.sync_api import sync_playwright

    with JupyterLab(notebook.parent) as lab, sync_playwright() as pw:
        browser = launch_chromium(pw)
        page = None
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.set_default_timeout(60_000)
            # the kernel is started first, so that JupyterLab attaches to it instead of asking
            kernel_id = lab.start_kernel_for(notebook.name)
            page.goto(lab.url(notebook.name))
            page.wait_for_selector(".jp-Notebook .jp-Cell", state="attached")
            accept_kernel_dialog(page)
            lab.wait_kernel_idle(kernel_id)  # the browser is connected and the kernel answers
            page.locator(".lm-MenuBar-item", has_text=re.compile(r"^Run$")).click()
            page.locator(".lm-Menu-item:visible", has_text=re.compile(r"^Run All Cells")).first.click()
            yield OpenNotebook(page, lab, kernel_id)
        except Exception:
            if page is not None:
                try:
                    failure_png.parent.mkdir(parents=True, exist_ok=True)
                    page.screenshot(path=str(failure_png))
                except Exception:  # noqa: BLE001 -- the log below still says what happened
                    pass
            print(lab.log())
            raise
        finally:
            browser.close()
