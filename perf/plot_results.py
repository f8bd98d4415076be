"""Draw the results table (perf/results.csv): speedup over our autoregressive run, per draft pair and machine.

    .venv/bin/python perf/plot_results.py                    # -> docs/img/results.png
    .venv/bin/python perf/plot_results.py --dtype fp32 --out /tmp/fp32.png
    .venv/bin/python perf/plot_results.py --table             # the README's results table (markdown)

One panel per draft pair (the 0.5B draft, SmolLM2-135M across tokenizers); each line is one machine and
thread count, each point one full run (4 prompts x 128 tokens) of the pair's tree method, in date order.
Ratios compare runs within one report (interleaved), so points from different days compare as ratios only.
"""

from __future__ import annotations

import argparse
import csv
import sys
from datetime import datetime
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent))
from perf._common import PERF_DIR, RESULTS_CSV  # noqa: E402

PAIRS = {"spec_0.5b": "Qwen2.5-Coder-0.5B draft", "spec_smollm2": "SmolLM2-135M draft (other tokenizer)"}
DEFAULT_OUT = PERF_DIR.parent / "docs" / "img" / "results.png"


def load(path: Path, dtype: str, full_only: bool = True) -> list[dict]:
    """The rows of the two pairs' tree methods in ``dtype`` (full runs only unless ``full_only`` is False)."""
    with path.open(newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["method"] in PAIRS and r["dtype"] == dtype and r["x_our_ar"]]
    if full_only:
        rows = [r for r in rows if r["prompts"] == "4" and r["max_new_tokens"] == "128"]
    return rows


def plot(rows: list[dict], out: Path, dtype: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.dates
    import matplotlib.pyplot as plt

    if not rows:
        raise SystemExit(f"no {dtype} rows of {sorted(PAIRS)} with 4 prompts x 128 tokens in the table; "
                         "run perf/e2e.py first or pick another --dtype")
    fig, axes = plt.subplots(1, len(PAIRS), figsize=(11, 4), sharey=True)
    for ax, (method, title) in zip(axes, PAIRS.items()):
        lines: dict[str, list[tuple[datetime, float]]] = {}
        for r in rows:
            if r["method"] == method:
                key = f"{r['machine']}, {r['threads']} thread{'s' if r['threads'] != '1' else ''}"
                when = datetime.strptime(r["date"][:16], "%Y-%m-%d %H:%M")
                lines.setdefault(key, []).append((when, float(r["x_our_ar"])))
        for key, pts in sorted(lines.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=key)
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_title(title, fontsize=10)
        ax.xaxis.set_major_formatter(matplotlib.dates.DateFormatter("%m-%d %H:%M"))
        ax.tick_params(axis="x", labelrotation=45, labelsize=7)
        ax.legend(fontsize=7)
    axes[0].set_ylabel(f"tok/s / our autoregressive ({dtype})")
    fig.suptitle("Qwen2.5-Coder-1.5B target, greedy, 4 prompts x 128 tokens (perf/results.csv)", fontsize=11)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


# The table also shows each pair's chain methods (the GGUF targets' runs draft chains).
TABLE_PAIRS = {**PAIRS, "spec_0.5b_chain": PAIRS["spec_0.5b"], "spec_smollm2_chain": PAIRS["spec_smollm2"]}


# A row's instruction set, from its CPU flags, and the CPU backend levels a run on it uses by default.
ISAS = (("amx", "AMX", ("amx",)), ("avx512", "AVX-512", ("avx512",)), ("avx2", "AVX2", ("avx2",)))


def machine_label(r: dict) -> str:
    """``lscpu`` model name and instruction set (one model name covers CPUs of different sets: AMD EPYC Zen 3 and
    Zen 4), plus the CPU backend level where a run asked for a lower one than the machine's. A row that did not
    record its level on an AMX CPU says so: it predates the amx level, so it did not run what that label now means."""
    for flag, isa, levels in ISAS:
        if flag in r["cpu_flags"]:
            label = f"{r['machine']} ({isa})"
            if not r["cpu_level"]:
                return f"{label}, level not recorded" if flag == "amx" else label
            return label if r["cpu_level"] in levels else f"{label}, {r['cpu_level']} level"
    return r["machine"]


def draft_settings(r: dict) -> dict:
    """A row's ``draft_settings`` ("quantize=int8 siblings=0 ...") as a dict."""
    return dict(kv.split("=", 1) for kv in r["draft_settings"].split())


def table(path: Path) -> str:
    """The README's results table: per draft pair and method, machine (:func:`machine_label`), weights, threads and
    the draft's quantization, the latest full run, preferring one measured
    against transformers; and llama.cpp's ratio from the latest run that measured it (its date when another
    run's)."""
    with path.open(newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["method"] in TABLE_PAIRS and r["prompts"] == "4"
                and r["max_new_tokens"] == "128"]
    best: dict[tuple, dict] = {}
    llama: dict[tuple, dict] = {}
    for r in sorted(rows, key=lambda r: r["date"]):
        settings = draft_settings(r)  # a run drafting 1..K tokens a step (length=auto) is its own row
        key = (TABLE_PAIRS[r["method"]], r["method"], machine_label(r), r["dtype"], r["threads"],
               settings.get("quantize", ""), settings.get("length", ""))
        if r["x_transformers"] or key not in best or not best[key]["x_transformers"]:
            best[key] = r
        if r["x_llamacpp"]:
            llama[key] = r
    out = ["| pair | machine | weights, threads | draft | tok/s | x our AR | x transformers (assisted) | x llama.cpp | "
           "tokens / target forward | same tokens as AR | date | commit |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for key in sorted(best):
        r = best[key]
        lc = llama.get(key)
        lc_cell = "-" if lc is None else f"{float(lc['x_llamacpp']):.2f}x" + (
            "" if lc is r else f" ({lc['date'][:10]}, {lc['commit']})")
        hf_cell = f"{float(r['x_transformers']):.2f}x" if r["x_transformers"] else "-"
        settings = draft_settings(r)
        shape = {"?": "", "0": "chain"}.get(settings.get("siblings", "?"), "tree")
        k = f"K<={r['k']} (auto)" if settings.get("length") == "auto" else f"K={r['k']}"
        draft = ", ".join(x for x in (settings.get("quantize", "?").replace("?", ""), shape, k) if x)
        out.append(f"| {TABLE_PAIRS[r['method']]} | {key[2]} | {r['dtype']}, {r['threads']} | {draft} | "
                   f"{float(r['tokens_per_second']):.2f} | {float(r['x_our_ar']):.2f}x | "
                   f"{hf_cell} | {lc_cell} | {float(r['tokens_per_target_forward']):.2f} | "
                   f"{r['same_tokens_as_ar']} | {r['date'][:10]} | {r['commit']} |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--csv", type=Path, default=RESULTS_CSV, help="the results table (default perf/results.csv)")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the PNG to write (default docs/img/results.png)")
    ap.add_argument("--table", action="store_true", help="print the README's results table instead of drawing")
    args = ap.parse_args(argv)
    if not args.csv.is_file():
        raise SystemExit(f"--csv {args.csv}: no such file; perf/e2e.py writes perf/results.csv")
    if args.table:
        print(table(args.csv))
        return 0
    print(f"wrote {plot(load(args.csv, args.dtype), args.out, args.dtype)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
