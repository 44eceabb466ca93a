"""docs/troubleshooting.md has one entry per message, and each refusal names its entry.

The page keeps its groups as level-2 headings; every message is a level-3 heading whose title is a short id
(``accumulate-grad-batches``), which is also its anchor. ``lightning_dp.core.errors.TROUBLESHOOTING`` maps each
id to a fragment of the message that no other message holds, and a ``DPConfigurationError`` ends with the
link to the entry whose fragment comes first in its text. These tests keep the three in step: the page,
the index and the messages the code raises. docs/guarantees.md's table of run-time checks has one short
line per check, each linking the subsection that explains it.
"""

from __future__ import annotations

import ast
import pickle
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conftest import TinyModule, make_trainer
from test_docs import DOCS, ROOT, _source_strings, anchors, github_slug, parse_blocks

from lightning_dp import DPConfigurationError, DPStrategy
from lightning_dp.core.errors import TROUBLESHOOTING, troubleshooting_entry

PAGE = DOCS / "troubleshooting.md"
ID = re.compile(r"^[a-z]+(?:-[a-z]+)*$")


@dataclass
class Entry:
    title: str
    line: int
    messages: list[str] = field(default_factory=list)  # the ```text blocks, whitespace squashed


def page_entries() -> tuple[dict[str, Entry], list[int]]:
    """The level-3 entries of troubleshooting.md, and the lines of any quoted message outside one."""
    entries: dict[str, Entry] = {}
    current: Entry | None = None
    outside: list[int] = []
    text = PAGE.read_text(encoding="utf-8")
    headings = {n: line for n, line in enumerate(text.splitlines(), 1) if re.match(r"^#{2,3} ", line)}
    blocks = {b.line: b for b in parse_blocks(PAGE) if b.lang == "text"}
    for n in sorted({*headings, *blocks}):
        if n in headings:
            level, title = headings[n].split(" ", 1)
            current = None
            if level == "###":
                assert title not in entries, f"troubleshooting.md:{n}: a second entry {title!r}"
                current = entries[title] = Entry(title, n)
        elif current is None:
            outside.append(n)
        else:
            current.messages.append(" ".join(blocks[n].code.split()))
    return entries, outside


ENTRIES, OUTSIDE = page_entries()
QUOTED = {title: entry for title, entry in ENTRIES.items() if entry.messages}


def test_every_message_is_under_a_heading_of_its_own_whose_title_is_its_anchor():
    assert not OUTSIDE, f"troubleshooting.md: messages outside a ### entry at lines {OUTSIDE}"
    assert len(QUOTED) >= 200
    for title, entry in ENTRIES.items():
        assert ID.match(title), f"troubleshooting.md:{entry.line}: {title!r} is not a short id (a-z, -)"
        assert github_slug(title) == title
    assert set(ENTRIES) <= anchors(PAGE)


def test_the_index_in_errors_holds_every_entry_of_the_page_and_nothing_else():
    """An entry without a quoted message is one of Lightning's or PyTorch's, or a symptom: not indexed."""
    missing = sorted(set(QUOTED) - set(TROUBLESHOOTING))
    stale = sorted(set(TROUBLESHOOTING) - set(QUOTED))
    assert not missing, (
        f"entries of troubleshooting.md not in lightning_dp.core.errors.TROUBLESHOOTING: {missing}"
    )
    assert not stale, f"TROUBLESHOOTING names entries troubleshooting.md does not have: {stale}"
    assert list(TROUBLESHOOTING) == [t for t in ENTRIES if t in TROUBLESHOOTING], "keep the page's order"


def test_each_fragment_is_text_of_the_code_that_no_other_message_holds():
    sources = _source_strings()
    for title, fragment in TROUBLESHOOTING.items():
        assert len(fragment) >= 12, f"{title}: {fragment!r} is too short to be one message's"
        assert "…" not in fragment, f"{title}: {fragment!r} holds a value filled in at run time"
        assert any(fragment in s for s in sources), f"{title}: {fragment!r} is not in lightning_dp/"
        others = [t for t, e in QUOTED.items() if t != title and any(fragment in m for m in e.messages)]
        assert not others, f"{title}: {fragment!r} is also quoted under {others}"


def test_each_quoted_message_finds_its_own_entry():
    """The first block of an entry is its message; later blocks (its variants, the fix it ends with) find
    that entry or none, never another: two messages never share an entry."""
    for title, entry in QUOTED.items():
        first, *rest = entry.messages
        assert troubleshooting_entry(first) == title, (title, first[:80])
        for message in rest:
            assert troubleshooting_entry(message) in (title, None), (title, message[:80])


# -- every refusal the code raises has an entry ------------------------------------------------------------

RAISED = {"DPConfigurationError": 0, "BatchDimensionError": 0, "ArgumentError": 0}
"""The refusals, and where their message is among the call's arguments."""
FORWARDED = {
    "lightning_dp/core/validation.py::_fail": "the messages of number() and flag(): the argument-* entries",
    "lightning_dp/checks/capture.py::_mixed_or_untraced": "the tracer's refusals (per_example/uses.py)",
    "lightning_dp/strategies/collectives.py::refuse_gather": "_GATHER_REFUSAL: collective-in-training-step",
    "lightning_dp/checks/capture.py::collected": "coverage.missed_use_message(): per-example-gradients-do-not-add-up",
    "lightning_dp/engine/step.py::_check_consistency": "checks.missed_use_message(): per-example-gradients-do-not-add-up",
    "lightning_dp/checks/mixing.py::run": "self.refusal(...) and a note: sensitivity-check-failed",
    "lightning_dp/strategies/base.py::load_checkpoint": "unreadable_checkpoint(): checkpoint-damaged & co.",
    "lightning_dp/strategies/base.py::_bind_sampler": "a sampler's ValueError from bind(): the data entries",
    "lightning_dp/strategies/checkpoints.py::restore_dp_state": "a slot's ValueError from load_state_dict",
    "lightning_dp/commands/tuning/space.py::load_search": "Repetitions' ValueError: the tune-repetitions-* entries",
}
"""Raise sites that pass on a message made elsewhere (``function``: where it is made), checked there."""


def _rendered(node: ast.AST) -> str | None:
    """A message expression as the page quotes it (``…`` for each value filled in), None if not a literal."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "…" for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _rendered(node.left), _rendered(node.right)
        return None if left is None and right is None else (left or "…") + (right or "…")
    return None


def _literals(function: ast.AST) -> list[str]:
    return [t for n in ast.walk(function) if (t := _rendered(n)) is not None and len(t) > 1]


def refusal_sites() -> list[tuple[str, str, list[str]]]:
    """Every refusal lightning_dp raises: ``(path:line, path::function, its message's literal texts)``.
    A message built by a helper of the package counts with the helper's literals."""
    trees = {
        p: ast.parse(p.read_text(encoding="utf-8")) for p in sorted((ROOT / "lightning_dp").rglob("*.py"))
    }
    helpers: dict[str, list[ast.AST]] = {}
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef):
                helpers.setdefault(node.name, []).append(node)
    sites = []
    for path, tree in trees.items():
        rel = path.relative_to(ROOT).as_posix()
        owner: dict[ast.AST, str] = {}  # each call's innermost function (ast.walk visits outer ones first)
        for function in ast.walk(tree):
            if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                owner.update({node: function.name for node in ast.walk(function)})
        for call in ast.walk(tree):
            name = getattr(call, "func", None)
            name = getattr(name, "id", None) or getattr(name, "attr", None)
            if not isinstance(call, ast.Call) or name not in RAISED or len(call.args) <= RAISED[name]:
                continue
            message = call.args[RAISED[name]]
            text = _rendered(message)
            if text is not None:
                texts = [text]
            elif isinstance(message, ast.Call):
                called = getattr(message.func, "id", None) or getattr(message.func, "attr", None)
                texts = [t for helper in helpers.get(str(called), []) for t in _literals(helper)]
            else:
                texts = []
            sites.append((f"{rel}:{call.lineno}", f"{rel}::{owner.get(call, '<module>')}", texts))
    return sites


def test_every_refusal_raised_in_lightning_dp_has_an_entry():
    sites = refusal_sites()
    assert len(sites) >= 190
    unknown, forwarded = [], set()
    for where, function, texts in sites:
        if not any(troubleshooting_entry(" ".join(t.split())) for t in texts):
            if function in FORWARDED:
                forwarded.add(function)
            else:
                unknown.append(f"{where}: {' | '.join(texts)[:120]!r}")
    assert not unknown, (
        "refusals with no entry in docs/troubleshooting.md: add a ### entry quoting the message and its "
        f"fragment to lightning_dp.core.errors.TROUBLESHOOTING: {unknown}"
    )
    assert forwarded == set(FORWARDED), (
        f"FORWARDED lists sites that no longer forward: {set(FORWARDED) - forwarded}"
    )


# -- the link, through the public API ------------------------------------------------------------------------


def _link(entry: str) -> str:
    return f"[docs/troubleshooting.md#{entry}]"


def test_a_refusal_ends_with_the_link_to_its_entry(tmp_path: Path):
    with pytest.raises(DPConfigurationError) as raised:
        DPStrategy(target_epsilon=0.0)
    assert str(raised.value).endswith(_link("argument-out-of-range"))
    trainer = make_trainer(DPStrategy(noise_multiplier=1.0), tmp_path, max_steps=1, accumulate_grad_batches=2)
    with pytest.raises(DPConfigurationError) as raised:
        trainer.fit(TinyModule())
    assert str(raised.value).endswith(_link("accumulate-grad-batches"))
    assert str(raised.value).count("docs/troubleshooting.md#") == 1


def test_a_sampler_refusal_in_a_fit_links_its_entry(tmp_path: Path):
    """A sampler's ValueError reaches the user as a DPConfigurationError, with the link."""
    with pytest.raises(DPConfigurationError) as raised:
        make_trainer(DPStrategy(noise_multiplier=1.0), tmp_path, max_steps=1).fit(
            TinyModule(n=8, batch_size=16)
        )
    assert str(raised.value).endswith(_link("batch-size-larger-than-training-set"))
    module = TinyModule(n=8, batch_size=4)
    loaders = {"a": module.train_dataloader(), "b": module.train_dataloader()}
    with pytest.raises(DPConfigurationError) as raised:
        make_trainer(DPStrategy(noise_multiplier=1.0), tmp_path, max_steps=1).fit(module, loaders)
    assert str(raised.value).endswith(_link("several-train-loaders"))


def test_the_link_is_added_once_and_only_to_a_message_with_an_entry():
    error = DPConfigurationError("Give either noise=... or noise_multiplier=..., not both.")
    assert str(error).endswith(_link("noise-given-twice"))
    assert str(pickle.loads(pickle.dumps(error))) == str(error)  # a rank's refusal sent to the others
    assert str(DPConfigurationError(f"Rank 1 refused this step before its release: {error}")).count("#") == 1
    assert str(DPConfigurationError(str(error))) == str(error)
    assert str(DPConfigurationError("something of your own")) == "something of your own"


# -- docs/guarantees.md: the run-time checks, one line each ----------------------------------------------------


def test_the_run_time_checks_table_has_one_short_line_per_check_linking_its_subsection():
    page = DOCS / "guarantees.md"
    section = page.read_text(encoding="utf-8").split("\n## Run-time checks\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| check")]
    assert len(rows) >= 15
    for row in rows:
        assert len(row.split()) <= 40, f"guarantees.md: a row of {len(row.split())} words: {row[:80]}"
        link = re.match(r"^\| \[[^\]]+\]\(#([\w-]+)\) \|", row)
        assert link, f"guarantees.md: the row's check does not link its subsection: {row[:80]}"
        assert link[1] in anchors(page), f"guarantees.md: no subsection #{link[1]}"
