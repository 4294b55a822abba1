"""Point docs/architecture.md's "FSDP lifecycle" table at the current line of each function it
names (tests/test_fsdp.py checks it): for every `minishard/...py:N` in a row, the first
`def NAME(` of a function the row names, searching from N's old neighbourhood outward.

    python scripts/refresh_lifecycle_lines.py
"""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    doc_path = ROOT / "docs" / "architecture.md"
    doc = doc_path.read_text()
    start = doc.index("### FSDP lifecycle")
    head, table, *rest = doc[start:].split("\n\n", 2)[0], *doc[start:].split("\n\n")[1:2], None
    new_rows = []
    for row in table.splitlines():
        names = re.findall(r"`(?:\w+\.)?(\w+)`", row)
        used: set[str] = set()

        def fix(m):
            """The nearest def of a name this row has not pointed at yet."""
            path, n = m.group(1), int(m.group(2))
            lines = (ROOT / path).read_text().splitlines()
            found = [(i + 1, d.group(1)) for i, line in enumerate(lines)
                     if (d := re.match(r"\s*def (\w+)\(", line)) and d.group(1) in names
                     and d.group(1) not in used]
            if not found:
                return m.group(0)
            best, name = min(found, key=lambda f: abs(f[0] - n))
            used.add(name)
            return f"`{path}:{best}`"

        new_rows.append(re.sub(r"`(minishard/[\w/]+\.py):(\d+)`", fix, row))
    doc = doc.replace(table, "\n".join(new_rows), 1)
    doc_path.write_text(doc)


if __name__ == "__main__":
    main()
