"""Property-based tests of every input surface (issue #28): whatever hypothesis generates, the outcome is a result
or the documented error (ValueError in the API, exit status 2 in the CLI), within a time and a memory limit.

- Each surface runs in its own subprocess under ``RLIMIT_AS`` (an address-space limit) and a timeout, so a case
  that allocates gigabytes, crashes the interpreter or hangs fails the test instead of the machine; the many
  cases of a surface share one subprocess (and one torch import).
- One fixed hypothesis profile: ``derandomize=True`` (the same cases on every run, in CI too), no example
  database, ``max_examples`` per surface in ``CASES``; the count each surface ran is printed and checked.
- Surfaces: config.json values, safetensors headers (through the whole loader), GGUF headers and GGUF
  metadata (both through the converter), chat messages, CLI arguments, bench prompt files.
"""

from __future__ import annotations

import json
import os
import resource
import struct
import subprocess
import sys
from pathlib import Path

import pytest

# Cases per surface: what the whole set costs is a few minutes on 2 cores (docs/errors.md lists them).
CASES = {"config": 400, "safetensors": 250, "gguf": 150, "gguf_metadata": 200, "chat": 250, "cli": 60,
         "bench_prompts": 250}
MEMORY_LIMIT = 4 << 30   # bytes of address space per surface's subprocess (torch itself maps about 1.5 GB)
TIME_LIMIT = 300         # seconds per surface


@pytest.mark.parametrize("surface", sorted(CASES))
def test_surface(surface, tmp_path):
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    env.pop("TRITON_INTERPRET", None)
    code = f"import sys; sys.path.append({str(Path(__file__).parent.parent)!r}); " \
           f"from tests.test_properties import _run; _run({surface!r}, {str(tmp_path)!r})"
    try:
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=TIME_LIMIT,
                           env=env, preexec_fn=_limit_memory)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the {surface} properties ran past {TIME_LIMIT} s (a case hangs or is far too slow)")
    assert p.returncode == 0, f"exit {p.returncode}\n{p.stdout[-6000:]}\n{p.stderr[-6000:]}"
    ran = [line for line in p.stdout.splitlines() if line.startswith("CASES ")]
    assert ran, p.stdout
    count = int(ran[-1].split()[2])
    print(ran[-1])
    assert count >= CASES[surface] // 2, f"only {count} cases ran (hypothesis gave up on generating?)"


def _limit_memory():
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


# ---------------------------------------------------------------------------------------------------------------
# Inside the subprocess.

def _run(surface: str, tmp: str) -> None:
    from hypothesis import HealthCheck, settings

    settings.register_profile("hostile", derandomize=True, database=None, deadline=None, print_blob=True,
                              suppress_health_check=list(HealthCheck))
    settings.load_profile("hostile")
    counter = [0, 0]  # cases, cases that gave a result (not the documented error)
    prop = _PROPERTIES[surface](Path(tmp), counter)
    settings(max_examples=CASES[surface])(prop)()
    print(f"CASES {surface} {counter[0]} results {counter[1]}", flush=True)


def _json_values():
    from hypothesis import strategies as st

    scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-2**70, max_value=2**70),
                        st.sampled_from([0, 1, 2, 3, 4, 7, 8, 16, 64, 10**6, 10**15, 2**31, 2**63]),
                        st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12))
    return st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                         st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                        max_leaves=8)


_CONFIG_KEYS = ["architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling",
                "rope_parameters", "max_position_embeddings", "tie_word_embeddings", "attention_bias", "bos_token_id",
                "eos_token_id", "torch_dtype", "dtype", "hidden_act", "mlp_bias", "sliding_window",
                "use_sliding_window", "layer_types", "num_experts"]
_GOOD_CONFIG = {"architectures": ["LlamaForCausalLM"], "vocab_size": 16, "hidden_size": 8, "intermediate_size": 16,
                "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1}


def _config_property(tmp: Path, counter):
    from hypothesis import given
    from hypothesis import strategies as st

    from graphspec.models.config import ModelConfig

    rope = st.fixed_dictionaries({}, optional={"rope_type": st.sampled_from(["default", "llama3", "linear", "yarn"]),
                                               "factor": _json_values(), "rope_theta": _json_values(),
                                               "low_freq_factor": _json_values(), "high_freq_factor": _json_values(),
                                               "original_max_position_embeddings": _json_values()})
    overrides = st.dictionaries(st.sampled_from(_CONFIG_KEYS), st.one_of(_json_values(), rope), max_size=5)
    raw = st.one_of(st.binary(max_size=64), st.sampled_from([b"[" * 5000, b'{"vocab_size": ' + b"9" * 5000 + b"}",
                                                             b"NaN", b'{"a": Infinity}', b"\xff\xfe{}"]))

    @given(overrides, st.booleans(), raw, st.booleans())
    def prop(over, from_good, data, as_file):
        counter[0] += 1
        d = {**(_GOOD_CONFIG if from_good else {}), **over}
        try:
            c = ModelConfig.from_dict(d)
        except ValueError:
            pass
        else:
            counter[1] += 1
            assert c.num_hidden_layers <= 1024 and c.hidden_size <= 1 << 17 and c.max_position_embeddings <= 1 << 24
        if as_file:
            f = tmp / "config.json"
            f.write_bytes(data)
            try:
                ModelConfig.from_file(f)
            except ValueError:
                pass

    return prop


def _tiny_expected():
    from graphspec.models.config import ModelConfig
    from graphspec.models.loader import expected_shapes

    return expected_shapes(ModelConfig.from_dict({**_GOOD_CONFIG, "tie_word_embeddings": True}))


def _safetensors_property(tmp: Path, counter):
    import torch
    from hypothesis import given
    from hypothesis import strategies as st

    from graphspec.models.loader import read_safetensors

    expected = _tiny_expected()
    names = st.one_of(st.sampled_from(sorted(expected)), st.text(max_size=10), st.just("__metadata__"))
    dtypes = st.one_of(st.sampled_from(["F32", "F16", "BF16", "F64", "I32", "U8", "BOOL", "F8_E4M3"]), _json_values())
    shape = st.one_of(st.lists(st.sampled_from([0, 1, 2, 8, 16, 2**40]), max_size=3), _json_values())
    offsets = st.one_of(st.lists(st.integers(min_value=-4, max_value=2**20), min_size=2, max_size=2), _json_values())
    entry = st.one_of(st.fixed_dictionaries({"dtype": dtypes, "shape": shape, "data_offsets": offsets}),
                      _json_values())
    header = st.one_of(st.just({}), st.dictionaries(names, entry, max_size=6))

    @given(header, st.booleans(), st.integers(min_value=0, max_value=4096),
           st.sampled_from(["true", "true", "true", "short", "long", "huge"]), st.booleans())
    def prop(h, from_good, data_len, prefix, consistent):
        counter[0] += 1
        d = tmp / "ckpt"
        d.mkdir(exist_ok=True)
        if from_good:  # a valid file, then the generated entries over it (consistent: offsets made to fit)
            start, body = 0, {}
            for n, s in expected.items():
                size = 4
                for x in s:
                    size *= x
                body[n] = {"dtype": "F32", "shape": list(s), "data_offsets": [start, start + size]}
                start += size
            body.update(h)
            h = body
            if consistent:
                data_len = start
        blob = json.dumps(h).encode()
        n = {"true": len(blob), "short": max(0, len(blob) - 3), "long": len(blob) + 100, "huge": 2**62}[prefix]
        (d / "model.safetensors").write_bytes(struct.pack("<Q", n) + blob + os.urandom(data_len))
        try:
            out = read_safetensors(d, expected, torch.float32, torch.device("cpu"))
        except ValueError:
            return
        counter[1] += 1
        assert set(out) == set(expected)
        for k, t in out.items():
            assert tuple(t.shape) == expected[k]

    return prop


def _gguf_property(tmp: Path, counter):
    import shutil

    from hypothesis import given
    from hypothesis import strategies as st

    from graphspec.models.gguf import convert_gguf, read_gguf_metadata
    from tests.models.test_gguf import write_tiny_gguf

    good = tmp / "good.gguf"
    write_tiny_gguf(good, "llama")
    data = good.read_bytes()
    header_end = min(len(data), 64 * 1024)  # the header, metadata and tensor table lie in the first bytes

    edit = st.tuples(st.integers(min_value=0, max_value=header_end - 1),
                     st.one_of(st.binary(min_size=1, max_size=8),
                               st.sampled_from([b"\xff" * 8, b"\x00" * 8, struct.pack("<Q", 2**62),
                                                struct.pack("<Q", 2**31), struct.pack("<I", 2**31)])))

    @given(st.lists(edit, max_size=4), st.one_of(st.none(), st.integers(min_value=0, max_value=len(data))),
           st.booleans(), st.binary(max_size=48))
    def prop(edits, cut, convert, raw):
        counter[0] += 1
        b = bytearray(data)
        for at, new in edits:
            b[at:at + len(new)] = new
        if cut is not None:
            b = b[:cut]
        f = tmp / "m.gguf"
        f.write_bytes(bytes(b) if edits or cut is not None else b"GGUF" + raw)
        try:
            read_gguf_metadata(f)
        except ValueError:
            return
        counter[1] += 1
        if convert:
            out = tmp / "out"
            shutil.rmtree(out, ignore_errors=True)
            try:
                convert_gguf(f, out, progress=False)
            except ValueError:
                pass

    return prop


_GGUF_KEYS = ["llama.block_count", "llama.embedding_length", "llama.attention.head_count",
              "llama.attention.head_count_kv", "llama.attention.key_length", "llama.rope.dimension_count",
              "llama.feed_forward_length", "llama.context_length", "llama.attention.layer_norm_rms_epsilon",
              "llama.rope.freq_base", "llama.rope.scaling.type", "llama.rope.scaling.factor",
              "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
              "tokenizer.ggml.padding_token_id", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
              "tokenizer.ggml.merges", "tokenizer.ggml.scores", "tokenizer.ggml.model", "tokenizer.ggml.pre",
              "tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token", "tokenizer.chat_template"]


def _gguf_metadata_property(tmp: Path, counter):
    """Metadata values of every type and size over a valid file's (as the reader returns them), through the
    whole converter: the binary framing is the other GGUF surface's."""
    import dataclasses
    import shutil

    from hypothesis import given
    from hypothesis import strategies as st

    from graphspec.models import gguf as gg
    from tests.models.test_gguf import write_tiny_gguf

    good = tmp / "good.gguf"
    write_tiny_gguf(good, "llama")
    info = gg.read_gguf_metadata(good)
    read = gg.read_gguf_metadata
    value = st.one_of(_json_values(), st.sampled_from([0, 1, 2, 3, 4, 16, 64, 10**6, 10**9, 2**32, 2**63 - 1]),
                      st.lists(st.sampled_from(["a", "b", "a b", "<|im_end|>", "", " "]), max_size=5),
                      st.lists(st.integers(-2, 6), max_size=5))

    @given(st.dictionaries(st.sampled_from(_GGUF_KEYS), value, min_size=1, max_size=3), st.booleans())
    def prop(over, drop):
        counter[0] += 1
        fields = dict(info.fields)
        for k, v in over.items():
            if drop and v is None:
                fields.pop(k, None)
            else:
                fields[k] = v
        gg.read_gguf_metadata = lambda path: dataclasses.replace(info, fields=fields)
        out = tmp / "out"
        shutil.rmtree(out, ignore_errors=True)
        try:
            gg.convert_gguf(good, out, progress=False)
        except ValueError:
            return
        finally:
            gg.read_gguf_metadata = read
        counter[1] += 1

    return prop


def _tiny_pipeline(tmp: Path):
    import graphspec
    from tests.checkpoints import make_checkpoint

    d = make_checkpoint(tmp / "tiny", "llama", tokenizer="bytelevel", chat_template="chatml")
    return d, graphspec.Pipeline(graphspec.load_model(d, dtype="float32"))


def _chat_property(tmp: Path, counter):
    from hypothesis import given
    from hypothesis import strategies as st

    _, pipe = _tiny_pipeline(tmp)
    text = st.one_of(st.text(max_size=20), st.sampled_from(["\udcff", "a\udcfeb", "{{ x }}", "<|im_start|>", ""]))
    value = st.one_of(text, _json_values())
    message = st.one_of(
        st.fixed_dictionaries({"role": st.one_of(st.sampled_from(["user", "assistant", "system"]), value),
                               "content": value}, optional={"name": value, "tool_calls": value}),
        st.dictionaries(st.text(max_size=8), value, max_size=3), _json_values())
    prompt = st.one_of(st.lists(message, max_size=4), text, st.lists(st.integers(-5, 1000), max_size=5))

    @given(prompt)
    def prop(p):
        counter[0] += 1
        try:
            ids = pipe.encode_prompt(p)
        except ValueError:
            return
        counter[1] += 1
        assert ids and all(0 <= i < pipe.target.config.vocab_size for i in ids)

    return prop


_RUN_FLAGS = {
    "-k": ["0", "1", "3", "-1", "99999999", "x"], "--dtype": ["fp32", "bf16", "fp64", ""],
    "--device": ["cpu", "meta", "cuda", "cuda:3", "tpu", "", "cpu:0"], "--threads": ["1", "0", "-2", "a", "1000000000"],
    "--temperature": ["0", "0.7", "-1", "nan", "inf", "1e400"], "--top-k": ["0", "5", "-3", "1e3"],
    "--top-p": ["1", "0.5", "0", "1.5", "nan"], "--seed": ["0", "18446744073709551615", "18446744073709551616", "-1"],
    "--max-new-tokens": ["1", "3", "0", "100000000", "-4"], "--stop": ["", "\n", "\udcff", "e"],
    "--draft": ["ngram", "TINY", "/nonexistent", ""], "--draft-vocab": ["auto", "none", "0", "50"],
    "--draft-siblings": ["auto", "0", "2", "-1"], "--draft-beam": ["0", "2", "-1"],
    "--draft-confidence": ["auto", "none", "0.5", "2"], "--draft-quantize": ["auto", "none", "int8", "int3"],
    "--vocab-mapping": ["auto", "tli", "slem", "x"],
}


def _cli_property(tmp: Path, counter):
    import contextlib
    import io

    from hypothesis import given
    from hypothesis import strategies as st

    from graphspec import cli

    d, _ = _tiny_pipeline(tmp)
    flag = st.sampled_from(sorted(_RUN_FLAGS)).flatmap(lambda f: st.tuples(st.just(f), st.sampled_from(_RUN_FLAGS[f])))
    extra = st.lists(st.sampled_from(["--chat", "--ignore-eos", "--json", "--bogus", "-"]), max_size=2, unique=True)
    prompt = st.one_of(st.text(max_size=10), st.sampled_from(["\udcff\udcfehi", "hello", "-x"]))

    @given(st.lists(flag, max_size=3), extra, prompt)
    def prop(flags, extras, p):
        counter[0] += 1
        argv = ["run", "--target", str(d)]
        if not any(f == "--max-new-tokens" for f, _ in flags):
            argv += ["--max-new-tokens", "2"]
        if not any(f == "--device" for f, _ in flags):
            argv += ["--device", "cpu"]
        for f, v in flags:
            argv += [f, str(d) if v == "TINY" else v]
        argv += [e for e in extras if e != "-"] + ["--", p]
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                rc = cli.main(argv)
            except SystemExit as e:
                rc = e.code
        assert rc in (0, 2), (rc, argv, err.getvalue()[-2000:])
        counter[1] += rc == 0
        assert "Traceback" not in err.getvalue(), err.getvalue()
        if rc == 2:
            assert "error:" in err.getvalue()

    return prop


def _bench_prompts_property(tmp: Path, counter):
    from hypothesis import given
    from hypothesis import strategies as st

    from graphspec import cli

    _, pipe = _tiny_pipeline(tmp)
    item = st.one_of(
        st.fixed_dictionaries({}, optional={"prompt": _json_values(), "messages": _json_values(),
                                            "token_ids": st.one_of(st.lists(st.integers(-3, 1000), max_size=4),
                                                                   _json_values()),
                                            "kind": _json_values()}),
        st.fixed_dictionaries({"messages": st.lists(st.fixed_dictionaries({"role": _json_values(),
                                                                           "content": _json_values()}), max_size=3)}),
        _json_values())
    line = st.one_of(item.map(json.dumps), st.text(max_size=20), st.just("[" * 3000))

    @given(st.lists(line, max_size=5), st.booleans(), st.binary(max_size=20))
    def prop(lines, jsonl, junk):
        counter[0] += 1
        f = tmp / ("p.jsonl" if jsonl else "p.txt")
        f.write_bytes("\n".join(lines).encode("utf-8", "surrogatepass") + (junk if not lines else b""))
        try:
            items = cli._read_prompts(f)
        except cli.CLIError:
            return
        counter[1] += 1
        for it in items:
            p = it.get("token_ids", it.get("messages", it.get("prompt")))
            try:
                pipe.encode_prompt(p)
            except ValueError:
                pass

    return prop


_PROPERTIES = {"config": _config_property, "safetensors": _safetensors_property, "gguf": _gguf_property,
               "gguf_metadata": _gguf_metadata_property,
               "chat": _chat_property, "cli": _cli_property, "bench_prompts": _bench_prompts_property}
