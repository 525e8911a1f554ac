#!/usr/bin/env bash
# Build Baton's image and run the real compose stack (compose.yaml) the way users deploy it, then
# check it (scripts/container_check.py does the HTTP side):
#   a  compose up (redis, gateway, 1 prefill + 1 decode worker, Prometheus): a streamed chat and a
#      streamed completion through the gateway's port equal transformers' greedy float32 output,
#      and every container's healthcheck passes. The workers run --dtype float32, which serves the
#      default model from its GGUF's dequantized weights (the reference's), not its Q4_1 blocks
#      (baton/model/quant.py: resolve_weights); the workers' "weights:" log line is checked
#   b  --scale decode_worker=2: both decode workers serve (their counters in the gateway's /stats)
#   c  SIGKILL of a decode container under 8 streams: all complete with the reference text, the
#      container comes back by its restart policy, nothing is held afterwards
#   d  a stream in flight while the Baton services stop finishes (workers drain, the gateway waits),
#      and `compose down` removes everything, within the grace periods
#   e  one container, `run -p PORT:8000 <image>`, serves the default model alone (its own Redis)
#   f  the image runs as non-root with a writable cache, carries a CPU-only torch, starts offline
# and prints a table. Bounded in time (CHECK_TIMEOUT, default 1200 s); removes every container,
# network and volume it made (the images stay, as a cache for the next run).
#
#   scripts/container_check.sh                          # podman (+ podman-compose), installed if missing
#   CONTAINER_ENGINE=docker BATON_BASE_IMAGE=python:3.11-slim scripts/container_check.sh
#
# Settings: CONTAINER_ENGINE (podman | docker), BATON_BASE_IMAGE (default: a Debian bookworm made
# with debootstrap from the apt mirror and imported once, for hosts that reach no registry; it also
# serves as the Redis image), BATON_REDIS_IMAGE, BATON_CHECK_IMAGE (the tag built, default
# baton:check), CHECK_TIMEOUT, BATON_CONTAINER_CACHE (podman-compose's venv; default
# ~/.cache/baton-container). Exit status: 0 all passed, 1 a check failed, 77 containers cannot run
# here (the reason is printed).
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT="$PWD"
CHECK_TIMEOUT="${CHECK_TIMEOUT:-1200}"
if [ -z "${_BATON_CHECK_INNER:-}" ]; then
  # The whole run under one bound; on expiry the trap below still removes what was made.
  _BATON_CHECK_INNER=1 exec timeout -k 60 "$CHECK_TIMEOUT" bash "$0" "$@"
fi

ENGINE="${CONTAINER_ENGINE:-podman}"
CACHE="${BATON_CONTAINER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/baton-container}"
IMAGE="${BATON_CHECK_IMAGE:-baton:check}"
BASE_TAG="localhost/baton-base:bookworm"
PROM_TAG="localhost/baton-prometheus:bookworm"
PROJECT="batoncheck$$"
TMP="$(mktemp -d /tmp/baton-container-check.XXXXXX)"
PY="$(command -v python3)"
HELPER="$ROOT/scripts/container_check.py"
START=$SECONDS

say()  { printf '\n==> [%4ss] %s\n' "$((SECONDS - START))" "$*" >&2; }
skip_all() { printf 'SKIP: %s\n' "$*"; rm -rf "$TMP"; exit 77; }

declare -a ROWS=()
FAILED=0
record() {  # record CHECK pass|fail|note DETAIL
  ROWS+=("$1|$2|$3")
  [ "$2" = fail ] && FAILED=1
  printf '  -> %s: %s (%s)\n' "$1" "$2" "$3" >&2
}

summary() {
  printf '\n| check | result | detail |\n|---|---|---|\n'
  local row
  for row in "${ROWS[@]}"; do
    IFS='|' read -r name result detail <<<"$row"
    printf '| %s | %s | %s |\n' "$name" "$result" "$detail"
  done
}

# ---- 0. the engine, its runtime settings, compose --------------------------------------------
if [ "$ENGINE" = podman ]; then
  export CONTAINERS_CONF="${CONTAINERS_CONF:-$ROOT/scripts/containers/containers.conf}"
  want=()
  command -v podman >/dev/null 2>&1 || want+=(podman)
  command -v runc >/dev/null 2>&1 || want+=(runc)
  if [ -z "${BATON_BASE_IMAGE:-}" ] && ! command -v debootstrap >/dev/null 2>&1; then want+=(debootstrap); fi
  if [ ${#want[@]} -gt 0 ]; then
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
      skip_all "podman is not installed and this is not a root Debian/Ubuntu host to apt-get it (${want[*]})"
    fi
    say "installing ${want[*]} (apt-get)"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${want[@]}"; } >/dev/null \
      || skip_all "apt-get install ${want[*]} failed"
  fi
  if command -v podman-compose >/dev/null 2>&1; then
    COMPOSE=(podman-compose)
  else
    if [ ! -x "$CACHE/compose-venv/bin/podman-compose" ]; then
      say "installing podman-compose into $CACHE/compose-venv"
      { python3 -m venv "$CACHE/compose-venv" && "$CACHE/compose-venv/bin/pip" install -q podman-compose; } >/dev/null \
        || skip_all "could not install podman-compose (python3 -m venv + pip)"
    fi
    COMPOSE=("$CACHE/compose-venv/bin/podman-compose")
  fi
  podman info >/dev/null 2>&1 || skip_all "podman cannot run here: $(podman info 2>&1 | tail -1)"
  PROJECT_LABEL=io.podman.compose.project
  SERVICE_LABEL=io.podman.compose.service
  NOHC=(--no-healthcheck)
elif [ "$ENGINE" = docker ]; then
  docker info >/dev/null 2>&1 || skip_all "docker cannot reach its daemon"
  docker compose version >/dev/null 2>&1 || skip_all "the docker compose plugin is missing"
  COMPOSE=(docker compose)
  PROJECT_LABEL=com.docker.compose.project
  SERVICE_LABEL=com.docker.compose.service
  NOHC=()
else
  skip_all "CONTAINER_ENGINE must be podman or docker, not $ENGINE"
fi
E() { "$ENGINE" "$@"; }
compose() { "${COMPOSE[@]}" -p "$PROJECT" -f "$ROOT/compose.yaml" "$@"; }
containers_of() {  # containers_of [SERVICE]: this project's containers, all states
  local filter=(--filter "label=$PROJECT_LABEL=$PROJECT")
  [ -n "${1:-}" ] && filter+=(--filter "label=$SERVICE_LABEL=$1")
  E ps -a "${filter[@]}" --format '{{.Names}}'
}
leftovers() {  # what this run made that still exists, on one line
  { containers_of
    [ "$ENGINE" = podman ] && podman pod ls --format '{{.Name}}' | grep -x "pod_$PROJECT"
    E network ls --format '{{.Name}}' | grep "^${PROJECT}_"
    E volume ls --format '{{.Name}}' | grep "^${PROJECT}_"
  } 2>/dev/null | tr '\n' ' '
}
SINGLES=()
cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  say "cleaning up"
  { compose down -v -t 5 || true; } >/dev/null 2>&1
  for c in $(containers_of) "${SINGLES[@]}"; do E rm -f "$c" >/dev/null 2>&1; done
  [ "$ENGINE" = podman ] && podman pod rm -f "pod_$PROJECT" >/dev/null 2>&1
  for n in $(E network ls --format '{{.Name}}' 2>/dev/null | grep "^${PROJECT}_"); do E network rm -f "$n" >/dev/null 2>&1; done
  for v in $(E volume ls --format '{{.Name}}' 2>/dev/null | grep "^${PROJECT}_"); do E volume rm -f "$v" >/dev/null 2>&1; done
  left="$(leftovers)"
  [ -n "$left" ] && record cleanup fail "left behind: $left"
  summary
  rm -rf "$TMP"
  [ $rc = 0 ] && [ "$FAILED" = 1 ] && rc=1
  exit $rc
}
trap cleanup EXIT
trap 'record timeout fail "interrupted or past CHECK_TIMEOUT=${CHECK_TIMEOUT}s"; exit 1' INT TERM

free_port() { "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
helper() { "$PY" "$HELPER" "$@"; }

# ---- 1. base images (cached) -------------------------------------------------------------------
BASE="${BATON_BASE_IMAGE:-}"
if [ -z "$BASE" ]; then
  BASE="$BASE_TAG"
  if E image exists "$BASE" 2>/dev/null || E image inspect "$BASE" >/dev/null 2>&1; then
    say "base image $BASE: cached"
  else
    command -v debootstrap >/dev/null 2>&1 || skip_all "debootstrap is needed to make a base image (or set BATON_BASE_IMAGE)"
    mirror="${DEBIAN_MIRROR:-$(grep -hsE '^[[:space:]]*(URIs:|deb )' /etc/apt/sources.list /etc/apt/sources.list.d/*.sources /etc/apt/sources.list.d/*.list \
      | grep -v security | grep -oE 'https?://[^ ]*debian/?' | head -1)}"
    mirror="${mirror:-http://deb.debian.org/debian}"
    say "making base image $BASE: debootstrap bookworm from $mirror"
    rootfs="$TMP/rootfs"
    t0=$SECONDS
    timeout 600 debootstrap --variant=minbase --include=python3,python3-venv,redis-server,ca-certificates \
      bookworm "$rootfs" "$mirror" >"$TMP/debootstrap.log" 2>&1 \
      || { tail -20 "$TMP/debootstrap.log" >&2; record base fail "debootstrap failed"; exit 1; }
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    tar -C "$rootfs" -c . | E import --change 'CMD ["/bin/bash"]' - "$BASE" >/dev/null \
      || { record base fail "import failed"; exit 1; }
    rm -rf "$rootfs"
    say "base image made in $((SECONDS - t0)) s"
  fi
fi
REDIS_IMAGE="${BATON_REDIS_IMAGE:-$BASE}"  # Debian's redis-server is in the base
[ -n "${BATON_BASE_IMAGE:-}" ] && REDIS_IMAGE="${BATON_REDIS_IMAGE:-redis:7}"

# Prometheus from Debian's package when no registry gives prom/prometheus.
PROM_IMAGE="${BATON_PROMETHEUS_IMAGE:-}"
if [ -z "$PROM_IMAGE" ] && [ -z "${BATON_BASE_IMAGE:-}" ]; then
  if E image inspect "$PROM_TAG" >/dev/null 2>&1; then
    PROM_IMAGE="$PROM_TAG"
  else
    say "building $PROM_TAG from Debian's prometheus package"
    printf '%s\n' "FROM $BASE" \
      'RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus wget && rm -rf /var/lib/apt/lists/*' \
      'WORKDIR /prometheus' 'ENTRYPOINT ["/usr/bin/prometheus"]' >"$TMP/Containerfile.prometheus"
    if timeout 300 "$ENGINE" build -q -t "$PROM_TAG" -f "$TMP/Containerfile.prometheus" "$TMP" >"$TMP/prom-build.log" 2>&1; then
      PROM_IMAGE="$PROM_TAG"
    else
      tail -5 "$TMP/prom-build.log" >&2
    fi
  fi
fi
[ -z "$PROM_IMAGE" ] && [ -n "${BATON_BASE_IMAGE:-}" ] && PROM_IMAGE="prom/prometheus:latest"

# ---- 2. Baton's image ----------------------------------------------------------------------------
build_args=(--build-arg "BASE_IMAGE=$BASE")
if [ "$ENGINE" = podman ]; then
  # pip in the build sees what pip sees here: the CA bundle, find-links, file:// indexes, constraints
  # (read-only); a CPU torch lying in find-links is taken instead of any download.
  mapfile -t pip_paths < <(helper pip-conf "$TMP/pip.conf")
  build_args+=(--format docker --force-rm --volume "$TMP/pip.conf:/etc/pip.conf:ro")
  for p in "${pip_paths[@]}"; do build_args+=(--volume "$p:$p:ro"); done
  torch_version="$(sed -n 's/^ARG TORCH_VERSION=//p' Dockerfile)"
  for p in "${pip_paths[@]}"; do
    if [ -d "$p" ] && compgen -G "$p/torch-${torch_version}+cpu-*.whl" >/dev/null; then
      build_args+=(--build-arg TORCH_INDEX_URL=); break
    fi
  done
fi
say "building $IMAGE ($ENGINE build, base $BASE)"
previous="$(E image inspect "$IMAGE" --format '{{.Id}}' 2>/dev/null)"
t0=$SECONDS
if ! timeout 900 "$ENGINE" build "${build_args[@]}" -t "$IMAGE" . >"$TMP/build.log" 2>&1; then
  tail -30 "$TMP/build.log" >&2
  record build fail "$ENGINE build failed after $((SECONDS - t0)) s"
  exit 1
fi
BUILD_S=$((SECONDS - t0))
# The image this build replaced, unless it is the same or still in use (its layers stay cached).
[ -n "$previous" ] && [ "$previous" != "$(E image inspect "$IMAGE" --format '{{.Id}}')" ] \
  && E rmi "$previous" >/dev/null 2>&1
SIZE="$(E image inspect "$IMAGE" --format '{{.Size}}' | awk '{printf "%.2f GB", $1 / 1e9}')"
record build pass "${BUILD_S} s, image $SIZE, base $BASE"

say "reference: transformers' greedy float32 output, computed inside the image, offline"
if ! E run --rm -i "${NOHC[@]}" --network none "$IMAGE" python - reference <"$HELPER" >"$TMP/ref.json" 2>"$TMP/ref.log"; then
  tail -20 "$TMP/ref.log" >&2
  record reference fail "transformers in the image failed"
  exit 1
fi

# ---- 3. the compose stack ----------------------------------------------------------------------
PORT="$(free_port)"
URL="http://127.0.0.1:$PORT"
export BATON_IMAGE="$IMAGE" BATON_REDIS_IMAGE="$REDIS_IMAGE" BATON_DTYPE=float32 GATEWAY_PORT="$PORT" \
  PROMETHEUS_PORT="$(free_port)" BATON_BASE_IMAGE="$BASE"
services=(redis gateway prefill_worker decode_worker)
prom_note=""
if [ -n "$PROM_IMAGE" ]; then
  export BATON_PROMETHEUS_IMAGE="$PROM_IMAGE"
  services+=(prometheus)
else
  prom_note="; Prometheus left out (no image: no registry and no Debian package build)"
  say "NOTE: Prometheus left out: no image could be pulled or built here"
fi

healthchecks() {  # every running container of the project passes its own healthcheck now
  local c bad=""
  for c in $(containers_of); do
    if [ "$ENGINE" = podman ]; then
      E healthcheck run "$c" >/dev/null 2>&1 || bad+=" $c"
    else
      [ "$(E inspect "$c" --format '{{if .State.Health}}{{.State.Health.Status}}{{else}}none{{end}}')" = unhealthy ] && bad+=" $c"
    fi
  done
  [ -z "$bad" ] || { echo "unhealthy:$bad" >&2; return 1; }
}

say "a: compose up (${services[*]}), float32"
t0=$SECONDS
compose up -d --no-build "${services[@]}" >"$TMP/up.log" 2>&1 || { tail -20 "$TMP/up.log" >&2; }
ready=0; parity=0
helper wait-ready "$URL" 300 && ready=1 && helper parity "$URL" "$TMP/ref.json" && parity=1
# What each worker serves, in its own words (the engine's start-up line): float32 parity needs the
# GGUF's dequantized weights, and a stack serving the blocks would differ at near ties.
compose logs prefill_worker decode_worker >"$TMP/a-workers.log" 2>&1 || true
weights="$(grep -o 'weights: [^(;]*' "$TMP/a-workers.log" | sort | uniq -c | sed 's/^ *//' | paste -sd ';' -)"
other_weights="$(grep 'weights: ' "$TMP/a-workers.log" | grep -vc 'weights: float32, dequantized from')"
if [ $parity = 1 ] && [ "${other_weights:-0}" = 0 ]; then
  sleep 3  # a Prometheus scrape, the workers' heartbeats
  if healthchecks; then
    record "a: compose up, parity" pass "ready in $((SECONDS - t0)) s; streamed chat + completion = transformers float32 (workers: ${weights:-?}); healthchecks pass$prom_note"
  else
    record "a: compose up, parity" fail "parity ok, a healthcheck fails$prom_note"
  fi
else
  compose logs --tail 30 >&2 2>&1 || true
  record "a: compose up, parity" fail "ready=$ready, parity=$parity, workers: ${weights:-no weights line}$prom_note"
fi

say "b: --scale decode_worker=2"
export DECODE_REPLICAS=2  # so that later compose commands (stop, down) know both replicas
compose up -d --no-build --no-recreate --scale decode_worker=2 "${services[@]}" >"$TMP/scale.log" 2>&1 \
  || tail -20 "$TMP/scale.log" >&2
if helper decode-workers "$URL" 2 180 && helper spread "$URL" "$TMP/ref.json" 8 >"$TMP/b.out" 2>&1; then
  record "b: 2 decode workers" pass "$(tail -1 "$TMP/b.out")"
else
  cat "$TMP/b.out" >&2 2>/dev/null; compose logs --tail 40 gateway >&2 2>&1
  record "b: 2 decode workers" fail "$(tail -1 "$TMP/b.out" 2>/dev/null)"
fi

say "c: SIGKILL of a decode container under 8 streams"
victim="$(containers_of decode_worker | head -1)"
restarts0="$(E inspect "$victim" --format '{{.RestartCount}}' 2>/dev/null || echo 0)"
pid="$(E inspect "$victim" --format '{{.State.Pid}}' 2>/dev/null)"
# SIGKILL of the container's init from the host, as the OOM killer or a crash would end it: podman
# treats `podman kill` as a stop by the user, which the restart policy then honours.
if helper kill "$URL" "$TMP/ref.json" 8 kill -9 "$pid" >"$TMP/c.out" 2>&1; then
  ok_streams=1
else
  ok_streams=0
fi
cat "$TMP/c.out" >&2
[ $ok_streams = 1 ] || compose logs --tail 40 gateway >&2 2>&1
deadline=$((SECONDS + 120)); back=0
while [ $SECONDS -lt $deadline ]; do
  state="$(E inspect "$victim" --format '{{.State.Status}} {{.RestartCount}}' 2>/dev/null)"
  if [ "${state%% *}" = running ] && [ "${state##* }" -gt "$restarts0" ]; then back=1; break; fi
  sleep 1
done
if [ $ok_streams = 1 ] && [ $back = 1 ] && helper decode-workers "$URL" 2 180 >/dev/null && helper idle "$URL" 60 >"$TMP/c-idle.out" 2>&1; then
  record "c: kill a decode container" pass "$(tail -1 "$TMP/c.out"); $victim restarted by policy; idle after (budget 0, no running, no KV blocks)"
else
  cat "$TMP/c-idle.out" >&2 2>/dev/null
  record "c: kill a decode container" fail "streams ok=$ok_streams, restarted=$back, state: ${state:-?}"
fi

say "d: stop under a stream in flight, then compose down"
# Docker Compose stops dependents before what they depend on (Redis last); podman-compose stops all
# at once, so the check stops the Baton services first, as Docker Compose would, then downs the rest.
t0=$SECONDS
if helper drain "$URL" "$TMP/ref.json" "${COMPOSE[@]}" -p "$PROJECT" -f "$ROOT/compose.yaml" stop gateway decode_worker prefill_worker >"$TMP/d.out" 2>&1; then
  drained=1
else
  drained=0
fi
cat "$TMP/d.out" >&2
compose down -v >"$TMP/down.log" 2>&1 || tail -20 "$TMP/down.log" >&2
down_s=$((SECONDS - t0))
left="$(leftovers)"
if [ $drained = 1 ] && [ -z "$left" ] && [ $down_s -le 100 ]; then
  record "d: stop + compose down" pass "stream in flight finished; $(grep -o 'took [0-9.]* s' "$TMP/d.out") to stop, ${down_s} s in all (grace: workers 45 s, gateway 50 s)"
else
  record "d: stop + compose down" fail "drained=$drained, ${down_s} s, left: ${left:-none}"
fi

# ---- 4. the image alone --------------------------------------------------------------------------
say "e: one container, run -p $PORT:8000 $IMAGE (its own Redis)"
single="${PROJECT}_single"
SINGLES+=("$single")
t0=$SECONDS
E run -d --name "$single" -p "127.0.0.1:$PORT:8000" --stop-timeout 90 "$IMAGE" >/dev/null 2>"$TMP/e.err"
# The image's own command (`baton serve`, bfloat16 by default: no float32 parity asked here).
if helper wait-ready "$URL" 300 >/dev/null && helper serves "$URL" >"$TMP/e.out" 2>&1 \
   && { [ "$ENGINE" != podman ] || E healthcheck run "$single" >/dev/null 2>&1; }; then
  record "e: image alone" pass "ready in $((SECONDS - t0)) s, no REDIS_URL (its own redis-server); streamed chat + completion served; HEALTHCHECK passes"
else
  cat "$TMP/e.out" "$TMP/e.err" >&2 2>/dev/null; E logs --tail 30 "$single" >&2 2>&1
  record "e: image alone" fail "see the log above"
fi
E rm -f "$single" >/dev/null 2>&1

say "f: non-root, CPU-only torch, writable cache, offline"
facts="$(E run --rm "${NOHC[@]}" --network none "$IMAGE" python -c '
import os, torch
open(os.path.join(os.environ["BATON_CACHE"], ".write-test"), "w").close()
print(os.getuid(), torch.__version__, torch.version.cuda)' 2>"$TMP/f.err")"
read -r uid torch_v cuda <<<"$facts"
offline="${PROJECT}_offline"
SINGLES+=("$offline")
E run -d --name "$offline" --network none --stop-timeout 90 "$IMAGE" >/dev/null 2>>"$TMP/f.err"
# No network at all: the request comes from inside the container.
if E exec "$offline" python -c 'import time, urllib.request
for _ in range(300):
    try:
        if urllib.request.urlopen("http://127.0.0.1:8000/ready", timeout=2).status == 200: break
    except OSError: time.sleep(1)
import json
r = urllib.request.urlopen(urllib.request.Request("http://127.0.0.1:8000/v1/completions",
    data=json.dumps({"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}).encode(),
    headers={"Content-Type": "application/json"}), timeout=120)
print(json.load(r)["choices"][0]["text"])' >"$TMP/f.out" 2>>"$TMP/f.err"; then served=1; else served=0; fi
E rm -f "$offline" >/dev/null 2>&1
if [ -n "${uid:-}" ] && [ "$uid" != 0 ] && [ "${cuda:-}" = None ] && [ $served = 1 ]; then
  record "f: non-root, CPU torch, offline" pass "uid $uid, torch $torch_v (cuda None), cache writable, served with --network none: $(tr -d '\n' <"$TMP/f.out" | cut -c1-40)"
else
  cat "$TMP/f.err" >&2
  record "f: non-root, CPU torch, offline" fail "uid=${uid:-?} torch=${torch_v:-?} cuda=${cuda:-?} served=$served"
fi

record total "$([ $FAILED = 0 ] && echo pass || echo fail)" "$((SECONDS - START)) s wall, image $SIZE, build ${BUILD_S} s"
