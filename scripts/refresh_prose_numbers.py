"""After re-executing notebooks: copy each named figure's new text into the written course.

A measured number in ``tutorial/`` and ``tutorial/zh/`` is a link that names a figure its notebook
recorded (``[2.53×](../notebooks/05-zero3.ipynb#nano-cpu-ratio)``, ``minishard.course.glue``).
When a notebook is re-executed its timings move and the links' texts go stale
(``tests/test_prose_numbers.py`` fails). This rewrites every link's text to the text its notebook
recorded under that name, in both editions, and prints each change.

    python scripts/refresh_prose_numbers.py              # rewrite tutorial/*.md and tutorial/zh/*.md
    python scripts/refresh_prose_numbers.py --dry-run    # only say what would change
    python scripts/refresh_prose_numbers.py --only 05 06 # pages whose name starts with these

Read each change it prints: a number that moved may need a sentence that says something else
("slower", "within the earlier runs' range"). A link that names no recorded figure is reported,
never guessed.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
from minishard.course.glue import states_a_figure  # noqa: E402
from test_prose_numbers import LINK, PAGES, recorded  # noqa: E402  (one definition of a link)


def refresh(md: Path, dry_run: bool) -> tuple[int, list[str]]:
    text, changed, unresolved = md.read_text(encoding="utf-8"), 0, []

    def fix(m):
        nonlocal changed
        label, notebook, name = m.group(1), m.group(2), m.group(3)
        if not states_a_figure(label):
            return m.group(0)
        fig = recorded(notebook).get(name or "")
        if fig is None:
            unresolved.append(f"[{label}](…{notebook}#{name or ''}): no such recorded figure")
            return m.group(0)
        if fig.text == label:
            return m.group(0)
        changed += 1
        print(f"  {md.relative_to(ROOT) if md.is_relative_to(ROOT) else md}: #{name}: {label!r} -> {fig.text!r}")
        return m.group(0)[:m.start(1) - m.start(0)] + fig.text + m.group(0)[m.end(1) - m.start(0):]

    new = LINK.sub(fix, text)
    if changed and not dry_run:
        md.write_text(new, encoding="utf-8")
    return changed, unresolved


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--only", nargs="*", default=None, help="chapters whose file name starts with these")
    args = ap.parse_args(argv)
    total, missing = 0, []
    for md in PAGES:
        if args.only is not None and not md.name.startswith(tuple(args.only)):
            continue
        n, bad = refresh(md, args.dry_run)
        total += n
        missing += [f"{md.relative_to(ROOT)}: {b}" for b in bad]
    print(f"{total} link(s) {'would change' if args.dry_run else 'rewritten'}")
    for b in missing:
        print("  unresolved:", b)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
