"""Draw ``jsonschemabench_sample.jsonl`` from a clone of guidance-ai/jsonschemabench (see README.md here).

    python benchmarks/data/sample_jsonschemabench.py GIT_DIR [--per-subset 5] [--max-bytes 40000]

From ``maskbench/data`` (each file: a schema and valid / invalid test instances), per subset: the files in name
order, shuffled with a fixed seed, the first ``--per-subset`` whose schema and first valid instance together
serialize to at most ``--max-bytes``. A row: subset, upstream file, the schema, that valid instance (or null).
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
from pathlib import Path

SUBSETS = ("Github_trivial", "Github_easy", "Github_medium", "Github_hard", "Github_ultra", "Glaiveai2K",
           "Kubernetes", "Snowplow", "JsonSchemaStore", "WashingtonPost")
SEED = 18
OUT = Path(__file__).with_name("jsonschemabench_sample.jsonl")


def _git(git_dir: str, *args: str) -> str:
    return subprocess.run(["git", "--git-dir", git_dir, *args], check=True, capture_output=True, text=True).stdout


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("git_dir")
    ap.add_argument("--per-subset", type=int, default=5)
    ap.add_argument("--max-bytes", type=int, default=40000)
    args = ap.parse_args(argv)
    commit = _git(args.git_dir, "rev-parse", "HEAD").strip()
    files = _git(args.git_dir, "ls-tree", "-r", "--name-only", "HEAD", "maskbench/data").split()
    rows = []
    for subset in SUBSETS:
        names = sorted(f for f in files if Path(f).name.startswith(subset + "---"))
        random.Random(f"{SEED}-{subset}").shuffle(names)
        taken = 0
        for name in names:
            doc = json.loads(_git(args.git_dir, "show", f"HEAD:{name}"))
            valid = [t["data"] for t in doc.get("tests", []) if t.get("valid")]
            row = {"subset": subset, "file": name, "schema": doc["schema"], "instance": valid[0] if valid else None}
            if len(json.dumps(row, ensure_ascii=False)) > args.max_bytes:
                continue
            rows.append(row)
            taken += 1
            if taken == args.per_subset:
                break
    with OUT.open("w") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False, separators=(",", ":")) + "\n")
    print(f"{len(rows)} schemas from {commit} -> {OUT} ({OUT.stat().st_size} bytes)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
