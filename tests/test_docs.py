"""The documentation: the docs site builds strictly and offline, the README's links resolve, and the
results table that the README and the docs draw from keeps its columns.

``mkdocs build --strict`` turns every warning (a nav entry or link to a missing page, a docstring
mkdocstrings cannot render) into a failure. The theme loads no web fonts and no plugin fetches
anything, so the build needs no network.
"""

from __future__ import annotations

import csv
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_docs_build_strictly_and_offline(tmp_path):
    site = tmp_path / "site"
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                           str(ROOT / "mkdocs.yml"), "--site-dir", str(site)], capture_output=True, text=True,
                          timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, (
        "mkdocs build --strict failed (is the 'docs' extra installed? .venv/bin/python -m pip install -e '.[docs]'):\n"
        + proc.stdout[-4000:] + proc.stderr[-4000:])
    api = (site / "api" / "index.html").read_text()
    assert 'id="graphspec.pipeline.Pipeline"' in api and "describe" in api  # the docstrings were rendered
    for page in site.rglob("*.html"):
        assert "fonts.googleapis.com" not in page.read_text(), f"{page} loads web fonts"


def test_every_nav_page_exists():
    nav = re.findall(r":\s*([\w./-]+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), flags=re.M)
    assert nav, "mkdocs.yml has no nav"
    missing = [p for p in nav if not (ROOT / "docs" / p).is_file()]
    assert not missing, f"mkdocs.yml's nav names pages that docs/ lacks: {missing}"


def test_the_readme_is_short_and_its_links_resolve():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 300
    links = [t for t in re.findall(r"\]\(([^)#\s]+)", text) if not t.startswith(("http://", "https://"))]
    assert links
    missing = [t for t in links if not (ROOT / t).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"
    for command in ("make demo", "make test"):
        assert command in text


def test_the_results_table_has_its_columns_and_e2e_appends_to_it(tmp_path):
    sys.path.append(str(ROOT))
    from perf._common import RESULTS_COLUMNS, RESULTS_CSV, append_results

    with RESULTS_CSV.open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert rows and tuple(rows[0]) == RESULTS_COLUMNS
    assert all(r["date"] and r["method"] and float(r["tokens_per_second"]) > 0 for r in rows)

    report = {"machine": {"date": "2026-01-01 00:00:00 UTC", "cpu_model": "Some CPU", "cpu_family": "25",
                          "cpu_model_number": "17", "cpu_flags": "avx2 fma", "cpu_level": "avx2", "torch_threads": 1,
                          "commit": "abc1234"},
              "target": "t", "num_prompts": 2, "max_new_tokens": 8, "read_bandwidth": {"gbps_median": 20.0},
              "dtypes": {"bf16": {"draft_quantize": "int8", "draft_vocab": "auto", "draft_siblings": "auto",
                                  "summary": {
                                      "ar": {"tokens_per_second": 5.0, "step_ms": 200.0, "hf_peer": "hf_ar",
                                             "speedup_vs_hf_peer": 2.0, "prompts_differing_from_ar": 0},
                                      "spec_0.5b": {"tokens_per_second": 10.0, "hf_peer": "hf_assist_0.5b",
                                                    "speedup_vs_hf_peer": 4.0, "prompts_differing_from_ar": 1,
                                                    "tokens_per_target_forward": 3.0, "num_speculative_tokens": 5}},
                                  "vs_llamacpp": {"spec_0.5b": {"speedup_vs_llamacpp": 2.5}}}}}
    path = tmp_path / "results.csv"
    append_results(report, {"spec_0.5b": "d"}, path)
    append_results(report, {"spec_0.5b": "d"}, path)  # a second run appends, with one header
    with path.open(newline="") as f:
        got = list(csv.DictReader(f))
    assert len(got) == 4 and tuple(got[0]) == RESULTS_COLUMNS
    spec = got[1]
    assert (spec["method"], spec["draft"], spec["x_our_ar"], spec["x_transformers"], spec["x_llamacpp"],
            spec["same_tokens_as_ar"], spec["cpu_family_model"], spec["commit"], spec["k"]) == (
        "spec_0.5b", "d", "2.000", "4.000", "2.500", "1/2", "25/17", "abc1234", "5")
    assert "quantize=int8" in spec["draft_settings"] and "siblings=auto" in spec["draft_settings"]


def test_the_readme_results_table_tells_cpus_of_one_name_apart(tmp_path):
    sys.path.append(str(ROOT))
    from perf._common import RESULTS_COLUMNS
    from perf.plot_results import table

    base = dict.fromkeys(RESULTS_COLUMNS, "")
    base.update(machine="AMD EPYC", threads="1", dtype="gguf-a8", method="spec_0.5b_chain", prompts="4",
                max_new_tokens="128", k="3", draft_settings="quantize=int8 siblings=0", tokens_per_target_forward="2.5",
                same_tokens_as_ar="4/4", commit="abc")
    rows = [dict(base, date="2026-01-01 00:00:00 UTC", cpu_flags="avx2 fma f16c avx512f avx512_bf16", cpu_level="avx512",
                 tokens_per_second="20.0", x_our_ar="1.20", x_transformers="5.0"),
            dict(base, date="2026-01-02 00:00:00 UTC", cpu_flags="avx2 fma f16c avx512f avx512_bf16", cpu_level="avx512",
                 tokens_per_second="21.0", x_our_ar="1.25"),  # later, without transformers: not shown
            dict(base, date="2026-01-03 00:00:00 UTC", cpu_flags="avx2 fma f16c", cpu_level="avx2",
                 tokens_per_second="11.0", x_our_ar="1.10", x_llamacpp="1.80"),
            dict(base, date="2026-01-04 00:00:00 UTC", cpu_flags="avx2 fma f16c avx512f avx512_bf16", cpu_level="avx2",
                 tokens_per_second="15.0", x_our_ar="1.05"),
            dict(base, date="2026-01-05 00:00:00 UTC", cpu_flags="avx2 fma f16c", cpu_level="avx2", k="5",
                 draft_settings="quantize=int8 siblings=0 length=auto",  # its own row, not the K=3 run's
                 tokens_per_second="12.0", x_our_ar="1.15"),
            dict(base, date="2026-01-06 00:00:00 UTC", machine="Intel Xeon", cpu_flags="avx512f amx_bf16", cpu_level="amx",
                 tokens_per_second="30.0", x_our_ar="2.00"),
            dict(base, date="2026-01-07 00:00:00 UTC", machine="Intel Xeon", cpu_flags="avx512f amx_bf16",
                 cpu_level="avx512", tokens_per_second="25.0", x_our_ar="1.70"),  # the amx run stays: its own row
            dict(base, date="2025-12-01 00:00:00 UTC", machine="Intel Xeon", cpu_flags="avx512f amx_bf16",
                 cpu_level="", tokens_per_second="24.0", x_our_ar="1.60", x_transformers="3.0")]  # before levels
    path = tmp_path / "results.csv"
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=RESULTS_COLUMNS)
        w.writeheader()
        w.writerows(rows)
    lines = table(path).splitlines()[2:]
    assert len(lines) == 7, lines
    auto = [line for line in lines if "(auto)" in line]
    assert len(auto) == 1 and "int8, chain, K<=5 (auto) | 12.00 | 1.15x" in auto[0]
    cells = {line.split(" | ")[1]: line for line in lines if line not in auto}
    assert set(cells) == {"AMD EPYC (AVX-512)", "AMD EPYC (AVX2)", "AMD EPYC (AVX-512), avx2 level", "Intel Xeon (AMX)",
                          "Intel Xeon (AMX), avx512 level", "Intel Xeon (AMX), level not recorded"}
    assert "| 30.00 | 2.00x |" in cells["Intel Xeon (AMX)"] and "| 25.00 | 1.70x |" in cells["Intel Xeon (AMX), avx512 level"]
    assert "| 20.00 | 1.20x | 5.00x | - |" in cells["AMD EPYC (AVX-512)"]
    assert "| 11.00 | 1.10x | - | 1.80x |" in cells["AMD EPYC (AVX2)"]
    assert "int8, chain, K=3" in cells["AMD EPYC (AVX2)"]
