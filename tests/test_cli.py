"""The command line: ``uvaple doctor`` says what runs here; ``uvaple`` with no or a bad command."""

from __future__ import annotations

import torch

from uvaple.cli import main
from uvaple.uva import system


def test_doctor_says_what_runs_here(capsys):
    code = main(["doctor", "--no-measure"])
    out = capsys.readouterr().out
    assert "torch build" in out
    huge = system.huge_pages_in("/dev/shm")  # this machine's /dev/shm, read from the mount table
    assert f"shared tables in /dev/shm     : {'2 MiB' if huge in ('always', 'within_size') else '4 KiB'} pages" in out
    if torch.cuda.is_available():
        assert code == 0 and "UVA path usable               : yes" in out
    else:
        assert code == 1 and "What runs here instead:" in out
        assert "copy placement" not in out  # --no-measure: no CPU figures
        assert "CUDA build of torch" in out and "every lookup placement on CPU tensors" in out


def test_doctor_json_and_cpu_measurements(capsys):
    import json

    assert main(["doctor", "--json", "--seconds", "0.2"]) in (0, 1)
    caps = json.loads(capsys.readouterr().out)
    if not torch.cuda.is_available():
        assert caps["cpu_copy_gbps"] > 0 and caps["cpu_interpreter_rows_per_s"] > 0
        assert caps["uva_usable"] is False


def test_unknown_and_missing_commands(capsys):
    assert main([]) == 2
    assert main(["frobnicate"]) == 2
    assert "unknown command" in capsys.readouterr().err
    assert main(["--help"]) == 0
    assert "shm" in capsys.readouterr().out
