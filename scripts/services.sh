#!/usr/bin/env bash
# scripts/services.sh -- start/stop the external services the test-suite needs,
# without Docker and without systemd.
#
#   scripts/services.sh up     [service...]   start (or reuse) services
#   scripts/services.sh down   [service...]   stop the services this script started
#   scripts/services.sh status [service...]   show what answers and what we started
#
# Services (default: all, in this order): mariadb mariadb_replica postgresql zookeeper kafka.
# Each has one <name>_up / <name>_down / <name>_status function, plus an entry
# in SERVICES below.
#
# ZooKeeper and Kafka (KRaft mode, no ZooKeeper needed; ZooKeeper is for the
# tailer's coordination) run on Java from the jars of scripts/kafka/pom.xml,
# which `up` fetches with Maven into $ROOT/.services/kafka/lib (cached in
# ~/.m2; refetched only when the pom changes).  `up` also installs kcat, the
# Kafka CLI the tests use; it is an install-only step, no process.  The same
# jars serve tests/harness/services.py, which starts private instances for
# fault-injection tests, so `up` fetches them even when it reuses servers.
#
# Rules every service follows:
#   * `up` first checks whether something already answers on the service's
#     port with the test credentials (e.g. `docker compose -f docker/compose.yml
#     up -d`, or a server started by an earlier `up`); if so it is reused and
#     nothing is started.
#   * Otherwise the service is installed when missing (apt, root only; Maven
#     for the ZooKeeper/Kafka jars) and a private instance is started with
#     its state under $ROOT/.services/<name> (gitignored, kept between runs
#     so the next `up` is fast).
#   * Every instance we start is recorded in $ROOT/.services/started; `down`
#     stops exactly those and never touches anything else.
#   * `up` and `down` are idempotent.
#
# Connection settings used by the tests:
#   MariaDB   127.0.0.1:3306  user cellstream  password cellstream (binary log on)
#   MariaDB replica 127.0.0.1:3307, same user, replicating the csr_* databases of 3306
#   PostgreSQL 127.0.0.1:5432 user cellstream  password cellstream (superuser)
#   ZooKeeper 127.0.0.1:2181  (all four-letter-word commands allowed)
#   Kafka     127.0.0.1:9092  PLAINTEXT, one KRaft node (controller on
#             127.0.0.1:9093), auto topic creation disabled
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)"
SVC_DIR="$ROOT/.services"
STATE_FILE="$SVC_DIR/started"
LOCK_FILE="$SVC_DIR/lock"

SERVICES=(mariadb mariadb_replica postgresql zookeeper kafka)
STOP_TIMEOUT=60

log() { printf 'services: %s\n' "$*" >&2; }
die() { log "$*"; exit 1; }

is_root() { [ "$(id -u)" -eq 0 ]; }

# find_bin NAME... -> absolute path of the first NAME found on PATH or in the
# sbin/bin directories (a non-root PATH often lacks /usr/sbin).
find_bin() {
  local n d
  for n in "$@"; do
    if command -v "$n" >/dev/null 2>&1; then
      command -v "$n"
      return 0
    fi
    for d in /usr/sbin /usr/bin /sbin /usr/local/sbin /usr/local/bin; do
      if [ -x "$d/$n" ]; then
        printf '%s\n' "$d/$n"
        return 0
      fi
    done
  done
  return 1
}

# tcp_open HOST PORT -> true if something accepts TCP connections there.
tcp_open() {
  # shellcheck disable=SC2016 # expanded by the inner bash
  timeout 3 bash -c 'exec 3<>"/dev/tcp/$1/$2"' _ "$1" "$2" >/dev/null 2>&1
}

# proc_alive PID COMM [CMDLINE-SUBSTRING] -> true if PID is a live process
# whose command name is COMM and whose command line contains the substring.
proc_alive() {
  local pid="$1" comm="$2" want="${3:-}" c cmdline
  [[ "$pid" =~ ^[0-9]+$ ]] || return 1
  [ -r "/proc/$pid/comm" ] || return 1
  c="$(cat "/proc/$pid/comm" 2>/dev/null)" || return 1
  [ "$c" = "$comm" ] || return 1
  # Zombies (state Z) are dead for our purposes.
  if grep -q '^State:[[:space:]]*Z' "/proc/$pid/status" 2>/dev/null; then
    return 1
  fi
  [ -z "$want" ] && return 0
  cmdline="$(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null)" || return 1
  [[ "$cmdline " == *"$want "* ]]
}

# pids_of COMM -> pids of all live processes named COMM (no procps needed).
pids_of() {
  local d pid
  for d in /proc/[0-9]*; do
    pid="${d#/proc/}"
    if proc_alive "$pid" "$1"; then
      printf '%s\n' "$pid"
    fi
  done
}

# wait_gone PID COMM SECONDS -> true once the process has exited.
wait_gone() {
  local pid="$1" comm="$2" i
  for ((i = 0; i < $3 * 4; i++)); do
    proc_alive "$pid" "$comm" || return 0
    sleep 0.25
  done
  ! proc_alive "$pid" "$comm"
}

# ---------------------------------------------------------------------------
# State file: one line per service we started: "<name> <pid-file> [extra...]"
# ---------------------------------------------------------------------------
state_get() {
  [ -f "$STATE_FILE" ] || return 1
  awk -v s="$1" '$1 == s { print; found = 1 } END { exit !found }' "$STATE_FILE"
}

state_del() {
  [ -f "$STATE_FILE" ] || return 0
  local tmp="$STATE_FILE.tmp.$$"
  awk -v s="$1" '$1 != s' "$STATE_FILE" >"$tmp"
  mv -f "$tmp" "$STATE_FILE"
}

state_add() { # name fields...
  state_del "$1"
  printf '%s\n' "$*" >>"$STATE_FILE"
}

# Services listed in the state file, most recently started first.
state_services() {
  [ -f "$STATE_FILE" ] || return 0
  awk 'NF { print $1 }' "$STATE_FILE" | tac
}

# ---------------------------------------------------------------------------
# apt
# ---------------------------------------------------------------------------
APT_UPDATED=0
POLICY_RC_D=/usr/sbin/policy-rc.d
POLICY_RC_D_CREATED=0

cleanup() {
  if [ "$POLICY_RC_D_CREATED" -eq 1 ]; then
    rm -f "$POLICY_RC_D"
    POLICY_RC_D_CREATED=0
  fi
}
trap cleanup EXIT
trap 'cleanup; exit 130' INT
trap 'cleanup; exit 143' TERM HUP

# apt_install PKG... -- root only.  Service starts by maintainer scripts are
# denied via policy-rc.d so installing never leaves a daemon running.
apt_install() {
  local rc=0 aptlog="$SVC_DIR/apt.log"
  is_root || return 1
  if [ "$APT_UPDATED" -eq 0 ]; then
    log "apt: apt-get update"
    if ! apt-get update >"$aptlog" 2>&1; then
      tail -n 20 "$aptlog" >&2
      die "apt: apt-get update failed (full log: $aptlog)"
    fi
    APT_UPDATED=1
  fi
  if [ ! -e "$POLICY_RC_D" ]; then
    printf '#!/bin/sh\n# created by cellstream scripts/services.sh during apt-get install\nexit 101\n' >"$POLICY_RC_D"
    chmod 755 "$POLICY_RC_D"
    POLICY_RC_D_CREATED=1
  fi
  log "apt: installing $*"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$@" \
    >>"$aptlog" 2>&1 || rc=$?
  cleanup
  if [ "$rc" -ne 0 ]; then
    tail -n 20 "$aptlog" >&2
    die "apt: installing $* failed (full log: $aptlog)"
  fi
}

# ===========================================================================
# MariaDB
# ===========================================================================
MARIADB_HOST=127.0.0.1
MARIADB_PORT=3306
MARIADB_USER=cellstream
MARIADB_PASSWORD=cellstream
MARIADB_PACKAGES=(mariadb-server mariadb-client)
MARIADB_DIR="$SVC_DIR/mariadb"
MARIADB_DATA="$MARIADB_DIR/data"
MARIADB_PID="$MARIADB_DIR/mariadbd.pid"
MARIADB_LOG="$MARIADB_DIR/error.log"
MARIADB_INIT_MARK="$MARIADB_DIR/.initialized"
MARIADB_START_TIMEOUT=90
MARIADB_STARTED_PID=
MARIADB_NAME=mariadb
# The primary writes a row-based binary log for its replica (mariadb_replica).
MARIADB_EXTRA_ARGS=(--server-id=1 --log-bin=mysql-bin --binlog-format=ROW --expire-logs-days=2)

# mariadb_sock DIR SUFFIX -> the socket path; a unix socket path must fit in sockaddr_un.sun_path (108 bytes).
mariadb_sock() {
  local sock="$1/mysqld.sock"
  if [ "${#sock}" -gt 100 ]; then
    if is_root; then
      sock="/run/mysqld/cellstream-$(printf '%s' "$ROOT" | cksum | cut -d' ' -f1)$2.sock"
    else
      sock="${TMPDIR:-/tmp}/cellstream-$(id -u)-$(printf '%s' "$ROOT" | cksum | cut -d' ' -f1)$2.sock"
    fi
  fi
  printf '%s' "$sock"
}
MARIADB_SOCK="$(mariadb_sock "$MARIADB_DIR" "")"

# The replica: a second mariadbd on 3307 with its own data dir, replicating from
# the primary on 3306. It applies only the databases named csr_* (the tests'
# replicated databases): the rest of the suite's writes are not its business.
REPLICA_PORT=3307
REPL_USER=repl
REPL_PASSWORD=repl
mariadb_replica_vars() {
  MARIADB_NAME=mariadb_replica
  MARIADB_PORT=$REPLICA_PORT
  MARIADB_DIR="$SVC_DIR/mariadb-replica"
  MARIADB_DATA="$MARIADB_DIR/data"
  MARIADB_PID="$MARIADB_DIR/mariadbd.pid"
  MARIADB_LOG="$MARIADB_DIR/error.log"
  MARIADB_INIT_MARK="$MARIADB_DIR/.initialized"
  MARIADB_SOCK="$(mariadb_sock "$MARIADB_DIR" -replica)"
  MARIADB_EXTRA_ARGS=(--server-id=2 --read-only=1 '--replicate-wild-do-table=csr\_%.%' --relay-log=relay-bin)
}

mariadb_client() { find_bin mariadb mysql; }

# Does 127.0.0.1:3306 accept the test credentials over TCP?
mariadb_answers() {
  local cli
  cli="$(mariadb_client)" || return 1
  "$cli" --no-defaults --protocol=TCP -h"$MARIADB_HOST" -P"$MARIADB_PORT" \
    -u"$MARIADB_USER" -p"$MARIADB_PASSWORD" --connect-timeout=3 \
    -N -B -e 'select 1' >/dev/null 2>&1
}

# Root SQL (stdin) over our private instance's socket.
# shellcheck disable=SC2120 # extra client options are optional
mariadb_root_sql() {
  local cli
  cli="$(mariadb_client)" || return 1
  "$cli" --no-defaults --socket="$MARIADB_SOCK" -uroot -N -B "$@"
}

# our_pid PIDFILE NAME MATCH -> pid of our NAME process (its command line holds MATCH), from the
# pid file or by scanning.
our_pid() {
  local pidfile="$1" name="$2" want="$3" pid
  pid="$(cat "$pidfile" 2>/dev/null || true)"
  if proc_alive "$pid" "$name" "$want"; then
    printf '%s\n' "$pid"
    return 0
  fi
  for pid in $(pids_of "$name"); do
    if proc_alive "$pid" "$name" "$want"; then
      printf '%s\n' "$pid"
      return 0
    fi
  done
  return 1
}

# The pid of the mariadbd serving our data dir, if any.
mariadb_our_pid() { our_pid "$MARIADB_PID" mariadbd "--datadir=$MARIADB_DATA"; }

mariadb_installed() {
  find_bin mariadbd >/dev/null && find_bin mariadb-install-db >/dev/null &&
    find_bin mariadb-admin >/dev/null && mariadb_client >/dev/null
}

mariadb_install() {
  mariadb_installed && return 0
  if ! is_root; then
    die "$MARIADB_NAME: not installed; as root run: apt-get install -y --no-install-recommends ${MARIADB_PACKAGES[*]}"
  fi
  log "$MARIADB_NAME: installing ${MARIADB_PACKAGES[*]} (apt)..."
  local before pid
  before=" $(pids_of mariadbd | tr '\n' ' ') "
  apt_install "${MARIADB_PACKAGES[@]}"
  mariadb_installed || die "$MARIADB_NAME: installed ${MARIADB_PACKAGES[*]} but mariadbd/mariadb-install-db/mariadb-admin/mariadb still not found"
  # policy-rc.d should have prevented it, but if the package started a
  # system server anyway, stop it: nobody would ever stop it otherwise.
  for pid in $(pids_of mariadbd); do
    [[ "$before" == *" $pid "* ]] && continue
    proc_alive "$pid" mariadbd "--datadir=$MARIADB_DATA" && continue
    log "$MARIADB_NAME: stopping the system server the package started (pid $pid)"
    if [ -x /etc/init.d/mariadb ]; then
      /etc/init.d/mariadb stop >/dev/null 2>&1 || true
    fi
    if proc_alive "$pid" mariadbd; then
      kill -TERM "$pid" 2>/dev/null || true
      wait_gone "$pid" mariadbd "$STOP_TIMEOUT" || kill -KILL "$pid" 2>/dev/null || true
    fi
  done
}

# Wait until our instance answers on its socket; fail early if it died.
mariadb_wait_ready() {
  local pid="$1" admin i
  admin="$(find_bin mariadb-admin mysqladmin)"
  for ((i = 0; i < MARIADB_START_TIMEOUT * 4; i++)); do
    if "$admin" --no-defaults --socket="$MARIADB_SOCK" -uroot --connect-timeout=2 \
      ping >/dev/null 2>&1; then
      return 0
    fi
    if ! proc_alive "$pid" mariadbd; then
      tail -n 30 "$MARIADB_LOG" >&2 || true
      die "$MARIADB_NAME: mariadbd exited during startup (log: $MARIADB_LOG)"
    fi
    sleep 0.25
  done
  tail -n 30 "$MARIADB_LOG" >&2 || true
  die "$MARIADB_NAME: no answer after ${MARIADB_START_TIMEOUT}s (log: $MARIADB_LOG)"
}

# Create the test account (idempotent).  With --skip-name-resolve, 'localhost'
# only matches socket connections; TCP from 127.0.0.1 matches '%'.
mariadb_setup_users() {
  mariadb_root_sql --abort-source-on-error <<SQL
CREATE USER IF NOT EXISTS '$MARIADB_USER'@'%' IDENTIFIED BY '$MARIADB_PASSWORD';
CREATE USER IF NOT EXISTS '$MARIADB_USER'@'localhost' IDENTIFIED BY '$MARIADB_PASSWORD';
ALTER USER '$MARIADB_USER'@'%' IDENTIFIED BY '$MARIADB_PASSWORD';
ALTER USER '$MARIADB_USER'@'localhost' IDENTIFIED BY '$MARIADB_PASSWORD';
GRANT ALL PRIVILEGES ON *.* TO '$MARIADB_USER'@'%' WITH GRANT OPTION;
GRANT ALL PRIVILEGES ON *.* TO '$MARIADB_USER'@'localhost' WITH GRANT OPTION;
FLUSH PRIVILEGES;
SQL
  # mariadb-install-db also creates password-less root@127.0.0.1/::1/<hostname>;
  # keep only root@localhost (socket only, with --skip-name-resolve).
  local host
  for host in $(mariadb_root_sql -e "SELECT host FROM mysql.user WHERE user = 'root' AND host <> 'localhost'"); do
    mariadb_root_sql -e "DROP USER IF EXISTS 'root'@'$host'"
  done
}

# Which unix user runs mariadbd: mysql when we are root (mariadbd refuses to
# run as root by default) unless mysql cannot reach the repo checkout.
mariadb_run_user() {
  if ! is_root; then
    id -un
  elif runuser -u mysql -- test -x "$MARIADB_DIR" -a -w "$MARIADB_DIR" 2>/dev/null; then
    echo mysql
  else
    echo root
  fi
}

mariadb_prepare_dirs() {
  mkdir -p "$MARIADB_DIR"
  if is_root; then
    chmod 755 "$SVC_DIR"
    mkdir -p /run/mysqld
    chown mysql:mysql /run/mysqld
    chown mysql:mysql "$MARIADB_DIR"
    chmod 750 "$MARIADB_DIR"
  fi
}

mariadb_init_datadir() {
  local user="$1" installdb
  if [ -f "$MARIADB_INIT_MARK" ] && [ -d "$MARIADB_DATA/mysql" ]; then
    return 0
  fi
  # Missing marker = never initialized or interrupted half-way: start over.
  rm -rf "$MARIADB_DATA"
  mkdir -p "$MARIADB_DATA"
  installdb="$(find_bin mariadb-install-db mysql_install_db)"
  local args=(--no-defaults --datadir="$MARIADB_DATA" --auth-root-authentication-method=normal
    --skip-test-db --skip-name-resolve)
  if is_root; then
    chown "$user:" "$MARIADB_DATA"
    args+=(--user="$user")
  fi
  log "$MARIADB_NAME: initializing data dir $MARIADB_DATA"
  if ! "$installdb" "${args[@]}" >"$MARIADB_DIR/install-db.log" 2>&1; then
    tail -n 30 "$MARIADB_DIR/install-db.log" >&2
    die "$MARIADB_NAME: mariadb-install-db failed (log: $MARIADB_DIR/install-db.log)"
  fi
  touch "$MARIADB_INIT_MARK"
}

mariadb_start() {
  local user="$1" mariadbd pid
  mariadbd="$(find_bin mariadbd mysqld)"
  local args=(--no-defaults
    --datadir="$MARIADB_DATA"
    --port="$MARIADB_PORT" --bind-address="$MARIADB_HOST"
    --socket="$MARIADB_SOCK"
    --pid-file="$MARIADB_PID"
    --log-error="$MARIADB_LOG"
    --skip-name-resolve
    --max-connections=500
    --innodb-buffer-pool-size=512M
    --max-allowed-packet=64M
    --character-set-server=utf8mb4
    --collation-server=utf8mb4_unicode_ci
    "${MARIADB_EXTRA_ARGS[@]}")
  # Durability defaults are kept on purpose (innodb_flush_log_at_trx_commit=1):
  # the benchmark measures durable puts.
  if is_root; then
    args+=(--user="$user")
  fi
  rm -f "$MARIADB_PID"
  # mariadbd opens --log-error after dropping to $user; our stdio redirect
  # below appends to the same file, so create it with the right owner first.
  touch "$MARIADB_LOG"
  if is_root; then
    chown "$user:" "$MARIADB_LOG"
  fi
  # Detached: own session, no inherited stdio (and not the lock fd), so `make`
  # can exit while the server keeps running.  In a non-interactive shell the
  # background job is not a process-group leader, so setsid execs mariadbd in
  # place and $! is mariadbd's pid.
  setsid "$mariadbd" "${args[@]}" </dev/null >>"$MARIADB_LOG" 2>&1 9>&- &
  pid=$!
  disown "$pid" 2>/dev/null || true
  # Record before waiting, so `down` stops it even if the wait fails.
  state_add "$MARIADB_NAME" "$MARIADB_PID" "$MARIADB_SOCK"
  mariadb_wait_ready "$pid"
  MARIADB_STARTED_PID="$(mariadb_our_pid)" ||
    die "$MARIADB_NAME: answers on $MARIADB_SOCK but no mariadbd process for $MARIADB_DATA found"
}

mariadb_up() {
  local pid user t0=$SECONDS

  # 1. Our own instance from an earlier `up` (possibly with a lost state
  #    file): make sure it is recorded, ready and has the test account.
  if pid="$(mariadb_our_pid)"; then
    state_add "$MARIADB_NAME" "$MARIADB_PID" "$MARIADB_SOCK"
    mariadb_wait_ready "$pid"
    mariadb_answers || mariadb_setup_users
    mariadb_answers || die "$MARIADB_NAME: our server (pid $pid) does not accept $MARIADB_USER over TCP (log: $MARIADB_LOG)"
    if [ "$MARIADB_NAME" = mariadb ] && [ "$(mariadb_root_sql -e 'SELECT @@log_bin')" != 1 ]; then
      log "$MARIADB_NAME: running without the binary log its replica needs: restarting it"
      mariadb_down
    else
      log "$MARIADB_NAME: already running (pid $pid, started by us), reusing"
      return 0
    fi
  fi
  # Not running: forget a stale record.
  state_del "$MARIADB_NAME"

  # 2. Somebody else's server (docker compose, a developer's own, ...).
  if tcp_open "$MARIADB_HOST" "$MARIADB_PORT"; then
    if ! mariadb_client >/dev/null; then
      if is_root; then
        log "$MARIADB_NAME: something listens on $MARIADB_HOST:$MARIADB_PORT; installing the client to check it"
        apt_install mariadb-client
      else
        die "$MARIADB_NAME: something listens on $MARIADB_HOST:$MARIADB_PORT but no mariadb client to check it; as root run: apt-get install -y --no-install-recommends mariadb-client"
      fi
    fi
    if mariadb_answers; then
      log "$MARIADB_NAME: already running, reusing"
      return 0
    fi
    die "$MARIADB_NAME: $MARIADB_HOST:$MARIADB_PORT is in use but does not accept $MARIADB_USER/$MARIADB_PASSWORD; stop it or create that user (GRANT ALL ON *.*)"
  fi

  # 3. Start a private instance.
  mariadb_install
  mariadb_prepare_dirs
  user="$(mariadb_run_user)"
  if is_root && [ "$user" = root ]; then
    log "$MARIADB_NAME: user mysql cannot reach $MARIADB_DIR; running mariadbd as root"
  fi
  mariadb_init_datadir "$user"
  log "$MARIADB_NAME: starting mariadbd (data dir $MARIADB_DATA)"
  mariadb_start "$user"
  pid="$MARIADB_STARTED_PID"
  mariadb_setup_users
  mariadb_answers || die "$MARIADB_NAME: started (pid $pid) but $MARIADB_USER cannot log in over TCP (log: $MARIADB_LOG)"
  log "$MARIADB_NAME: started on $MARIADB_HOST:$MARIADB_PORT (pid $pid, $((SECONDS - t0))s)"
}

mariadb_down() {
  local pid admin
  if ! state_get "$MARIADB_NAME" >/dev/null; then
    log "$MARIADB_NAME: not started by us, leaving it alone"
    return 0
  fi
  if ! pid="$(mariadb_our_pid)"; then
    log "$MARIADB_NAME: not running"
    state_del "$MARIADB_NAME"
    return 0
  fi
  log "$MARIADB_NAME: stopping (pid $pid)"
  admin="$(find_bin mariadb-admin mysqladmin || true)"
  if [ -z "$admin" ] || ! timeout "$STOP_TIMEOUT" "$admin" --no-defaults \
    --socket="$MARIADB_SOCK" -uroot --connect-timeout=5 shutdown >/dev/null 2>&1; then
    kill -TERM "$pid" 2>/dev/null || true
  fi
  finish_stop "$MARIADB_NAME" "$pid" mariadbd
}

# finish_stop NAME PID COMM -- wait for a server asked to stop; kill it if it outlives STOP_TIMEOUT; forget it.
finish_stop() {
  local name="$1" pid="$2" comm="$3"
  if ! wait_gone "$pid" "$comm" "$STOP_TIMEOUT"; then
    log "$name: still running after ${STOP_TIMEOUT}s, killing"
    kill -KILL "$pid" 2>/dev/null || true
    wait_gone "$pid" "$comm" 10 || die "$name: could not stop pid $pid"
  fi
  state_del "$name"
  log "$name: stopped"
}

# "NAME: HOST:PORT answers=.. started-by-us=.. [pid=..]" (no newline) for a service that
# has NAME_answers and NAME_our_pid.
service_status() {
  local name="$1" host="$2" port="$3" answers=no ours=no pid=""
  "${name}_answers" && answers=yes
  if state_get "$name" >/dev/null; then
    ours=yes
    pid="$("${name}_our_pid" || true)"
  fi
  printf '%s: %s:%s answers=%s started-by-us=%s%s' "$name" "$host" "$port" "$answers" "$ours" "${pid:+ pid=$pid}"
}

mariadb_status() {
  service_status mariadb "$MARIADB_HOST" "$MARIADB_PORT"
  echo
}

# SQL as the test user over TCP, on the server at port $1 (ours or somebody else's).
mariadb_tcp_sql() {
  local port="$1" cli
  shift
  cli="$(mariadb_client)" || return 1
  "$cli" --no-defaults --protocol=TCP -h"$MARIADB_HOST" -P"$port" -u"$MARIADB_USER" -p"$MARIADB_PASSWORD" \
    --connect-timeout=5 -N -B "$@"
}

mariadb_replica_up() {
  (mariadb_replica_vars && mariadb_up)
  # Replication, once: the replica keeps it (and resumes it) across restarts.
  mariadb_tcp_sql "$MARIADB_PORT" -e "CREATE USER IF NOT EXISTS '$REPL_USER'@'%' IDENTIFIED BY '$REPL_PASSWORD';
    GRANT REPLICATION SLAVE ON *.* TO '$REPL_USER'@'%'" ||
    die "mariadb_replica: cannot create the replication user on the primary ($MARIADB_HOST:$MARIADB_PORT)"
  if [ -z "$(mariadb_tcp_sql "$REPLICA_PORT" -e 'SHOW SLAVE STATUS')" ]; then
    log "mariadb_replica: replicating from $MARIADB_HOST:$MARIADB_PORT"
    mariadb_tcp_sql "$REPLICA_PORT" -e "CHANGE MASTER TO MASTER_HOST='$MARIADB_HOST', MASTER_PORT=$MARIADB_PORT,
      MASTER_USER='$REPL_USER', MASTER_PASSWORD='$REPL_PASSWORD', MASTER_USE_GTID=current_pos; START SLAVE" ||
      die "mariadb_replica: CHANGE MASTER failed"
  else
    mariadb_tcp_sql "$REPLICA_PORT" -e "START SLAVE" >/dev/null 2>&1 || true
  fi
  local i running
  for ((i = 0; i < 240; i++)); do
    running="$(mariadb_tcp_sql "$REPLICA_PORT" --column-names -E -e 'SHOW SLAVE STATUS' |
      awk -F': ' '$1 ~ /Slave_(IO|SQL)_Running$/ && $2 == "Yes" { n++ } END { print n + 0 }')"
    [ "$running" = 2 ] && return 0
    sleep 0.25
  done
  mariadb_tcp_sql "$REPLICA_PORT" --column-names -E -e 'SHOW SLAVE STATUS' >&2 || true
  die "mariadb_replica: replication from $MARIADB_HOST:$MARIADB_PORT did not start"
}

mariadb_replica_down() { (mariadb_replica_vars && mariadb_down); }
mariadb_replica_answers() { (mariadb_replica_vars && mariadb_answers); }
mariadb_replica_our_pid() { (mariadb_replica_vars && mariadb_our_pid); }
mariadb_replica_status() {
  (mariadb_replica_vars && service_status mariadb_replica "$MARIADB_HOST" "$MARIADB_PORT")
  echo
}

# ===========================================================================
# PostgreSQL (Debian's packages; a private cluster run by the postgres user,
# which PostgreSQL requires: it refuses to run as root)
# ===========================================================================
PG_HOST=127.0.0.1
PG_PORT=5432
PG_USER=cellstream
PG_PASSWORD=cellstream
PG_PACKAGES=(postgresql postgresql-client)
PG_DIR="$SVC_DIR/postgresql"
PG_DATA="$PG_DIR/data"
PG_LOG="$PG_DIR/postgresql.log"
PG_INIT_MARK="$PG_DIR/.initialized"
PG_START_TIMEOUT=60

# The server binaries of the newest installed major version.
pg_bin() {
  local dir
  dir="$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)"
  [ -n "$dir" ] && [ -x "$dir/$1" ] && printf '%s\n' "$dir/$1"
}

postgresql_installed() { pg_bin initdb >/dev/null && pg_bin pg_ctl >/dev/null && find_bin psql >/dev/null; }

# Does 127.0.0.1:5432 accept the test credentials over TCP?
postgresql_answers() {
  local psql
  psql="$(find_bin psql)" || return 1
  PGPASSWORD="$PG_PASSWORD" PGCONNECT_TIMEOUT=3 "$psql" -h "$PG_HOST" -p "$PG_PORT" -U "$PG_USER" \
    -d postgres -w -tAc 'select 1' >/dev/null 2>&1
}

# The postmaster of our data dir, if it runs.
postgresql_our_pid() {
  local pid
  pid="$(head -n 1 "$PG_DATA/postmaster.pid" 2>/dev/null || true)"
  proc_alive "$pid" postgres "$PG_DATA" || return 1
  printf '%s\n' "$pid"
}

# Run a command as the postgres user (or as ourselves when not root).
as_postgres() {
  if is_root; then
    runuser -u postgres -- "$@"
  else
    "$@"
  fi
}

postgresql_install() {
  postgresql_installed && return 0
  is_root || die "postgresql: not installed; as root run: apt-get install -y --no-install-recommends ${PG_PACKAGES[*]}"
  log "postgresql: installing ${PG_PACKAGES[*]} (apt)..."
  apt_install "${PG_PACKAGES[@]}"
  postgresql_installed || die "postgresql: installed ${PG_PACKAGES[*]} but initdb/pg_ctl/psql still not found"
}

postgresql_init() {
  if [ -f "$PG_INIT_MARK" ] && [ -f "$PG_DATA/PG_VERSION" ]; then
    return 0
  fi
  rm -rf "$PG_DATA"
  mkdir -p "$PG_DATA"
  is_root && chown -R postgres: "$PG_DIR"
  log "postgresql: initializing data dir $PG_DATA"
  local pwfile="$PG_DIR/.pw"
  printf '%s\n' "$PG_PASSWORD" >"$pwfile"
  is_root && chown postgres: "$pwfile"
  if ! as_postgres "$(pg_bin initdb)" -D "$PG_DATA" -U "$PG_USER" --pwfile="$pwfile" --auth-local=trust \
    --auth-host=scram-sha-256 -E UTF8 --locale=C.UTF-8 >"$PG_DIR/initdb.log" 2>&1; then
    rm -f "$pwfile"
    tail -n 30 "$PG_DIR/initdb.log" >&2
    die "postgresql: initdb failed (log: $PG_DIR/initdb.log)"
  fi
  rm -f "$pwfile"
  touch "$PG_INIT_MARK"
}

postgresql_up() {
  local pid t0=$SECONDS
  if pid="$(postgresql_our_pid)"; then
    state_add postgresql "$PG_DATA"
    postgresql_answers || die "postgresql: our server (pid $pid) does not accept $PG_USER over TCP (log: $PG_LOG)"
    log "postgresql: already running (pid $pid, started by us), reusing"
    return 0
  fi
  state_del postgresql
  if tcp_open "$PG_HOST" "$PG_PORT"; then
    postgresql_install
    postgresql_answers && { log "postgresql: already running, reusing"; return 0; }
    die "postgresql: $PG_HOST:$PG_PORT is in use but does not accept $PG_USER/$PG_PASSWORD; stop it or create that superuser"
  fi
  postgresql_install
  mkdir -p "$PG_DIR"
  if is_root; then
    chmod 755 "$SVC_DIR"
    chown postgres: "$PG_DIR"
    runuser -u postgres -- test -x "$PG_DIR" -a -w "$PG_DIR" ||
      die "postgresql: user postgres cannot reach $PG_DIR (it needs search access to every parent)"
  fi
  postgresql_init
  log "postgresql: starting (data dir $PG_DATA)"
  touch "$PG_LOG"
  is_root && chown postgres: "$PG_LOG"
  state_add postgresql "$PG_DATA"
  # pg_ctl detaches the server (its stdio goes to the log), so `make` can exit while it runs.
  if ! as_postgres "$(pg_bin pg_ctl)" -D "$PG_DATA" -l "$PG_LOG" -w -t "$PG_START_TIMEOUT" \
    -o "-c listen_addresses=$PG_HOST -p $PG_PORT -k $PG_DIR -c max_connections=200 -c fsync=on" \
    start >/dev/null 2>&1 9>&-; then
    tail -n 30 "$PG_LOG" >&2 || true
    die "postgresql: the server did not start (log: $PG_LOG)"
  fi
  pid="$(postgresql_our_pid)" || die "postgresql: started but no postmaster for $PG_DATA found"
  postgresql_answers || die "postgresql: started (pid $pid) but $PG_USER cannot log in over TCP (log: $PG_LOG)"
  log "postgresql: started on $PG_HOST:$PG_PORT (pid $pid, $((SECONDS - t0))s)"
}

postgresql_down() {
  local pid
  if ! state_get postgresql >/dev/null; then
    log "postgresql: not started by us, leaving it alone"
    return 0
  fi
  if ! pid="$(postgresql_our_pid)"; then
    log "postgresql: not running"
    state_del postgresql
    return 0
  fi
  log "postgresql: stopping (pid $pid)"
  as_postgres "$(pg_bin pg_ctl)" -D "$PG_DATA" -m fast -w -t "$STOP_TIMEOUT" stop >/dev/null 2>&1 ||
    kill -TERM "$pid" 2>/dev/null || true
  finish_stop postgresql "$pid" postgres
}

postgresql_status() {
  service_status postgresql "$PG_HOST" "$PG_PORT"
  echo
}

# ===========================================================================
# Java, the Kafka/ZooKeeper jars and kcat (install-only steps shared by the
# zookeeper and kafka services; tests/harness/services.py uses the same jars)
# ===========================================================================
JAVA_PACKAGES=(openjdk-17-jre-headless)
MAVEN_PACKAGES=(maven)
KAFKA_POM="$ROOT/scripts/kafka/pom.xml"
KAFKA_DIR="$SVC_DIR/kafka"
KAFKA_LIB="$KAFKA_DIR/lib"
KAFKA_LIB_STAMP="$KAFKA_LIB/.pom.sha256"
# One jar that must be there for the lib dir to count as complete.
KAFKA_LIB_PROBE="kafka_2.13-*.jar"

java_bin() { find_bin java; }

java_install() {
  java_bin >/dev/null && return 0
  is_root || die "java: not installed; as root run: apt-get install -y --no-install-recommends ${JAVA_PACKAGES[*]}"
  apt_install "${JAVA_PACKAGES[@]}"
  java_bin >/dev/null || die "java: installed ${JAVA_PACKAGES[*]} but java still not found"
}

kafka_pom_hash() { sha256sum "$KAFKA_POM" | cut -d' ' -f1; }

kafka_lib_complete() {
  [ -f "$KAFKA_LIB_STAMP" ] && [ "$(cat "$KAFKA_LIB_STAMP")" = "$(kafka_pom_hash)" ] &&
    compgen -G "$KAFKA_LIB/$KAFKA_LIB_PROBE" >/dev/null
}

# Fetch the jars of scripts/kafka/pom.xml into $KAFKA_LIB (Maven Central,
# cached in ~/.m2); skipped when the stamp matches the pom's hash.
kafka_lib_install() {
  local mvn tmp mvnlog="$KAFKA_DIR/mvn.log" t0=$SECONDS
  java_install
  kafka_lib_complete && return 0
  if ! mvn="$(find_bin mvn)"; then
    is_root || die "kafka: Maven is needed to fetch the jars; as root run: apt-get install -y --no-install-recommends ${MAVEN_PACKAGES[*]}"
    apt_install "${MAVEN_PACKAGES[@]}"
    mvn="$(find_bin mvn)" || die "kafka: installed ${MAVEN_PACKAGES[*]} but mvn still not found"
  fi
  mkdir -p "$KAFKA_DIR"
  tmp="$KAFKA_DIR/lib.tmp.$$"
  rm -rf "$tmp"
  log "kafka: fetching the Kafka/ZooKeeper jars with Maven ($KAFKA_POM -> $KAFKA_LIB)"
  if ! "$mvn" -q -B -f "$KAFKA_POM" dependency:copy-dependencies \
    -DoutputDirectory="$tmp" >"$mvnlog" 2>&1 </dev/null 9>&-; then
    tail -n 30 "$mvnlog" >&2
    rm -rf "$tmp"
    die "kafka: fetching the jars failed (log: $mvnlog)"
  fi
  compgen -G "$tmp/$KAFKA_LIB_PROBE" >/dev/null || die "kafka: Maven ran but no $KAFKA_LIB_PROBE in $tmp (log: $mvnlog)"
  kafka_pom_hash >"$tmp/.pom.sha256"
  # Swap in one step so a half-copied lib dir is never mistaken for complete.
  rm -rf "$KAFKA_LIB"
  mv "$tmp" "$KAFKA_LIB"
  log "kafka: $(find "$KAFKA_LIB" -name '*.jar' | wc -l) jars in $KAFKA_LIB ($((SECONDS - t0))s)"
}

# kcat: the CLI the tests (and our readiness checks) talk to Kafka with.
kcat_bin() { find_bin kcat kafkacat; }

kcat_install() {
  kcat_bin >/dev/null && return 0
  is_root || die "kcat: not installed; as root run: apt-get install -y --no-install-recommends kcat"
  apt_install kcat
  kcat_bin >/dev/null || die "kcat: installed kcat but kcat still not found"
}

# java_start NAME LOG OUT PIDFILE JAVA-ARGS... -- start a JVM detached (own
# session, no inherited stdio, not the lock fd); stdout/stderr (JVM errors
# before log4j is up) go to OUT.  Echoes the pid.
java_start() {
  local name="$1" out="$2" pidfile="$3" java pid
  shift 3
  java="$(java_bin)" || die "$name: java not found"
  : >"$out"
  # See mariadb_start: in a non-interactive shell setsid execs java in place,
  # so $! is the JVM's pid.
  setsid "$java" "$@" </dev/null >>"$out" 2>&1 9>&- &
  pid=$!
  disown "$pid" 2>/dev/null || true
  printf '%s\n' "$pid" >"$pidfile"
  printf '%s\n' "$pid"
}

# java_our_pid PIDFILE CMDLINE-TAIL -> pid of our JVM whose command line ends
# in CMDLINE-TAIL (its config file), from the pid file or by scanning.
java_our_pid() {
  local pid
  pid="$(our_pid "$1" java "$2")" || return 1
  printf '%s\n' "$pid" >"$1"  # kept current, so the next look needs no scan
  printf '%s\n' "$pid"
}

# java_stop NAME PID -- SIGTERM (both servers shut down cleanly on it), then
# SIGKILL after $STOP_TIMEOUT.
java_stop() {
  local name="$1" pid="$2"
  log "$name: stopping (pid $pid)"
  kill -TERM "$pid" 2>/dev/null || true
  if ! wait_gone "$pid" java "$STOP_TIMEOUT"; then
    log "$name: still running after ${STOP_TIMEOUT}s, killing"
    kill -KILL "$pid" 2>/dev/null || true
    wait_gone "$pid" java 10 || die "$name: could not stop pid $pid"
  fi
}

# log4j_file_config FILE LOGFILE [EXTRA-LINES] -- a log4j 1.x (reload4j)
# config sending everything at INFO to a size-capped LOGFILE.
log4j_file_config() {
  cat >"$1" <<L4J
# Written by scripts/services.sh on every start; edits are lost.
log4j.rootLogger=INFO, file
log4j.appender.file=org.apache.log4j.RollingFileAppender
log4j.appender.file.File=$2
log4j.appender.file.Append=true
log4j.appender.file.MaxFileSize=20MB
log4j.appender.file.MaxBackupIndex=2
log4j.appender.file.layout=org.apache.log4j.PatternLayout
log4j.appender.file.layout.ConversionPattern=[%d] %p %m (%c)%n
${3:-}
L4J
}

# show_logs FILE... -- the tail of each existing file, to stderr.
show_logs() {
  local f
  for f in "$@"; do
    [ -s "$f" ] || continue
    printf -- '--- last lines of %s ---\n' "$f" >&2
    tail -n 30 "$f" >&2
  done
}

# ===========================================================================
# ZooKeeper (standalone, from the jars in $KAFKA_LIB)
# ===========================================================================
ZK_HOST=127.0.0.1
ZK_PORT=2181
ZK_DIR="$SVC_DIR/zookeeper"
ZK_DATA="$ZK_DIR/data"
ZK_CFG="$ZK_DIR/zoo.cfg"
ZK_LOG4J="$ZK_DIR/log4j.properties"
ZK_LOG="$ZK_DIR/zookeeper.log"
ZK_OUT="$ZK_DIR/zookeeper.out"
ZK_PID="$ZK_DIR/zookeeper.pid"
ZK_HEAP_OPTS=(-Xms64m -Xmx256m)
ZK_START_TIMEOUT=60

# zk_4lw CMD -> the server's answer to a four-letter-word command.
zk_4lw() {
  # shellcheck disable=SC2016 # expanded by the inner bash
  timeout 3 bash -c 'exec 3<>"/dev/tcp/$1/$2" && printf %s "$3" >&3 && head -c 200 <&3' \
    _ "$ZK_HOST" "$ZK_PORT" "$1" 2>/dev/null
}

# Is a ZooKeeper serving on 127.0.0.1:2181?  `ruok` needs the 4lw whitelist
# (ours is *); `srvr` is whitelisted by default (e.g. the zookeeper image).
zookeeper_answers() {
  [ "$(zk_4lw ruok)" = imok ] && return 0
  [[ "$(zk_4lw srvr)" == "Zookeeper version:"* ]]
}

# Stop a Java service `up` started (NAME_our_pid finds it); leave one we did not start alone.
java_service_down() {
  local name="$1" pid
  if ! state_get "$name" >/dev/null; then
    log "$name: not started by us, leaving it alone"
    return 0
  fi
  if ! pid="$("${name}_our_pid")"; then
    log "$name: not running"
    state_del "$name"
    return 0
  fi
  java_stop "$name" "$pid"
  state_del "$name"
  log "$name: stopped"
}

zookeeper_our_pid() { java_our_pid "$ZK_PID" "$ZK_CFG"; }

zookeeper_write_config() {
  mkdir -p "$ZK_DATA"
  cat >"$ZK_CFG" <<CFG
# Written by scripts/services.sh on every start; edits are lost.
tickTime=2000
dataDir=$ZK_DATA
clientPort=$ZK_PORT
clientPortAddress=$ZK_HOST
maxSessionTimeout=60000
# The tests open many sessions from 127.0.0.1.
maxClientCnxns=0
admin.enableServer=false
4lw.commands.whitelist=*
autopurge.snapRetainCount=3
autopurge.purgeInterval=1
CFG
  log4j_file_config "$ZK_LOG4J" "$ZK_LOG"
}

zookeeper_wait_ready() {
  local pid="$1" i
  for ((i = 0; i < ZK_START_TIMEOUT * 4; i++)); do
    [ "$(zk_4lw ruok)" = imok ] && return 0
    if ! proc_alive "$pid" java; then
      show_logs "$ZK_OUT" "$ZK_LOG"
      die "zookeeper: the JVM exited during startup (log: $ZK_LOG)"
    fi
    sleep 0.25
  done
  show_logs "$ZK_OUT" "$ZK_LOG"
  die "zookeeper: no answer to ruok on $ZK_HOST:$ZK_PORT after ${ZK_START_TIMEOUT}s (log: $ZK_LOG)"
}

zookeeper_up() {
  local pid t0=$SECONDS
  # The jars are needed by tests/harness/services.py even when a server is reused.
  kafka_lib_install

  # 1. Our own instance from an earlier `up`.
  if pid="$(zookeeper_our_pid)"; then
    state_add zookeeper "$ZK_PID" "$ZK_CFG"
    zookeeper_wait_ready "$pid"
    log "zookeeper: already running (pid $pid, started by us), reusing"
    return 0
  fi
  state_del zookeeper

  # 2. Somebody else's server (docker compose, ...).
  if tcp_open "$ZK_HOST" "$ZK_PORT"; then
    zookeeper_answers && {
      log "zookeeper: already running, reusing"
      return 0
    }
    die "zookeeper: $ZK_HOST:$ZK_PORT is in use but does not answer ruok/srvr like ZooKeeper; stop it"
  fi

  # 3. Start a private instance.
  zookeeper_write_config
  log "zookeeper: starting (data dir $ZK_DATA)"
  pid="$(java_start zookeeper "$ZK_OUT" "$ZK_PID" \
    "${ZK_HEAP_OPTS[@]}" -XX:+UseG1GC -Djava.awt.headless=true \
    -Dlog4j.configuration="file:$ZK_LOG4J" -Dzookeeper.log.dir="$ZK_DIR" \
    -cp "$KAFKA_LIB/*" org.apache.zookeeper.server.ZooKeeperServerMain "$ZK_CFG")"
  # Record before waiting, so `down` stops it even if the wait fails.
  state_add zookeeper "$ZK_PID" "$ZK_CFG"
  zookeeper_wait_ready "$pid"
  log "zookeeper: started on $ZK_HOST:$ZK_PORT (pid $pid, $((SECONDS - t0))s)"
}

zookeeper_down() { java_service_down zookeeper; }

zookeeper_status() {
  service_status zookeeper "$ZK_HOST" "$ZK_PORT"
  echo
}

# ===========================================================================
# Kafka (single KRaft node, broker + controller in one JVM)
# ===========================================================================
KAFKA_HOST=127.0.0.1
KAFKA_PORT=9092
KAFKA_CONTROLLER_PORT=9093
KAFKA_DATA="$KAFKA_DIR/data"
KAFKA_PROPS="$KAFKA_DIR/server.properties"
KAFKA_LOG4J="$KAFKA_DIR/log4j.properties"
KAFKA_LOG="$KAFKA_DIR/server.log"
KAFKA_OUT="$KAFKA_DIR/kafka.out"
KAFKA_PID="$KAFKA_DIR/kafka.pid"
# 2 cores, shared with the tests: a modest heap.
KAFKA_HEAP_OPTS=(-Xms256m -Xmx512m)
# What bin/kafka-run-class.sh uses (KAFKA_JVM_PERFORMANCE_OPTS).
KAFKA_JVM_OPTS=(-XX:+UseG1GC -XX:MaxGCPauseMillis=20 -XX:InitiatingHeapOccupancyPercent=35
  -XX:+ExplicitGCInvokesConcurrent -XX:MaxInlineLevel=15 -Djava.awt.headless=true)
KAFKA_START_TIMEOUT=120

kafka_java() {
  "$(java_bin)" "${KAFKA_HEAP_OPTS[@]}" "${KAFKA_JVM_OPTS[@]}" \
    -Dlog4j.configuration="file:$KAFKA_LOG4J" -Dkafka.logs.dir="$KAFKA_DIR" \
    -cp "$KAFKA_LIB/*" "$@"
}

# Does a Kafka broker at 127.0.0.1:9092 return metadata with >= 1 broker?
kafka_answers() {
  local kcat
  kcat="$(kcat_bin)" || return 1
  tcp_open "$KAFKA_HOST" "$KAFKA_PORT" || return 1
  timeout 20 "$kcat" -b "$KAFKA_HOST:$KAFKA_PORT" -L -t __cellstream_probe -m 10 2>/dev/null |
    grep -Eq '^ +broker [0-9]+ at '
}

kafka_our_pid() { java_our_pid "$KAFKA_PID" "$KAFKA_PROPS"; }

kafka_write_config() {
  mkdir -p "$KAFKA_DATA"
  cat >"$KAFKA_PROPS" <<CFG
# Written by scripts/services.sh on every start; edits are lost.
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@$KAFKA_HOST:$KAFKA_CONTROLLER_PORT
listeners=PLAINTEXT://$KAFKA_HOST:$KAFKA_PORT,CONTROLLER://$KAFKA_HOST:$KAFKA_CONTROLLER_PORT
advertised.listeners=PLAINTEXT://$KAFKA_HOST:$KAFKA_PORT
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT
log.dirs=$KAFKA_DATA
num.partitions=1
auto.create.topics.enable=false
offsets.topic.replication.factor=1
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
min.insync.replicas=1
default.replication.factor=1
group.initial.rebalance.delay.ms=0
num.network.threads=2
num.io.threads=4
CFG
  log4j_file_config "$KAFKA_LOG4J" "$KAFKA_LOG" \
    'log4j.logger.kafka.request.logger=WARN
log4j.logger.org.apache.kafka.clients=WARN'
}

# Format the KRaft storage once (a fresh cluster id); meta.properties marks it.
kafka_format_storage() {
  local id fmtlog="$KAFKA_DIR/format.log"
  [ -f "$KAFKA_DATA/meta.properties" ] && return 0
  # Missing meta.properties = never formatted or interrupted: start over.
  rm -rf "$KAFKA_DATA"
  mkdir -p "$KAFKA_DATA"
  id="$(kafka_java kafka.tools.StorageTool random-uuid 2>"$fmtlog" </dev/null 9>&- | tail -n 1)"
  [[ "$id" =~ ^[A-Za-z0-9_-]{22}$ ]] || {
    show_logs "$fmtlog"
    die "kafka: StorageTool random-uuid gave '$id' (log: $fmtlog)"
  }
  log "kafka: formatting $KAFKA_DATA (cluster id $id)"
  if ! kafka_java kafka.tools.StorageTool format -t "$id" -c "$KAFKA_PROPS" \
    >>"$fmtlog" 2>&1 </dev/null 9>&-; then
    show_logs "$fmtlog"
    die "kafka: formatting the storage failed (log: $fmtlog)"
  fi
  [ -f "$KAFKA_DATA/meta.properties" ] || die "kafka: format ran but wrote no $KAFKA_DATA/meta.properties (log: $fmtlog)"
}

kafka_wait_ready() {
  local pid="$1" t_end=$((SECONDS + KAFKA_START_TIMEOUT))
  while [ "$SECONDS" -lt "$t_end" ]; do
    kafka_answers && return 0
    if ! proc_alive "$pid" java; then
      show_logs "$KAFKA_OUT" "$KAFKA_LOG"
      die "kafka: the JVM exited during startup (log: $KAFKA_LOG)"
    fi
    sleep 0.5
  done
  show_logs "$KAFKA_OUT" "$KAFKA_LOG"
  die "kafka: no metadata from $KAFKA_HOST:$KAFKA_PORT after ${KAFKA_START_TIMEOUT}s (log: $KAFKA_LOG)"
}

kafka_up() {
  local pid t0=$SECONDS
  # Install-only steps, needed by the tests even when a broker is reused.
  kcat_install
  kafka_lib_install

  # 1. Our own broker from an earlier `up`.
  if pid="$(kafka_our_pid)"; then
    state_add kafka "$KAFKA_PID" "$KAFKA_PROPS"
    kafka_wait_ready "$pid"
    log "kafka: already running (pid $pid, started by us), reusing"
    return 0
  fi
  state_del kafka

  # 2. Somebody else's broker (docker compose, ...).
  if tcp_open "$KAFKA_HOST" "$KAFKA_PORT"; then
    kafka_answers && {
      log "kafka: already running, reusing"
      return 0
    }
    die "kafka: $KAFKA_HOST:$KAFKA_PORT is in use but returns no Kafka metadata (kcat -L); stop it"
  fi
  tcp_open "$KAFKA_HOST" "$KAFKA_CONTROLLER_PORT" &&
    die "kafka: the controller port $KAFKA_HOST:$KAFKA_CONTROLLER_PORT is in use by something else; stop it"

  # 3. Start a private broker.
  kafka_write_config
  kafka_format_storage
  log "kafka: starting (KRaft, data dir $KAFKA_DATA)"
  pid="$(java_start kafka "$KAFKA_OUT" "$KAFKA_PID" \
    "${KAFKA_HEAP_OPTS[@]}" "${KAFKA_JVM_OPTS[@]}" \
    -Dlog4j.configuration="file:$KAFKA_LOG4J" -Dkafka.logs.dir="$KAFKA_DIR" \
    -cp "$KAFKA_LIB/*" kafka.Kafka "$KAFKA_PROPS")"
  state_add kafka "$KAFKA_PID" "$KAFKA_PROPS"
  kafka_wait_ready "$pid"
  log "kafka: started on $KAFKA_HOST:$KAFKA_PORT (controller $KAFKA_CONTROLLER_PORT, pid $pid, $((SECONDS - t0))s)"
}

kafka_down() { java_service_down kafka; }

kafka_status() {
  service_status kafka "$KAFKA_HOST" "$KAFKA_PORT"
  printf ' kcat=%s\n' "$(kcat_bin || echo missing)"
}

# ===========================================================================
# main
# ===========================================================================
usage() {
  echo "usage: $0 {up|down|status} [${SERVICES[*]}]" >&2
  exit 2
}

known_service() {
  local s
  for s in "${SERVICES[@]}"; do
    [ "$s" = "$1" ] && return 0
  done
  return 1
}

main() {
  [ $# -ge 1 ] || usage
  local cmd="$1" s
  shift
  local selected=("$@")
  [ ${#selected[@]} -gt 0 ] || selected=("${SERVICES[@]}")
  for s in "${selected[@]}"; do
    known_service "$s" || die "unknown service: $s (known: ${SERVICES[*]})"
  done

  mkdir -p "$SVC_DIR"
  # Serialize concurrent invocations (e.g. two `make test` in parallel).
  exec 9>"$LOCK_FILE"
  flock -w 900 9 || die "timed out waiting for $LOCK_FILE"

  case "$cmd" in
    up)
      for s in "${selected[@]}"; do
        "${s}_up"
      done
      ;;
    down)
      local rc=0 started
      started=" $(state_services | tr '\n' ' ') "
      # Everything we started, most recent first (restricted to the selection).
      for s in $started; do
        if [ $# -gt 0 ] && ! printf '%s\n' "${selected[@]}" | grep -qx -- "$s"; then
          continue
        fi
        if known_service "$s"; then
          "${s}_down" || rc=1
        else
          log "$s: unknown service in $STATE_FILE, leaving it alone"
        fi
      done
      for s in "${selected[@]}"; do
        [[ "$started" == *" $s "* ]] || log "$s: not started by us, leaving it alone"
      done
      return "$rc"
      ;;
    status)
      for s in "${selected[@]}"; do
        "${s}_status"
      done
      ;;
    *) usage ;;
  esac
}

main "$@"
