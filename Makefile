# Two entry points on a fresh machine: `make serve` and `make test`. Each install step prints one line; pip's
# and apt's output go to build/logs/, and the end of the log is shown if a step fails.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
comma := ,
# System packages the tests use: speech synthesis, PulseAudio + PortAudio (mic client), SIP and RTP peers,
# a headless browser (the captioning page).
APT_PACKAGES := espeak-ng sox pulseaudio pulseaudio-utils libportaudio2 libasound2-plugins \
	baresip-core gstreamer1.0-tools gstreamer1.0-plugins-base gstreamer1.0-plugins-good \
	chromium chromium-driver

.PHONY: serve test lint protos install install-dev system-deps gpu-rehearsal clean

LOGS := build/logs
# $(call logged,WHAT,LOG,COMMANDS): one line saying WHAT; the output of COMMANDS to LOG, its end shown on failure.
logged = mkdir -p $(LOGS); echo "$(1) (log: $(2))"; echo "=== $$(date -Is) $(1)" >>$(2); \
	{ $(3); } >>$(2) 2>&1 || { echo "failed: $(1); the end of $(2):"; tail -n 30 $(2); exit 1; }
PIP_FLAGS := --progress-bar off --no-input

serve: install
	@echo "cosystream serve $(ARGS) (Ctrl-C stops it); once ready it prints the command to try, with its" \
	  "real port, for another terminal after . $(VENV)/bin/activate (README.md)"
	@$(VENV)/bin/cosystream serve $(ARGS)

test: install-dev system-deps
	$(PY) -m pytest -q $(ARGS)

lint: install-dev
	$(VENV)/bin/ruff check cosystream tests benchmarks clients scripts training
	$(VENV)/bin/ruff format --check cosystream tests benchmarks clients scripts training
	$(PY) scripts/gen_protos.py --check
	$(PY) scripts/check_layers.py

# The GPU scripts run on this CPU machine as the GPU machine would run them (docs/GPU.md).
gpu-rehearsal: install-dev system-deps
	bash benchmarks/gpu_rehearsal.sh

protos: install-dev
	$(PY) scripts/gen_protos.py

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

# The CPU build of torch first, so that the package's loose `torch>=2.4` is already met.
$(VENV)/bin/python:
	@$(call logged,creating $(VENV) with the CPU build of torch 2.13,$(LOGS)/install.log, \
	  $(PYTHON) -m venv $(VENV) && $(PIP) install $(PIP_FLAGS) --upgrade pip && $(PIP) install $(PIP_FLAGS) torch==2.13.0)

# The server with the Google/Riva protocols (compat), what the programs in clients/ need (clients), the
# second pass (whisper: faster-whisper and its Whisper model, ~420 MB installed, no torch; docs/MODELS.md)
# compressed streams (codecs: PyAV, which faster-whisper needs too) and new words' pronunciations for phrase
# boosting (vocabulary: espeak-ng's library, 10 MB) and the GPU gauges on /metrics (gpu: NVIDIA's NVML
# bindings, pure Python; on a machine without a driver there are none).
$(VENV)/.installed: $(VENV)/bin/python pyproject.toml Makefile
	@$(call logged,installing cosystream[compat$(comma)clients$(comma)whisper$(comma)codecs$(comma)vocabulary$(comma)gpu] into $(VENV),$(LOGS)/install.log, \
	  $(PIP) install $(PIP_FLAGS) -e '.[compat$(comma)clients$(comma)whisper$(comma)codecs$(comma)vocabulary$(comma)gpu]')
	@touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	@$(call logged,installing the test and development tools (cosystream[dev]),$(LOGS)/install.log, \
	  $(PIP) install $(PIP_FLAGS) -e '.[dev]')
	@touch $@

system-deps:
	@missing=""; for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" != 0 ]; then \
	  echo "missing system packages:$$missing (tests that need them are skipped); as root: apt-get install$$missing"; \
	  exit 0; \
	fi; \
	$(call logged,apt-get install$$missing,$(LOGS)/apt.log, \
	  apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y$$missing)

clean:
	rm -rf $(VENV) build *.egg-info
