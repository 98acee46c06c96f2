"""The learner's side of sealed grading: a loop that imports one exercise module and answers calls.

It runs in a fresh interpreter (``python -I -B``) started by :mod:`.sealed`, as another Unix user
where the grader is root, with resource limits, an empty environment and its own temporary
folder.  It is executed from its source text together with :mod:`._wire` (so it never imports
``minikv.grading``), reads requests from one pipe and writes answers to another, and does only
what a request asks: call a learner function (or a method of an object a learner function
returned) with the data given, and send back the data it returns or the exception it raises.

Everything here runs beside code the grader does not trust, so nothing here is trusted either:
a hostile learner can rewrite this loop, and then lie about its own outputs -- but that is all,
since the grader's inputs, graders and verdicts live in another process.  The audit hook below
is a *detector*, not a wall: it notes the moves that only tampering makes (opening another
process's ``/proc`` entries, writing outside its folder, loading the graders, signalling other
processes), and every answer carries the notes, so the grader can say "tampering" instead of
just "failed".
"""
import importlib
import os
import re
import sys
import traceback
import types

_PROC = re.compile(r"^/proc/(\d+)(/|$)")
#: the parts of minikv.grading a submission may load: the given plumbing (and the loop itself)
_ALLOWED_GRADING = ("minikv.grading", "minikv.grading.harness")


def _watch(notes: list, home: str, reads, cfg: dict):
    own = str(os.getpid())

    def hook(event, args):
        try:
            if event == "open" and args and isinstance(args[0], (str, bytes)):
                path = os.fsdecode(args[0])
                m = _PROC.match(path)
                if m and m.group(1) != own:
                    notes.append(f"opened {path}, another process's memory or files")
                elif _private(path, reads, cfg):
                    notes.append(f"opened {path}, which a check may not read (the reference answers, the graders, "
                                 "or another submission's files)")
                mode, flags = (args[1] if len(args) > 1 else None), (args[2] if len(args) > 2 else 0)
                writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or \
                         (isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
                full = os.path.realpath(path)
                if writes and not (full.startswith(home) or full.startswith("/dev/")):
                    notes.append(f"opened {path} for writing, outside its own folder")
            elif event in ("os.listdir", "os.scandir") and args and isinstance(args[0], (str, bytes)) \
                    and os.path.realpath(os.fsdecode(args[0])) == "/proc":
                notes.append("listed /proc, every process of the machine")
            elif event in ("os.kill", "os.killpg") and args and args[0] not in (0, os.getpid()):
                notes.append(f"sent signal {args[1] if len(args) > 1 else '?'} to process {args[0]}")
            elif event == "import" and args and isinstance(args[0], str) and args[0].startswith("minikv.grading.") \
                    and args[0] not in _ALLOWED_GRADING:
                notes.append(f"loaded the graders ({args[0]}) into its process")
        except Exception:  # noqa: BLE001 -- a detector must never break the learner's code
            pass

    sys.addaudithook(hook)


def _private(path: str, reads, cfg: dict) -> bool:
    """Whether ``path`` is one a check may not read: a closed module or ``solutions/``, or a file
    of the repository or of the temporary folder outside the child's own folder and the libraries."""
    full = os.path.realpath(path)
    if reads.is_closed(full, cfg["closed"]):
        return True
    inside = lambda roots: any(full == r or full.startswith(r + os.sep) for r in roots)  # noqa: E731
    return inside(cfg["private"]) and not inside(cfg["own"])


class _ClosedModules:
    """A finder placed first on ``sys.meta_path``: a module whose file is closed to this check is
    refused whatever name reaches it (``minikv.audit.detect`` re-exports ``minikv.audit.detector``;
    ``minikv.engine.engine`` imports ``minikv.security``) and the attempt becomes a note.  The file
    is unreadable anyway where Landlock closes it; this says which module, and why."""

    def __init__(self, notes: list, reads, closed: list):
        self.notes, self.reads, self.closed = notes, reads, closed

    def find_spec(self, name, path=None, target=None):
        if not name.startswith(("minikv.", "solutions")) or not self.closed:
            return None
        import importlib.machinery

        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.origin and self.reads.is_closed(spec.origin, self.closed):
            self.notes.append(f"imported {name}, a module closed to this check (the reference it is graded "
                              "against, or the graders)")
            raise ImportError(f"{name} is closed to a graded check: the grade must measure your code, "
                              "not the engine's reference")
        return None


def main(wire, reads, cfg: dict) -> None:
    sys.path[:0] = cfg["path"]
    sys.dont_write_bytecode = True
    home = os.path.realpath(cfg["home"])
    # minikv.grading's __init__ imports every grader; a submission gets only the harness, so the
    # package is entered without running its __init__ (and a later load of a grader is visible).
    grading = types.ModuleType("minikv.grading")
    grading.__path__ = [os.path.join(cfg["minikv"], "grading")]
    sys.modules["minikv.grading"] = grading
    notes: list = []
    sys.meta_path.insert(0, _ClosedModules(notes, reads, cfg["closed"]))
    _watch(notes, home, reads, cfg)
    rf = os.fdopen(cfg["rfd"], "rb")
    wf = os.fdopen(cfg["wfd"], "wb", buffering=0)
    objects: dict = {}  # handle -> an object this process owns (a learner's instance, function ...)
    snapshots: list = []  # (parent's handle, namespace, its tensors) of the data objects of a call

    def handle(obj) -> int:
        objects[id(obj)] = obj
        return id(obj)

    class Remote:
        """An object the grader owns: public attributes and calls only, each a round trip."""

        def __init__(self, h: int):
            object.__setattr__(self, "_h", h)

        def __getattr__(self, name):
            if name.startswith("_"):
                raise AttributeError(name)
            return ask({"op": "getattr", "h": self._h, "name": name})

        def __call__(self, *args, **kwargs):
            return ask({"op": "call", "h": self._h, "name": None, "args": enc(list(args)), "kwargs": enc(kwargs)})

        def __repr__(self):
            return f"<grader object {self._h}>"

    def resolve(h):
        return Remote(h)

    def enc(obj):
        return wire.encode(obj, handle)

    def dec(data):
        return wire.decode(data, resolve)

    seen_graders: set = set()

    def send(msg: dict) -> None:
        loaded = {m for m in sys.modules if m.startswith("minikv.grading.") and m not in _ALLOWED_GRADING}
        if loaded - seen_graders:
            notes.append(f"loaded the graders ({', '.join(sorted(loaded - seen_graders)[:3])}) into its process")
            seen_graders.update(loaded)
        msg["notes"] = list(notes)
        notes.clear()
        wf.write(wire.dumps(msg))

    def fail(exc: BaseException) -> dict:
        where = ""
        for fr in reversed(traceback.extract_tb(exc.__traceback__)):
            if fr.filename.startswith(cfg["pkg"]):
                where = f" (at {os.path.basename(fr.filename)}:{fr.lineno} in {fr.name})"
                break
        return {"op": "raise", "type": type(exc).__name__, "msg": str(exc)[:2000], "where": where}

    def ask(msg: dict):
        send(msg)
        while True:
            reply = wire.loads(rf.readline())
            if reply["op"] == "value":
                return dec(reply["value"])
            if reply["op"] == "error":
                raise _rebuild(reply)
            serve(reply)  # the grader calls back into learner code while answering

    def target(msg: dict):
        if "h" in msg:
            obj = objects[msg["h"]]
            return getattr(obj, msg["name"]) if msg.get("name") else obj
        obj = importlib.import_module(f"{cfg['package']}.{msg['module']}")
        for part in msg["name"].split("."):
            obj = getattr(obj, part)
        return obj

    def data_objects(args: list) -> None:
        """Turn each ``{"__ns": [h, fields]}`` argument into a namespace whose tensors are synced back."""
        for i, a in enumerate(args):
            if isinstance(a, dict) and set(a) == {"__ns"}:
                h, fields = a["__ns"]
                ns = types.SimpleNamespace(**{k: dec(v) for k, v in fields.items()})
                snapshots.append((h, ns, {k: v for k, v in vars(ns).items() if hasattr(v, "shape")}))
                args[i] = ns
            else:
                args[i] = dec(a)

    def serve(msg: dict) -> None:
        op = msg["op"]
        try:
            if op == "getattr":
                obj = target(msg)
                send({"op": "value", "value": enc(obj)})
                return
            fn = target(msg)
            args = list(msg.get("args") or [])
            data_objects(args)
            kwargs = dec(msg.get("kwargs") or {"__d": []})
            result = fn(*args, **kwargs)
            sync = [[h, name, getattr(ns, name) is t, enc(getattr(ns, name))]
                    for h, ns, tensors in snapshots for name, t in tensors.items()]
            snapshots.clear()
            send({"op": "value", "value": enc(result), "sync": sync})
        except BaseException as exc:  # noqa: BLE001 -- every failure is data for the grader
            snapshots.clear()
            send(fail(exc))

    def _rebuild(reply):
        import builtins

        cls = getattr(builtins, reply.get("type", ""), None)
        if not (isinstance(cls, type) and issubclass(cls, Exception)):
            cls = RuntimeError
        return cls(reply.get("msg", ""))

    import atexit

    atexit.register(lambda: send({"op": "bye"}))  # registered first, so it runs after the learner's exit hooks
    send({"op": "ready"})
    while True:
        line = rf.readline()
        if not line:
            break
        msg = wire.loads(line)
        if msg["op"] == "exit":
            break
        serve(msg)
