"""Old module paths still import, as the same module, with a DeprecationWarning that names
the new path; the top of the package holds at most 8 modules."""

from __future__ import annotations

import importlib
import pickle
import sys
from pathlib import Path

import pytest

import mixprec
from mixprec._imports import MOVED


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_imports_the_new_module_and_warns_with_the_new_path(old):
    new = importlib.import_module(MOVED[old])
    saved = sys.modules.pop(old, None)  # as on a first import
    try:
        with pytest.warns(DeprecationWarning, match=f"{old} moved to {MOVED[old]}"):
            mod = importlib.import_module(old)
    finally:
        if saved is not None:
            sys.modules[old] = saved
    assert mod is new
    assert new.__spec__.name == MOVED[old]  # the alias leaves the module's own spec


def test_a_pickle_that_names_an_old_path_loads():
    blob = b"cmixprec.scaler\nDynamicLossScale\n."  # a 0.2 pickle's global reference
    saved = sys.modules.pop("mixprec.scaler", None)
    try:
        with pytest.warns(DeprecationWarning):
            cls = pickle.loads(blob)
    finally:
        if saved is not None:
            sys.modules["mixprec.scaler"] = saved
    from mixprec.engine.scaler import DynamicLossScale

    assert cls is DynamicLossScale


def test_the_package_top_holds_at_most_8_modules():
    top = sorted(p.name for p in Path(mixprec.__file__).parent.glob("*.py"))
    assert len(top) <= 8, top


def test_the_packages_export_their_names_as_before():
    from mixprec import checkpoint, engine, formats, parallel

    assert engine.MixedPrecision is mixprec.MixedPrecision
    assert checkpoint.save_engine.__module__ == "mixprec.checkpoint.core"
    assert parallel.DDP.__module__ == "mixprec.parallel.layouts"
    assert formats.get("e4m3").max == 448.0
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        engine.nope  # noqa: B018
