"""docs/guides/compositions.md is the composition matrix's own list of cells
(tests/helpers/matrix_cells.py) as docs/gen_matrix.py writes it."""

from __future__ import annotations

import importlib
import sys

from helpers.matrix_cells import CELLS
from helpers.paths import DOCS


def _gen():
    sys.path.insert(0, str(DOCS))
    try:
        return importlib.import_module("gen_matrix")
    finally:
        sys.path.remove(str(DOCS))


def test_the_compositions_page_is_the_tests_list_of_cells():
    have = (DOCS / "guides" / "compositions.md").read_text()
    assert have == _gen().page(), ("docs/guides/compositions.md is stale: run "
                                   "python docs/gen_matrix.py")


def test_the_page_shows_every_cell_and_every_refusal():
    """Each cell's outcome reaches the page: every refusal's reason and every bound."""
    text = _gen().page()
    for c in CELLS:
        assert (c.refuses or f"trains ≤ {c.tol:g}" if c.layout != "one" else "trains"
                ) in text, c.id
        assert c.no_resume is None or c.no_resume in text, c.id
