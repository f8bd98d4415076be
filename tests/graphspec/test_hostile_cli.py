"""Issue #28 through the command line: each row of its table gives exit status 2 and one error (its first line
``graphspec: error: ...``, then the indented problems it lists, if several), never a traceback, and it is found
before the expensive work. Most run ``graphspec.cli.main`` in this process; what needs real argv bytes, stdin,
a FIFO or a kill runs a subprocess."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from graphspec import cli
from graphspec.models import zoo
from tests.checkpoints import make_checkpoint
from tests.models.test_zoo import NAME, cache, fake, wheels  # noqa: F401  (fixtures: a fake zoo entry)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("hostile-cli") / "tiny", "llama", tokenizer="bytelevel",
                           chat_template="chatml")


def _copy(src: Path, dst: Path, config: dict | None = None, skip=()) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        if f.name not in skip:
            os.link(f, dst / f.name)
    if config is not None:
        d = json.loads((src / "config.json").read_text())
        d.update(config)
        (dst / "config.json").unlink()
        (dst / "config.json").write_text(json.dumps(d))
    return dst


def _main(capsys, *args) -> tuple[int, str, str]:
    try:
        rc = cli.main([str(a) for a in args])
    except SystemExit as e:  # argparse's own errors
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_error(rc: int, err: str, *fragments: str) -> str:
    """Exit 2, no traceback, exactly one error line; every fragment in the error (its first line or the indented
    lines after it). Returns the error's text."""
    assert rc == 2, (rc, err)
    assert "Traceback" not in err, err
    lines = err.rstrip("\n").splitlines()
    starts = [i for i, line in enumerate(lines) if ": error:" in line and line.startswith("graphspec")]
    assert len(starts) == 1, err
    error = lines[starts[0]:]
    assert all(line.startswith("  ") for line in error[1:]), err
    text = "\n".join(error)
    for f in fragments:
        assert f in text, (f, text)
    return text


def _cli(*args, input_bytes=None, timeout=120, env_extra=None):
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "graphspec", *args], capture_output=True, input=input_bytes,
                          timeout=timeout, env=env)


# --- the cache folder ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("where", ["file", "sys", "proc", "readonly"])
@pytest.mark.parametrize("command", ["fetch", "run"])
def test_an_unusable_cache_folder(capsys, tmp_path, monkeypatch, where, command):
    if where == "file":
        root = tmp_path / "cache"
        root.write_text("not a folder")
    elif where == "readonly":
        if os.geteuid() == 0:
            pytest.skip("root writes into read-only folders (the sys and proc cases cover root)")
        root = tmp_path / "ro"
        root.mkdir(mode=0o555)
    else:
        root = Path("/sys/graphspec-cache") if where == "sys" else Path("/proc")
    monkeypatch.setenv("GRAPHSPEC_CACHE", str(root))
    args = (["fetch", "smollm2-135m-instruct"] if command == "fetch" else
            ["run", "--target", "smollm2-135m-instruct", "--device", "cpu", "hi"])
    rc, out, err = _main(capsys, *args)
    assert_one_error(rc, err, f"GRAPHSPEC_CACHE={root}", "point GRAPHSPEC_CACHE at a writable folder")
    assert out == ""


# --- bench -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("target", ["/nonexistent/dir/out.json", "DIR"])
def test_bench_json_path_is_checked_before_the_benchmark(capsys, tiny, tmp_path, target):
    target = str(tmp_path) if target == "DIR" else target
    rc, out, err = _main(capsys, "bench", "--target", tiny, "--draft", "ngram", "--json", target)
    assert_one_error(rc, err, "--json", target)
    assert "loading" not in err and "prompt 0" not in out  # nothing was loaded or measured


@pytest.mark.parametrize("line, fragment", [
    ('{"messages":[{"role":"user","content":5}]}', "line 2 has message #0 that is not"),
    ('{"messages":"text"}', "line 2 has \"messages\" that are not a non-empty list"),
    ('{"messages":[1,2,3]}', "line 2 has message #0 that is not"),
    ('{"prompt":[1,2,3]}', "token ids go in \"token_ids\""),
    ('{"token_ids":[1,"2"]}', "line 2 has \"token_ids\" that are not"),
    ('{"prompt":"a","messages":[]}', "needs exactly one of"),
    ('[1,2]', "line 2 is a JSON list"),
    ('{"prompt": "x", "kind": 3}', "\"kind\" that is not a string"),
    ("[" * 50_000, "line 2 is not JSON"),
])
def test_bench_prompt_files_are_checked_line_by_line(capsys, tiny, tmp_path, line, fragment):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "fine"}\n' + line + "\n")
    rc, out, err = _main(capsys, "bench", "--target", tiny, "--draft", "ngram", "--prompts", prompts)
    assert_one_error(rc, err, f"--prompts {prompts}: ", fragment)
    assert "loading" not in err


def test_bench_prompt_file_forms_that_are_accepted(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('"plain"\n{"prompt": "p", "kind": "code"}\n{"token_ids": [1, 2, 3]}\n'
                       '{"messages": [{"role": "user", "content": "hi"}]}\n\n')
    got = cli._read_prompts(prompts)
    assert [sorted(g) for g in got] == [["prompt"], ["kind", "prompt"], ["token_ids"], ["messages"]]
    (tmp_path / "bad.txt").write_bytes(b"ok\n\xff\xfe\n")
    with pytest.raises(cli.CLIError, match="not valid UTF-8"):
        cli._read_prompts(tmp_path / "bad.txt")
    # a .json file: one list of the same items (not one text line holding the whole file)
    listed = tmp_path / "p.json"
    listed.write_text(json.dumps(["plain", {"prompt": "p", "kind": "code"}, {"token_ids": [1, 2, 3]},
                                  {"messages": [{"role": "user", "content": "hi"}]}], indent=1))
    assert cli._read_prompts(listed) == [{"prompt": "plain"}] + [json.loads(x) for x in (
        '{"prompt": "p", "kind": "code"}', '{"token_ids": [1, 2, 3]}', '{"messages": [{"role": "user", "content": "hi"}]}')]


@pytest.mark.parametrize("text, fragment", [
    ('{"prompt": "one"}', "a .json file holds a list of prompts"),
    ('["fine", {"prompt": 3}]', "item 2 has a \"prompt\" that is not"),
    ('["fine", 7]', "item 2 is a JSON int"),
    ('[{"prompt": "x"}', "not JSON"),
    ("[]", "no prompts in the file"),
])
def test_bench_json_prompt_files_are_checked(capsys, tiny, tmp_path, text, fragment):
    prompts = tmp_path / "p.json"
    prompts.write_text(text)
    rc, out, err = _main(capsys, "bench", "--target", tiny, "--draft", "ngram", "--prompts", prompts)
    assert_one_error(rc, err, f"--prompts {prompts}: ", fragment)
    assert "loading" not in err


def test_bench_checks_every_prompt_encodes_before_measuring(capsys, tiny, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "fine"}\n{"token_ids": [5, 100000]}\n')
    rc, out, err = _main(capsys, "bench", "--target", tiny, "--draft", "ngram", "--dtype", "fp32", "--prompts",
                         prompts)
    assert_one_error(rc, err, "prompt 2: prompt holds token ids outside [0, 400)")
    assert "prompt 0" not in out  # nothing was measured


def test_bench_runs_token_id_prompts(capsys, tiny, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"token_ids": [5, 6, 7, 8]}\n')
    out_json = tmp_path / "r.json"
    rc, out, err = _main(capsys, "bench", "--target", tiny, "--draft", "ngram", "--dtype", "fp32", "--prompts",
                         prompts, "--max-new-tokens", "4", "--max-k", "2", "--json", out_json)
    assert rc == 0, err
    assert len(json.loads(out_json.read_text())["prompts"]) == 1


# --- run: text, devices, seeds, sizes --------------------------------------------------------------------------

def test_invalid_utf8_argument_and_stdin(tiny):
    p = _cli("run", "--target", str(tiny), "--dtype", "fp32", "--max-new-tokens", "2", b"\xff\xfehi")
    assert_one_error(p.returncode, p.stderr.decode(errors="replace"), "the prompt is not valid UTF-8 (byte 0xff")
    assert b"loading" not in p.stderr
    p = _cli("run", "--target", str(tiny), "--dtype", "fp32", "--max-new-tokens", "2", "-", input_bytes=b"ok \xc3(")
    assert_one_error(p.returncode, p.stderr.decode(errors="replace"), "standard input is not valid UTF-8 (byte 0xc3")
    p = _cli("run", "--target", str(tiny), "--dtype", "fp32", "--max-new-tokens", "2", "--stop", b"\xff", "hi")
    assert_one_error(p.returncode, p.stderr.decode(errors="replace"), "--stop is not valid UTF-8")


@pytest.mark.parametrize("device, fragment", [
    ("meta", "graphspec runs on cpu or cuda devices only"), ("mps", "cpu or cuda devices only"),
    ("tpu", "is not a device"), ("cuda:99", "cuda"), ("", "is not a device"),
])
def test_devices_other_than_cpu_and_cuda(capsys, tiny, device, fragment):
    rc, out, err = _main(capsys, "run", "--target", tiny, "--device", device, "hi")
    assert_one_error(rc, err, "--device", fragment)
    assert "loading" not in err


def test_a_thread_count_that_would_abort_openmp(capsys, tiny):
    rc, out, err = _main(capsys, "run", "--target", tiny, "--threads", "1000000000", "hi")
    assert_one_error(rc, err, "argument --threads: expected at most 1024 threads, got 1000000000")


@pytest.mark.parametrize("seed", ["18446744073709551616", "-1", "1.5", "seven"])
def test_seeds_outside_64_bits_are_refused_naming_the_seed(capsys, tiny, seed):
    rc, out, err = _main(capsys, "run", "--target", tiny, "--seed", seed, "hi")
    assert_one_error(rc, err, "argument --seed: expected an integer seed with 0 <= seed < 2**64", seed)


def test_the_largest_seed_runs_and_seeds_differ(capsys, tiny):
    def run(seed):
        rc, out, err = _main(capsys, "run", "--target", tiny, "--dtype", "fp32", "--temperature", "2",
                             "--max-new-tokens", "24", "--ignore-eos", "--seed", seed, "The quick")
        assert rc == 0, err
        return out

    assert run(2**64 - 1) == run(2**64 - 1)
    assert run(1) != run(2**32 + 1)


def test_huge_max_new_tokens_with_a_huge_context_claim(capsys, tiny, tmp_path):
    d = _copy(tiny, tmp_path / "m", {"max_position_embeddings": 10**15})
    rc, out, err = _main(capsys, "run", "--target", d, "--max-new-tokens", "100000000", "hi")
    assert_one_error(rc, err, "max_position_embeddings=1000000000000000, above graphspec's limit")


@pytest.mark.parametrize("config, fragment", [
    ({"rope_parameters": {"rope_theta": float("inf"), "rope_type": "default"}}, "rope_theta=inf"),
    ({"num_hidden_layers": 10**6}, "num_hidden_layers=1000000, above graphspec's limit"),
    ({"num_hidden_layers": 500}, "num_hidden_layers=500 but the weights hold layers 0..1"),
])
def test_configs_the_weights_cannot_back(capsys, tiny, tmp_path, config, fragment):
    d = _copy(tiny, tmp_path / "m", config)
    rc, out, err = _main(capsys, "run", "--target", d, "hi")
    assert_one_error(rc, err, fragment)


def test_a_directory_named_model_safetensors(capsys, tiny, tmp_path):
    d = _copy(tiny, tmp_path / "m", skip=("model.safetensors",))
    (d / "model.safetensors").mkdir()
    rc, out, err = _main(capsys, "run", "--target", d, "hi")
    assert_one_error(rc, err, "model.safetensors is a directory, not a regular file")


def test_a_fifo_named_model_safetensors(tiny, tmp_path):
    d = _copy(tiny, tmp_path / "m", skip=("model.safetensors",))
    os.mkfifo(d / "model.safetensors")
    p = _cli("run", "--target", str(d), "hi", timeout=120)  # it hung forever before
    assert_one_error(p.returncode, p.stderr.decode(), "model.safetensors is a named pipe, not a regular file")


def test_a_loader_error_prints_every_problem(capsys, tiny, tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    d = _copy(tiny, tmp_path / "m", skip=("model.safetensors",))
    t = load_file(tiny / "model.safetensors")
    t["model.layers.0.self_attn.k_proj.weight"] = t["model.layers.0.self_attn.k_proj.weight"].T.contiguous()
    t["model.layers.1.mlp.up_proj.weight"] = t["model.layers.1.mlp.up_proj.weight"].to(torch.int32)
    save_file(t, d / "model.safetensors")
    rc, out, err = _main(capsys, "run", "--target", d, "hi")
    text = assert_one_error(rc, err, "(2 problem(s))", "model.layers.0.self_attn.k_proj.weight has shape (64, 32)",
                            "model.layers.1.mlp.up_proj.weight has dtype I32")
    assert len(text.splitlines()) == 3


# --- the zoo cache: damage, repair, stdout, children -----------------------------------------------------------

def test_a_truncated_cache_entry_is_marked_and_repaired_by_fetch(capsys, fake, cache):
    path = zoo.resolve(NAME, progress=False)
    weights = path / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as f:
        f.truncate(size // 2)
    assert zoo.cached(NAME) is None and "model.safetensors has" in zoo.damaged(NAME)

    rc, out, err = _main(capsys, "models")
    assert rc == 0 and f"DAMAGED: model.safetensors has {size // 2} bytes" in out and f"graphspec fetch {NAME}" in out
    rc, out, err = _main(capsys, "run", "--target", NAME, "--device", "cpu", "hi")
    assert_one_error(rc, err, f"the cached zoo model {NAME!r}", "is damaged", f"run `graphspec fetch {NAME}`")

    calls = len(fake)
    rc, out, err = _main(capsys, "fetch", NAME)
    assert rc == 0, err
    assert out.strip() == str(path) and "damaged" in err
    assert weights.stat().st_size == size and zoo.cached(NAME) == path
    assert len(fake) == calls + 1  # the GGUF was not kept, so it was downloaded again


def test_fetch_finds_same_size_corruption_by_sha256(capsys, fake, cache):
    path = zoo.resolve(NAME, progress=False)
    weights = path / "model.safetensors"
    good = weights.read_bytes()
    with open(weights, "r+b") as f:  # same size, one byte changed near the end (weights, not the header)
        f.seek(len(good) - 3)
        f.write(bytes([good[-3] ^ 0xFF]))
    assert zoo.cached(NAME) == path  # a use checks sizes only (cheap)
    rc, out, err = _main(capsys, "fetch", NAME)
    assert rc == 0 and "does not match its sha256" in err, err
    assert weights.read_bytes() == good


def test_a_manifest_without_a_file_list_gets_one_from_fetch(capsys, fake, cache):
    path = zoo.resolve(NAME, progress=False)
    manifest = json.loads((path / "graphspec-manifest.json").read_text())
    assert set(manifest["files"]) >= {"config.json", "model.safetensors", "tokenizer.json"}
    del manifest["files"]
    (path / "graphspec-manifest.json").write_text(json.dumps(manifest))
    assert zoo.cached(NAME) == path  # an entry from before file lists: used as it is
    rc, out, err = _main(capsys, "fetch", NAME)
    assert rc == 0, err
    assert "files" in json.loads((path / "graphspec-manifest.json").read_text())


_CHILD = """
import sys, time
from pathlib import Path
from graphspec.models import zoo
marker = Path(sys.argv[1])
zoo._pip_command = lambda req, dest: [sys.executable, "-c",
    "import os, sys, time; print('pip log line'); sys.stdout.flush(); "
    f"open({str(marker)!r}, 'w').write(str(os.getpid())); time.sleep(float(sys.argv[1]) if len(sys.argv) > 1 else 0)",
    sys.argv[2]]
zoo._pip_download(["x==1"], Path("."), progress=True)
print("PARENT DONE")
"""


def test_pip_output_goes_to_stderr(tmp_path):
    marker = tmp_path / "pid"
    p = subprocess.run([sys.executable, "-c", _CHILD, str(marker), "0"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout == "PARENT DONE\n" and "pip log line" in p.stderr


def test_pip_dies_with_its_parent(tmp_path):
    marker = tmp_path / "pid"
    parent = subprocess.Popen([sys.executable, "-c", _CHILD, str(marker), "120"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not (marker.exists() and marker.read_text()):
        assert time.monotonic() < deadline and parent.poll() is None, "the child never started"
        time.sleep(0.1)
    child = int(marker.read_text())
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        try:  # a zombie still answers kill(0): reaped by init soon, but look at its state
            if Path(f"/proc/{child}/stat").read_text().split()[2] == "Z":
                break
        except OSError:
            break
        time.sleep(0.1)
    else:
        os.kill(child, signal.SIGKILL)
        pytest.fail("the pip child outlived its killed parent")


def test_stale_work_folders_of_any_name_are_removed_by_the_next_fetch(fake, cache):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    other = cache / "tmp" / "some-other-model"
    (other / f"{dead.pid}-deadbeef" / "wheels").mkdir(parents=True)
    (other / f"{dead.pid}-deadbeef" / "wheels" / "half.whl").write_bytes(b"x" * 1000)
    # a live process's folder under a name whose lock it holds stays
    live_dir = cache / "tmp" / "busy-model" / f"{os.getpid()}-cafe0000"
    live_dir.mkdir(parents=True)
    (cache / "locks").mkdir(parents=True, exist_ok=True)
    import fcntl

    fd = os.open(cache / "locks" / "busy-model.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        zoo.resolve(NAME, progress=False)
    finally:
        os.close(fd)
    assert not other.exists()
    assert live_dir.is_dir()


def test_fetch_prints_only_the_path_on_stdout(tmp_path, wheels):
    """`path=$(graphspec fetch NAME)` gets the path alone, with pip's own log (a real subprocess) on stderr."""
    index, parts, sha = wheels
    code = textwrap.dedent(f"""
        import sys
        from graphspec import cli
        from graphspec.models import zoo
        zoo.ZOO["t"] = zoo.ZooEntry("t", "t", {parts!r}, {sha!r}, download_mb=1)
        zoo._pip_command = lambda req, dest: [sys.executable, "-c",
            "import shutil, sys; print('Collecting fake wheels'); "
            "[shutil.copy(w, sys.argv[1]) for w in sys.argv[2:]]", str(dest),
            *[str(p) for p in __import__('pathlib').Path({str(index)!r}).glob('*.whl')]]
        sys.exit(cli.main(["fetch", "t"]))
    """)
    env = {**os.environ, "GRAPHSPEC_CACHE": str(tmp_path / "c")}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stderr
    assert p.stdout == f"{tmp_path / 'c' / 'models' / 't'}\n"
    assert "Collecting fake wheels" in p.stderr
