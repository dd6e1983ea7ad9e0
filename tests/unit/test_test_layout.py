"""The test tree's layout: pytest imports the test files of unit/ and integration/ (no __init__.py) by
their base name, so two files of one name in those folders stop the whole run at collection, and the fast
tier (unit + sim) does not collect integration/ to see it."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_test_files_outside_packages_have_unique_names() -> None:
    names = Counter(
        path.name for path in TESTS.rglob("test_*.py") if not (path.parent / "__init__.py").exists()
    )
    assert not [name for name, count in names.items() if count > 1], names.most_common(3)
