"""`mixprec formats`: the table and two worked examples."""

from __future__ import annotations

import re

from mixprec.cli import main


def _rows(out: str) -> dict[str, str]:
    return {m.group(1): line for line in out.splitlines()
            if (m := re.match(r"│ (\w+)\s+│", line))}


def test_formats_table_lists_every_format(capsys):
    assert main(["formats"]) == 0
    rows = _rows(capsys.readouterr().out)
    assert set(rows) >= {"fp32", "tf32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "fp6_e3m2",
                         "fp6_e2m3", "fp4_e2m1", "e8m0"}
    assert "65504" in rows["fp16"] and "448" in rows["fp8_e4m3"] and "57344" in rows["fp8_e5m2"]


def test_update_at_2048(capsys):
    assert main(["formats", "--value", "2048", "--update", "1e-4"]) == 0
    rows = _rows(capsys.readouterr().out)
    assert "vanishes" in rows["fp16"] and "vanishes" in rows["bf16"]
    # fp32's spacing at 2048 is 2^-12: 1e-4 is less than half of it (a common claim says it is kept)
    assert "vanishes" in rows["fp32"] and "0.000244141" in rows["fp32"]
    # e4m3 has no inf: 2048 overflows to NaN, so there is no stored value to update
    # (NaN + 1e-4 != NaN must not read "survives"), and its error is not 0
    assert "NaN" in rows["fp8_e4m3"] and "survives" not in rows["fp8_e4m3"]
    assert "lost: no value" in rows["fp8_e4m3"] and "inf" in rows["fp8_e4m3"]
    assert main(["formats", "--value", "1000", "--update", "1e-4"]) == 0
    rows = _rows(capsys.readouterr().out)
    assert "survives" in rows["fp32"] and "vanishes" in rows["bf16"]


def test_underflow_of_2_pow_minus_30(capsys):
    assert main(["formats", "--value", "9.31e-10"]) == 0
    rows = _rows(capsys.readouterr().out)
    assert "underflows to 0" in rows["fp16"]
    assert "normal" in rows["bf16"] and "underflow" not in rows["bf16"]


def test_unknown_format_is_an_error(capsys):
    assert main(["formats", "--formats", "fp7"]) == 2
    assert "unknown format 'fp7'" in capsys.readouterr().err


def test_version(capsys):
    import pytest

    import mixprec

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith(f"mixprec {mixprec.__version__} (torch ")
