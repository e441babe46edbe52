#!/usr/bin/env bash
# A statically linked `dblock` for Linux: one file with no shared libraries to load, that
# starts faster as a whole process than the dynamically linked build `cargo install` makes.
#
#     scripts/build-static.sh [--musl] [--check]
#
# Default: glibc linked statically (`-C target-feature=+crt-static` on the gnu target, e.g.
# x86_64-unknown-linux-gnu), the fastest start measured. It runs on any Linux of its
# architecture; host names are resolved by the glibc inside it (/etc/hosts, then DNS: built
# in since glibc 2.34; checked here by --check). A hosts source that glibc loads as a module
# at run time (LDAP, mDNS, systemd-resolved's `resolve`) may be unavailable to it: such
# modules must come from the glibc version it was built with. Where one is needed, use a URL
# with an address, or the normal build.
#
# --musl: the musl target instead (needs `musl-gcc`, Debian's `musl-tools`, for the bundled
# SQLite): musl's own resolver, no modules at all; its start measured a little slower and
# noisier (musl's allocator).
#
# The target is added with rustup if missing. --check then runs the binary through what a
# static build could get wrong — that it is static, a fenced `dblock run` on the embedded
# file, exclusion between two processes (with a free name as the control), and a PostgreSQL
# URL by host name over TLS (DATABASE_URL's server, named `localhost`) — and fails if any
# does not hold. `.ci/run` runs this.
#
# Prints the binary's path last. Figures (docs/performance.md, issue 21, "fourth session"):
# `dblock run NAME -- true` on the embedded default, fenced, 1.6-1.7x flock(1) statically
# linked against 1.9-2.2x dynamically, side by side on one machine.
set -euo pipefail
cd "$(dirname "$0")/.."

log() { printf 'build-static: %s\n' "$*" >&2; }

musl=0
check=0
for arg in "$@"; do
  case "$arg" in
    --musl) musl=1 ;;
    --check) check=1 ;;
    *) log "unknown argument: $arg (usage: scripts/build-static.sh [--musl] [--check])"; exit 2 ;;
  esac
done

arch="$(uname -m)"
if [ "$musl" = 0 ]; then
  target="$arch-unknown-linux-gnu"
  # With --target, RUSTFLAGS reach only the target's crates: build scripts and proc
  # macros stay dynamically linked, as they must.
  export RUSTFLAGS="${RUSTFLAGS:-} -C target-feature=+crt-static"
else
  target="$arch-unknown-linux-musl"
  if ! command -v musl-gcc >/dev/null 2>&1; then
    log "musl-gcc is missing (Debian: apt-get install musl-tools); it compiles the bundled SQLite"
    exit 1
  fi
  # The cc crate looks for <target>-gcc, which Debian's musl-tools names musl-gcc.
  cc_var="CC_${target//-/_}"
  export "$cc_var"="${!cc_var:-musl-gcc}"
fi

if ! rustup target list --installed | grep -qx "$target"; then
  log "rustup target add $target"
  rustup target add "$target"
fi

# A target directory of its own: the static build's flags never invalidate the normal one.
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-target/static}"
log "cargo build --release --locked -p dblock-cli --target $target"
cargo build --release --locked -q -p dblock-cli --target "$target"
bin="$CARGO_TARGET_DIR/$target/release/dblock"

if [ "$check" = 1 ]; then
  fail() { log "CHECK FAILED: $*"; exit 1; }
  # No program interpreter: nothing to load before main.
  if readelf -l "$bin" | grep -q 'Requesting program interpreter'; then
    fail "$bin is dynamically linked"
  fi
  if readelf -d "$bin" 2>/dev/null | grep -q '(NEEDED)'; then
    fail "$bin needs shared libraries: $(readelf -d "$bin" | grep NEEDED | tr -s ' ')"
  fi
  dir="$(mktemp -d)"
  trap 'rm -rf "$dir"' EXIT
  db="sqlite:$dir/locks.db"
  # A fenced run: the command sees its token.
  token="$("$bin" run --db "$db" static-check -- sh -c 'printf %s "$DBLOCK_FENCING_TOKEN"')"
  [ -n "$token" ] || fail "no DBLOCK_FENCING_TOKEN in the command's environment"
  token2="$("$bin" run --db "$db" static-check -- sh -c 'printf %s "$DBLOCK_FENCING_TOKEN"')"
  [ "$token2" -gt "$token" ] || fail "the second token ($token2) is not above the first ($token)"
  # Exclusion between processes: while one holds the name, another's --no-wait exits 75.
  "$bin" run --db "$db" static-hold -- sh -c "touch '$dir/held'; sleep 3" &
  holder=$!
  # A check that fails while the holder runs ends it too (dblock run passes the TERM on
  # to its command), rather than leaving it to finish its sleep on its own.
  trap 'kill "$holder" 2>/dev/null; rm -rf "$dir"' EXIT
  for _ in $(seq 100); do [ -e "$dir/held" ] && break; sleep 0.05; done
  [ -e "$dir/held" ] || fail "the holder never started its command"
  set +e
  "$bin" run --db "$db" --no-wait static-hold -- true
  code=$?
  set -e
  [ "$code" = 75 ] || fail "a second process got a held name (exit $code, expected 75)"
  # The control: another name is free meanwhile, so the 75 above was the held name's.
  "$bin" run --db "$db" --no-wait static-other -- true || fail "a free name was refused"
  wait "$holder" || fail "the holder's run failed"
  trap 'rm -rf "$dir"' EXIT
  "$bin" run --db "$db" --no-wait static-hold -- true || fail "the name was not free after its holder ended"
  # PostgreSQL by host name, over TLS (the server's certificate is not verified: sslmode=require).
  pg="${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/test}"
  pg="${pg/@127.0.0.1:/@localhost:}"
  pg="${pg%%\?*}?sslmode=require"
  "$bin" run --db "$pg" --namespace "static-check-$$" static-check -- true \
    || fail "dblock run on $pg failed"
  log "checked: static, fenced run, exclusion, PostgreSQL by host name over TLS"
fi

echo "$bin"
