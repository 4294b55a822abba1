"""After re-executing notebooks: carry the prose's measured numbers over to the new outputs.

Each measured number in the written course is a link to the notebook that printed it
(``tests/test_prose_numbers.py``). When a notebook is re-executed, timings move and those links
go stale. For every stale link this finds where its numbers stood in the notebook as committed
(``--base``, default HEAD): the cell, and which number of that cell's output each one was. It
takes the number at the same place in the new output, but only when the words around it are
the same (so a cell whose output changed shape is reported, never guessed), and rewrites the link.

    python scripts/refresh_prose_numbers.py              # rewrite tutorial/*.md and tutorial/zh/*.md
    python scripts/refresh_prose_numbers.py --dry-run    # only say what would change

Read each change it prints: a number that moved may need a sentence that says something else.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from test_prose_numbers import MEASURED, NUMBER, printed  # noqa: E402  (one definition of a link)


def cell_texts(nb: dict) -> list[str]:
    """The text of every cell's outputs, by cell index (empty for cells without output)."""
    out = []
    for cell in nb["cells"]:
        text = []
        for o in cell.get("outputs", []):
            if o.get("output_type") == "stream":
                text.append("".join(o["text"]) if isinstance(o["text"], list) else o["text"])
            elif "data" in o:
                t = o["data"].get("text/plain", "")
                text.append("".join(t) if isinstance(t, list) else t)
        out.append("\n".join(text))
    return out


def tokens(text: str) -> list[tuple[str, str]]:
    """(number, the words just before it) for every number of an output, in order."""
    out, last = [], 0
    for m in NUMBER.finditer(text):
        out.append((m.group(0), text[max(last, m.start() - 24):m.start()]))
        last = m.end()
    return out


def locate(number: str, old_cells: list[str], new_cells: list[str], hint: int | None) -> tuple[int, str] | None:
    """Where ``number`` stood in the old outputs (preferring cell ``hint``), and the number at the
    same place in the new outputs when the words before it are unchanged."""
    order = ([hint] if hint is not None else []) + [i for i in range(len(old_cells)) if i != hint]
    for i in order:
        if i >= len(new_cells):
            continue
        old, new = tokens(old_cells[i]), tokens(new_cells[i])
        for k, (n, before) in enumerate(old):
            if n == number and k < len(new) and new[k][1] == before:
                return i, new[k][0]
    return None


def refresh(md: Path, base: str, dry_run: bool) -> tuple[int, list[str]]:
    text, changed, unresolved = md.read_text(), 0, []
    old_nb, new_nb = {}, {}

    def fix(m: re.Match) -> str:
        nonlocal changed
        label, name = m.group(1), m.group(2)
        if ".ipynb" in label:
            return m.group(0)
        if name not in new_nb:
            path = ROOT / "notebooks" / f"{name}.ipynb"
            new_nb[name] = cell_texts(json.loads(path.read_text()))
            committed = subprocess.run(["git", "show", f"{base}:notebooks/{name}.ipynb"], cwd=ROOT,
                                       capture_output=True, text=True)
            old_nb[name] = cell_texts(json.loads(committed.stdout)) if committed.returncode == 0 else []
        # Follow the number's place even when it is still printed somewhere else: a timing
        # that happens to reappear in another column is a coincidence, not the same number.
        numbers = NUMBER.findall(label)
        current = any(all(printed(n, c) for n in numbers) for c in new_nb[name])
        hint = next((i for i, c in enumerate(old_nb[name]) if all(printed(n, c) for n in numbers)), None)
        new_label, pos = "", 0
        for nm in NUMBER.finditer(label):
            found = locate(nm.group(0), old_nb[name], new_nb[name], hint) if hint is not None else None
            if found is None:
                if not current:
                    unresolved.append(f"{md.relative_to(ROOT)}: [{label}]({name}) — {nm.group(0)} not found")
                return m.group(0)
            new_label += label[pos:nm.start()] + found[1]
            pos = nm.end()
        new_label += label[pos:]
        if new_label == label:
            return m.group(0)
        changed += 1
        print(f"{md.relative_to(ROOT)}: [{label}] -> [{new_label}]  ({name})")
        return m.group(0).replace(f"[{label}]", f"[{new_label}]", 1)

    new_text = MEASURED.sub(fix, text)
    if changed and not dry_run:
        md.write_text(new_text)
    return changed, unresolved


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="HEAD", help="the commit whose executed notebooks the prose matched")
    ap.add_argument("--dry-run", action="store_true", help="print the changes, write nothing")
    args = ap.parse_args()
    chapters = sorted((ROOT / "tutorial").glob("[0-9][0-9]-*.md")) + \
        sorted((ROOT / "tutorial" / "zh").glob("*.md"))
    total, unresolved = 0, []
    for md in chapters:
        n, u = refresh(md, args.base, args.dry_run)
        total, unresolved = total + n, unresolved + u
    print(f"{total} links {'would change' if args.dry_run else 'changed'}; {len(unresolved)} to fix by hand")
    for u in unresolved:
        print("  " + u)
    return 1 if unresolved else 0


if __name__ == "__main__":
    sys.exit(main())
