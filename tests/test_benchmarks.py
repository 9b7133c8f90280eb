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


def test_profile_cli_writes_json_markdown_png_and_trace(tmp_path, capsys):
    from mixedad.cli import main

    main(["profile", "--model", "mlp", "--depths", "2", "4", "--width", "8", "--batch", "4",
          "--repeats", "1", "--out", str(tmp_path), "--trace", "--dtype", "float64"])
    rows = json.loads((tmp_path / "mlp_cpu.json").read_text())["rows"]
    assert {r["strategy"] for r in rows} == {"mixed_grad", "double_backward", "func_grad_of_grad",
                                             "forward_ad_recipe", "plain_forward"}
    assert all(r["max_rel_error"] < 1e-9 for r in rows if "max_rel_error" in r)
    deep = {r["strategy"]: r for r in rows if r["depth"] == 4}
    assert deep["mixed_grad"]["peak_bytes"] < deep["double_backward"]["peak_bytes"]
    assert (tmp_path / "mlp_cpu.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "trace_mlp_mixed_grad_cpu.json").exists()
    assert "| mlp | 4 | mixed_grad |" in (tmp_path / "mlp_cpu.md").read_text()
    assert "10/10" in capsys.readouterr().err  # tqdm's bar reached the end


def test_profile_cli_bad_arguments(tmp_path):
    import pytest

    from mixedad import benchmark
    from mixedad.cli import main

    with pytest.raises(SystemExit, match="--width must be positive, got -1"):
        main(["profile", "--width", "-1", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match=r"profile: expected strategies from .* got \['magic'\]"):
        benchmark.profile("mlp", [2], width=4, batch=2, strategies=["magic"])
    with pytest.raises(ValueError, match=r"profile: expected model in .* got 'vae'"):
        benchmark.profile("vae", [2], width=4, batch=2)


def test_depth_benchmark_checks_targets(tmp_path, monkeypatch, capsys):
    """The CPU benchmark script in --quick mode: both models, then its table of targets."""
    monkeypatch.setattr(sys, "argv", ["mixed_grad_vs_depth.py", "--out", str(tmp_path), "--repeats", "1", "--quick"])
    try:
        runpy.run_path(str(BENCH / "mixed_grad_vs_depth.py"), run_name="__main__")
    except SystemExit as exit:
        assert exit.code == 0
    assert (tmp_path / "mlp_cpu.json").exists() and (tmp_path / "dcgan_cpu.png").exists()
    table = (tmp_path / "targets_cpu.md").read_text()
    assert "| MLP: time / double backward |" in table and "| DCGAN: peak / plain forward |" in table
    assert "| MLP, oneDNN tangent off (same BLAS as the baselines): time / double backward |" in table


def test_cuda_script_exits_cleanly_without_cuda():
    import subprocess

    import torch

    if torch.cuda.is_available():
        import pytest

        pytest.skip("a CUDA device is present; the script would profile")
    env = {**__import__("os").environ, "PYTHONPATH": str(BENCH.parent)}
    for script in (BENCH.parent / "scripts" / "profile_cuda.py", BENCH / "cuda_speed.py"):
        proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
        assert proc.returncode == 0
        assert "no CUDA device is available here" in proc.stdout


def test_neighbours_benchmark_runs(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["neighbours.py", "--out", str(tmp_path)])
    try:
        runpy.run_path(str(BENCH / "neighbours.py"), run_name="__main__")
    except SystemExit as exit:
        assert exit.code == 0
    rows = json.loads((tmp_path / "neighbours_cpu.json").read_text())
    assert all(r["ratio"] < 1 and r["max_rel_error"] < 1e-5 for r in rows)


def test_linear_kernels_benchmark_runs(tmp_path, capsys):
    sys.path.insert(0, str(BENCH))
    try:
        from linear_kernels import main
    finally:
        sys.path.remove(str(BENCH))
    assert main(["--batch", "4", "--width", "8", "--repeats", "1", "--out", str(tmp_path)]) == 0
    from mixedad.benchmark import frozen_linear_tangent_kernel as _onednn_linear_op

    if _onednn_linear_op() is None:
        assert "no usable oneDNN linear kernel" in capsys.readouterr().out
        return
    result = json.loads((tmp_path / "linear_kernels_cpu.json").read_text())
    assert set(result["seconds"]) == {"F.linear (BLAS)", "oneDNN"}
    assert result["max_rel_difference"] < 1e-5
    assert "| oneDNN |" in (tmp_path / "linear_kernels_cpu.md").read_text()


def test_op_rules_benchmark_runs_and_shows_the_local_rule_saving_memory(tmp_path, monkeypatch, capsys):
    argv = ["op_rules_vs_depth.py", "--quick", "--repeats", "1", "--out", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", argv)
    runpy.run_path(str(BENCH / "op_rules_vs_depth.py"), run_name="__main__")
    rows = json.loads((tmp_path / "stylegan2_ada_cpu.json").read_text())["rows"]
    at = {r["strategy"]: r for r in rows if r["depth"] == 2}
    assert at["mixed_grad"]["peak_bytes"] < at["mixed_grad_no_local_rule"]["peak_bytes"]
    assert at["mixed_grad"]["max_rel_error"] < 1e-4
    assert "| vq_decoder | 2 |" in (tmp_path / "op_rules_memory_cpu.md").read_text()


def test_attention_benchmark_runs_and_writes_results(tmp_path, monkeypatch, capsys):
    argv = ["attention_vs_length.py", "--quick", "--repeats", "1", "--out", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", argv)
    runpy.run_path(str(BENCH / "attention_vs_length.py"), run_name="__main__")
    rows = json.loads((tmp_path / "attention_cpu.json").read_text())["rows"]
    at = {r["strategy"]: r for r in rows if r["T"] == 128}
    assert at["mixed_grad"]["peak_bytes"] < at["mixed_grad_math_attention"]["peak_bytes"]
    assert at["mixed_grad"]["max_rel_error"] < 1e-4
    assert (tmp_path / "attention_cpu.png").read_bytes()[:4] == b"\x89PNG"


def _run_quick(script, out, monkeypatch):
    """Run a benchmark script in --quick mode with one repeat, writing into ``out``; it must exit 0."""
    monkeypatch.setattr(sys, "argv", [script, "--quick", "--repeats", "1", "--out", str(out)])
    try:
        runpy.run_path(str(BENCH / script), run_name="__main__")
    except SystemExit as exit:
        assert exit.code == 0


def test_many_tangents_benchmark_runs_and_writes_results(tmp_path, monkeypatch, capsys):
    _run_quick("many_tangents.py", tmp_path, monkeypatch)
    rows = json.loads((tmp_path / "many_tangents_cpu.json").read_text())["rows"]
    assert [r["generator"] for r in rows] == ["mlp", "dcgan", "attention"]
    assert all(r["max_rel_diff"] < 1e-5 for r in rows)  # float32: the batch and the loop agree
    assert "| attention |" in (tmp_path / "many_tangents_cpu.md").read_text()


def test_curvature_benchmark_runs_and_checks_its_targets(tmp_path, monkeypatch, capsys):
    _run_quick("curvature_vs_depth.py", tmp_path, monkeypatch)
    rows = json.loads((tmp_path / "curvature_cpu.json").read_text())["rows"]
    assert {(r["model"], r["depth"]) for r in rows} == {("mlp", 8), ("mlp", 32), ("dcgan", 8), ("dcgan", 32)}
    assert all(r["hessian_rel_error"] < 1e-4 and r["implicit_rel_error"] < 1e-3 for r in rows)
    text = (tmp_path / "curvature_cpu.md").read_text()
    assert "| mlp: GGN peak / anchor, depth 32 |" in text and "| target | measured | bound | met |" in text


def test_plan_headline_benchmark_runs_and_writes_results(tmp_path, monkeypatch, capsys):
    _run_quick("plan_headline.py", tmp_path, monkeypatch)
    rows = json.loads((tmp_path / "plan_headline.json").read_text())["rows"]
    planned = [r for r in rows if "peak_bytes" in r]
    assert planned and all(r["peak_bytes"]["double_backward"] > r["peak_bytes"]["forward"] for r in planned)
    assert "| generator | batch | dtype | plain forward | mixed_grad | double backward | plan time |" in \
        (tmp_path / "plan_headline.md").read_text()


def _tangent_speed():
    import importlib.util

    spec = importlib.util.spec_from_file_location("tangent_speed", BENCH / "tangent_speed.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tangent_speed_runs_side_by_side_and_leaves_the_readme_alone_elsewhere(tmp_path):
    readme = (BENCH.parent / "README.md").read_text()
    assert _tangent_speed().main(["--quick", "--repeats", "1", "--out", str(tmp_path)]) == 0
    rows = {r["generator"]: r for r in json.loads((tmp_path / "tangent_speed_cpu.json").read_text())["rows"]}
    assert set(rows) == {"dcgan (eval)", "dcgan (train)", "mlp", "attention"}
    assert set(rows["dcgan (eval)"]["time_vs_plain"]) == {"plain_forward", "two plain forwards", "mixed_grad",
                                                          "mixed_grad per-op", "mixed_grad compiled", "torch.func.jvp",
                                                          "hand JVP"}
    assert "mixed_grad compiled" not in rows["attention"]["time_vs_plain"]  # no tangent program: it would run eager
    assert rows["dcgan (train)"]["mixed_grad_compile_seconds"] > 0
    assert rows["attention"]["peak_vs_plain"]["mixed_grad"] > 1
    table = (tmp_path / "tangent_speed_cpu.md").read_text()
    assert "| dcgan (train): mixed_grad time / plain forward |" in table
    assert "| dcgan (eval): mixed_grad compiled time / plain forward |" in table
    assert (BENCH.parent / "README.md").read_text() == readme


def test_the_readme_speed_table_is_the_committed_results():
    module = _tangent_speed()
    table = (BENCH / "results" / "tangent_speed_cpu.md").read_text()
    readme = (BENCH.parent / "README.md").read_text()
    assert module.readme_with_table(readme, table) == readme, "run python benchmarks/tangent_speed.py"


def test_cuda_speed_benchmark_runs_on_the_cpu_at_a_tiny_size(tmp_path, capsys):
    """The GPU speed benchmark's logic, on the CPU: every method timed, the block sizes swept, results written."""
    sys.path.insert(0, str(BENCH))
    try:
        from cuda_speed import main
    finally:
        sys.path.remove(str(BENCH))
    assert main(["--device", "cpu", "--quick", "--repeats", "1", "--block-mib", "0.01", "1.5",
                 "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "cuda_speed_cpu.json").read_text())["rows"]
    assert [r["generator"] for r in rows] == ["dcgan 4 channels, batch 2", "attention T=64"]
    assert set(rows[1]["peak_vs_plain"]) == {"plain forward", "double backward", "mixed_grad, 0.01 MiB blocks",
                                             "mixed_grad, 1.5 MiB blocks"}
    assert "| mixed_grad compiled |" in (tmp_path / "cuda_speed_cpu.md").read_text()


def test_jax_compare_says_what_it_needs_or_runs_at_a_tiny_size(tmp_path, capsys):
    """The JAX comparison is optional: without JAX it says so and exits 0; with it, JAX's numbers equal mixedad's."""
    sys.path.insert(0, str(BENCH))
    try:
        from jax_compare import main
    finally:
        sys.path.remove(str(BENCH))
    assert main(["--quick", "--repeats", "1", "--out", str(tmp_path)]) == 0
    try:
        import jax  # noqa: F401
    except ImportError:
        assert "JAX is not installed" in capsys.readouterr().out
        assert not (tmp_path / "jax_compare_cpu.json").exists()
        return
    rows = json.loads((tmp_path / "jax_compare_cpu.json").read_text())["rows"]
    assert [r["generator"] for r in rows] == ["dcgan (eval)", "dcgan (train)"]
    assert all(r["difference"]["G(z)"] < 1e-4 and r["difference"]["mixed"] < 1e-4 for r in rows)


def test_float32_kinks_runs_at_a_tiny_size_and_the_default_takes_the_per_op_pass_kinks(tmp_path):
    """The default's programs compute G's primal as G does: not one draw apart from the per-op pass."""
    sys.path.insert(0, str(BENCH))
    try:
        from float32_kinks import main
    finally:
        sys.path.remove(str(BENCH))
    assert main(["--quick", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "float32_kinks_cpu.json").read_text())["rows"]
    assert set(rows) == {"per-op pass", "default", "compile=True"}
    assert max(rows["default"]["per-op"]) <= 1e-6 and all(len(r["float64"]) == 3 for r in rows.values())
    assert "| default | 0 |" in (tmp_path / "float32_kinks_cpu.md").read_text()
