# Two entry points, each creating or updating the local virtualenv by itself:
#   make demo   - speculative decoding on real small checkpoints (fetched once, cached)
#   make test   - the whole test suite (what CI runs)
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch 2.13.0 lies on these machines' disk; installing it first keeps
# pip from pulling a multi-GB CUDA build for the bare `torch` requirement.
TORCH_SPEC ?= torch==2.13.0

.PHONY: demo test bench venv
venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check "$(TORCH_SPEC)"
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test]'
	touch $@

demo: venv
	$(VENV)/bin/graphspec run --target qwen2.5-coder-0.5b-instruct --draft smollm2-135m-instruct \
	    --chat --max-new-tokens 96 "Write a Python function that checks whether a string is a palindrome."

test: venv
	$(PY) -m pytest tests -q

bench: venv
	$(PY) -m pytest perf -q --benchmark-only
