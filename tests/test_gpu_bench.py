"""benchmarks/gpu/bench.py runs end to end at its tiny CPU shape: it is written for a GPU that CI lacks, so
this is what keeps it from rotting. TRL joins only where this interpreter can import it."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu" / "bench.py"
FIELDS = {"lib", "shape", "rows", "length", "dtype", "device_name", "versions", "model_gb", "seconds",
          "tokens_per_s", "logp_sum", "grad_norm", "memory", "peak_gb"}


def test_tiny_cpu_run_agrees_across_libraries(tmp_path):
    libs = ["rlft", "rlft-torch", "plain"] + (["trl"] if importlib.util.find_spec("trl") else [])
    out = tmp_path / "results.md"
    command = [sys.executable, str(BENCH), "--device", "cpu", "--shape", "tiny", "--lengths", "32",
               "--rows", "2", "--repeats", "1", "--libs", *libs, "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    rows = {row["lib"]: row for row in map(json.loads, lines)}
    assert set(rows) == set(libs)
    for row in rows.values():
        assert "error" not in row, row
        assert FIELDS <= set(row), FIELDS - set(row)
        assert (row["shape"], row["rows"], row["length"], row["dtype"]) == ("tiny", 2, 32, "float32")
        assert row["seconds"] > 0 and row["peak_gb"] > 0 and row["memory"] == "peak RSS"
    for lib in libs[1:]:  # same model, seed and tokens: same log-probs and gradient, whoever computes them
        assert math.isclose(rows[lib]["logp_sum"], rows["rlft"]["logp_sum"], rel_tol=1e-4), lib
        assert math.isclose(rows[lib]["grad_norm"], rows["rlft"]["grad_norm"], rel_tol=1e-4), lib
    report = out.read_text()
    assert report.startswith("# rlft vs TRL 1.16 scoring on CPU")
    assert "Command: `python " in report and "--shape tiny" in report and "torch " in report
    assert "| shape | library | completion tokens | peak RSS (GiB) |" in report
    assert all(f"| tiny | {lib} | 32 |" in report for lib in libs)
    assert report.count("\n{") == len(libs)  # the JSON lines, one per child


def test_packing_bench_runs_at_its_tiny_cpu_shape(tmp_path):
    """benchmarks/gpu/packing.py end to end on a CPU: every variant scores the padded log-probs."""
    out = tmp_path / "packing.md"
    command = [sys.executable, str(BENCH.parent / "packing.py"), "--device", "cpu", "--shape", "tiny",
               "--scale", "64", "--sweep", "32", "64", "--offload-sweep", "4096", "--repeats", "1", "--vocab", "500",
               "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines() if line.startswith('{"workload"')]
    assert len(rows) == 15 and {r["kernel"] for r in rows if r["variant"] != "padded"} == {"sdpa per block"}
    assert all(r["max_logp_diff_vs_padded"] < 1e-5 for r in rows)
    skewed = {r["variant"]: r["computed_tokens"] for r in rows if r["workload"] == "skewed"}
    assert skewed["prompts"] < skewed["rows"] == rows[1]["real_tokens"] < skewed["padded"]
    offloads = [json.loads(line) for line in out.read_text().splitlines() if line.startswith('{"offload_length"')]
    assert [(r["offload_length"], r["variant"]) for r in offloads] == [
        (64, "packed"), (64, "offload"), (64, "offload+mlp-chunks")]
    norms = [r["grad_norm"] for r in offloads]  # the same gradient whichever option holds memory
    assert norms[1] == norms[0] and math.isclose(norms[2], norms[0], rel_tol=1e-6)
    assert "| 64 | offload | " in out.read_text()


def test_profile_script_runs_at_its_tiny_cpu_shape(tmp_path):
    """benchmarks/gpu/profile_scoring.py end to end on a CPU: a table of operators per library."""
    out = tmp_path / "profile.md"
    command = [sys.executable, str(BENCH.parent / "profile_scoring.py"), "--device", "cpu", "--shape", "tiny",
               "--length", "16", "--rows", "2", "--vocab", "500", "--libs", "rlft", "--rows-shown", "5",
               "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr
    report = out.read_text()
    assert report.startswith("# Scoring profile on CPU") and "## rlft" in report and "aten::" in report


def test_long_fused_script_runs_at_its_tiny_cpu_shape(tmp_path):
    """benchmarks/gpu/long_fused.py end to end on a CPU: the head's two backwards give the same gradients
    (on a CPU the second takes the loss's gradient in the forward), and every setting the same log-probs."""
    out = tmp_path / "long.md"
    command = [sys.executable, str(BENCH.parent / "long_fused.py"), "--device", "cpu", "--shape", "tiny",
               "--lengths", "48", "--positions", "64", "--repeats", "1", "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr
    report = out.read_text()
    difference = float(report.split("dL/dh and dL/dW: ")[1].split()[0])
    assert difference < 1e-5
    rows = [line.split(" | ") for line in report.splitlines() if line.startswith("| 48 |")]
    assert len(rows) == 5 and len({row[4] for row in rows}) == 1  # the log-prob sums


def test_the_grpo_step_script_runs_at_its_tiny_cpu_shape(tmp_path):
    """benchmarks/gpu/grpo_step.py end to end on a CPU (rlft, and TRL where this interpreter has it): a row per
    library with its step time, split, training MFU and completion lengths, and TRL's ratios beside rlft's."""
    libs = ["rlft"] + (["trl"] if importlib.util.find_spec("trl") else [])
    out = tmp_path / "step.md"
    command = [sys.executable, str(BENCH.parent / "grpo_step.py"), "--device", "cpu", "--shape", "tiny",
               "--length", "12", "--steps", "2", "--vocab", "600", "--modes", "lora", "--libs", *libs,
               "--out-dir", str(tmp_path / "runs"), "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines() if line.startswith('{"lib"')]
    assert [r["lib"] for r in rows] == libs
    for row in rows:
        assert "error" not in row, row
        assert row["steps"] == 1 and row["step_s"] > row["generation_s"] > 0 and row["training_s"] > 0
        assert 0 < row["training_mfu_percent"] < 100 and row["lengths"]["mean"] <= 12
    assert "| tiny | lora | rlft |" in out.read_text()
    probe = subprocess.run([*command[:2], "--probe", "--device", "cpu", "--shape", "tiny", "--length", "12", "--vocab",
                            "600"], capture_output=True, text=True, timeout=600, check=False)
    assert probe.returncode == 0, probe.stderr
    lengths = json.loads(probe.stdout.strip().splitlines()[-1])["lengths"]
    assert len(lengths) == 16 and all(0 < n <= 12 for n in lengths) and lengths == sorted(lengths)
