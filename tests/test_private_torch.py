"""Every private PyTorch name minishard uses is listed in one adapter, with why, and exists.

The adapters, one per kind: ``core/c10d.py`` (process groups), ``core/autograd_private.py``
(autograd and tensor internals the strategies use, as PyTorch's own DDP and FSDP2 do),
``instruments/watching/fsdp2.py`` and ``instruments/watching/ddp.py`` (what the watch reaches in
PyTorch's wrappers). Each has ``PRIVATE`` (name -> why no public API serves) and ``CHECKED_ON``.
A torch upgrade that drops or renames one fails here, naming it, rather than deep in a run; a
private name used anywhere else fails the scan, naming the file and line."""
import ast
import importlib
from pathlib import Path

import pytest

import rank_tasks
from minishard.core import autograd_private, c10d
from minishard.instruments.watching import ddp, fsdp2

ADAPTERS = {"minishard/core/c10d.py": c10d, "minishard/core/autograd_private.py": autograd_private,
            "minishard/instruments/watching/fsdp2.py": fsdp2,
            "minishard/instruments/watching/ddp.py": ddp}
ROOT = Path(__file__).resolve().parent.parent
ALL = {name: path for path, mod in ADAPTERS.items() for name in mod.PRIVATE}


def resolve(name: str):
    """``a.b.C.d``: the longest importable module prefix, then attributes (``#x`` left out)."""
    parts = name.partition("#")[0].split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attribute in parts[i:]:
            obj = getattr(obj, attribute)
        return obj
    raise ImportError(name)


@pytest.mark.parametrize("path", sorted(ADAPTERS))
def test_each_adapter_lists_its_names_with_why_and_the_versions(path):
    mod = ADAPTERS[path]
    assert mod.CHECKED_ON and all(isinstance(v, str) for v in mod.CHECKED_ON)
    assert mod.PRIVATE and all(len(why.split()) >= 3 for why in mod.PRIVATE.values()), path


def test_every_listed_name_is_in_this_torch():
    missing = []
    for name, path in ALL.items():
        try:
            resolve(name)
        except (ImportError, AttributeError) as e:
            missing.append(f"{name} ({path}): {type(e).__name__}: {e}")
    assert not missing, "private torch names gone from this torch:\n" + "\n".join(missing)


def test_every_listed_attribute_is_on_a_live_object(pools):
    names = [n for n in ALL if "#" in n]
    (have, _) = pools(2).run(rank_tasks.live_private_attributes, names)
    gone = [f"{n} ({ALL[n]})" for n, ok in have.items() if not ok]
    assert not gone, "attributes torch no longer sets:\n" + "\n".join(gone)


def _private_uses(source: str, listed_attributes: set[str]):
    """(line, text) of each private torch name in a module: a ``torch...._x`` chain, an import
    from a private torch module or of a private name, or an attribute the adapters list."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
            private = [p for p in node.module.split(".") if p.startswith("_")]
            private += [a.name for a in node.names if a.name.startswith("_")]
            if private:
                yield node.lineno, f"from {node.module} import ..."
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("torch") and any(p.startswith("_") for p in a.name.split(".")):
                    yield node.lineno, f"import {a.name}"
        elif isinstance(node, ast.Attribute):
            chain, inner = [node.attr], node.value
            while isinstance(inner, ast.Attribute):
                chain.append(inner.attr)
                inner = inner.value
            rooted = isinstance(inner, ast.Name) and inner.id in ("torch", "dist", "c10d")
            if (rooted and node.attr.startswith("_") and not node.attr.startswith("__")) \
                    or node.attr in listed_attributes:
                yield node.lineno, ".".join([getattr(inner, "id", "?"), *reversed(chain)])
        elif isinstance(node, ast.Constant) and node.value in listed_attributes:
            yield node.lineno, repr(node.value)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module" \
                and node.args and isinstance(node.args[0], ast.Constant) \
                and any(p.startswith("_") for p in str(node.args[0].value).split(".")):
            yield node.lineno, f"import_module({node.args[0].value!r})"


def test_no_private_torch_name_outside_the_adapters():
    listed = {n.partition("#")[0].rsplit(".", 1)[-1] if "#" not in n else n.partition("#")[2]
              for n in ALL}
    listed = {a for a in listed if a.startswith("_") and a != "_dynamo"}
    found = []
    for py in sorted((ROOT / "minishard").rglob("*.py")):
        rel = py.relative_to(ROOT).as_posix()
        if rel in ADAPTERS:
            continue
        found += [f"{rel}:{line}: {text}" for line, text in _private_uses(py.read_text(), listed)]
    assert not found, "private torch names outside the adapters (list them in one):\n" + "\n".join(found)


def test_the_scan_sees_what_it_looks_for():
    """The scan is not blind: each form it looks for, planted in a line, is found."""
    listed = {"_sharded_state"}
    for line in ["x = torch._foreach_norm", "from torch.utils._pytree import tree_map",
                 "import torch._dynamo", "b = dist.distributed_c10d._get_default_group()",
                 "s = pg._sharded_state", "getattr(pg, '_sharded_state')",
                 "importlib.import_module('torch._dynamo')"]:
        assert list(_private_uses(line, listed)), line
    assert not list(_private_uses("y = torch.zeros(3).__class__\nself._x = 1", listed))


def test_a_buffer_refilled_in_place_is_put_back_at_the_version_backward_saved():
    """``set_version_counter``, as an FSDP unit uses it on its all-gather buffer: autograd saved a
    view of the buffer in forward; the buffer is refilled in place (the same values, gathered
    again) and put back at the version it had, and backward accepts it. Without, or at another
    version, backward refuses a tensor "modified by an inplace operation"."""
    import torch

    def refilled(reset: bool) -> torch.Tensor:
        w = torch.ones(4, requires_grad=True)
        buf = torch.arange(8.0)
        loss = (buf[:4] * w).sum()                     # saves a view of the buffer
        version = buf._version
        with torch.no_grad():
            buf.copy_(torch.arange(8.0))
        if reset:
            autograd_private.set_version_counter((buf,), (version,))
            assert buf._version == version
        loss.backward()
        return w.grad

    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        refilled(reset=False)
    assert torch.equal(refilled(reset=True), torch.arange(4.0))
