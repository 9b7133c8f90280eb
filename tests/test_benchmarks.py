"""The benchmark scripts run end to end at a tiny size (they are not timed tests)."""
import json
import pathlib
import runpy
import sys

BENCH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


def test_many_codes_runs_and_writes_results(tmp_path, monkeypatch, capsys):
    argv = ["many_codes.py", "--n", "128", "--chunk-size", "16", "--depth", "2", "--width", "16",
            "--measurements", "4", "--budget-mib", "0.05", "--repeats", "1", "--out", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", argv)
    try:
        runpy.run_path(str(BENCH / "many_codes.py"), run_name="__main__")
    except SystemExit as exit:
        assert exit.code == 0
    rows = json.loads((tmp_path / "many_codes_cpu.json").read_text())["rows"]
    ours = [r for r in rows if r["method"] == "mixedad.input_grad"]
    naive = [r for r in rows if r["method"] == "naive create_graph"]
    assert [r["N"] for r in ours] == [32, 64, 128]
    assert naive[-1]["within_budget"] is False  # the budget stops the naive code
    assert all(r["y_grad_rel_err"] is None or r["y_grad_rel_err"] < 1e-4 for r in rows)
    assert "| mixedad.input_grad | 128 | 16 |" in (tmp_path / "many_codes_cpu.md").read_text()
