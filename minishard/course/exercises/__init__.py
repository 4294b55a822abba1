"""Exercises: one module per chapter, each a small piece of the library for the learner to write.

Every module ``chNN.py`` holds

* the **stub** the learner edits: a function with a docstring that says what to compute, whose
  body raises ``NotImplementedError``;
* a **check** ``check_<name>(fn=None, ...)`` that runs the learner's function — on real ranks
  where the chapter is about ranks — and compares it with what minishard itself computes or
  measures. It prints what it compared and returns True; a wrong answer raises
  :class:`ExerciseFailed` with a hint. A stub that still raises ``NotImplementedError`` is
  reported as "not done yet" (``False``), so a notebook that shows the exercise still runs.

Reference solutions live outside the package, in ``solutions/chNN.py``; ``tests/test_exercises.py``
runs every check with them. In a notebook::

    from minishard.course.exercises import ch02
    def ring_bytes(op, nbytes, world_size):   # your version (or edit the stub in ch02.py)
        ...
    ch02.check_ring_bytes(ring_bytes)

Functions that run on ranks are sent to the rank processes as *source code* (a function defined
in a notebook cell cannot be imported by another process), so write them self-contained: use
``torch`` and ``math`` (always available there), and import anything else inside the function.
"""
from __future__ import annotations

import importlib
import inspect
import math
import textwrap
import types
from typing import Callable

__all__ = ["ExerciseFailed", "NotDone", "attempt", "portable", "load", "expect", "pools",
           "at_world_sizes"]


class ExerciseFailed(AssertionError):
    """The learner's answer disagrees with minishard; the message says where and hints why."""


class NotDone(Exception):
    """Raised internally when the learner's function still raises NotImplementedError."""


def attempt(check: Callable) -> Callable:
    """Decorator for ``check_*``: a stub that is not written yet prints a friendly line and
    returns False instead of failing; a correct answer returns True."""
    solution = f"solutions/{check.__module__.rsplit('.', 1)[-1]}.py"

    def wrapper(*args, **kwargs):
        try:
            check(*args, **kwargs)
        except (NotDone, NotImplementedError) as e:
            what = str(e) or "the stub raises NotImplementedError"
            print(f"not done yet: {what} — write it, then run the check again "
                  f"(a reference solution is in {solution})")
            return False
        print(f"✓ {check.__name__}: your answer agrees with minishard")
        return True
    wrapper.__name__, wrapper.__doc__ = check.__name__, check.__doc__
    wrapper.__wrapped__ = check
    return wrapper


def call(fn: Callable, *args, **kwargs):
    """Call the learner's function; its NotImplementedError means "not done yet"."""
    try:
        return fn(*args, **kwargs)
    except NotImplementedError as e:
        raise NotDone(f"{getattr(fn, '__name__', 'the function')} raises NotImplementedError") from e


def expect(cond: bool, message: str) -> None:
    if not cond:
        raise ExerciseFailed(message)


# ---------------------------------------------------------------- functions that travel to ranks

def portable(fn: Callable) -> dict:
    """What the rank processes need to rebuild ``fn``: its source, its name, and the modules
    its body refers to by a global name (``torch``, ``nn``, ``F`` …)."""
    if isinstance(fn, dict):
        return fn
    try:
        src = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError) as e:
        raise ExerciseFailed(f"cannot read the source of {fn!r} to send it to the ranks ({e}); "
                             f"define it with `def` in a cell or a .py file") from e
    names = set()

    def walk(code):
        names.update(code.co_names)
        for c in code.co_consts:
            if isinstance(c, types.CodeType):
                walk(c)

    walk(fn.__code__)
    modules = {n: m.__name__ for n, m in fn.__globals__.items()
               if n in names and isinstance(m, types.ModuleType)}
    return {"source": src, "name": fn.__name__, "modules": modules}


def load(spec: dict) -> Callable:
    """Rebuild a function from :func:`portable`'s description (on a rank)."""
    import torch

    ns = {"torch": torch, "math": math, "nn": torch.nn, "F": torch.nn.functional}
    for name, module in spec["modules"].items():
        ns[name] = importlib.import_module(module)
    exec(compile(spec["source"], f"<exercise {spec['name']}>", "exec"), ns)
    return ns[spec["name"]]


def run_on_rank(spec: dict, *args, **kwargs):
    """Call the learner's function on a rank; say so plainly if it is not written yet."""
    try:
        return load(spec)(*args, **kwargs)
    except NotImplementedError as e:
        raise NotImplementedError(f"{spec['name']} raises NotImplementedError") from e


def run_guarded(spec: dict, *args, **kwargs) -> tuple[object, str | None]:
    """Call the learner's function on a rank; ``(result, None)``, or ``(None, "Error: message")``
    when it raises. A wrong answer thus comes back as a hint instead of a rank error, which would
    close the learner's pool of ranks. (Every rank runs the same code, so every rank fails at the
    same place and no collective is left waiting for a rank that gave up.)"""
    try:
        return run_on_rank(spec, *args, **kwargs), None
    except NotImplementedError:
        raise
    except Exception as e:                                   # noqa: BLE001 — reported, not hidden
        return None, f"{type(e).__name__}: {e}"


def pools(given=None):
    """``with pools(ranks) as get: get(2).run(...)`` — the caller's warm pools where they have the
    size asked (a notebook's ``R2``, a dict of them from a test), others started and closed on
    exit (``launch.Pools``)."""
    from minishard.core.launch import Pools
    return Pools(*(() if given is None else given.values() if isinstance(given, dict) else (given,)))


def in_process():
    """A one-rank context for running a rank task right here (no process group: collectives
    on one rank are copies)."""
    import torch

    from minishard.core.launch import RankContext
    from minishard.core.trace import Tracer
    return RankContext(0, 1, torch.device("cpu"), Tracer(), "none")


def unwrap_rank_error(e: Exception) -> Exception:
    """A learner's NotImplementedError on a rank arrives as a RankError: turn it back."""
    from minishard.core.launch import RankError
    if isinstance(e, RankError) and "NotImplementedError" in e.error:
        return NotDone(e.error.split("(", 1)[-1].rstrip(")").strip("'\""))
    return e


def at_world_sizes(task: Callable, spec: dict, ranks, sizes: tuple[int, ...]):
    """Run the rank task ``task(ctx, spec)`` at each world size in turn and yield
    ``(n, [one result per rank])``. World size 1 runs right here (quick, and a wrong answer
    fails before any pool starts); the others on ``ranks`` or pools started for the purpose. A
    learner's NotImplementedError on a rank comes back as "not done yet"."""
    with pools(ranks) as get:
        for n in sizes:
            try:
                out = [task(in_process(), spec)] if n == 1 else get(n).run(task, spec)
            except Exception as e:
                raise unwrap_rank_error(e) from e
            yield n, out
