#!/usr/bin/env python3
"""Never slower than before: `dblock bench` of an earlier commit against this checkout's, interleaved.

    scripts/bench-against.py [--rev 680537d] [--rounds 5] [--seconds 3] [--db URL ...] [--loop [--instructions]]

Builds the `dblock` program of REV (in a throwaway git worktree, with a target directory of
its own under target/bench-against/ so later runs reuse it) and of the working tree, both
in release mode, then runs `dblock bench --json --seconds S --db URL` of the two in turn,
A B B A A B …, ROUNDS times for each URL, on the same server and settings. It prints, per
workload, each side's median cycles per second and the median and range of the round-by-round
ratio new ÷ old — a ratio within one round is the fair comparison on a shared machine, whose
speed drifts between rounds — and the load average before and after.

With no --db: the embedded backend on a fresh file in a temporary directory, and PostgreSQL
at $DATABASE_URL (else postgres://postgres@127.0.0.1:5432/test) with sslmode=disable, as the
figures in docs/performance.md are taken. Give --db more than once for several backends
(e.g. a mysql:// URL, or a PostgreSQL URL with sslmode=require).

With --loop it compares the libraries alone: `dblock bench`'s harness (its timing, its
floor's slices, its runtime) has changed along with dblock, so its figures for an earlier
commit are of that commit's harness too. `--loop` builds this checkout's
`dblock/examples/lock_loop.rs` — a plain loop that uses only `Locks::connect` and
`Locks::lock` — against REV's library and against the working tree's, and runs the two in
turn for 1 worker, 8 workers and 8 workers on one name (`--hot`), printing the rates, the
ratio and each side's CPU a cycle (user + kernel, µs; medians). For a PostgreSQL server on
this machine (its postmaster found by the URL's port, through the socket lock file
/var/run/postgresql/.s.PGSQL.PORT.lock), it also prints the server's CPU a cycle: what the
postmaster's reaped children (the loop's backends, which exit when it does) used over
the run, divided by all the run's cycles — nothing else should use that server meanwhile.
The lock file is the server owner's (mode 0600): as another user the column prints "—".

With --loop --instructions it counts instead of timing: each side's loop runs under
valgrind's callgrind, for 1 second and for --seconds, and the difference of the two runs'
instructions over the difference of their cycles is the client's instructions a cycle (all
its threads, user space; the start-up and the warm-up cancel out) — a count the machine's
speed and load do not move, as they move the rates. Needs `valgrind`. (Under valgrind the
CPU's SHA extensions are not offered, so a name's key costs its software hash there: the same
on both sides.)
Exit status 0 when every run succeeded; the ratios are printed, never judged here.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def sh(cmd, **kw):
    return subprocess.run(cmd, check=True, **kw)


# Both builds with the same code generation, whatever an earlier commit's Cargo.toml says
# (link-time optimisation came in with issue 21's third round): the comparison is of the code.
SAME_SETTINGS = ["--config", 'profile.release.lto="fat"',
                 "--config", "profile.release.codegen-units=1"]


LOOP = os.path.join(ROOT, "dblock", "examples", "lock_loop.rs")


def read(path):
    """The text of `path`; None if it cannot be read (no such file, or not this user's to
    read)."""
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def build_rev(rev, loop=False):
    """The release `dblock` of `rev` (with `loop`: this checkout's `lock_loop` example
    built against `rev`'s library), built once into target/bench-against/<sha>-lto/."""
    sha = subprocess.run(["git", "-C", ROOT, "rev-parse", "--verify", rev + "^{commit}"],
                         check=True, capture_output=True, text=True).stdout.strip()
    out = os.path.join(ROOT, "target", "bench-against", sha[:12] + "-lto")
    release = os.path.join(out, "target", "release")
    binary = os.path.join(release, "examples", "lock_loop") if loop else os.path.join(release, "dblock")
    # The loop's source as it was built: a changed loop is built again.
    built_from = os.path.join(out, "lock_loop.rs")
    loop_src = read(LOOP)
    if os.path.exists(binary) and (not loop or read(built_from) == loop_src):
        return binary, sha
    src = os.path.join(out, "src")
    if os.path.exists(src):
        subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", src])
        shutil.rmtree(src, ignore_errors=True)
    os.makedirs(out, exist_ok=True)
    sh(["git", "-C", ROOT, "worktree", "add", "--detach", src, sha], stdout=subprocess.DEVNULL)
    try:
        env = dict(os.environ, CARGO_TARGET_DIR=os.path.join(out, "target"))
        if loop:
            shutil.copy(LOOP, os.path.join(src, "dblock", "examples", "lock_loop.rs"))
            manifest = os.path.join(src, "dblock", "Cargo.toml")
            with open(manifest) as f:
                declared = 'name = "lock_loop"' in f.read()
            if not declared:
                with open(manifest, "a") as f:
                    f.write('\n[[example]]\nname = "lock_loop"\n')
            sh(["cargo", "build", "--release", "--locked", "-q", "-p", "dblock", "--example",
                "lock_loop"] + SAME_SETTINGS, cwd=src, env=env)
            with open(built_from, "w") as f:
                f.write(loop_src)
        else:
            sh(["cargo", "build", "--release", "--locked", "-q", "-p", "dblock-cli"]
               + SAME_SETTINGS, cwd=src, env=env)
    finally:
        subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", src])
    return binary, sha


def build_head(loop=False):
    if loop:
        sh(["cargo", "build", "--release", "--locked", "-q", "-p", "dblock", "--example",
            "lock_loop"] + SAME_SETTINGS, cwd=ROOT)
        return os.path.join(ROOT, "target", "release", "examples", "lock_loop")
    sh(["cargo", "build", "--release", "--locked", "-q", "-p", "dblock-cli"] + SAME_SETTINGS,
       cwd=ROOT)
    return os.path.join(ROOT, "target", "release", "dblock")


class Unsupported(Exception):
    """The build does not know the URL's backend (an earlier commit without it)."""


def bench(binary, url, seconds):
    r = subprocess.run([binary, "bench", "--json", "--seconds", str(seconds), "--db", url],
                       capture_output=True, text=True)
    if r.returncode != 0:
        if "unknown scheme" in r.stderr:
            raise Unsupported(r.stderr.strip())
        sys.exit(f"{binary} bench --db {url} failed ({r.returncode}):\n{r.stderr}")
    rows = json.loads(r.stdout)
    return {(m["workload"], m["workers"]): m["ops_per_sec"] for m in rows}


# The loop's workloads: `dblock bench`'s three, named as it names them.
LOOP_WORKLOADS = [(("uncontended", 1), ["--workers", "1"]),
                  (("uncontended", 8), ["--workers", "8"]),
                  (("hot", 8), ["--workers", "8", "--hot"])]


def postmaster(url):
    """The pid of the PostgreSQL server `url` reaches on this machine, from its socket's
    lock file (first line); None for another backend, a remote host or no such file."""
    if not url.startswith(("postgres://", "postgresql://")):
        return None
    hostport = url.split("://", 1)[1].split("/", 1)[0].rsplit("@", 1)[-1]
    host, _, port = hostport.partition(":")
    if host not in ("127.0.0.1", "localhost", "[::1]", ""):
        return None
    text = read(f"/var/run/postgresql/.s.PGSQL.{port or '5432'}.lock")
    try:
        return int(text.splitlines()[0]) if text else None
    except (ValueError, IndexError):
        return None


def reaped_ticks(pid):
    """CPU ticks (10 ms) of `pid`'s children it has waited for: `/proc/PID/stat`'s
    cutime + cstime (fields 16 and 17, counted after the command's last `)`)."""
    text = read(f"/proc/{pid}/stat") if pid else None
    if not text:
        return None
    fields = text.rsplit(")", 1)[1].split()
    return int(fields[13]) + int(fields[14])


def run_loop(binary, url, seconds):
    """`lock_loop` of each workload: {(workload, workers): (ops/s, user µs, kernel µs,
    server µs or None)}."""
    out = {}
    pm = postmaster(url)
    for w, flags in LOOP_WORKLOADS:
        before = reaped_ticks(pm)
        r = subprocess.run([binary, url, "--seconds", str(seconds)] + flags,
                           capture_output=True, text=True)
        if r.returncode != 0:
            if "unknown scheme" in r.stderr or "unsupported" in r.stderr.lower():
                raise Unsupported(r.stderr.strip())
            sys.exit(f"{binary} {url} {' '.join(flags)} failed ({r.returncode}):\n{r.stderr}")
        m = json.loads(r.stdout.strip().splitlines()[-1])
        server = None
        if before is not None and m.get("all_cycles"):
            # The loop's backends exit once it closes its connections; the postmaster
            # reaps them a moment later.
            time.sleep(0.3)
            after = reaped_ticks(pm)
            if after is not None:
                server = (after - before) * 10_000 / m["all_cycles"]
        out[w] = (m["ops_per_sec"], m["user_us"], m["system_us"], server)
    return out


def instructions(binary, url, seconds, flags):
    """Instructions a cycle of `binary` (a `lock_loop`) with `flags`: callgrind's count of
    a `seconds` run less that of a 1 s run, over the difference of their cycles."""
    counts = []
    for secs in (1.0, seconds):
        with tempfile.NamedTemporaryFile(prefix="dblock-callgrind-") as out:
            r = subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out.name}",
                                binary, url, "--seconds", str(secs)] + flags,
                               capture_output=True, text=True)
        if r.returncode != 0:
            if "unknown scheme" in r.stderr or "unsupported" in r.stderr.lower():
                raise Unsupported(r.stderr.strip())
            sys.exit(f"valgrind {binary} {url} {' '.join(flags)} failed ({r.returncode}):\n"
                     f"{r.stderr[-2000:]}")
        collected = [line.rsplit(":", 1)[1].replace(",", "").strip()
                     for line in r.stderr.splitlines() if "Collected :" in line]
        cycles = json.loads(r.stdout.strip().splitlines()[-1]).get("all_cycles")
        if not collected or not cycles:
            sys.exit(f"no count from valgrind {binary} {' '.join(flags)}:\n{r.stderr[-2000:]}")
        counts.append((int(cycles), int(collected[-1])))
    (c1, i1), (c2, i2) = counts
    return (i2 - i1) / (c2 - c1) if c2 > c1 else None


def count_instructions(old, new, urls, seconds, rev, sha):
    """--instructions: each side's instructions a cycle per workload."""
    print(f"old: {rev} ({sha[:12]})  new: working tree  harness: examples/lock_loop.rs on "
          f"both, under callgrind (a {seconds:g} s run less a 1 s run)")
    for url in urls:
        shown = url.split("@")[-1] if "://" in url else url
        print(f"\n{shown}")
        print(f"  {'workload':<20} {'old instr/cycle':>16} {'new instr/cycle':>16} {'new÷old':>8}")
        for w, flags in LOOP_WORKLOADS:
            try:
                a = instructions(old, url.replace("{side}", "old"), seconds, flags)
                b = instructions(new, url.replace("{side}", "new"), seconds, flags)
            except Unsupported as e:
                print(f"  {rev} has no such backend, nothing to compare ({e})")
                break
            ratio = f"{b / a:>8.2f}" if a and b else f"{'—':>8}"
            label = f"{w[0]} x{w[1]}"
            fmt = lambda v: f"{v:>16,.0f}" if v else f"{'—':>16}"
            print(f"  {label:<20} {fmt(a)} {fmt(b)} {ratio}")


def load():
    with open("/proc/loadavg") as f:
        return f.read().split()[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rev", default="680537d", help="the earlier commit (default 680537d)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--db", action="append", help="database URL (repeatable)")
    ap.add_argument("--loop", action="store_true",
                    help="compare the libraries with one harness (examples/lock_loop.rs)")
    ap.add_argument("--instructions", action="store_true",
                    help="with --loop: count each side's instructions a cycle under callgrind "
                         "instead of timing")
    args = ap.parse_args()
    if args.instructions and not args.loop:
        sys.exit("--instructions counts the lock_loop harness: give --loop too")

    tmp = tempfile.mkdtemp(prefix="dblock-bench-against-")
    urls = args.db or [
        f"sqlite:{tmp}/{{side}}.db",
        os.environ.get("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test")
        + ("&" if "?" in os.environ.get("DATABASE_URL", "") else "?") + "sslmode=disable",
    ]
    old, sha = build_rev(args.rev, args.loop)
    new = build_head(args.loop)
    if args.instructions:
        count_instructions(old, new, urls, args.seconds, args.rev, sha)
        shutil.rmtree(tmp, ignore_errors=True)
        return
    measure = run_loop if args.loop else (lambda b, u, s: {w: (r, None, None, None) for w, r in
                                                           bench(b, u, s).items()})
    print(f"old: {args.rev} ({sha[:12]})  new: working tree  rounds: {args.rounds}  "
          f"seconds: {args.seconds}  "
          + ("harness: examples/lock_loop.rs on both" if args.loop else "harness: each side's dblock bench"))
    for url in urls:
        shown = url.split("@")[-1] if "://" in url else url.replace(tmp, "$TMP").replace("{side}", "old|new")
        before = load()
        rates = {"old": [], "new": []}
        try:
            for i in range(args.rounds):
                order = [("old", old), ("new", new)] if i % 2 == 0 else [("new", new), ("old", old)]
                for side, binary in order:
                    # The embedded backend: a file per side, so neither reads the other's tables.
                    rates[side].append(measure(binary, url.replace("{side}", side), args.seconds))
        except Unsupported as e:
            # Nothing to compare with: say so, and go on with the other URLs.
            print(f"\n{shown}: {args.rev} has no such backend, nothing to compare ({e})")
            continue
        print(f"\n{shown}  (load {before} → {load()})")
        cpu_head = (f"  {'old cpu u+s':>13} {'new cpu u+s':>13} {'old server':>10} {'new server':>10}"
                    if args.loop else "")
        print(f"  {'workload':<20} {'old ops/s':>12} {'new ops/s':>12} {'new÷old':>8}  {'range':<11}"
              + cpu_head)
        for w in rates["new"][0]:
            if w not in rates["old"][0]:
                continue
            o = [r[w][0] for r in rates["old"]]
            n = [r[w][0] for r in rates["new"]]
            ratios = [b / a for a, b in zip(o, n) if a > 0]
            label = f"{w[0]} x{w[1]}"
            line = (f"  {label:<20} {statistics.median(o):>12.0f} {statistics.median(n):>12.0f} "
                    f"{statistics.median(ratios):>8.2f}  {min(ratios):.2f}–{max(ratios):.2f}")
            if args.loop:
                for side in ("old", "new"):
                    user = [r[w][1] for r in rates[side] if r[w][1] is not None]
                    system = [r[w][2] for r in rates[side] if r[w][2] is not None]
                    cpu = (f"{statistics.median(user):.2f}+{statistics.median(system):.2f}"
                           if user and system else "—")
                    line += f" {cpu:>13}"
                for side in ("old", "new"):
                    server = [r[w][3] for r in rates[side] if r[w][3] is not None]
                    line += f" {statistics.median(server):>10.2f}" if server else f" {'—':>10}"
            print(line)
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
