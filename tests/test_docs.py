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
    }
    assert expected <= {p.name for p in DOCS.glob("*.md")}
    assert len(CHAINS) >= 8


def test_every_fence_names_its_language():
    for path in DOC_FILES:
        for block in parse_blocks(path):
            assert block.lang, (
                f"{path.name}:{block.line}: give the fence a language (python, text, bash, yaml)"
            )


def test_relative_links_point_to_existing_files():
    link = re.compile(r"\]\(([^)#\s]+)(#[^)]*)?\)")
    for path in DOC_FILES:
        text = path.read_text(encoding="utf-8")
        for target, _ in link.findall(text):
            if re.match(r"^[a-z]+://", target) or target.startswith("mailto:"):
                continue
            assert (path.parent / target).exists(), f"{path.name}: broken link to {target}"


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
    from lightning_dp.cli import main

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
