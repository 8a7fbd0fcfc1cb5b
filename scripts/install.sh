#!/usr/bin/env bash
# scripts/install.sh -- install what the test servers run from; start nothing.
#
#   Debian packages: mariadb-server, postgresql, Java 17, Maven, kcat, chromium + chromium-driver (the
#                    console's browser tests), prometheus (promtool, for make lint) (apt; as root; only what
#                    is missing)
#   Maven jars:      Kafka 3.9 + ZooKeeper from scripts/kafka/pom.xml into .services/kafka/lib
#                    (cached in ~/.m2; fetched again only when the pom changes)
#                    S3Proxy (an S3-compatible server, for the object-storage backup tests) into
#                    .services/s3proxy/lib: one self-contained jar, its SHA-256 pinned here
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

# S3Proxy: Maven Central's jar-with-dependencies (runs on Java 17), checked by Maven (-C: strict checksums)
# and against the pin below; kept out of the Kafka lib dir, whose classpath is `lib/*`.
S3PROXY_VERSION=4.1.0
S3PROXY_SHA256=a4d025969aaf796616ed4b1e2491d87d455ce84bb28cb9db086b2e6aaa68b48d
S3PROXY_JAR="$ROOT/.services/s3proxy/lib/s3proxy-$S3PROXY_VERSION-jar-with-dependencies.jar"
if ! echo "$S3PROXY_SHA256  $S3PROXY_JAR" | sha256sum -c --status 2>/dev/null; then
  tmp="$ROOT/.services/s3proxy/lib.tmp.$$"
  rm -rf "$tmp" && mkdir -p "$tmp"
  log "maven: fetching S3Proxy $S3PROXY_VERSION into $(dirname "$S3PROXY_JAR")"
  mvn -q -B -C org.apache.maven.plugins:maven-dependency-plugin:3.8.1:copy \
    -Dartifact="org.gaul:s3proxy:$S3PROXY_VERSION:jar:jar-with-dependencies" -DoutputDirectory="$tmp" \
    >"$ROOT/.services/mvn-s3proxy.log" 2>&1 </dev/null ||
    { tail -n 20 "$ROOT/.services/mvn-s3proxy.log" >&2; rm -rf "$tmp"; die "maven failed (log: .services/mvn-s3proxy.log)"; }
  echo "$S3PROXY_SHA256  $tmp/$(basename "$S3PROXY_JAR")" | sha256sum -c --status ||
    { rm -rf "$tmp"; die "S3Proxy $S3PROXY_VERSION: SHA-256 differs from the pin in scripts/install.sh"; }
  rm -rf "$(dirname "$S3PROXY_JAR")" && mv "$tmp" "$(dirname "$S3PROXY_JAR")"
fi
