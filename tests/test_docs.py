"""The guides' code is the repository's code: every ```python and ```yaml block of a guide in docs/
appears verbatim in a repository file (Python in plfl/ or tests/, YAML in configs/)."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = {"python": ["plfl/**/*.py", "tests/*.py"], "yaml": ["configs/*.yaml"]}
FENCE = re.compile(r"^```(?P<language>\w+)\n(?P<block>.*?)^```$", re.MULTILINE | re.DOTALL)


def code_blocks(guide: Path) -> list[tuple[str, str, str]]:
    """(language, block, name) of each checked block; the name is the guide, line and first line."""
    text = guide.read_text()
    blocks = []
    for m in FENCE.finditer(text):
        if m["language"] in SOURCES:
            line = text.count("\n", 0, m.start()) + 1
            blocks.append((m["language"], m["block"], f"{guide.name}:{line} {m['block'].splitlines()[0].strip()}"))
    return blocks


BLOCKS = [block for guide in sorted((ROOT / "docs").glob("*.md")) for block in code_blocks(guide)]


def test_the_method_guide_has_checked_blocks():
    names = [name for _, _, name in BLOCKS if name.startswith("writing-a-method.md")]
    assert len(names) >= 5, names  # schema, registry, update, class, test (and the config)


@pytest.mark.parametrize("language, block, name", BLOCKS, ids=[name for _, _, name in BLOCKS])
def test_block_appears_verbatim_in_the_repository(language, block, name):
    files = [path for pattern in SOURCES[language] for path in sorted(ROOT.glob(pattern))]
    assert any(block in path.read_text() for path in files), (
        f"The {language} block at {name!r} is not in any of {', '.join(SOURCES[language])}: copy it again "
        "from the file it shows, or fix the file."
    )
