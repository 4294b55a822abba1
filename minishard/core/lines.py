"""Where a line of a file stops being what its reader reads: the words every reader of a trace
or a dump names a damaged line with (``trace.py``, the doctor's ``records.py``)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator


def json_problem(e: json.JSONDecodeError) -> str:
    """``Unterminated string starting at column 147`` of a one-line document: the decoder's words
    end in "at", its position follows (its ``str()`` says "at: line 1 column 147 (char 146)";
    counted in characters, a line's newline is no line 2)."""
    return f"{e.msg.removesuffix(' at')} at column {e.pos + 1}"


def not_utf8(e: UnicodeDecodeError, text: bytes) -> tuple[int, str]:
    """Where ``text`` (a file's bytes, or one line's) stops being UTF-8: the line (1 for one
    line), and ``byte 0xff at column 67`` (counted in bytes from the line's start)."""
    line_start = text.rfind(b"\n", 0, e.start) + 1
    return (text.count(b"\n", 0, e.start) + 1,
            f"byte 0x{text[e.start]:02x} at column {e.start - line_start + 1}")


def numbered_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """A file's lines as bytes, numbered from 1: each reader decodes them, strictly or not."""
    with open(path, "rb") as f:
        yield from enumerate(f, 1)
