"""Importing graphspec puts torch's large CPU buffers (the packed weights among them) on transparent huge pages.

torch's allocator reads ``THP_MEM_ALLOC_ENABLE`` once, at its first allocation, so each case runs in a fresh
interpreter: graphspec must set it before anything allocates, and must leave a value the user set alone.
"""

import json
import os
import subprocess
import sys

import pytest

from graphspec.kernels import cpu

VAR = cpu.THP_ENV
BUFFER_MIB = 64

# A fresh interpreter: the imports a user's script starts with, then one large tensor, touched; it prints what
# the environment holds and how much of the process sits on huge pages.
SCRIPT = f"""
import json, os
import torch
import graphspec
from graphspec.kernels import cpu
before = cpu.huge_pages()["anon_huge_mib"] or 0
x = torch.ones({BUFFER_MIB} << 20, dtype=torch.uint8)
after = cpu.huge_pages()
print(json.dumps({{"env": os.environ.get("{VAR}"), "grew_mib": (after["anon_huge_mib"] or 0) - before,
                  "kernel": after["kernel"]}}))
"""


def _run(value: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != VAR}
    if value is not None:
        env[VAR] = value
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_turns_on_torchs_huge_page_allocations():
    got = _run(None)
    assert got["env"] == "1", f"import graphspec left {VAR}={got['env']!r}; it sets '1' when the user set nothing"
    if got["kernel"] not in ("madvise", "always"):
        pytest.skip(f"this kernel's transparent huge pages are {got['kernel']!r}: nothing to observe")
    # every 2 MiB-aligned stretch of the buffer can be a huge page: all but at most the two partial ends
    assert got["grew_mib"] >= BUFFER_MIB - 4, (
        f"a {BUFFER_MIB} MiB tensor allocated after `import graphspec` put {got['grew_mib']} MiB on huge pages "
        f"(kernel mode {got['kernel']!r}); expected nearly all of it (unless the machine had no free 2 MiB pages: "
        f"see /proc/buddyinfo)")


def test_a_users_setting_is_kept():
    got = _run("0")
    assert got["env"] == "0"
    if got["kernel"] == "madvise":  # ("always" backs large buffers with huge pages whatever torch advises)
        assert got["grew_mib"] <= 4, f"{VAR}=0 still put {got['grew_mib']} MiB of a fresh tensor on huge pages"


def test_huge_pages_reports_this_process():
    info = cpu.huge_pages()
    assert set(info) == {"kernel", "torch", "anon_huge_mib"}
    if cpu.THP_SYSFS.exists():
        assert info["kernel"] in ("always", "madvise", "never")
        assert info["anon_huge_mib"] is None or info["anon_huge_mib"] >= 0
