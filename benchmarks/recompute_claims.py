"""Recompute the claims of the committed learning-benchmark results from their per-question scores, without
rerunning anything: for each ``docs/results/learn_NAME/results.json``, the claims declared in
``benchmarks/learn_NAME.py`` (``CLAIMS``) are tested by :func:`harness.claims` (one-sided exact McNemar / sign-flip
p, shown when p < 0.05 on >= 100 test questions, Holm across the benchmark's claims), written into the file's
``claims`` list, and the claims table of its ``results.md`` is replaced (or appended). Prints the table of all
claims (the one docs/results/README.md quotes)::

    python benchmarks/recompute_claims.py            # rewrite the committed results
    python benchmarks/recompute_claims.py --check    # only print; exit 1 when a file's claims would change
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import REPO, _p, claims, power_cell, with_claims_table  # noqa: E402

from sleuth.retrieval.building import write_atomic  # noqa: E402

BENCHMARKS = ("learn_acesearcher", "learn_exsearch", "learn_s3", "learn_arena", "learn_real")


def recompute(results_dir: Path, specs: list[dict[str, Any]], write: bool) -> tuple[list[dict[str, Any]], bool]:
    """The claims of ``results_dir/results.json`` from its per-question scores, and whether they changed; with
    ``write``, the file's ``claims`` and ``results.md``'s table are rewritten."""
    path = results_dir / "results.json"
    results = json.loads(path.read_text())
    found = claims(results, specs, seed=int(results.get("settings", {}).get("seed", 0) or 0))
    changed = results.get("claims") != json.loads(json.dumps(found))
    if write:
        results["claims"] = found
        write_atomic(path, (json.dumps(results, indent=1, default=str) + "\n").encode())
        markdown = results_dir / "results.md"
        write_atomic(markdown, with_claims_table(markdown.read_text(), found).encode())
    return found, changed


def table(rows: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """Markdown: one row per claim of every benchmark."""
    lines = [
        "| benchmark | claim | metric | n | better / worse | difference [95% CI] | exact p | shown | Holm p | "
        "shown (Holm) | power: detectable / questions needed |",
        "|---|---|---|---:|---|---|---:|---|---:|---|---|",
    ]
    for bench, c in rows:
        metric = c["metric"] + (f" vs {c['before_metric']}" if "before_metric" in c else "")
        p, holm_p = c["p_exact"], c["p_holm"]
        lines.append(
            f"| {bench} | {c['name']} ({c['after']} vs {c['before']}) | {metric} | {c['n']} | "
            f"{c['better']} / {c['worse']} | {100 * c['mean']:+.1f} [{100 * c['lo']:+.1f}, {100 * c['hi']:+.1f}] | "
            f"{_p(p)} | {'**yes**' if c['shown'] else 'no'} | {_p(holm_p)} | {'yes' if c['shown_holm'] else 'no'} | "
            f"{power_cell(c)} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 when a file's claims differ")
    parser.add_argument("--results", type=Path, default=REPO / "docs" / "results", help="the results root")
    args = parser.parse_args()
    rows: list[tuple[str, dict[str, Any]]] = []
    stale = []
    for name in BENCHMARKS:
        results_dir = args.results / name
        if not (results_dir / "results.json").exists():
            continue
        specs = importlib.import_module(name).CLAIMS
        found, changed = recompute(results_dir, specs, write=not args.check)
        rows += [(name, c) for c in found]
        if changed:
            stale.append(name)
    print("\n".join(table(rows)))
    if args.check and stale:
        print(f"claims not up to date in: {', '.join(stale)}", file=sys.stderr)
        raise SystemExit(1)


if __name__ == "__main__":
    main()
