# Entry points, each creating or updating the local virtualenv by itself:
#   make demo   - speculative decoding on real small checkpoints (fetched once, cached)
#   make test   - the whole test suite (what CI runs)
#   make check-device-triton - the kernel tests under the GPU machine's triton (3.6), before a device call
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch 2.13.0 lies on these machines' disk; installing it first keeps
# pip from pulling a multi-GB CUDA build for the bare `torch` requirement.
TORCH_SPEC ?= torch==2.13.0

.PHONY: demo test bench venv check-device-triton
venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check "$(TORCH_SPEC)"
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test]'
	touch $@

demo: venv
	$(VENV)/bin/graphspec run --target qwen2.5-coder-0.5b-instruct --draft smollm2-135m-instruct \
	    --chat --max-new-tokens 96 "Write a Python function that checks whether a string is a palindrome."

# Two pytest workers (pytest-xdist): each runs one torch thread, so two processes use both cores of these
# machines; more workers would each load the real checkpoints (memory). PYTEST_WORKERS=0 runs in one process.
# PYTHONSAFEPATH=1 (here and in every worker): the current directory is not put first on sys.path, so this
# repository's kernels/ (graphspec.kernels) does not hide the "kernels" package transformers >= 5.25 imports.
PYTEST_WORKERS ?= 2
test: venv
	PYTHONSAFEPATH=1 $(PY) -m pytest tests -q -n $(PYTEST_WORKERS)

bench: venv
	PYTHONSAFEPATH=1 $(PY) -m pytest perf -q --benchmark-only

# The kernel tests (interpreted, and the sm_90 compile checks) under the GPU machine's triton (3.6, see
# ../shared/GPU.md) instead of the venv's, so a Triton feature that 3.6 lacks fails here rather than in a
# device call. The wheels go to .cache/ once (about 190 MB); numpy 2.2 because triton 3.6's interpreter
# converts 1-element arrays to scalars, which numpy 2.4 refuses. Not part of `make test`.
DEVICE_TRITON ?= 3.6.0
DEVICE_TRITON_DIR := .cache/triton-$(DEVICE_TRITON)
check-device-triton: venv
	test -d $(DEVICE_TRITON_DIR) || $(PY) -m pip install -q --disable-pip-version-check --no-deps \
	    --target $(DEVICE_TRITON_DIR) "triton==$(DEVICE_TRITON)" "numpy==2.2.6"
	PYTHONPATH=$(DEVICE_TRITON_DIR) $(PY) -c "import triton; assert triton.__version__ == '$(DEVICE_TRITON)', triton.__version__"
	PYTHONSAFEPATH=1 PYTHONPATH=$(DEVICE_TRITON_DIR) $(PY) -m pytest tests/kernels -q -p no:cacheprovider
