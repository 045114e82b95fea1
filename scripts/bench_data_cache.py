"""The tokenized cache's cold and warm start: `tunekit data prepare` over 100k+ rows, 1 and 2 processes.

    PYTHONPATH=. python scripts/bench_data_cache.py [--rows 120000] [--out benchmarks/data/data-cache-DATE] [--work DIR]

The rows are built from the embedded default data (tunekit/data/default/, 1,171 alpaca rows): chats of
1 to 3 turns, each turn a default row drawn by a seeded generator, numbered so that no two rows are the
same. Each measurement is a fresh `tunekit data prepare` process on the default model's tokenizer:

  no cache   data.cache=false, 1 process: tokenizing alone
  cold       an empty data.cache_dir: tokenize + hash the rows + write the entry
  warm       the same command again: the entry read back, nothing tokenized

for data.num_proc=1 and 2. Wall: the whole command (imports, config, tokenizer, rows read and
checked); `prepare` is what the command itself reports (tokenizer load + load_splits). Peak RSS is the
command's main process (os.wait4), the pool's workers not included.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchlib import REPO, machine, versions, write_result

DEFAULT = REPO / "tunekit" / "data" / "default"


def build_rows(n: int, path: Path) -> None:
    """n chat rows of 1-3 turns from the default data, in a seeded order, each numbered."""
    base = [json.loads(line) for name in ("train.jsonl", "val.jsonl")
            for line in (DEFAULT / name).read_text().splitlines() if line.strip()]
    rng = random.Random(0)
    with open(path, "w") as f:
        for i in range(n):
            messages = []
            for turn in range(rng.choice((1, 1, 2, 3))):
                row = rng.choice(base)
                ask = row["instruction"] + (f"\n\n{row['input']}" if row.get("input") else "")
                messages += [{"role": "user", "content": f"({i}.{turn}) {ask}"},
                             {"role": "assistant", "content": row["output"]}]
            f.write(json.dumps({"messages": messages}) + "\n")


def prepare(data: Path, cache_dir: Path, num_proc: int, cache: bool = True) -> dict:
    """One `tunekit data prepare` process: its wall time, peak RSS and report."""
    cmd = [sys.executable, "-m", "tunekit.commands.main", "data", "prepare", f"data.path={data}",
           f"data.cache_dir={cache_dir}", f"data.num_proc={num_proc}", f"data.cache={str(cache).lower()}"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    load = os.getloadavg()[0]  # how busy the machine was as the run started (other jobs share its cores)
    with tempfile.TemporaryFile("w+") as fout, tempfile.TemporaryFile("w+") as ferr:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=fout, stderr=ferr, text=True)
        _, status, usage = os.wait4(proc.pid, 0)  # its own rusage: the peak RSS of this process
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        fout.seek(0)
        ferr.seek(0)
        out, err = fout.read(), ferr.read()
    if proc.returncode != 0:
        raise SystemExit(f"bench_data_cache: {' '.join(cmd)} failed:\n{err[-3000:]}")
    done = re.search(r"done in ([\d.]+) s", out)
    return {"wall_s": round(wall, 2), "prepare_s": float(done.group(1)) if done else None,
            "peak_rss_mib": round(usage.ru_maxrss / 1024, 1), "load_1min": round(load, 2),
            # CPU seconds of the command and of the pool workers it waited for
            "cpu_s": round(usage.ru_utime + usage.ru_stime, 1),
            "from_cache": "tokenized rows from cache" in err, "report": out.strip().splitlines()}


def cache_costs(data: Path, cache_dir: Path, repeats: int = 3) -> dict:
    """The cache's own costs in this process, tokenizing left out (each the best of `repeats`): the key
    (hashing the rows and the tokenizer), writing the entry, reading it back. From the entry a cold
    run wrote, to a fresh folder."""
    from tunekit.data.cache import TokenCache
    from tunekit.data.formats import read_rows
    from tunekit.model import load_tokenizer
    from tunekit.model.folder import resolve_model_path

    rows = read_rows(str(data))
    tok = load_tokenizer(resolve_model_path(None))
    entry = TokenCache(cache_dir).entry(str(data), rows, "chat", tok, 512)
    got = entry.load()
    if got is None:
        raise SystemExit(f"bench_data_cache: no entry at {entry.folder}")
    out = {"key_s": [], "write_s": [], "read_s": []}
    for i in range(repeats):
        t0 = time.perf_counter()
        fresh = TokenCache(cache_dir.parent / f"costs{i}").entry(str(data), rows, "chat", tok, 512)
        t1 = time.perf_counter()
        fresh.store(got.examples, got.lost, got.dropped)
        t2 = time.perf_counter()
        assert fresh.load() is not None
        t3 = time.perf_counter()
        out["key_s"].append(t1 - t0)
        out["write_s"].append(t2 - t1)
        out["read_s"].append(t3 - t2)
    return {k: round(min(v), 2) for k, v in out.items()}


def entry_bytes(cache_dir: Path) -> int:
    return sum(f.stat().st_size for f in cache_dir.rglob("*") if f.is_file())


def render(r: dict) -> str:
    lines = [f"# The tokenized cache: cold and warm start of `tunekit data prepare` ({r['date']})", "",
             f"Machine: {r['machine_note']}. Versions: "
             + ", ".join(f"{k} {v}" for k, v in r["versions"].items()) + ".", "",
             f"Data: {r['rows']:,} chat rows (1-3 turns) built from the embedded default data "
             f"(`scripts/bench_data_cache.py`), {r['data_mib']:.1f} MiB; the default model's tokenizer, "
             f"data.max_seq_len=512. Cache entries on disk: {r['cache_mib']:.1f} MiB.", "",
             f"The cache's own costs, tokenizing left out (in one process, best of 3): the key (hashing the rows and "
             f"the tokenizer) {r['costs']['key_s']:.2f} s, writing the entry {r['costs']['write_s']:.2f} s, reading it "
             f"back {r['costs']['read_s']:.2f} s.", "",
             "| run | data.num_proc | wall (s) | prepare (s) | CPU (s) | load (1 min) | peak RSS (MiB) | from cache |",
             "|---|---|---|---|---|---|---|---|"]
    for m in r["runs"]:
        lines.append(f"| {m['name']} | {m['num_proc']} | {m['wall_s']:.1f} | {m['prepare_s']:.1f} | {m['cpu_s']:.1f} | "
                     f"{m['load_1min']:.1f} | {m['peak_rss_mib']:.0f} | {'yes' if m['from_cache'] else 'no'} |")
    run = {(m["name"], m["num_proc"]): m for m in r["runs"]}  # the last of a repeated name
    cold, warm, cold2 = run[("cold", 1)], run[("warm", 1)], run[("cold", 2)]
    lines += ["", f"Warm against cold (1 process): the command's own work {warm['prepare_s']:.1f} s against "
              f"{cold['prepare_s']:.1f} s ({cold['prepare_s'] / warm['prepare_s']:.1f}x less), the whole command "
              f"{warm['wall_s']:.1f} s against {cold['wall_s']:.1f} s. 2 processes against 1, cold: "
              f"{cold2['prepare_s']:.1f} s against {cold['prepare_s']:.1f} s, {cold2['cpu_s']:.1f} against "
              f"{cold['cpu_s']:.1f} CPU seconds, at a load of {cold2['load_1min']:.1f} and {cold['load_1min']:.1f} "
              "on 2 cores: where other jobs hold the cores, the second worker has none of its own. Every run "
              "reported the same counts of examples and tokens, cuts and drops: "
              f"{'yes' if r['same_report_every_run'] else 'NO'}."]
    lines += ["", "wall: the whole command (imports, config, rows read and checked, tokenizer); prepare: "
              "what the command reports (tokenizer load + tokenization or cache read + split); CPU: user + system "
              "seconds of the command and its pool workers; load: the machine's 1-minute load average as the run "
              "started (2 cores: above 2, other jobs take cores from this one, and a second worker process gains "
              "little or nothing). Peak RSS: the command's main process, not its workers. Times are disturbed by "
              "other jobs on the same 2 cores: compare within this table only, with its load column.", "",
              "What the command printed (cold, 1 process):", "", "```",
              *r["runs"][1]["report"], "```", ""]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=120_000)
    p.add_argument("--out", default=str(REPO / "benchmarks" / "data" / f"data-cache-{datetime.date.today()}"))
    p.add_argument("--work", default=None, help="scratch folder (default: a temporary one, removed after)")
    args = p.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="bench-data-cache-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        data = work / "rows.jsonl"
        build_rows(args.rows, data)
        runs = []
        for name, num_proc, folder, cache in (("no cache", 1, "none", False), ("cold", 1, "c1", True),
                                              ("warm", 1, "c1", True), ("cold", 2, "c2", True),
                                              ("warm", 2, "c2", True), ("no cache", 2, "none", False),
                                              ("no cache", 1, "none", False)):
            m = prepare(data, work / folder, num_proc, cache)
            runs.append({"name": name, "num_proc": num_proc, **m})
            print(f"{name}, {num_proc} process(es): wall {m['wall_s']} s, prepare {m['prepare_s']} s, "
                  f"rss {m['peak_rss_mib']} MiB", flush=True)
        reports = {tuple(ln for ln in m["report"] if not ln.startswith(("cache:", "done in"))) for m in runs}
        result = {"date": str(datetime.date.today()), "machine": machine()["device"].split(",")[0],
                  "machine_note": f"{machine()['device'].split(',')[0]}, 2 cores shared with other jobs, no GPU",
                  "versions": versions(("torch", "transformers", "tokenizers", "safetensors", "tunekit")),
                  "rows": args.rows, "data_mib": data.stat().st_size / 2 ** 20,
                  "cache_mib": entry_bytes(work / "c1") / 2 ** 20, "same_report_every_run": len(reports) == 1,
                  "costs": cache_costs(data, work / "c1"),
                  "runs": runs}
        write_result(Path(args.out), result, render)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
