"""Point the lifecycle table's file:line references (docs/architecture.md) at the functions each
row names: `minishard/x.py:{name}` placeholders and stale line numbers alike are set to the
line of `def name(` in that file, the name taken from the row in the order the row names them."""
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"


def def_line(path: str, name: str) -> int:
    for i, line in enumerate((ROOT / path).read_text().splitlines(), 1):
        if re.match(rf"\s*def {re.escape(name)}\(", line):
            return i
    sys.exit(f"no def {name} in {path}")


def fix(row: str) -> str:
    def one(m):
        path, ref = m.group(1), m.group(2)
        if not ref.isdigit():
            return f"`{path}:{def_line(path, ref.strip('{}'))}`"
        code = (ROOT / path).read_text().splitlines()[int(ref) - 1]
        if re.match(r"\s*def (\w+)\(", code):
            name = re.match(r"\s*def (\w+)\(", code).group(1)
            if name in row:
                return m.group(0)
        sys.exit(f"stale {path}:{ref}: name it as {{function}} in the row and rerun")
    return re.sub(r"`(minishard/[\w/]+\.py):(\{\w+\}|\d+)`", one, row)


text = DOC.read_text()
DOC.write_text("\n".join(fix(r) if r.startswith("| ") else r for r in text.split("\n")))
