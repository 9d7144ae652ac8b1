# Sourced by the GPU scripts (benchmarks/gpu_check.sh, training/gpu.sh) on a machine that cannot reach the
# network: installs the carried wheels (.gpu/whl, from scripts/gpu_carry.sh) into /tmp/site, puts the
# checkout and them on PYTHONPATH, and checks that every module the script needs imports, by name, before
# anything runs: a missing one stops the script here with the list, never an hour later.
#
#   gpu_env MODULE...      (after `source scripts/gpu_env.sh`); sets PY and CUDA (1 when torch sees a GPU)
CARRY=${CARRY:-.gpu}
SITE=${SITE:-/tmp/site}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1

gpu_env() {
  if [ -d "$CARRY/whl" ] && [ ! -e "$SITE/.installed" ]; then
    "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --no-cache-dir \
      --upgrade --target "$SITE" "$CARRY"/whl/*.whl && touch "$SITE/.installed" \
      || { echo "gpu_env: installing the wheels in $CARRY/whl failed" >&2; return 1; }
  fi
  export PYTHONPATH="$(pwd):$SITE${PYTHONPATH:+:$PYTHONPATH}"
  "$PY" - "$@" <<'PY' || return 1
import importlib, sys
missing = []
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except Exception as err:  # ImportError, or a wheel built for another Python
        missing.append(f"{name} ({type(err).__name__}: {err})")
if missing:
    print("gpu_env: cannot import " + "; ".join(missing), file=sys.stderr)
    print("gpu_env: build the carried wheels with scripts/gpu_carry.sh and name .gpu in the call's carry",
          file=sys.stderr)
    sys.exit(1)
PY
  CUDA=$("$PY" -c 'import torch; print(int(torch.cuda.is_available()))') || return 1
  export CUDA
}
