"""The GPU check's code paths, on tiny shapes on the CPU (Triton through its interpreter), ~30 s.

The real check runs once per GPU lease; this keeps it from breaking unnoticed in between (it lives under
tests/ so that `make test`, and with it CI, runs it).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_dry_run(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path))
    proc = subprocess.run([sys.executable, "perf/gpu_check.py", "--dry-run", "--budget-s", "300"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert result["dry_run"] and not result.get("errors")
    assert result["kernels"] and all("error" not in k for k in result["kernels"])
    assert all(k["triton"]["ms"] > 0 and k["torch"]["ms"] > 0 for k in result["kernels"])
    costs = result["costs"]
    assert costs["step_ms"] > 0 and len(costs["verify_ms"]) == 8  # K = 1..8
    # A draft identical to the target accepts everything it proposes (greedy, same kernels).
    assert result["pipelines"]["draft = target, K=4"]["acceptance_rate"] == 1.0
    # Every bf16 pair measured on the CPU is projected (none skipped because gpu_check did not know its method),
    # each from the costs above and the draft forwards a step measured with it where acceptance.json has them.
    pairs = json.loads((ROOT / "perf" / "acceptance.json").read_text())["pairs"]
    bf16 = {key for key in pairs if key.endswith("/bf16")}
    assert bf16 and set(result["projections"]) == bf16
    for key, p in result["projections"].items():
        measured = pairs[key].get("draft_forwards_per_step")
        assert p["draft_forwards_from"] == ("measured" if measured is not None else "K")
        assert p["draft_forwards_per_step"] == (measured if measured is not None
                                                else (0.0 if key.startswith("ngram/") else p["K"]))
        t_draft = 0.0 if key.startswith("ngram/") else costs["draft_ms"][
            "smollm2-135m" if "smollm2" in key else "qwen2.5-0.5b"]
        expected = p["tokens_per_target_forward"] * costs["step_ms"] / (
            p["draft_forwards_per_step"] * t_draft + costs["verify_ms"][str(p["K"])])
        assert abs(p["projected_speedup"] - expected) < 1e-9 * expected
    assert "summary" in (tmp_path / "gpu_check.log").read_text()
