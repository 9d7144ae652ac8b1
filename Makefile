# Two entry points on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# System packages the tests use: speech synthesis, PulseAudio + PortAudio (mic client), SIP and RTP peers,
# a headless browser (the captioning page).
APT_PACKAGES := espeak-ng sox pulseaudio pulseaudio-utils libportaudio2 libasound2-plugins \
	baresip-core gstreamer1.0-tools gstreamer1.0-plugins-base gstreamer1.0-plugins-good \
	chromium chromium-driver

.PHONY: serve test lint protos install install-dev system-deps gpu-rehearsal clean

serve: install
	$(VENV)/bin/cosystream serve $(ARGS)

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

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# The CPU build of torch first, so that the package's loose `torch>=2.4` is already met.
	$(PIP) install -q torch==2.13.0

$(VENV)/.installed: $(VENV)/bin/python pyproject.toml
	$(PIP) install -q -e .
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(PIP) install -q -e '.[dev]'
	touch $@

system-deps:
	@missing=""; for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	  else echo "missing system packages:$$missing (tests that need them are skipped); as root: apt-get install$$missing"; fi; \
	fi

clean:
	rm -rf $(VENV) build *.egg-info
