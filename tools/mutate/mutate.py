#!/usr/bin/env python3
"""Mutation testing of kvtier: applies each mutation of a list, one at a time,
in a scratch copy of the source tree (never the working tree), builds, runs the
test suite, and says whether the suite caught it (killed) or not (survived).

Each mutation names the files to look in (a glob: a snippet is found wherever
the code moved), an original snippet that must occur exactly once in them, its
replacement, the DESIGN.md rule it breaks, the tests to run first, and, for a
mutation the suite is known not to catch, why (equivalent or untestable).

usage:
  tools/mutate/mutate.py [--list FILE] [--only ID,...] [--scratch DIR] [--keep]
                          [--jobs N] [--timeout S]
  tools/mutate/mutate.py --check      # every snippet matches exactly once; no build
  tools/mutate/mutate.py --listed-only --only ID,...   # a quick look at new mutations:
      no unmutated-suite run and only each mutation's listed tests (not a result)

Exit status: 0 when every mutation was killed or is explained, 1 when an
unexplained mutation survived (or an explained one was killed: update the
list), 2 on a stale list (a snippet not found, found twice, or a mutation that
does not build).
"""
import argparse
import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


class Mutation:
    def __init__(self, mid, title, line):
        self.id, self.title, self.line = mid, title, line
        self.files = ""
        self.rule = ""
        self.tests = []
        self.survives = ""
        self.orig = []
        self.repl = []


def parse(path):
    """Blocks:  === ID title / key: value lines / <<< / original / ||| / replacement / >>>"""
    muts, cur, mode = [], None, None
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    for no, raw in enumerate(lines, 1):
        if mode in ("orig", "repl"):
            if raw == "|||" and mode == "orig":
                mode = "repl"
            elif raw == ">>>":
                mode = None
            else:
                (cur.orig if mode == "orig" else cur.repl).append(raw)
            continue
        s = raw.strip()
        if not s or s.startswith("#"):
            continue
        m = re.match(r"^=== (\S+)\s*(.*)$", s)
        if m:
            cur = Mutation(m.group(1), m.group(2), no)
            muts.append(cur)
            continue
        if cur is None:
            sys.exit(f"{path}:{no}: text before the first '=== ID'")
        if s == "<<<":
            mode = "orig"
            continue
        m = re.match(r"^(files|rule|tests|survives):\s*(.*)$", s)
        if not m:
            sys.exit(f"{path}:{no}: expected files:, rule:, tests:, survives: or <<<, got: {s}")
        k, v = m.group(1), m.group(2)
        if k == "tests":
            cur.tests = v.split()
        elif k == "survives":
            cur.survives = (cur.survives + " " + v).strip()
        else:
            setattr(cur, k, v)
    if mode:
        sys.exit(f"{path}: unterminated snippet in {cur.id}")
    seen = set()
    for m in muts:
        if m.id in seen:
            sys.exit(f"{path}:{m.line}: duplicate id {m.id}")
        seen.add(m.id)
        if not m.files or not m.rule or not m.orig:
            sys.exit(f"{path}:{m.line}: {m.id} needs files:, rule: and an original snippet")
        if m.orig == m.repl:
            sys.exit(f"{path}:{m.line}: {m.id} replaces its snippet with itself")
    return muts


def locate(tree, m):
    """(path, text, offset) of the one occurrence of m's snippet, or an error string."""
    snippet = "\n".join(m.orig)
    hits = []
    for pat in m.files.split():
        for p in sorted(glob.glob(os.path.join(tree, pat))):
            with open(p, encoding="utf-8") as f:
                text = f.read()
            at = text.find(snippet)
            while at >= 0:
                hits.append((p, text, at))
                at = text.find(snippet, at + 1)
    if len(hits) != 1:
        where = ", ".join(os.path.relpath(h[0], tree) for h in hits) or "nowhere"
        return f"snippet found {len(hits)} times in {m.files} ({where})"
    return hits[0]


def run(cmd, cwd, timeout, log):
    with open(log, "a") as lf:
        lf.write(f"\n$ {' '.join(cmd)}\n")
        lf.flush()
        # its own process group, so a timeout also ends the test programs ctest started
        p = subprocess.Popen(cmd, cwd=cwd, stdout=lf, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            lf.write(f"timed out after {timeout} s\n")
            return "timeout"


def test_costs(build):
    """Seconds each test took in the build's last ctest runs (ctest's own
    CTestCostData.txt: name, runs, average seconds), {} when absent."""
    costs = {}
    try:
        with open(os.path.join(build, "Testing", "Temporary", "CTestCostData.txt")) as f:
            for ln in f:
                parts = ln.split()
                if len(parts) == 3:
                    try:
                        costs[parts[0]] = float(parts[2])
                    except ValueError:
                        pass
    except OSError:
        pass
    return costs


def failed_tests(build):
    """Names of the tests the last ctest run in build failed (ctest's own list)."""
    try:
        with open(os.path.join(build, "Testing", "Temporary", "LastTestsFailed.log")) as f:
            return [ln.strip().split(":", 1)[-1] for ln in f if ln.strip()]
    except OSError:
        return []


def load():
    """The 1-minute load average, as text."""
    try:
        with open("/proc/loadavg") as f:
            return f.read().split()[0]
    except OSError:
        return "?"


def copy_tree(dst):
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                           stdout=subprocess.PIPE).stdout.split(b"\0")
    for f in files:
        if not f:
            continue
        rel = f.decode()
        src = os.path.join(ROOT, rel)
        if not os.path.isfile(src):
            continue
        d = os.path.join(dst, rel)
        os.makedirs(os.path.dirname(d), exist_ok=True)
        shutil.copy2(src, d)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--list", default=os.path.join(HERE, "mutations.txt"))
    ap.add_argument("--only", default="")
    ap.add_argument("--scratch", default="")
    ap.add_argument("--keep", action="store_true", help="keep the scratch tree")
    ap.add_argument("--jobs", default=os.environ.get("JOBS", "2"))
    ap.add_argument("--timeout", type=int, default=int(os.environ.get("KVT_MUTATE_TIMEOUT", "300")),
                    help="least seconds per run of the listed tests (they get three times their unmutated time; a "
                         "timeout is a kill only when a rerun with three times as long times out too); the "
                         "rest of the suite gets three times the unmutated suite's time, at least this")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--listed-only", action="store_true",
                    help="run only each mutation's listed tests, without the unmutated suite first: a quick check "
                         "of new mutations while writing them, never a kill rate")
    a = ap.parse_args()
    muts = parse(a.list)
    if a.only:
        want = set(a.only.split(","))
        muts = [m for m in muts if m.id in want]
        if len(muts) != len(want):
            sys.exit(f"--only: unknown id(s) {sorted(want - {m.id for m in parse(a.list)})}")
    stale = []
    for m in muts:
        r = locate(ROOT, m)
        if isinstance(r, str):
            stale.append(f"{m.id}: {r}")
    if stale:
        print("mutate: the list is stale (fix the snippets):\n  " + "\n  ".join(stale))
        return 2
    if a.check:
        expl = sum(1 for m in muts if m.survives)
        print(f"mutate: {len(muts)} mutations, each snippet found once ({expl} explained survivors)")
        return 0

    scratch = a.scratch or tempfile.mkdtemp(prefix="kvt-mutate.")
    tree, build = os.path.join(scratch, "src"), os.path.join(scratch, "build")
    log = os.path.join(scratch, "mutate.log")
    print(f"mutate: scratch copy in {scratch} (log {log})", flush=True)
    if not os.path.isdir(tree):
        copy_tree(tree)
    env = dict(os.environ)
    shared = os.environ.get("KVT_SHARED_DIR") or os.path.realpath(os.path.join(ROOT, "..", "shared"))
    env["KVT_SHARED_DIR"] = shared
    os.environ["KVT_SHARED_DIR"] = shared
    # warnings stay warnings: a mutant that leaves a variable unused is still a mutant
    cfg = ["cmake", "-S", tree, "-B", build, "-DKVT_WERROR=OFF"]
    if run(cfg, scratch, 600, log) != 0 or run(["cmake", "--build", build, "-j", a.jobs], scratch, 3600, log) != 0:
        print("mutate: the unmutated tree does not build; see the log")
        return 2
    # the unmutated suite must pass (a failing tree would "kill" everything);
    # its time bounds each mutated suite run at three times as long
    tb = time.time()
    if a.listed_only:
        suite_timeout = a.timeout
        print("mutate: --listed-only: the unmutated suite is not run, nor the rest of the suite", flush=True)
    elif run(["ctest", "--test-dir", build, "-LE", "long", "-j", a.jobs], scratch, 3600, log) != 0:
        print("mutate: the unmutated suite fails; see the log")
        return 2
    else:
        suite_timeout = max(a.timeout, int(3 * (time.time() - tb)))
        print(f"mutate: the unmutated suite passes in {time.time() - tb:.0f} s (load {load()})", flush=True)
    # the unmutated time of each test: a mutation's listed tests get three
    # times their sum, at least --timeout (a slow machine is not a kill)
    costs = test_costs(build)
    t0 = time.time()
    results = []
    for i, m in enumerate(muts, 1):
        path, text, at = locate(tree, m)
        snippet = "\n".join(m.orig)
        mutated = text[:at] + "\n".join(m.repl) + text[at + len(snippet):]
        with open(path, "w", encoding="utf-8") as f:
            f.write(mutated)
        t1 = time.time()
        verdict, by = "survived", ""
        try:
            first = list(m.tests)
            # the listed tests' programs (fuzz_corpus_X runs fuzz_X_replay) and
            # the kvtier binary some tests run
            targets = ["kvtier"] + [("fuzz_%s_replay" % t[len("fuzz_corpus_"):]) if t.startswith("fuzz_corpus_")
                                    else t for t in first if t.startswith(("test_", "fuzz_corpus_"))]
            b = run(["cmake", "--build", build, "-j", a.jobs] + sum((["--target", t] for t in targets), []),
                    scratch, 3600, log)
            if b != 0:
                verdict = "nobuild"
            if verdict == "survived" and first:
                rx = "^(" + "|".join(re.escape(t) for t in first) + ")$"
                # one at a time, in the listed order (the quickest, surest test
                # first): a test that fails ends the mutation at once, and one
                # that hangs does not hold up a listed test that would fail
                for t in first:
                    tmo = max(a.timeout, int(3 * costs.get(t, 0)))
                    lcmd = ["ctest", "--test-dir", build, "-R", "^" + re.escape(t) + "$", "--no-tests=error",
                            "--output-on-failure"]
                    r = run(lcmd, scratch, tmo, log)
                    if r == "timeout":
                        # a hang is a kill only when it hangs again with three
                        # times as long (a loaded machine is not a hang)
                        r = run(lcmd, scratch, 3 * tmo, log)
                        if r == "timeout":
                            verdict, by = "killed", "listed tests (%s: timeout twice, %d s and %d s)" % (t, tmo, 3 * tmo)
                            break
                    if r != 0:
                        verdict, by = "killed", "listed tests (%s)" % t
                        break
            if verdict == "survived" and a.listed_only:
                verdict, by = "listed", "not killed by its listed tests"
            if verdict == "survived":
                if run(["cmake", "--build", build, "-j", a.jobs], scratch, 3600, log) != 0:
                    verdict = "nobuild"
            if verdict == "survived":
                # mutate_list checks the snippets of the list, which a mutation removes by design
                skip = "^mutate_list$" + ("|" + rx if first else "")
                cmd = ["ctest", "--test-dir", build, "-LE", "long", "--stop-on-failure", "-j", a.jobs,
                       "--output-on-failure", "-E", skip]
                # a kill by the rest of the suite counts only when the failed
                # test fails again (a test flaky under load kills nothing); after
                # a failure that did not repeat the suite runs once more (it had
                # stopped there)
                flaky = []
                for attempt in range(2):
                    r = run(cmd, scratch, suite_timeout, log)
                    if r == "timeout":
                        verdict, by = "killed", "suite (timeout, %d s)" % suite_timeout
                        break
                    if r == 0:
                        break
                    failed = failed_tests(build)
                    # by name: --rerun-failed takes the numbers of the -E-filtered
                    # run as numbers of the whole list and reruns other tests
                    again = run(["ctest", "--test-dir", build, "-R",
                                 "^(" + "|".join(re.escape(t) for t in failed) + ")$", "--output-on-failure"],
                                scratch, suite_timeout, log) if failed else 1
                    if again != 0:
                        verdict, by = "killed", "suite"
                        break
                    flaky += failed
                if verdict == "survived" and flaky:
                    by = "suite failures that did not repeat (flaky: %s)" % ", ".join(flaky)
        finally:
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
        dt = time.time() - t1
        note = by
        if verdict == "survived":
            note = ("explained" if m.survives else "NOT EXPLAINED") + (f"; {by}" if by else "")
        elif verdict == "killed" and m.survives:
            note += "; listed as a survivor: update the list"
        results.append((m, verdict, note))
        print(f"[{i}/{len(muts)}] {m.id:<28} {verdict:<8} {note} ({dt:.0f} s, load {load()})", flush=True)
        with open(log, "a") as lf:
            lf.write(f"== {m.id}: {verdict} {note}\n")
    # the tree as it was, rebuilt, so a kept scratch copy is usable
    run(["cmake", "--build", build, "-j", a.jobs], scratch, 3600, log)
    if a.listed_only:
        missed = [r[0].id for r in results if r[1] != "killed"]
        print(f"\nmutate --listed-only: {len(results) - len(missed)} of {len(results)} killed by their listed tests"
              + (f"; not: {', '.join(missed)}" if missed else ""))
        return 0
    killed = [r for r in results if r[1] == "killed"]
    surv = [r for r in results if r[1] == "survived"]
    nob = [r for r in results if r[1] == "nobuild"]
    n = len(killed) + len(surv)
    rate = 100.0 * len(killed) / n if n else 0.0
    by_listed = sum(1 for r in killed if r[2].startswith("listed tests"))
    timeouts = [r[0].id for r in killed if "timeout" in r[2]]
    expl = sum(1 for r in surv if r[0].survives)
    print(f"\nmutate: {len(results)} mutations in {time.time() - t0:.0f} s: {len(killed)} killed "
          f"({by_listed} by their listed tests, {len(killed) - by_listed} by the rest of the suite; "
          f"{len(timeouts)} by a timeout{': ' + ', '.join(timeouts) if timeouts else ''}), "
          f"{len(surv)} survived ({expl} explained), {len(nob)} did not build; kill rate {rate:.1f}% "
          f"(load at the end {load()})")
    for m, v, note in surv:
        print(f"  survived {m.id} ({m.rule}): {m.survives or 'NOT EXPLAINED'}")
    for m, v, note in nob:
        print(f"  did not build {m.id}: fix the replacement")
    if not a.keep and not a.scratch:
        shutil.rmtree(scratch, ignore_errors=True)
    bad = nob or [r for r in surv if not r[0].survives] or [r for r in killed if r[0].survives]
    return 2 if nob else (1 if bad else 0)


if __name__ == "__main__":
    sys.exit(main())
