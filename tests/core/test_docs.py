"""The documentation: every configuration key is documented, the README stays short and keeps
CI's test command, relative links resolve, and no benchmark figure leaves bench/RESULTS.md.

Pure: reads files and the pydantic models, no database.
"""

from __future__ import annotations

import re
import types
import typing
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import BaseModel

from config.models import Config
from tests.support.paths import ROOT

README = ROOT / "README.md"
DOCS = ROOT / "docs"
CONFIGURATION = DOCS / "configuration.md"
TEST_COMMAND = "python3 -m venv .venv && .venv/bin/pip install -e '.[dev]' && .venv/bin/pytest"
README_MAX_LINES = 170
EXPECTED_DOCS = ("tutorial", "sql", "privacy", "deployment", "configuration", "operations",
                 "bi-tools", "architecture", "isolation")


def _documents() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def _models_in(annotation: object) -> Iterator[type[BaseModel]]:
    """The BaseModel classes an annotation holds: itself, a dict's values, an Optional's arm."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield annotation
        return
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is dict:
        yield from _models_in(args[1])
    elif origin in (typing.Union, types.UnionType, list, tuple):
        for arg in args:
            yield from _models_in(arg)


def _keys(model: type[BaseModel], section: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], str]]:
    """(section path, key) for every field of `model` and of the models nested in it; a
    dict-valued field (analysts, tables, columns) contributes its value model's fields under
    a NAME level, as the TOML writes `[analysts.NAME]`."""
    for name, field in model.model_fields.items():
        key = field.alias or name
        nested = list(_models_in(field.annotation))
        if not nested or (section and typing.get_origin(field.annotation) is dict):
            yield section, key  # a leaf, or a key within a section holding named entries (`columns`)
        for sub in nested:
            level = (*section, key, "NAME") if typing.get_origin(field.annotation) is dict \
                else (*section, key)
            yield from _keys(sub, level)


CONFIG_KEYS = sorted(set(_keys(Config)))


def test_the_walk_finds_nested_and_aliased_keys() -> None:
    keys = {".".join((*s, k)) for s, k in CONFIG_KEYS}
    assert {"auth_method", "listen.max_connections", "backend.ledger_dsn",
            "analysts.NAME.max_dp_queries", "tables.NAME.uid_column", "tables.NAME.schema",
            "tables.NAME.columns", "tables.NAME.columns.NAME.lower",
            "defaults.release_quantum_ms"} <= keys
    assert "tables.NAME.schema_" not in keys


def _headed_sections(text: str) -> dict[str, str]:
    """Each heading's text (lower case, without '#' and backticks) -> the text under it."""
    out: dict[str, str] = {}
    parts = re.split(r"^(#{1,6} .*)$", text, flags=re.MULTILINE)
    for heading, body in zip(parts[1::2], parts[2::2], strict=True):
        out[heading.lstrip("#").strip().replace("`", "").lower()] = body
    return out


def _section_heading(section: tuple[str, ...]) -> str:
    """The heading a key's section has in configuration.md: `[listen]`, `[analysts.NAME]`, ...;
    the keys of `columns.COL` are documented under their table's heading."""
    if not section:
        return "top level"
    if section[:3] == ("tables", "NAME", "columns"):
        section = section[:2]
    return "[" + ".".join(section).lower() + "]"


@pytest.mark.parametrize(("section", "key"), CONFIG_KEYS,
                         ids=[".".join((*s, k)) for s, k in CONFIG_KEYS])
def test_every_configuration_key_is_documented(section: tuple[str, ...], key: str) -> None:
    text = CONFIGURATION.read_text(encoding="utf-8")
    assert f"`{key}`" in text, f"`{key}` is not in docs/configuration.md"
    sections = _headed_sections(text)
    heading = _section_heading(section)
    assert heading in sections, f"docs/configuration.md has no heading {heading}"
    assert f"`{key}`" in sections[heading], f"`{key}` is not under the heading {heading}"


def test_readme_is_short_and_keeps_the_test_command() -> None:
    text = README.read_text(encoding="utf-8")
    lines = text.splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines"
    assert TEST_COMMAND in lines
    # CI (.ci/run) runs the first ```sh block after the marker
    after = text.split("<!-- test-command -->", 1)[1].lstrip("\n").splitlines()
    assert after[:3] == ["```sh", TEST_COMMAND, "```"]
    assert "## On a fresh machine" in lines


def test_every_doc_exists_and_the_readme_links_it() -> None:
    readme = README.read_text(encoding="utf-8")
    for name in EXPECTED_DOCS:
        assert (DOCS / f"{name}.md").is_file(), f"docs/{name}.md is missing"
        assert f"(docs/{name}.md)" in readme, f"README.md does not link docs/{name}.md"


_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def _anchors(path: Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings."""
    out = set()
    for line in _FENCE.sub("", path.read_text(encoding="utf-8")).splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


@pytest.mark.parametrize("doc", _documents(), ids=lambda p: p.name)
def test_relative_links_resolve(doc: Path) -> None:
    text = _FENCE.sub("", doc.read_text(encoding="utf-8"))
    for target in _LINK.findall(text):
        if re.match(r"^[a-z]+:", target):
            continue  # http(s):, mailto:
        path, _, anchor = target.partition("#")
        resolved = (doc.parent / path).resolve() if path else doc
        assert resolved.exists(), f"{doc.name}: link {target} points to nothing"
        if anchor and resolved.suffix == ".md":
            assert anchor in _anchors(resolved), f"{doc.name}: no heading #{anchor} in {path or doc.name}"


_FIGURES = [
    re.compile(r"\d+(\.\d+)?\s?×"),        # a ratio
    re.compile(r"\btps\b"),               # throughput
    re.compile(r"\d\s?MiB\b"),            # memory
    re.compile(r"\d+(\.\d+)?\s?ms\b"),    # latencies
    re.compile(r"\d+(\.\d+)?\s?%\s+of (the )?(direct|relay)"),
]


@pytest.mark.parametrize("doc", _documents(), ids=lambda p: p.name)
def test_no_benchmark_figures_outside_results(doc: Path) -> None:
    for n, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
        for pattern in _FIGURES:
            assert not pattern.search(line), (
                f"{doc.name}:{n}: a benchmark figure ({pattern.pattern}) belongs in bench/RESULTS.md: "
                f"{line.strip()}")
