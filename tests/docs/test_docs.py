"""The documentation is code too: every public name has a docstring, and every
docstring example runs and prints what it says. The pages agree with each other: none
calls refused or missing what another documents as working, and the README and the
manual's front page link every guide."""

from __future__ import annotations

import doctest
import importlib
import inspect
import pkgutil
import re
import warnings

import pytest

import mixprec
from helpers.paths import ROOT

with warnings.catch_warnings():  # the walk imports the deprecated mixprec.fp8 package
    warnings.simplefilter("ignore", DeprecationWarning)
    MODULES = sorted(m.name for m in pkgutil.walk_packages(mixprec.__path__, "mixprec.")
                     if not m.name.endswith("__main__") and m.name != "mixprec.fp8")


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    mod = importlib.import_module(name)
    result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0


def test_every_public_name_has_a_docstring():
    missing = []
    for name in ["mixprec", *MODULES]:
        mod = importlib.import_module(name)
        if not (mod.__doc__ or "").strip():
            missing.append(name)
        for attr in getattr(mod, "__all__", []):
            obj = getattr(mod, attr)
            if (inspect.isfunction(obj) or inspect.isclass(obj)) and not (obj.__doc__ or
                                                                          "").strip():
                missing.append(f"{name}.{attr}")
            if inspect.isclass(obj):
                for member, value in vars(obj).items():
                    fn = value.fget if isinstance(value, property) else value
                    if (not member.startswith("_") and inspect.isfunction(fn)
                            and not (fn.__doc__ or "").strip()):
                        missing.append(f"{name}.{attr}.{member}")
    assert not missing, missing


def test_docstring_examples_exist_on_the_entry_points():
    """DESIGN.md: public entry points carry a short runnable example."""
    from mixprec import memory
    from mixprec.engine.context import precision_context

    for obj in (memory.estimate, precision_context, mixprec.Recipe, mixprec.MixedPrecision,
                mixprec.LossScaler, mixprec.doctor):
        assert ">>>" in (obj.__doc__ or "") or "::" in (obj.__doc__ or ""), obj


# --- the pages agree: what one page documents as working, no page calls refused or missing

#: the pages a reader meets (the changelog is history: what an old version lacked)
PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md")
                              if p.name != "changelog.md")]
GUIDES = sorted(p.relative_to(ROOT / "docs").as_posix()
                for p in (ROOT / "docs" / "guides").glob("*.md"))
#: features the manual documents as working, by the words a page calls them -> the page
#: that documents them, and the limits that page itself states (a clause that names one
#: of them states a documented limit, not a contradiction)
WORKING = {
    "tensor parallelism": ("docs/guides/tensor-parallel.md", ()),
    "fp8 all gather": ("docs/guides/distributed.md", ("tensor parallel", "int8")),
    "mixture of experts": ("docs/guides/moe.md", ("gpu",)),
    "fsdp2": ("docs/guides/distributed.md", ()),
    "activation checkpointing": ("docs/guides/your-loop.md", ()),
    "torch.compile": ("docs/guides/your-loop.md", ()),
    "exact emulation": ("docs/guides/any-cpu.md", ()),
    "mixprec.plan": ("docs/guides/plan.md", ()),
    "deepspeed": ("docs/guides/deepspeed.md", ("lightning", "strategy", "cannot",
                                                 "doctor")),
}
#: a clause that says its subject is refused, missing or narrower than documented
REFUSED = re.compile(r"\b(?:is|are) (?:refused|not supported|unsupported|not (?:yet )?"
                     r"(?:available|there|implemented|built)|[\w ]{1,20} only)\b"
                     r"|\bnot there yet\b|\brefused\b")


def _normal(text: str) -> str:
    """Lower case, markup and word joiners (``_``, ``-``, backticks) as spaces."""
    return " ".join(re.sub(r"[`*_\-]", " ", text.lower()).split())


def _clauses(text: str) -> list[str]:
    """The prose of a page cut into clauses (sentences, ``;``, table cells), code out."""
    prose = re.sub(r"```.*?```", " ", text, flags=re.S)
    return [c for c in (_normal(c) for c in re.split(r"(?<=[.;!?])\s|\n\s*\n|\|", prose))
            if c]


def contradictions(pages: dict[str, str]) -> list[str]:
    """Each clause of ``pages`` whose subject is a working feature and which calls it
    refused, missing or narrower, with no limit its documenting page states."""
    found = []
    for page, text in pages.items():
        for clause in _clauses(text):
            for phrase, (home, limits) in WORKING.items():
                at = clause.find(phrase)
                said = REFUSED.search(clause, at + len(phrase)) if at >= 0 else None
                if said and not any(lim in clause for lim in limits):
                    found.append(f"{page}: {phrase!r} is documented on {home}, but: "
                                 f"{clause!r}")
    return found


def _missing_titles(text: str) -> list[str]:
    """Items of a not-there-yet list whose bold title is a working feature and nothing
    more (no part of it named as the missing one)."""
    bad = []
    for title in re.findall(r"(?m)^- \*\*(.+?)\*\*", text):
        rest = _normal(title)
        for phrase in WORKING:
            rest = rest.replace(phrase, " ")
        if not set(re.findall(r"[a-z0-9]+", rest)) - {"the", "s", "yet", "support", "of"}:
            bad.append(title)
    return bad


def test_the_working_features_are_documented_where_the_table_says():
    for phrase, (home, limits) in WORKING.items():
        page = _normal((ROOT / home).read_text())
        assert phrase in page, (phrase, home)
        assert all(lim in page for lim in limits), (phrase, home, limits)


def test_no_page_calls_a_documented_feature_refused_or_missing():
    pages = {p: (ROOT / p).read_text() for p in PAGES}
    assert not contradictions(pages), "\n".join(contradictions(pages))
    assert not _missing_titles(pages["docs/not-there-yet.md"])


def test_the_cross_check_catches_a_contradiction():
    """What the README once said, against the guides that document both features."""
    once = ("- fp8 all-gather under FSDP is per-tensor only; tensor parallelism, DeepSpeed "
            "and\n  Lightning's FSDP1 strategy are refused with the route that works.")
    found = contradictions({"README.md": once})
    assert sorted(f.split("'")[1] for f in found) == ["fp8 all gather", "tensor parallelism"]
    assert _missing_titles("- **Tensor parallelism.** Not yet.\n- **Mixture-of-experts"
                           " on a GPU.**\n") == ["Tensor parallelism."]


@pytest.mark.parametrize("index", ["README.md", "docs/index.md"])
def test_every_guide_is_linked_from_the_front_pages(index):
    text = (ROOT / index).read_text()
    base = "docs/" if index == "README.md" else ""
    linked = set(re.findall(r"\]\(([^)#\s]+)", text))
    missing = [g for g in GUIDES if base + g not in linked]
    assert not missing, f"{index} links no {missing}"
