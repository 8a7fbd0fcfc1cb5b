#!/usr/bin/env bash
# scripts/install.sh -- install what the test servers run from; start nothing.
#
#   Debian packages: mariadb-server, postgresql, Java 17, Maven, kcat, chromium + chromium-driver (the
#                    console's browser tests), prometheus (promtool, for make lint) (apt; as root; only what
#                    is missing)
#   Maven jars:      Kafka 3.9 + ZooKeeper from scripts/kafka/pom.xml into .services/kafka/lib
#                    (cached in ~/.m2; fetched again only when the pom changes)
#
# The servers themselves are started and stopped from Python (tests/harness/servers.py): by the test
# session's fixtures, or `python -m tests.harness.servers up|down|run -- CMD`. Idempotent.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)"
LIB="$ROOT/.services/kafka/lib"
POM="$ROOT/scripts/kafka/pom.xml"
log() { printf 'install: %s\n' "$*" >&2; }
die() { log "$*"; exit 1; }
have() { command -v "$1" >/dev/null 2>&1 || [ -x "/usr/sbin/$1" ]; }

missing=()
have mariadbd || missing+=(mariadb-server mariadb-client)
ls -d /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 && have psql || missing+=(postgresql postgresql-client)
have java || missing+=(openjdk-17-jre-headless)
have mvn || missing+=(maven)
have kcat || missing+=(kcat)
have chromium || missing+=(chromium)
have chromedriver || missing+=(chromium-driver)
have promtool || missing+=(prometheus)
if [ "${#missing[@]}" -gt 0 ]; then
  [ "$(id -u)" -eq 0 ] || die "missing: ${missing[*]}; as root run: apt-get install -y --no-install-recommends ${missing[*]}"
  mkdir -p "$ROOT/.services"
  aptlog="$ROOT/.services/apt.log"
  # Package scripts must not start system daemons: our servers run from their own data dirs.
  policy=/usr/sbin/policy-rc.d
  created=0
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod 755 "$policy" && created=1
  fi
  trap '[ "$created" -eq 1 ] && rm -f "$policy"' EXIT
  log "apt: installing ${missing[*]}"
  { apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"; } \
    >"$aptlog" 2>&1 || { tail -n 20 "$aptlog" >&2; die "apt failed (log: $aptlog)"; }
fi

stamp="$(sha256sum "$POM" | cut -d' ' -f1)"
if [ "$(cat "$LIB/.pom.sha256" 2>/dev/null)" != "$stamp" ] || ! compgen -G "$LIB/kafka_2.13-*.jar" >/dev/null; then
  tmp="$LIB.tmp.$$"
  rm -rf "$tmp"
  mkdir -p "$(dirname "$LIB")"
  log "maven: fetching the Kafka/ZooKeeper jars into $LIB"
  mvn -q -B -f "$POM" dependency:copy-dependencies -DoutputDirectory="$tmp" >"$ROOT/.services/mvn.log" 2>&1 </dev/null ||
    { tail -n 20 "$ROOT/.services/mvn.log" >&2; rm -rf "$tmp"; die "maven failed (log: .services/mvn.log)"; }
  printf '%s\n' "$stamp" >"$tmp/.pom.sha256"
  rm -rf "$LIB" && mv "$tmp" "$LIB"  # in one step: a half-copied lib dir never looks complete
fi
