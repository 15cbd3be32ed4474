"""The Python in the README and docs/ is excerpts of examples/ (which CI runs): every
```python block whose first line is ``# from examples/<file>`` must appear in that file, line
for line (the excerpt may be dedented as a whole), and the README's Python blocks are all such
excerpts."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MARKER = re.compile(r"^# from (examples/\S+)$")


def excerpts(doc: Path) -> list[tuple[str, list[str]]]:
    out = []
    for block in re.findall(r"^```python\n(.*?)^```", doc.read_text(), re.M | re.S):
        first, _, body = block.partition("\n")
        match = MARKER.match(first)
        if match:
            out.append((match.group(1), textwrap.dedent(body).rstrip("\n").splitlines()))
    return out


def found_in(lines: list[str], source: str) -> bool:
    """``lines`` are a contiguous run of ``source``'s lines, all with the same extra indent."""
    text = source.splitlines()
    for start in range(len(text) - len(lines) + 1):
        window = text[start:start + len(lines)]
        if textwrap.dedent("\n".join(window)).splitlines() == lines:
            return True
    return False


def test_every_python_excerpt_in_the_docs_is_in_its_example():
    checked = 0
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for path, lines in excerpts(doc):
            source = (ROOT / path).read_text()
            assert lines and found_in(lines, source), (
                f"{doc.name}: the excerpt of {path} starting {lines[:1]} is not in that file; "
                f"copy it again from the example")
            checked += 1
    assert checked >= 9     # the README's four, docs/producers.md sections 9 and 10, docs/trainer.md


def test_the_readme_shows_no_python_that_is_not_an_example_excerpt():
    blocks = re.findall(r"^```python\n(.*?)^```", (ROOT / "README.md").read_text(), re.M | re.S)
    assert blocks and all(MARKER.match(block.partition("\n")[0]) for block in blocks)


def test_the_checker_catches_an_edited_excerpt():
    source = "def f():\n    a = 1\n    b = 2\n    return a + b\n"
    assert found_in(["a = 1", "b = 2"], source)
    assert not found_in(["a = 1", "b = 3"], source)
    assert not found_in(["a = 1", "return a + b"], source)      # not contiguous
