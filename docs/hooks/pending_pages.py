"""MkDocs hooks (mkdocs.yml ``hooks:``): pages that other branches of this wave write, until they land.

``PENDING`` lists pages that the README, docs/index.md and the nav already name but that are written on
another branch (the lead merges them). While such a page is absent, the build leaves it out of the nav and
turns links to it into plain text, and ``tests/test_docs.py`` accepts links to it; once it exists, it is
checked like any page. Empty ``PENDING`` once they have landed: then nothing is tolerated.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

PENDING: tuple[str, ...] = ()
DOCS = Path(__file__).resolve().parents[1]


def absent() -> set[str]:
    """The pending pages (relative to docs/) that are not there yet."""
    return {page for page in PENDING if not (DOCS / page).exists()}


def _prune(nav: list[Any], missing: set[str]) -> list[Any]:
    kept: list[Any] = []
    for entry in nav:
        if isinstance(entry, dict):
            ((title, value),) = entry.items()
            if isinstance(value, list):
                kept.append({title: _prune(value, missing)})
            elif value not in missing:
                kept.append(entry)
        elif entry not in missing:
            kept.append(entry)
    return kept


def on_config(config: Any) -> Any:
    """Leave the absent pending pages out of the nav."""
    missing = absent()
    if missing and config["nav"]:
        config["nav"] = _prune(config["nav"], missing)
    return config


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Turn links to an absent pending page into their text."""
    for name in absent():
        markdown = re.sub(rf"\[([^\]]*)\]\({re.escape(name)}(#[^)]*)?\)", r"\1", markdown)
    return markdown
