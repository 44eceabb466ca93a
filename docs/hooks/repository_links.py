"""MkDocs hooks (mkdocs.yml ``hooks:``): links that leave docs/ point at the repository on the site.

A page may link a file beside the docs, as ``../CONTRIBUTING.md`` or ``../bench/README.md#model-zoo``; on
GitHub that works, on the site the file is not there. Such links are rewritten to ``repo_url``'s copy of the
file, anchor kept; ``tests/test_docs.py`` checks that the file and the anchor exist. Links inside docs/ are
left to MkDocs, which checks them (``--strict``).
"""

from __future__ import annotations

import posixpath
import re
from typing import Any

LINK = re.compile(r"\]\((?P<target>[^)#\s]+)(?P<anchor>#[^)\s]*)?\)")


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Rewrite every relative link that resolves outside docs/ to the file's URL in the repository."""
    repository = config["repo_url"].rstrip("/") + "/blob/main/"
    folder = posixpath.dirname(page.file.src_uri)

    def rewrite(match: re.Match[str]) -> str:
        target = match["target"]
        if re.match(r"^[a-z]+:", target):
            return match[0]
        resolved = posixpath.normpath(posixpath.join("docs", folder, target))
        if resolved.startswith("docs/"):
            return match[0]
        return f"]({repository}{resolved}{match['anchor'] or ''})"

    return LINK.sub(rewrite, markdown)
