"""llama.cpp as an optional provider in the benchmark: its plain decoding and its speculative decoding.

    .venv/bin/python perf/llamacpp.py --threads 1 2               # build if needed, 4 prompts x 128 tokens
    .venv/bin/python perf/llamacpp.py --threads 1 2 --prompts 2   # the first 2 prompts
    .venv/bin/python perf/e2e.py --dtypes bf16 --methods ar spec_0.5b --no-hf --llamacpp   # next to graphspec

Not part of `make test`: the first run downloads the llama-cpp-python sdist (about 75 MB) and builds
llama.cpp from it (several minutes on 2 cores). Main choices:

- Source: the llama.cpp vendored in the llama-cpp-python sdist (`pip download --no-binary :all:`,
  version ``VERSION``): package registries are reachable here, GitHub is not. The llama.cpp commit is
  the one the sdist's CHANGELOG names for that version; it is passed to cmake so that the binaries
  (and llama-bench's JSON) report it.
- Build: cmake, CPU only, ``-DGGML_NATIVE=ON`` (this machine's instruction set), static libraries,
  only the targets used (llama-bench, llama-speculative, llama-quantize; not the server, nor
  llama-cli, which needs the server's code in this version). Cache: $GRAPHSPEC_CACHE/llamacpp, else
  ~/.cache/graphspec/llamacpp; a build of the same version with the same flags and targets is reused.
- Weights: the zoo's own GGUF files (`models/zoo.fetch`: the PyPI packages graphspec's zoo reads;
  Q4_K/Q6_K for the 1.5B, Q5_0/Q8_0/Q6_K/Q4_K for the 0.5B), requantized to F16 with
  ``llama-quantize --allow-requantize``: the dequantized values graphspec runs, rounded to F16 (graphspec's
  bf16 runs round them to bf16): 2 bytes a weight on both sides. graphspec's drafts are int8 by default
  (perf/e2e.py --draft-quantize), llama.cpp's draft here is F16. ``run(..., weights="zoo")`` (perf/e2e.py
  ``--weights gguf-a8 --llamacpp``) runs the zoo's GGUF files themselves instead, in their own block formats.
- Plain decoding: ``llama-bench -p 0 -n 128`` (tg128: 128 tokens after an empty context, no prompt),
  the mean of ``--reps`` repetitions.
- Speculative decoding: ``llama-speculative`` with the 0.5B as the draft, K=5 (a chain: one draft
  sequence, no early stop in that example), greedy (``--temp 0``), ``--ignore-eos`` (so every prompt
  runs its whole length, as graphspec's ``ignore_eos`` and transformers' ``min_new_tokens``). The
  prompt is the text graphspec encodes: chat prompts rendered with the target's chat template by
  graphspec's tokenizer (the same call as perf/e2e.py), raw prompts as they are; llama.cpp parses the
  special tokens in that text. Its figure is the one it prints: generated tokens / seconds after the
  prompt. That example stops once it has more than n tokens, so a run has n+1 to n+K of them (129-133
  for n=128 here); the rate counts them all. Where it crashes with the weights repacked at load (ggml's AMX
  matrix multiply, seen on an Intel Xeon with AMX), it runs again with ``--no-repack``, as do the runs after it,
  and their results say ``repack: false``; llama-bench keeps its default.
- Errors (no cmake, no compiler, a failed build or run) are one line saying what to install or
  where the log is.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent))
from perf._common import DRAFT, TARGET, load_prompts  # noqa: E402

VERSION = "0.3.36"  # llama-cpp-python, whose sdist vendors llama.cpp (the issue measured this one)
TARGETS = ("llama-bench", "llama-speculative", "llama-quantize")
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF",
               "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_CURL=OFF")
K = 5  # draft tokens a step, as graphspec's spec_0.5b
_STAMP = "graphspec-build.json"


def cache_dir() -> Path:
    """$GRAPHSPEC_CACHE/llamacpp, else ~/.cache/graphspec/llamacpp (next to the zoo's cache)."""
    env = os.environ.get("GRAPHSPEC_CACHE")
    return (Path(env).expanduser() if env else Path.home() / ".cache" / "graphspec") / "llamacpp"


# ----------------------------------------------------------------------------------------------- build


def _say(msg: str) -> None:
    print(f"llamacpp: {msg}", file=sys.stderr, flush=True)


def _tool(names: tuple[str, ...], env: str | None = None) -> str | None:
    if env and os.environ.get(env):
        return shutil.which(os.environ[env].split()[0])
    venv_bin = Path(sys.executable).parent  # `pip install cmake` into the venv puts it here
    for n in names:
        if (venv_bin / n).is_file():
            return str(venv_bin / n)
        if found := shutil.which(n):
            return found
    return None


def _check_toolchain() -> str:
    cmake = _tool(("cmake",))
    if cmake is None:
        raise SystemExit("llamacpp: no cmake found to build llama.cpp; install it with `.venv/bin/pip install cmake` "
                         "or `apt-get install cmake`")
    if _tool(("c++", "g++", "clang++"), "CXX") is None or _tool(("cc", "gcc", "clang"), "CC") is None:
        raise SystemExit("llamacpp: no C/C++ compiler found to build llama.cpp; install one with "
                         "`apt-get install build-essential` (or set CC / CXX)")
    return cmake


def _run_logged(cmd: list[str], log: Path, what: str, progress=None) -> None:
    """Run ``cmd``, its output into ``log``; ``progress(line)`` sees each line. One-line SystemExit on failure."""
    with open(log, "a") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        try:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    text=True, errors="replace")
        except OSError as e:
            raise SystemExit(f"llamacpp: {what} could not start ({e.strerror}: {cmd[0]})") from None
        tail: list[str] = []
        for line in proc.stdout:
            f.write(line)
            tail = (tail + [line.rstrip()])[-12:]
            if progress:
                progress(line.rstrip())
        rc = proc.wait()
    if rc != 0:
        print("\n".join(tail), file=sys.stderr)
        raise SystemExit(f"llamacpp: {what} failed (exit {rc}); the last lines are above, the whole log is {log}")


def _llamacpp_commit(src: Path, version: str) -> str:
    """The llama.cpp commit that llama-cpp-python's CHANGELOG names for ``version`` ("unknown" if none)."""
    try:
        text = (src / "CHANGELOG.md").read_text(errors="replace")
    except OSError:
        return "unknown"
    section = re.search(rf"^## \[{re.escape(version)}\]\s*$(.*?)(?=^## \[|\Z)", text, re.M | re.S)
    found = re.search(r"llama\.cpp@([0-9a-f]{7,40})", section.group(1)) if section else None
    return found.group(1) if found else "unknown"


def _download_sdist(dest: Path, version: str) -> Path:
    name = f"llama_cpp_python-{version}.tar.gz"
    if (dest / name).is_file():
        return dest / name
    _say(f"downloading the llama-cpp-python {version} sdist (about 75 MB) with pip")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--disable-pip-version-check",
           "-d", str(dest), f"llama-cpp-python=={version}"]
    if subprocess.run(cmd, stdin=subprocess.DEVNULL).returncode != 0 or not (dest / name).is_file():
        raise SystemExit(f"llamacpp: pip download of llama-cpp-python=={version} (sdist) failed; check that PyPI is "
                         "reachable and offers that version (`pip index versions llama-cpp-python`)")
    return dest / name


def _unpack(sdist: Path, dest: Path, version: str) -> Path:
    """The sdist unpacked under dest/src-<version>/ (renamed into place only when complete)."""
    final = dest / f"src-{version}"
    top = final / f"llama_cpp_python-{version}"
    if (top / "vendor" / "llama.cpp" / "CMakeLists.txt").is_file():
        return top
    tmp = dest / f".src-{version}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    _say(f"unpacking {sdist.name}")
    with tarfile.open(sdist) as tf:
        if hasattr(tarfile, "data_filter"):
            tf.extractall(tmp, filter="data")
        else:  # Python < 3.11.4: no extraction filters
            tf.extractall(tmp)
    if not (tmp / top.name / "vendor" / "llama.cpp" / "CMakeLists.txt").is_file():
        shutil.rmtree(tmp, ignore_errors=True)
        raise SystemExit(f"llamacpp: {sdist.name} has no vendor/llama.cpp/CMakeLists.txt; this version of "
                         "llama-cpp-python does not vendor llama.cpp's source as expected, pick another (--version)")
    shutil.rmtree(final, ignore_errors=True)
    os.rename(tmp, final)
    return top


def build(dest: str | os.PathLike | None = None, version: str = VERSION, jobs: int | None = None) -> Path:
    """Build llama.cpp's ``TARGETS`` from the llama-cpp-python ``version`` sdist; returns the folder of the binaries.

    Skipped when a build with the same version, commit and flags is already there. Prints progress on stderr.
    """
    dest = Path(dest) if dest is not None else cache_dir()
    dest.mkdir(parents=True, exist_ok=True)
    bin_dir = dest / f"build-{version}" / "bin"
    stamp_file = dest / f"build-{version}" / _STAMP

    def current() -> bool:
        try:
            stamp = json.loads(stamp_file.read_text())
        except (OSError, ValueError):
            return False
        return (stamp.get("flags") == list(CMAKE_FLAGS) and set(stamp.get("targets", [])) >= set(TARGETS)
                and all((bin_dir / t).is_file() for t in TARGETS))

    if current():
        return bin_dir
    cmake = _check_toolchain()
    fd = os.open(dest / "build.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _say("waiting for another process that is building llama.cpp ...")
            fcntl.flock(fd, fcntl.LOCK_EX)
        if current():
            return bin_dir
        top = _unpack(_download_sdist(dest, version), dest, version)
        commit = _llamacpp_commit(top, version)
        src = top / "vendor" / "llama.cpp"
        build_dir = bin_dir.parent
        stamp_file.unlink(missing_ok=True)
        log = dest / f"build-{version}.log"
        log.write_text("")
        generator = ["-G", "Ninja"] if _tool(("ninja",)) else []
        started = time.monotonic()
        _say(f"configuring llama.cpp {commit} (llama-cpp-python {version}); log: {log}")
        _run_logged([cmake, "-S", str(src), "-B", str(build_dir), *generator, *CMAKE_FLAGS,
                     f"-DLLAMA_BUILD_COMMIT={commit}"], log, "cmake's configure step of llama.cpp")
        jobs = jobs or os.cpu_count() or 2
        _say(f"building {', '.join(TARGETS)} with {jobs} jobs (several minutes on 2 cores)")
        shown = [0.0]

        def progress(line: str) -> None:  # "[12/180] ..." (ninja) or "[ 12%] ..." (make): one line in 20 s
            m = re.match(r"\[\s*(\d+)/(\d+)\]|\[\s*(\d+)%\]", line)
            if m and time.monotonic() - shown[0] > 20:
                shown[0] = time.monotonic()
                frac = f"{m.group(1)}/{m.group(2)}" if m.group(1) else f"{m.group(3)}%"
                _say(f"  build {frac} after {time.monotonic() - started:.0f}s")

        _run_logged([cmake, "--build", str(build_dir), "-j", str(jobs), "--target", *TARGETS], log,
                    "the llama.cpp build (a compiler error, or too little memory for -j; see the log)", progress)
        missing = [t for t in TARGETS if not (bin_dir / t).is_file()]
        if missing:
            raise SystemExit(f"llamacpp: the build finished but {', '.join(missing)} is not in {bin_dir}; see {log}")
        stamp_file.write_text(json.dumps({"version": version, "commit": commit, "flags": list(CMAKE_FLAGS),
                                          "targets": list(TARGETS), "seconds": round(time.monotonic() - started)},
                                         indent=1) + "\n")
        _say(f"built in {time.monotonic() - started:.0f}s: {bin_dir}")
        return bin_dir
    finally:
        os.close(fd)


def build_info(bin_dir: Path) -> dict:
    """What was built: the stamp written by ``build`` (version, commit, flags, targets)."""
    try:
        return json.loads((bin_dir.parent / _STAMP).read_text())
    except (OSError, ValueError):
        return {}


# ----------------------------------------------------------------------------------------------- weights


def f16_gguf(name: str, bin_dir: Path) -> Path:
    """Zoo model ``name`` as an F16 GGUF (the zoo's GGUF requantized by llama-quantize), cached."""
    from graphspec.models import zoo

    out = cache_dir() / "gguf" / f"{name}-f16.gguf"
    if out.is_file():
        return out
    src = zoo.fetch(name)  # the zoo's own packages and checksum; kept in the zoo's cache (gguf/)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    log = out.with_suffix(".log")
    log.write_text("")
    _say(f"requantizing {src.name} to F16")
    try:
        _run_logged([str(bin_dir / "llama-quantize"), "--allow-requantize", str(src), str(tmp), "F16",
                     str(os.cpu_count() or 1)], log, f"llama-quantize of {src} to F16")
        os.rename(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def prepare(version: str = VERSION, weights: str = "f16") -> tuple[Path, Path, Path]:
    """Everything a run needs, built or fetched if missing: (binaries' folder, target GGUF, draft GGUF).

    ``weights``: "f16" (the zoo's files requantized to F16, cached) or "zoo" (the zoo's GGUF files themselves)."""
    if weights not in ("f16", "zoo"):
        raise ValueError(f"weights must be 'f16' or 'zoo', got {weights!r}")
    bin_dir = build(version=version)
    if weights == "zoo":
        from graphspec.models import zoo

        return bin_dir, zoo.fetch(TARGET), zoo.fetch(DRAFT)
    return bin_dir, f16_gguf(TARGET, bin_dir), f16_gguf(DRAFT, bin_dir)


def prompt_texts(prompts: list[dict], tokenizer=None) -> list[str]:
    """The text of each prompt as graphspec encodes it: chat prompts through the target's chat template."""
    if tokenizer is None and any("messages" in p for p in prompts):
        from graphspec.models import zoo
        from graphspec.models.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_dir(zoo.resolve(TARGET))
    return [tokenizer.apply_chat_template(p["messages"], add_generation_prompt=True) if "messages" in p
            else p["prompt"] for p in prompts]


# ----------------------------------------------------------------------------------------------- runs


def _run(cmd: list[str], what: str, timeout: float, crash_ok: bool = False) -> subprocess.CompletedProcess:
    """Run ``cmd``; a failure is one line (SystemExit), except a crash (killed by a signal) with ``crash_ok``."""
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, errors="replace", stdin=subprocess.DEVNULL,
                             timeout=timeout)
    except subprocess.TimeoutExpired:
        raise SystemExit(f"llamacpp: {what} ran past {timeout:.0f}s; the machine is too loaded, or lower --reps") from None
    if res.returncode < 0 and crash_ok:
        return res
    if res.returncode != 0:
        print("\n".join((res.stdout + res.stderr).strip().splitlines()[-12:]), file=sys.stderr)
        raise SystemExit(f"llamacpp: {what} failed (exit {res.returncode}); its last lines are above; command: "
                         f"{' '.join(cmd[:6])} ...")
    return res


def bench(bin_dir: Path, model: Path, threads: int, n: int = 128, reps: int = 3) -> dict:
    """llama-bench's tg<n> (``-p 0 -n n``): mean and spread of generation tokens/s over ``reps`` runs."""
    cmd = [str(bin_dir / "llama-bench"), "-m", str(model), "-p", "0", "-n", str(n), "-t", str(threads),
           "-r", str(reps), "-ngl", "0", "-o", "json"]
    res = _run(cmd, f"llama-bench ({threads} threads)", timeout=60 + reps * n * 5.0)
    try:
        row = json.loads(res.stdout)[0]
    except (ValueError, IndexError, KeyError):
        raise SystemExit(f"llamacpp: llama-bench printed no JSON row; its output began: {res.stdout[:200]!r}") from None
    return {"tokens_per_second": row["avg_ts"], "stddev": row.get("stddev_ts"), "samples": row.get("samples_ts"),
            "threads": row.get("n_threads", threads), "n_gen": row.get("n_gen", n), "reps": reps,
            "build_commit": row.get("build_commit"), "cpu_info": row.get("cpu_info"),
            "model_type": row.get("model_type"), "model_size": row.get("model_size")}


def _flags(binary: Path) -> str:
    res = subprocess.run([str(binary), "--help"], capture_output=True, text=True, errors="replace",
                         stdin=subprocess.DEVNULL, timeout=60)
    return res.stdout + res.stderr


def speculative(bin_dir: Path, target: Path, draft: Path, prompt: str, threads: int, n: int = 128, k: int = K,
                help_text: str | None = None, repack: bool = True) -> dict:
    """One llama-speculative run: greedy, ``n`` tokens (EOS ignored), ``k`` draft tokens a step, CPU only;
    ``repack=False``: with ``--no-repack`` from the start (an earlier run of this binary crashed with repacking)."""
    exe = bin_dir / "llama-speculative"
    help_text = help_text if help_text is not None else _flags(exe)
    # the draft-length flag was renamed (--draft-max until 2026, --spec-draft-n-max in this version)
    k_flag = "--spec-draft-n-max" if "--spec-draft-n-max" in help_text else "--draft-max"
    cmd = [str(exe), "-m", str(target), "-md", str(draft), k_flag, str(k), "-t", str(threads), "-tb", str(threads),
           "-n", str(n), "--temp", "0", "--ignore-eos", "-s", "0", "-ngl", "0", "-p", prompt]
    for flag in ("-td", "-tbd"):  # the draft's threads, where the version has the flags
        if re.search(rf"(^|[\s,]){flag}[\s,]", help_text, re.M):
            cmd[-2:-2] = [flag, str(threads)]
    if re.search(r"(^|[\s,])-ngld[\s,]", help_text, re.M):
        cmd[-2:-2] = ["-ngld", "0"]
    timeout = 120 + n * 10.0
    if not repack:
        cmd[-2:-2] = ["--no-repack"]
    res = _run(cmd, f"llama-speculative ({threads} threads)", timeout, crash_ok=repack and "--no-repack" in help_text)
    if res.returncode < 0:
        # Seen on an Intel Xeon with AMX: ggml's AMX mul_mat, which runs on the weights repacked at load, crashes
        # (SIGSEGV) in this example; without repacking it runs. The result records which way it ran.
        print(f"llamacpp: llama-speculative crashed (signal {-res.returncode}) with weight repacking; "
              "running it again with --no-repack", file=sys.stderr)
        cmd[-2:-2] = ["--no-repack"]
        repack = False
        res = _run(cmd, f"llama-speculative ({threads} threads, --no-repack)", timeout)
    out = res.stdout + "\n" + res.stderr
    enc = re.search(r"encoded\s+(\d+) tokens in\s+([\d.]+) seconds", out)
    dec = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds, speed:\s+([\d.]+) t/s", out)
    drafted = re.search(r"n_drafted\s*=\s*(\d+)", out)
    accepted = re.search(r"n_accept\s*=\s*(\d+)", out)
    if not (enc and dec and drafted and accepted):
        raise SystemExit("llamacpp: llama-speculative's output has no 'decoded N tokens in T seconds' / n_drafted / "
                         "n_accept lines (another version's format?); its last lines: "
                         + " | ".join(out.strip().splitlines()[-4:]))
    tokens, seconds = int(dec.group(1)), float(dec.group(2))
    return {"tokens": tokens, "seconds": seconds, "tokens_per_second": tokens / seconds,
            "prompt_tokens": int(enc.group(1)), "prompt_seconds": float(enc.group(2)),
            "drafted": int(drafted.group(1)), "accepted": int(accepted.group(1)), "command_flags": cmd[5:-2],
            "repack": repack}


def run(threads: list[int], prompts: list[dict], max_new_tokens: int = 128, k: int = K, reps: int = 3,
        tokenizer=None, log=print, version: str = VERSION, weights: str = "f16") -> dict:
    """Build if needed, then llama-bench (plain) and llama-speculative (0.5B draft) at each thread count, on
    ``weights`` (see :func:`prepare`)."""
    bin_dir, target, draft = prepare(version, weights)
    texts = prompt_texts(prompts, tokenizer)
    help_text = _flags(bin_dir / "llama-speculative")
    info = build_info(bin_dir)
    report = {"llamacpp": {"llama_cpp_python": info.get("version"), "commit": info.get("commit"),
                           "cmake_flags": info.get("flags")},
              "target": f"{TARGET} ({target.name})", "draft": f"{DRAFT} ({draft.name})", "weights": weights,
              "num_speculative_tokens": k,
              "max_new_tokens": max_new_tokens, "num_prompts": len(prompts), "prompt_kinds": [p["kind"] for p in prompts],
              "bench_reps": reps, "threads": {}}
    for t in threads:
        log(f"[llama.cpp, {t} thread{'s' if t > 1 else ''}]")
        ar = bench(bin_dir, target, t, max_new_tokens, reps)
        log(f"  llama-bench tg{max_new_tokens}: {ar['tokens_per_second']:.2f} tok/s (+-{ar['stddev'] or 0:.2f}, "
            f"{reps} reps)")
        runs = []
        repack = True  # until a run crashes with it: then the rest run without, not crash again first
        for i, text in enumerate(texts):
            r = speculative(bin_dir, target, draft, text, t, max_new_tokens, k, help_text, repack)
            repack = r["repack"]
            runs.append(r)
            log(f"  llama-speculative prompt {i + 1}/{len(texts)}: {r['tokens_per_second']:.2f} tok/s, "
                f"{r['tokens']} tokens, accepted {r['accepted']}/{r['drafted']}")
        tokens, seconds = sum(r["tokens"] for r in runs), sum(r["seconds"] for r in runs)
        drafted, accepted = sum(r["drafted"] for r in runs), sum(r["accepted"] for r in runs)
        spec = {"tokens": tokens, "seconds": seconds, "tokens_per_second": tokens / seconds,
                "with_prompt_tokens_per_second": tokens / (seconds + sum(r["prompt_seconds"] for r in runs)),
                "acceptance_rate": accepted / drafted if drafted else 0.0, "drafted": drafted, "accepted": accepted,
                "per_prompt_tokens_per_second": [r["tokens_per_second"] for r in runs], "runs": runs}
        report["threads"][str(t)] = {"ar": ar, "speculative": spec,
                                     "speculative_vs_ar": spec["tokens_per_second"] / ar["tokens_per_second"]}
    return report


def table(report: dict) -> str:
    lines = [f"| threads | llama-bench tg{report['max_new_tokens']} tok/s | llama-speculative tok/s (K="
             f"{report['num_speculative_tokens']}) | speculative / plain | acceptance |", "|---|---|---|---|---|"]
    for t, r in report["threads"].items():
        lines.append(f"| {t} | {r['ar']['tokens_per_second']:.2f} | {r['speculative']['tokens_per_second']:.2f} | "
                     f"{r['speculative_vs_ar']:.2f} | {r['speculative']['acceptance_rate']:.3f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--prompts", type=int, default=None, help="use only the first N prompts of perf/prompts.json")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=K, help="draft tokens a step")
    ap.add_argument("--reps", type=int, default=3, help="llama-bench repetitions")
    ap.add_argument("--version", default=VERSION, help="the llama-cpp-python sdist whose llama.cpp is built")
    ap.add_argument("--build-only", action="store_true", help="build (or find) the binaries and stop")
    ap.add_argument("--out", default="llamacpp.json", help="a .json file name (under perf/results/) or a path")
    args = ap.parse_args(argv)
    if args.build_only:
        print(build(version=args.version))
        return 0
    from perf._common import machine_info, output_path, save_json

    out = output_path(args.out)
    prompts = load_prompts(limit=args.prompts)
    started = machine_info()
    report = run(args.threads, prompts, args.max_new_tokens, args.k, args.reps, version=args.version)
    report = {"machine": started, **report}
    report["machine"]["loadavg_end"] = list(os.getloadavg())
    print(table(report))
    print(f"# wrote {save_json(out, report)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
