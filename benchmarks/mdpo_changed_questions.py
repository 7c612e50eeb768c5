"""Where do the SFT model and an mDPO model part, on the test questions whose EM changed between them?

Both models answer those questions greedily (the learning benchmark's agent, world and index, on its engine); for
each question the first step that differs (decomposition, a sub-answer, the final call) is counted, with the number
of sub-questions each model used and the gold hop count. Also: the sub-question counts of each iteration's
decomposition pairs (chosen / rejected / gold), from ``pairs.jsonl``. Reads ``learn_acesearcher``'s cached stages::

    python benchmarks/mdpo_changed_questions.py --model $RUNS/learn-acesearcher/mdpo-167fb5f1240d/iter1/model

writes ``changed_questions.json`` (the traces) beside the model and prints the counts (docs/training.md, "Second
diagnosis").
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import ModelServer, runs_home  # noqa: E402
from noise_floor import default_agent  # noqa: E402

SUBQUESTION = re.compile(r"### Q\d")


def steps_of(trace: dict[str, Any]) -> tuple[str, list[Any], str]:
    steps = trace["steps"]
    decomposition = next((s["output"] or "" for s in steps if s["kind"] == "decompose"), "")
    subanswers = [(s["meta"].get("subquestion"), s["parsed"]) for s in steps if s["kind"] == "subanswer"]
    final = next((s["output"] or "" for s in steps if s["kind"] == "answer"), "")
    return decomposition, subanswers, final


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="an mDPO model directory evaluated by learn_acesearcher")
    parser.add_argument("--work", default=str(runs_home() / "learn-acesearcher"))
    parser.add_argument("--engine", default="auto")
    parser.add_argument("--llm-options", default="threads=2&max_batch=32")
    args = parser.parse_args()
    from sleuth.agents import Context
    from sleuth.data.synth import load_synth
    from sleuth.retrieval import load_retriever
    from sleuth.runner import run
    from sleuth.train.common import auto_engine

    work, model = Path(args.work), Path(args.model)
    evaluations = [json.loads(p.read_text()) for p in (work / "eval" / "test").glob("*.json")]
    by_model = {e["key"]["model"]: e["per_example"]["em"] for e in evaluations if "per_example" in e}
    sft, updated = by_model[str(work / "sft")], by_model[str(model)]
    test = list(load_synth(work / "world" / "test.jsonl"))[: len(sft)]
    changed = [i for i in range(len(sft)) if sft[i] != updated[i]]
    agent, index = default_agent(), str(work / "index")
    traces = {}
    for name, directory in (("sft", work / "sft"), ("updated", model)):
        with ModelServer(directory, auto_engine(args.engine), args.llm_options) as server:
            ctx = Context(llm=server.get(), retriever=load_retriever(index), config=agent)
            traces[name] = [t.to_dict() for t in run("acesearcher", [test[i] for i in changed], ctx, progress=False)]
    (model / "changed_questions.json").write_text(json.dumps({"changed": changed, **traces}))

    where: Counter[tuple[str, ...]] = Counter()
    for i, a, b in zip(changed, traces["sft"], traces["updated"], strict=True):
        (da, sa, _), (db, sb, _) = steps_of(a), steps_of(b)
        first = "decomposition" if da != db else "subanswer" if sa != sb else "final"
        direction = "better" if updated[i] > sft[i] else "worse"
        hops = len(a["example"]["decomposition"] or [])
        counts = f"gold {hops} / sft {len(SUBQUESTION.findall(da))} / updated {len(SUBQUESTION.findall(db))}"
        where[(direction, first, counts)] += 1
    print(f"{len(changed)} changed test questions: (direction, first difference, sub-questions) -> count")
    for key, n in sorted(where.items()):
        print(f"  {key}: {n}")

    train = {row["id"]: row for row in map(json.loads, (work / "world" / "train.jsonl").open())}
    for pairs_file in sorted(work.glob("mdpo-*/iter*/pairs.jsonl")):
        pairs = [json.loads(line) for line in pairs_file.open() if line.strip()]
        kinds: Counter[str] = Counter()
        for p in (p for p in pairs if p["set"] == "decompose"):
            chosen = len(SUBQUESTION.findall(p["chosen"][0]["content"]))
            rejected = len(SUBQUESTION.findall(p["rejected"][0]["content"]))
            hops = len(train[p["question_id"]]["decomposition"] or [])
            kinds[f"chosen {chosen} / rejected {rejected} / gold {hops}"] += 1
        print(f"{pairs_file.relative_to(work)} decomposition pairs (sub-questions): {dict(sorted(kinds.items()))}")


if __name__ == "__main__":
    main()
