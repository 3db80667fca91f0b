"""The public modules of the source tree: those with an ``__all__``, less the command
line and the implementation rooms users reach through other modules."""

from __future__ import annotations

from helpers.paths import ROOT

__all__ = ["INTERNAL", "modules_with_all"]


# implementation rooms: public to the code's structure, not to users (the API page
# documents what users call; these are reached through it)
INTERNAL = {"mixprec.engine.checks", "mixprec.parallel.comm", "mixprec.engine.param_state",
            "mixprec.parallel.layouts", "mixprec.engine.build", "mixprec.engine.step",
            "mixprec.recipe.rules", "mixprec.integrations._proxies", "mixprec._imports",
            "mixprec.parallel"}


def modules_with_all() -> list[str]:
    """Every ``mixprec`` module with an ``__all__``, but the command line's and
    ``INTERNAL``."""
    out = []
    for p in sorted((ROOT / "src" / "mixprec").rglob("*.py")):
        if "__all__" not in p.read_text():
            continue
        parts = p.relative_to(ROOT / "src").with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        if not name.startswith("mixprec.cli") and name not in INTERNAL | {"mixprec.fp8"}:
            out.append(name)
    return out
