"""The GPU check's code paths, on tiny shapes on the CPU (Triton through its interpreter), ~30 s.

The real check runs once per GPU lease; this keeps it from breaking unnoticed in between.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


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
    assert "summary" in (tmp_path / "gpu_check.log").read_text()
