"""The engine stands apart from the course: it imports no course or widget code, and installs and
trains on a cluster node without JupyterLab, plotly or ipywidgets.

* Statically: no module of the engine (``minishard/*.py``) imports ``minishard.course``,
  ``minishard.viz`` or a notebook library — not even lazily, inside a function.
* For real: a fresh virtual environment gets torch and ``pip install`` of the engine — the
  package without ``course/`` and ``viz/``, so that an engine module importing them would fail —
  with its dependencies only (nothing else is installed); there, under ``torchrun``, two ranks
  train DDP, ZeRO-2 and FSDP and save a checkpoint, and ``destroy_process_group`` then leaves
  each rank with the threads it had before the group; one plain process loads the checkpoint
  (resharded from 2 ranks to 1) and trains on. (One torchrun job: every job starts an agent and
  its ranks, each importing torch afresh in a new environment.)
"""
import ast
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
ENGINE = sorted(f for f in (ROOT / "minishard").rglob("*.py")
                if not f.relative_to(ROOT / "minishard").parts[0] in ("course", "viz"))
COURSE_ONLY = ("minishard.course", "minishard.viz", "plotly", "ipywidgets", "anywidget", "IPython",
               "jupyterlab", "jupyter_server", "nbformat", "nbclient")


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, anywhere in it, as absolute names."""
    package = list(path.relative_to(ROOT).with_suffix("").parts[:-1])    # e.g. [minishard, checkpoint]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[:len(package) - node.level + 1]) if node.level else ""
            mod = ".".join(x for x in (base, node.module or "") if x)
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)
    return out


def test_the_engine_imports_no_course_or_widget_code():
    for path in ENGINE:
        bad = sorted(m for m in imported_modules(path) if m.startswith(COURSE_ONLY))
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}: the engine must not (course " \
                        f"code lives in minishard/course, widgets in minishard/viz)"


# the engine proper: what trains and saves; the instruments, viewers, planner and CLI stand on it
CORE_ENGINE = [f for f in ENGINE if f.relative_to(ROOT / "minishard").parts[0] in
               ("core", "strategies", "checkpoint", "training")]


def test_the_engine_knows_nothing_of_the_faults_chapter_11_plants():
    """A fault is planted by wrapping the object that makes the mistake (minishard.instruments.faults,
    through the loop's RunHooks), never by a knob the engine reads: no engine module imports the
    faults or names one of them, and no communicator carries a skip predicate."""
    from minishard.instruments.faults import FAULTS
    names = [f'"{n}"' for n in FAULTS] + ["fault_rank", "synced_start", ".skip(", "skip="]
    assert CORE_ENGINE, "no engine modules found"
    for path in CORE_ENGINE:
        text = path.read_text()
        said = [n for n in names if n in text]
        assert not said, f"{path.relative_to(ROOT)} names {said}: faults belong to minishard.instruments.faults"
        assert not any(m.startswith("minishard.instruments.faults") for m in imported_modules(path)), \
            f"{path.relative_to(ROOT)} imports the faults"


def test_the_step_and_what_it_stands_on_import_no_instrument():
    """The collectives, the strategies, the checkpoints and the training step import nothing of
    the instruments (no health note, no watch, no doctor): what the doctor notes about a step is
    taken by the optimizer's step hooks the run registers (training/loop.py, the one place that
    wires instruments to a run)."""
    step = ROOT / "minishard" / "training" / "step.py"
    engine = [f for f in CORE_ENGINE if f.relative_to(ROOT / "minishard").parts[0] != "training"]
    for path in [step, *engine]:
        reached = sorted(m for m in imported_modules(path) if m.startswith("minishard.instruments"))
        assert not reached, f"{path.relative_to(ROOT)} imports {reached}"


def test_the_instruments_stand_on_the_core_not_on_the_viewers():
    """The doctor and the health notes print sizes and dtypes with the core's words
    (core/words.py), the layer both they and the viewers stand on: no instrument imports a viewer."""
    for path in sorted((ROOT / "minishard" / "instruments").rglob("*.py")):
        reached = sorted(m for m in imported_modules(path) if m.startswith("minishard.viewers"))
        assert not reached, f"{path.relative_to(ROOT)} imports {reached}"


MUTATORS = {"append", "extend", "insert", "remove", "pop", "popitem", "clear", "update",
            "setdefault", "add", "discard"}
CONTAINERS = {"list", "dict", "set", "defaultdict", "WeakKeyDictionary", "WeakValueDictionary",
              "OrderedDict", "deque", "Counter"}


def module_state_changes(source: str) -> list[tuple[int, str]]:
    """Where a function changes state its module holds: ``global`` names, and the module's own
    lists, dicts and sets appended to, updated or assigned into."""
    tree = ast.parse(source)
    held = set()
    for node in tree.body:
        target = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, ast.AnnAssign) and node.value is not None else []
        value = getattr(node, "value", None)
        literal = isinstance(value, (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp))
        made = isinstance(value, ast.Call) and getattr(value.func, "id", getattr(value.func, "attr", "")) in CONTAINERS
        if literal or made:
            held |= {t.id for t in target if isinstance(t, ast.Name)}
    out = []
    for fn in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
        for n in ast.walk(fn):
            if isinstance(n, ast.Global):
                out += [(n.lineno, f"global {g}") for g in n.names]
            elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in MUTATORS \
                    and isinstance(n.func.value, ast.Name) and n.func.value.id in held:
                out.append((n.lineno, f"{n.func.value.id}.{n.func.attr}(...)"))
            elif isinstance(n, (ast.Assign, ast.AugAssign, ast.Delete)):
                for t in n.targets if isinstance(n, (ast.Assign, ast.Delete)) else [n.target]:
                    if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name) and t.value.id in held:
                        out.append((n.lineno, f"{t.value.id}[...] changed"))
    return out


def test_no_module_keeps_state_that_changes_as_it_runs():
    """State belongs to the object that owns it (the communicator keeps the background save in
    flight and its group; the tracer is passed explicitly): no module of minishard changes a
    list, dict or set it holds, or a global, at run time — but the one the style rules name,
    the notebook kernel's shared Plotly library widget (viz/live_figure.py)."""
    allowed = {"minishard/viz/live_figure.py": {"global _library"}}
    found = []
    for path in sorted((ROOT / "minishard").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        found += [f"{rel}:{line}: {what}" for line, what in module_state_changes(path.read_text())
                  if what not in allowed.get(rel, ())]
    assert not found, "module-level state changed at run time:\n" + "\n".join(found)
    planted = "_pending: list = []\n\ndef save(x):\n    _pending.append(x)\n"
    assert module_state_changes(planted) == [(4, "_pending.append(...)")]


def engine_import_graph() -> dict[str, set[str]]:
    """Which engine modules each engine module imports, at run time: lazy imports inside
    functions included, ``if TYPE_CHECKING:`` blocks left out (they never run)."""
    def name(path: Path) -> str:
        parts = path.relative_to(ROOT).with_suffix("").parts
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    modules = {name(p): p for p in ENGINE}
    graph = {}
    for mod, path in modules.items():
        tree = ast.parse(path.read_text())
        never = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                 and "TYPE_CHECKING" in ast.unparse(block.test) for b in block.body for n in ast.walk(b)}
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        deps = set()
        for node in ast.walk(tree):
            if id(node) in never:
                continue
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
                target = ".".join([*base, *([node.module] if node.module else [])])
                for a in node.names:        # `from . import hooks` imports the module hooks
                    deps.add(f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target)
        graph[mod] = {d for d in deps if d in modules and d != mod}
    return graph


def test_no_engine_module_imports_itself_back_through_others():
    """No import cycle among the engine's modules, lazy imports included: a cycle hidden by an
    import inside a function still ties the modules' meanings together (and breaks the day the
    import moves to the top)."""
    graph = engine_import_graph()
    assert "minishard.planner.analytic" in graph["minishard.planner.costmodel"]          # the walk sees imports
    assert "minishard.instruments.watching.calls" in graph["minishard.instruments.watching.session"]     # lazy ones too
    done, path = set(), []

    def visit(mod):
        if mod in path:
            cycle = path[path.index(mod):] + [mod]
            raise AssertionError("import cycle: " + " -> ".join(cycle))
        if mod in done:
            return
        path.append(mod)
        for dep in sorted(graph[mod]):
            visit(dep)
        path.pop()
        done.add(mod)
    for mod in sorted(graph):
        visit(mod)


def test_the_engines_dependencies_are_torch_numpy_safetensors_and_xxhash():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {d.split(">")[0].split("=")[0].split("[")[0].strip() for d in project["dependencies"]}
    assert names == {"torch", "numpy", "safetensors", "xxhash"}
    assert {"jupyterlab", "plotly", "ipywidgets"} <= {
        d.split(">")[0].strip() for d in project["optional-dependencies"]["course"]}


TASK = textwrap.dedent('''
    import os, sys, torch.distributed as dist
    from minishard.core.launch import context_from_env
    from minishard.training.loop import TrainConfig, train
    threads = lambda: len(os.listdir("/proc/self/task"))
    out_dir, phase = sys.argv[1], sys.argv[2]
    kw = dict(model="nano", micro_batch=1, track_activations=False)
    if phase == "resume":            # one process, no group: the 2 ranks' shards read as one
        r = train(None, TrainConfig("single", steps=1, resume_from=os.path.join(out_dir, "ck"), **kw))
        print(f"one process resumed at step {r['checkpoint']['load']['step']}", flush=True)
        sys.exit()
    before = threads()
    ctx = context_from_env()
    for s in ("ddp", "zero2", "fsdp"):
        r = train(ctx, TrainConfig(s, steps=2, **kw))
        print(f"rank {ctx.rank} {s} wire {r['wire'][-1]} loss {r['losses'][-1]:.4f}", flush=True)
    train(ctx, TrainConfig("fsdp", steps=2, save_to=os.path.join(out_dir, "ck"), **kw))
    dist.destroy_process_group()
    print(f"rank {ctx.rank} threads: {before} before the group, {threads()} after it", flush=True)
''')


def _checked(done: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    """A failed command fails the test with what it printed (the ranks' tracebacks), not just
    its exit status."""
    if done.returncode:
        pytest.fail(f"{' '.join(map(str, done.args))} exited with {done.returncode}:\n"
                    f"{done.stdout[-2000:]}\n{done.stderr[-6000:]}")
    return done


def _lend_torch(venv: Path, folder: Path) -> None:
    """torch and the distributions it requires — and nothing else — as links in ``folder``, which
    a ``.pth`` file puts on the fresh environment's path: pip sees torch installed (the build this
    machine has; a user installs theirs first) and installs the engine's other dependencies
    itself. (``pip install torch`` copied its 2,300 modules and libraries and compiled the modules:
    half this test's time.)"""
    folder.mkdir()
    todo, seen = ["torch"], set()
    while todo:
        dist = importlib.metadata.distribution(todo.pop())
        if dist.metadata["Name"].lower() in seen:
            continue
        seen.add(dist.metadata["Name"].lower())
        for req in map(Requirement, dist.requires or []):
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
        where = Path(dist.locate_file(""))
        for top in {f.parts[0] for f in dist.files} - {"..", "__pycache__"}:
            if not top.endswith(".pth") and not (folder / top).exists():
                (folder / top).symlink_to(where / top)
    site, = (venv / "lib").glob("python3*/site-packages")
    (site / "torch-alone.pth").write_text(f"{folder}\n")


def test_a_fresh_environment_with_only_the_engine_trains_and_reshards(tmp_path):
    venv = tmp_path / "venv"
    py = venv / "bin" / "python"
    run = lambda *cmd, **kw: _checked(subprocess.run(cmd, capture_output=True, text=True,  # noqa: E731
                                                     timeout=600, **kw))
    run(sys.executable, "-m", "venv", str(venv))
    _lend_torch(venv, tmp_path / "torch-alone")
    src = tmp_path / "src"                      # (a copy: building in the repository leaves build/)
    shutil.copytree(ROOT / "minishard", src / "minishard",
                    ignore=shutil.ignore_patterns("__pycache__", "course", "viz"))
    for f in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / f, src / f)
    run(str(py), "-m", "pip", "install", "-q", "--no-compile", str(src))     # + the engine's dependencies
    installed = {line.split("==")[0].split(" @ ")[0].lower() for line in
                 run(str(py), "-m", "pip", "freeze").stdout.splitlines()}
    assert "minishard" in installed and {"numpy", "safetensors"} <= installed
    assert not installed & {"jupyterlab", "plotly", "ipywidgets", "anywidget", "ipython", "nbformat"}
    (tmp_path / "task.py").write_text(TASK)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    out = run(str(py), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
              str(tmp_path / "task.py"), str(tmp_path), "train", cwd=tmp_path, env=env).stdout
    # (lines of different ranks may interleave in the output)
    assert len(re.findall(r"rank \d (?:ddp|zero2|fsdp) wire \d+", out)) == 2 * 3, out
    # destroy_process_group ended the group: none of gloo's threads is left to run into the
    # interpreter's shutdown (minishard.core.c10d.init_group)
    left = re.findall(r"rank \d threads: (\d+) before the group, (\d+) after it", out)
    assert len(left) == 2 and all(a == b for a, b in left), out
    out = run(str(py), str(tmp_path / "task.py"), str(tmp_path), "resume", cwd=tmp_path, env=env).stdout
    assert "one process resumed at step 2" in out, out
