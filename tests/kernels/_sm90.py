"""Ahead-of-time sm_90 (H100/H200) compile check for the Triton kernels, shared by the kernel tests.

The interpreter accepts programs a GPU compiler rejects (dot shapes, dtype mixes, shared memory),
so every kernel is also compiled to an sm_90 cubin with the ptxas inside the triton wheel. Kernels
must be defined with the interpreter off, so each test module runs its own specs in a subprocess
(``python -m tests.kernels.<module>``, whose ``__main__`` calls ``compile_main``).

A spec is ``(name, kernel, signature, constexprs)`` or ``(name, kernel, signature, constexprs, options)``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
H100_SHARED_BYTES = 227 * 1024


def compile_for_sm90(specs) -> list[str]:
    """Compile each spec for sm_90; return one line per failure (all of them, not only the first)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.autotuner import Autotuner

    failures = []
    for spec in specs:
        name, kernel, signature, constexprs = spec[:4]
        options = spec[4] if len(spec) > 4 else {}
        fn = kernel.fn if isinstance(kernel, Autotuner) else kernel
        try:
            compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                                      target=GPUTarget("cuda", 90, 32), options=options)
            if not compiled.asm.get("cubin"):
                raise RuntimeError("no cubin produced")
            if compiled.metadata.shared > H100_SHARED_BYTES:
                raise RuntimeError(f"needs {compiled.metadata.shared} bytes of shared memory; "
                                   f"an H100/H200 has {H100_SHARED_BYTES}")
        except Exception as exc:  # report every kernel, not only the first
            failures.append(f"{name}: {type(exc).__name__}: {str(exc)[:1500]}")
    return failures


def compile_main(specs) -> int:
    failures = compile_for_sm90(specs)
    for failure in failures:
        print("FAIL", failure)
    print(f"{len(failures)} of {len(specs)} kernels failed to compile for sm_90")
    return 1 if failures else 0


def have_ptxas() -> bool:
    import triton

    return (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists()


def run_compile_check(module: str) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    # `python -m module` with the repository appended to sys.path, not first: its kernels/ would hide the "kernels"
    # package transformers imports (make test sets PYTHONSAFEPATH, so -m alone would not find tests/ at all)
    code = f"import runpy, sys; sys.path.append({str(REPO)!r}); runpy.run_module({module!r}, run_name='__main__')"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
