"""What tests of the command line share."""

from __future__ import annotations


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert "Traceback" not in err and len(lines) == 1, err
    assert lines[0].startswith("slimtorch: error: ")
    return lines[0]
