"""The documentation runs: every ```python block in docs/*.md and CONTRIBUTING.md is executed.

Conventions for doc authors:

* each ```python block runs in a fresh namespace, with the working directory in a temporary folder;
* a block preceded by ``<!-- docs-test: continue -->`` runs in the namespace of the previous python
  block of the same file (for walkthroughs that build on an earlier block);
* blocks that must not run use ```text, ```bash or ```yaml; every fence names its language;
* every ```text block in docs/troubleshooting.md quotes a message from the code, with ``…`` standing
  for the parts filled in at run time; the test checks that each quoted fragment still exists.
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import io
import json
import re
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
DOC_FILES = [*sorted(DOCS.glob("*.md")), ROOT / "CONTRIBUTING.md"]
CONTINUE = "<!-- docs-test: continue -->"
FENCE = re.compile(r"^(\s*)(`{3,})(.*)$")


@dataclass
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    marker: str  # the last non-blank line before the fence ("" if none)


@dataclass
class Chain:
    """A python block plus the ``continue`` blocks after it: one namespace."""

    blocks: list[Block] = field(default_factory=list)

    @property
    def id(self) -> str:
        first = self.blocks[0]
        return f"{first.path.relative_to(ROOT)}:{first.line}"


def parse_blocks(path: Path) -> list[Block]:
    """Every fenced code block of a Markdown file, with its language and the line just before it."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    i = 0
    previous = ""
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            if lines[i].strip():
                previous = lines[i].strip()
            i += 1
            continue
        indent, ticks, info = match.groups()
        start = i
        body: list[str] = []
        i += 1
        while i < len(lines) and not re.match(rf"^\s*{ticks}\s*$", lines[i]):
            body.append(lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i])
            i += 1
        if i == len(lines):
            raise AssertionError(f"{path.name}:{start + 1}: code fence is never closed")
        blocks.append(Block(path, start + 1, info.strip().split(" ")[0], "\n".join(body) + "\n", previous))
        previous = ""
        i += 1
    return blocks


def python_chains() -> list[Chain]:
    chains: list[Chain] = []
    for path in DOC_FILES:
        current: Chain | None = None
        for block in parse_blocks(path):
            if block.lang != "python":
                continue
            if block.marker == CONTINUE:
                assert current is not None, (
                    f"{path.name}:{block.line}: 'continue' with no python block before"
                )
                current.blocks.append(block)
            else:
                current = Chain([block])
                chains.append(current)
    return chains


CHAINS = python_chains()


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(ROOT))  # `import recipes` as from the repository root
    return tmp_path


@pytest.mark.parametrize("chain", CHAINS, ids=[c.id for c in CHAINS])
def test_python_block_runs(chain: Chain, in_tmp):
    namespace: dict[str, object] = {"__name__": "__docs__"}
    out = io.StringIO()
    with warnings.catch_warnings(), contextlib.redirect_stdout(out):
        warnings.simplefilter("ignore")
        for block in chain.blocks:
            # Pad with blank lines so tracebacks point at the line in the Markdown file.
            source = "\n" * block.line + block.code
            exec(compile(source, str(block.path), "exec"), namespace)


def test_docs_exist_and_have_runnable_examples():
    expected = {
        "index.md",
        "getting-started.md",
        "choosing-epsilon-delta.md",
        "mechanisms.md",
        "multi-gpu.md",
        "checkpoints.md",
        "privacy-report.md",
        "guarantees.md",
        "troubleshooting.md",
        "results.md",
    }
    assert expected <= {p.name for p in DOCS.glob("*.md")}
    assert len(CHAINS) >= 8


def test_every_fence_names_its_language():
    for path in DOC_FILES:
        for block in parse_blocks(path):
            assert block.lang, (
                f"{path.name}:{block.line}: give the fence a language (python, text, bash, yaml)"
            )


# -- links: every relative link in every Markdown file of the repository, anchors included ----------------------

SKIP_DIRS = {".venv", "site", "build", "dist", "node_modules", "lightning_logs", "runs"}
MARKDOWN_FILES = sorted(
    p
    for p in ROOT.rglob("*.md")
    if not any(part in SKIP_DIRS or part.startswith(".") for part in p.relative_to(ROOT).parts[:-1])
)
LINK = re.compile(r"(?<!!)\[(?:[^\[\]]|\[[^\]]*\])*\]\((?P<target>[^)\s]*)\)")


def _pending_pages() -> set[Path]:
    """The pages of docs/hooks/pending_pages.py's PENDING that are absent (written on another branch)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("pending_pages", DOCS / "hooks" / "pending_pages.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return {(DOCS / page).resolve() for page in module.absent()}


def github_slug(heading: str) -> str:
    """The anchor GitHub (and the site, through pymdownx.slugs) gives a heading: lower case, punctuation
    dropped, each space a hyphen."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor a Markdown file defines: its headings (outside code blocks, duplicates numbered as
    GitHub does) and explicit ``id=``/``name=`` HTML anchors."""
    found: set[str] = set()
    counts: dict[str, int] = {}
    fence = ""
    for line in path.read_text(encoding="utf-8").splitlines():
        opening = re.match(r"^\s*(`{3,}|~{3,})", line)
        if opening:
            ticks = opening.group(1)
            if not fence:
                fence = ticks
            elif ticks.startswith(fence) and not line.strip()[len(ticks) :].strip():
                fence = ""
            continue
        if fence:
            continue
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading:
            slug = github_slug(heading.group(1))
            n = counts.get(slug, 0)
            counts[slug] = n + 1
            found.add(slug if n == 0 else f"{slug}-{n}")
        found.update(re.findall(r"""(?:id|name)=["']([^"']+)["']""", line))
    return found


def broken_links(path: Path, pending: set[Path]) -> list[str]:
    """The relative links of one file whose target file or anchor does not exist."""
    broken = []
    text = path.read_text(encoding="utf-8")
    text = re.sub(r"^\s*(`{3,}).*?^\s*\1\s*$", "", text, flags=re.M | re.S)  # no links in code blocks
    text = re.sub(r"(`+)[^`\n]*?\1", "", text)  # nor in code spans
    for match in LINK.finditer(text):
        target = match["target"].strip("<>")
        if not target or re.match(r"^[a-z][a-z0-9+.-]*:", target):
            continue  # an absolute URL (https:, mailto:)
        file, _, anchor = target.partition("#")
        resolved = (path.parent / file).resolve() if file else path.resolve()
        if resolved in pending:
            continue
        if not resolved.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target} (no heading with that anchor)")
    return broken


def test_every_relative_link_in_every_markdown_file_resolves():
    """README, CONTRIBUTING, CHANGELOG, docs/ (API pages included), bench/README: every relative link's
    file exists and so does its #anchor. The pages another branch of this wave writes
    (docs/hooks/pending_pages.py) are accepted only while they are absent."""
    pending = _pending_pages()
    assert {p.relative_to(ROOT).as_posix() for p in MARKDOWN_FILES} >= {
        "README.md", "CONTRIBUTING.md", "CHANGELOG.md", "docs/index.md", "docs/api/index.md", "bench/README.md",
    }  # fmt: skip
    broken = {
        path.relative_to(ROOT).as_posix(): links
        for path in MARKDOWN_FILES
        if (links := broken_links(path, pending))
    }
    assert not broken, f"broken links: {broken}"


def test_link_checker_catches_a_broken_file_and_a_broken_anchor(tmp_path):
    (tmp_path / "a.md").write_text("# Title\n\n## The `x.py`: what (issue #1)\n\n## Same\n\n## Same\n")
    (tmp_path / "b.md").write_text(
        "[ok](a.md#the-xpy-what-issue-1) [ok](a.md#same-1) [ok](#local) [bad](a.md#nope) [bad](c.md)\n"
        "## Local\n```text\n[not a link](c.md)\n```\n[web](https://example.org/x.md) `[code](c.md)`\n"
    )
    assert broken_links(tmp_path / "b.md", set()) == [
        "a.md#nope (no heading with that anchor)",
        "c.md (no such file)",
    ]
    assert broken_links(tmp_path / "b.md", {(tmp_path / "c.md").resolve()}) == [
        "a.md#nope (no heading with that anchor)"
    ]


# -- the documentation site (mkdocs.yml) -------------------------------------------------------------------------


def _mkdocs_config() -> dict:
    import yaml

    text = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    return yaml.load(text, Loader=yaml.BaseLoader)  # BaseLoader: the !!python tags stay strings


def _nav_pages(nav) -> list[str]:
    pages: list[str] = []
    for entry in nav:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages.extend(_nav_pages(value) if isinstance(value, list) else [value])
    return pages


def test_site_nav_lists_every_page_and_only_pages_that_exist():
    nav = _nav_pages(_mkdocs_config()["nav"])
    assert len(nav) == len(set(nav)), "a page is twice in mkdocs.yml's nav"
    pending = _pending_pages()
    missing = [page for page in nav if not (DOCS / page).exists() and (DOCS / page).resolve() not in pending]
    assert not missing, f"mkdocs.yml's nav names pages that do not exist: {missing}"
    pages = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md") if "hooks" not in p.parts}
    assert pages <= set(nav), f"pages missing from mkdocs.yml's nav: {sorted(pages - set(nav))}"


def test_api_reference_documents_every_public_name():
    """Every name of lightning_dp.__all__ and recipes.__all__ has a ``::: module.name`` block (or its
    module's) on a page of docs/api/, and every block names something that exists."""
    import importlib

    import lightning_dp
    import recipes

    def resolve(path: str) -> object:
        try:
            return importlib.import_module(path)
        except ModuleNotFoundError:
            module_name, _, attribute = path.rpartition(".")
            module = importlib.import_module(module_name)
            assert hasattr(module, attribute), f"docs/api/: {path} does not exist"
            return getattr(module, attribute)

    blocks = set()
    for page in (DOCS / "api").glob("*.md"):
        blocks |= set(re.findall(r"^::: ([\w.]+)\s*$", page.read_text(encoding="utf-8"), re.M))
    shown = {id(resolve(block)) for block in blocks}
    for package in (lightning_dp, recipes):
        undocumented = [
            name
            for name in package.__all__
            if id(getattr(package, name)) not in shown and package.__name__ not in blocks
        ]
        assert not undocumented, f"not in docs/api/: {package.__name__}.{undocumented}"


LIGHTNING_ARGUMENTS = {
    "accelerator",
    "checkpoint_io",
    "precision_plugin",
    "parallel_devices",
    "cluster_environment",
}
"""Lightning's own strategy arguments, passed through unchanged."""
SHARES_PRIVACY_OPTIONS = {"DPStrategy", "DPDDPStrategy", "DPFSDPStrategy"}
"""Strategies whose privacy options are PrivacyConfig's fields, documented once there (their signatures are
generated from it); the deprecated keywords they still take are documented by their new form."""


def test_public_api_docstrings_document_every_argument():
    """Each argument of every public class and function of lightning_dp and recipes (a class's
    ``__init__``, a dataclass's fields) has an entry in its docstring (``Args:``/``Attributes:``, or the
    field's own docstring), as mkdocstrings reads it for the API reference."""
    griffe = pytest.importorskip("griffe", reason="griffe comes with the docs extras (make install)")
    import dataclasses

    import lightning_dp
    import recipes

    def documented(obj) -> set[str]:
        names: set[str] = set()
        for holder in (obj, obj.members.get("__init__") if obj.is_class else None):
            if holder is None or holder.docstring is None:
                continue
            for section in holder.docstring.parsed:
                if section.kind.value in ("parameters", "attributes", "other parameters"):
                    names |= {item.name.lstrip("*") for item in section.value}
        if obj.is_class:  # a dataclass field with its own docstring
            names |= {n for n, m in obj.members.items() if m.is_attribute and m.docstring is not None}
        return names

    missing: dict[str, list[str]] = {}
    for package in (lightning_dp, recipes):
        loaded = griffe.load(package.__name__, search_paths=[str(ROOT)], docstring_parser="google")

        def griffe_object(value, loaded=loaded, package=package):
            return loaded[f"{value.__module__.removeprefix(package.__name__ + '.')}.{value.__name__}"]

        shared = set()
        if package is lightning_dp:
            from lightning_dp.strategies import deprecated

            shared = documented(griffe_object(lightning_dp.PrivacyConfig)) | set(deprecated.KEYWORDS)
        for name in package.__all__:
            value = getattr(package, name)
            if not (inspect.isclass(value) or inspect.isfunction(value)):
                continue
            if inspect.isclass(value) and issubclass(value, BaseException):
                continue  # raised, not called: its message is its documentation
            if dataclasses.is_dataclass(value):
                arguments = [f.name for f in dataclasses.fields(value)]
            else:
                parameters = inspect.signature(value).parameters.values()
                arguments = [p.name for p in parameters if p.name not in ("self", "cls")]
            known = documented(griffe_object(value)) | LIGHTNING_ARGUMENTS
            if name in SHARES_PRIVACY_OPTIONS:
                known |= shared
            config = getattr(getattr(value, "__init__", None), "config_type", None)
            if (
                config is not None
            ):  # keywords generated from a config's fields (slots.takes_config): documented there
                known |= documented(griffe_object(config))
            if absent := [a for a in arguments if a not in known]:
                missing[f"{package.__name__}.{name}"] = absent
    assert not missing, f"arguments with no docstring entry (say what, default, unit): {missing}"


def test_index_lists_every_page():
    index = (DOCS / "index.md").read_text(encoding="utf-8")
    for page in DOCS.glob("*.md"):
        if page.name != "index.md":
            assert f"({page.name})" in index, f"docs/index.md does not link {page.name}"


# -- the docs agree with the code ---------------------------------------------------------------------


def _source_strings() -> list[str]:
    """Every string literal in lightning_dp, f-string placeholders rendered as '…', whitespace squashed."""
    strings = []
    for path in (ROOT / "lightning_dp").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.JoinedStr):
                parts = [
                    v.value if isinstance(v, ast.Constant) and isinstance(v.value, str) else "…"
                    for v in node.values
                ]
                strings.append("".join(parts))
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                strings.append(node.value)
    return [" ".join(s.split()) for s in strings]


def test_troubleshooting_quotes_the_real_messages():
    sources = _source_strings()
    quoted = [b for b in parse_blocks(DOCS / "troubleshooting.md") if b.lang == "text"]
    assert len(quoted) >= 15
    for block in quoted:
        message = " ".join(block.code.split())
        fragments = [f.strip() for f in message.split("…") if len(f.strip()) >= 12]
        assert fragments, f"troubleshooting.md:{block.line}: nothing to check in {message!r}"
        for fragment in fragments:
            assert any(fragment in s for s in sources), (
                f"troubleshooting.md:{block.line}: {fragment!r} is not (or no longer) in lightning_dp/"
            )


def test_mechanisms_page_documents_every_strategy_argument():
    from lightning_dp import DPStrategy

    page = (DOCS / "mechanisms.md").read_text(encoding="utf-8")
    documented = set(re.findall(r"^\| `(\w+)` \|", page, re.M))
    arguments = set(inspect.signature(DPStrategy.__init__).parameters) - {"self"}
    assert arguments <= documented, f"undocumented DPStrategy arguments: {sorted(arguments - documented)}"


def test_report_page_documents_every_field(in_tmp):
    from conftest import TinyModule, make_trainer

    from lightning_dp import DPStrategy

    trainer = make_trainer(DPStrategy(noise_multiplier=1.0, seed=0), in_tmp, max_steps=2)
    module = TinyModule(n=64, batch_size=16)
    trainer.fit(module)
    trainer.test(module, verbose=False)
    report = json.loads((in_tmp / "privacy_report.json").read_text())
    page = (DOCS / "privacy-report.md").read_text(encoding="utf-8")
    documented = set(re.findall(r"^\| `(\w+)` \|", page, re.M))
    assert set(report) == documented, (set(report) - documented, documented - set(report))


def test_cli_config_in_getting_started_trains(in_tmp):
    """The YAML a user copies from getting-started.md runs under `lightning-dp fit` (1 epoch here)."""
    from lightning_dp.commands.cli import main

    blocks = parse_blocks(DOCS / "getting-started.md")
    configs = [b for b in blocks if b.lang == "yaml" and b.marker == "<!-- cli-config -->"]
    assert len(configs) == 1
    (in_tmp / "config.yaml").write_text(configs[0].code)
    out = io.StringIO()
    with warnings.catch_warnings(), contextlib.redirect_stdout(out):
        warnings.simplefilter("ignore")
        main(["fit", "--config", "config.yaml", "--trainer.max_epochs", "1",
              "--trainer.enable_progress_bar", "false"])  # fmt: skip
    assert re.search(
        r"lightning-dp: ε = [0-9.]+ \(δ = 1e-05, rdp, \d+ steps\), test accuracy", out.getvalue()
    )


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
