"""Trainers sampling through vLLM: mDPO and the ExSearch E-step on a server per model (``engine``), and the RL
trainers' LoRA adapter served by a real vLLM (``ServedPolicy``).

The wiring tests run the stand-in ``vllm`` package of ``tests/test_vllm_server.py`` (a real HTTP server started
through sleuth's launcher that echoes its prompt), so which server was started on which model, when it was stopped
and what the run recorded are checked in seconds. Tests marked ``vllm`` run the real vLLM of ``.venv-vllm`` and are
skipped, with the reason, when it is missing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from sleuth.agents.acesearcher import AceSearcherConfig
from sleuth.llm import LLMError, Request, Sampling
from sleuth.llm import vllm_server as vs
from sleuth.train import exsearch_em, mdpo
from tests.scripted import ListRetriever, passages
from tests.test_served_policy import OneProcess
from tests.test_vllm_server import VLLM_PYTHON, _pids_with_argument, alive, require_real_vllm


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SLEUTH_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("SLEUTH_VLLM_PYTHON", raising=False)
    return tmp_path / "home"


def started_servers() -> list[tuple[str, int]]:
    """(model, port) of every server sleuth started under this SLEUTH_HOME, from the first line of its log."""
    found = []
    for log in sorted(vs.log_dir().glob("vllm-*.log"), key=lambda p: p.stat().st_ctime_ns):
        words = log.read_text().splitlines()[0].split()
        found.append((words[words.index("--model") + 1], int(words[words.index("--port") + 1])))
    return found


def live_servers() -> list[vs.VLLMServer]:
    """The servers sleuth started under this SLEUTH_HOME that still run (a module's shared server is not one)."""
    return [s for s in list(vs._LIVE) if s.running() and s.log_path.parent == vs.log_dir()]


def no_server_running(*_: Any) -> None:
    live = [server.describe() for server in live_servers()]
    assert live == [], f"a vLLM server runs while the trainer trains: {live}"


def test_engine_spec_and_its_validation(tmp_path: Path) -> None:
    config = mdpo.MDPOConfig(llm_options="threads=1")
    assert mdpo.engine_spec(config, tmp_path) == f"hf:{tmp_path}?threads=1"
    config.engine = "vllm"
    assert mdpo.engine_spec(config, tmp_path) == f"vllm:{tmp_path}"
    config.engine = "vllm:{model}?tensor_parallel=2"
    assert mdpo.engine_spec(config, tmp_path) == f"vllm:{tmp_path}?tensor_parallel=2"
    for bad in ("vllm:MODEL", "{model}", "sglang"):
        with pytest.raises(ValueError, match="engine"):
            dataclasses.replace(config, engine=bad).validate()
        with pytest.raises(ValueError, match="engine"):
            exsearch_em.EMConfig(engine=bad).validate()


def test_mdpo_samples_and_evaluates_on_a_server_started_on_each_iterations_model(
    tmp_path: Path, tiny_model_dir: Path, fake_python: str, home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.test_mdpo import _run_config

    real = mdpo.train_dpo

    def train_alone(*args: Any, **kwargs: Any) -> Any:
        no_server_running()
        return real(*args, **kwargs)

    monkeypatch.setattr(mdpo, "train_dpo", train_alone)
    config = _run_config(tmp_path, tiny_model_dir, decompositions=1, solutions=2, train_limit=2, dev_limit=1)
    config.engine = f"vllm:{{model}}?python={fake_python}&startup_timeout=120"
    config.agent = AceSearcherConfig(k=1, max_subquestions=2)
    mdpo.train_mdpo(config, retriever=ListRetriever(passages("Ann was born in Paris.")))

    run = tmp_path / "run"
    iter1, iter2 = run / "iter1" / "model", run / "iter2" / "model"
    servers = started_servers()
    # θ(1) samples and is evaluated on one server; θ(2) is evaluated and samples iteration 2 on the next; θ(3) last
    assert [model for model, _ in servers] == [str(tiny_model_dir), str(iter1), str(iter2)]
    stats = [json.loads((run / f"iter{t}" / "stats.json").read_text()) for t in (1, 2)]
    ports = [f":{port}/v1" for _, port in servers]
    assert stats[0]["sampling_engine"]["backend"] == "VLLMServerLLM"
    assert stats[0]["sampling_engine"]["model"] == str(tiny_model_dir)
    assert stats[0]["sampling_engine"]["base_url"].endswith(ports[0])
    assert stats[0]["eval_engine"]["model"] == str(iter1) and stats[0]["eval_engine"]["base_url"].endswith(ports[1])
    assert stats[1]["sampling_engine"] == stats[0]["eval_engine"]  # the same server, not restarted
    assert stats[1]["eval_engine"]["model"] == str(iter2)
    assert stats[0]["rollouts"] == 2 * 1 * 2
    traces = (run / "iter1" / "rollouts" / "rollouts.jsonl").read_text()
    assert "echo: " in traces  # the rollouts are the server's answers
    assert not live_servers()
    assert [p for _, port in servers for p in _pids_with_argument(f"--port {port}") if alive(p)] == []


def test_exsearch_samples_on_the_server_and_scores_on_hf(
    tmp_path: Path, tiny_model_dir: Path, fake_python: str, home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.test_exsearch_em import _loop_config

    real = exsearch_em.train_weighted

    def train_alone(*args: Any, **kwargs: Any) -> Any:
        no_server_running()
        return real(*args, **kwargs)

    monkeypatch.setattr(exsearch_em, "train_weighted", train_alone)
    config = _loop_config(tmp_path, tiny_model_dir, iterations=1, warmup=False, train_limit=2, dev_limit=1)
    engine = f"vllm:{{model}}?python={fake_python}&startup_timeout=120"
    config = dataclasses.replace(config, engine=engine, score_on_engine=True)  # asked for, refused by the stand-in
    summary = exsearch_em.train_exsearch(config)

    out = tmp_path / "run"
    servers = started_servers()
    assert [model for model, _ in servers] == [str(tiny_model_dir), str(out / "iter0" / "model")]
    estep = json.loads((out / "iter0" / "estep.json").read_text())
    base = json.loads((out / "dev_base.json").read_text())
    assert estep["sampling_engine"]["backend"] == "VLLMServerLLM"
    assert estep["sampling_engine"] == base["engine"]  # the base model's evaluation server sampled the E-step
    # best-of ranks the server's candidates with the hf scorer: the stand-in server cannot score at all
    assert estep["scorer"].startswith("hf (the engine cannot score: LLMError"), estep["scorer"]
    assert estep["best_of"]["applied"] and estep["best_of"]["scored"] > 0
    assert estep["best_of"]["mean_logprob_kept"] is not None and math.isfinite(estep["best_of"]["mean_logprob_kept"])
    rollouts = (out / "iter0" / "rollouts" / "rollouts.jsonl").read_text()
    assert "echo: " in rollouts
    stats = json.loads((out / "iter0" / "stats.json").read_text())
    assert stats["sampling_engine"] == estep["sampling_engine"]
    assert summary["iterations"][0]["dev"]["engine"]["model"] == str(out / "iter0" / "model")
    assert not live_servers()
    assert [p for _, port in servers for p in _pids_with_argument(f"--port {port}") if alive(p)] == []


class Rank:
    """One process of a two-process run; ``shared`` plays the collective (process 0 gathers first)."""

    world = 2

    def __init__(self, rank: int, shared: list[Any]) -> None:
        self.rank, self.main, self.shared = rank, rank == 0, shared

    def gather(self, obj: Any) -> list[Any]:
        if self.main:
            self.shared.append(obj)
        return [self.shared[0], obj]

    def barrier(self) -> None:
        pass


def test_a_rollout_server_from_a_vllm_spec_is_started_once_for_all_processes(
    tmp_path: Path, tiny_model_dir: Path, fake_python: str, home: Path
) -> None:
    from sleuth.llm.openai_compat import OpenAICompatLLM
    from sleuth.train.served_policy import ServedPolicy

    spec = f"vllm:{tiny_model_dir}?python={fake_python}&enable_lora=1&startup_timeout=120"
    shared: list[Any] = []
    main = ServedPolicy(spec, tmp_path / "served", Rank(0, shared))
    other = ServedPolicy(spec, tmp_path / "served", Rank(1, shared))
    try:
        assert len(started_servers()) == 1 and isinstance(main.template, vs.VLLMServerLLM)
        assert type(other.template) is OpenAICompatLLM and other.template.base_url == main.template.base_url
        assert other.run_id == main.run_id
        rollouts = other.publish(object(), 3)  # process 1 saves and loads nothing: it names process 0's adapter
        assert rollouts.model == main.adapter_name(3) and rollouts.base_url == main.template.base_url
        assert rollouts.concurrency == main.template.concurrency and rollouts.deadline == main.template.deadline
    finally:
        main.close()
    assert not live_servers()


# -------------------------------------------------------------------- the real vLLM


LORA_PROMPTS = [
    "What is the capital of France?",
    "Who wrote Romeo and Juliet?",
    "Name a primary color.",
    "What is 12 times 7?",
]


def lora_policy(seed: int) -> Any:
    """SmolLM2 with a rank-8 LoRA on q/v whose B is random (PEFT starts B at 0, which would change nothing)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from sleuth.assets import default_model_dir

    base = AutoModelForCausalLM.from_pretrained(default_model_dir(), dtype=torch.float32)
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    model = get_peft_model(base, lora)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)
    return model.eval()


def generate(llm: Any, prompts: list[str], tokens: int = 24) -> tuple[list[str], float]:
    started = time.perf_counter()
    out = asyncio.run(llm.generate([Request.chat(p) for p in prompts], Sampling(max_new_tokens=tokens)))
    return [g.text for g in out], time.perf_counter() - started


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory: pytest.TempPathFactory):
    """A real vLLM server on the embedded SmolLM2 with runtime LoRA, started by ServedPolicy from a vllm: spec."""
    require_real_vllm()
    from sleuth.train.served_policy import ServedPolicy

    started = time.monotonic()
    spec = f"vllm:default?python={VLLM_PYTHON}&enable_lora=1&max_lora_rank=8"
    served = ServedPolicy(spec, tmp_path_factory.mktemp("served"), OneProcess())
    sys.stderr.write(f"\nreal vLLM server with LoRA ready in {time.monotonic() - started:.0f} s\n")
    yield served
    server = served.template.server
    served.close()
    assert not server.running()


@pytest.mark.vllm
def test_real_vllm_serves_the_published_adapter_as_hf_merged_and_forgets_the_previous(lora_server: Any) -> None:
    import copy

    from transformers import AutoTokenizer

    from sleuth.assets import default_model_dir
    from sleuth.llm.hf import HFLLM
    from sleuth.llm.openai_compat import OpenAICompatLLM

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    t = lora_server.template
    base_llm = OpenAICompatLLM(t.model, t.base_url, timeout=600, max_retries=0)
    base, base_s = generate(base_llm, LORA_PROMPTS)

    policy = lora_policy(seed=1)
    started = time.perf_counter()
    served = lora_server.publish(policy, 0)
    load_s = time.perf_counter() - started
    through_adapter, adapter_s = generate(served, LORA_PROMPTS)
    merged = HFLLM.from_model(copy.deepcopy(policy).merge_and_unload(), tokenizer)
    expected, hf_s = generate(merged, LORA_PROMPTS)
    sys.stderr.write(
        f"\nLoRA on vLLM: publish (save + load) {load_s:.2f} s; {len(LORA_PROMPTS)} prompts x 24 tokens: "
        f"base {base_s:.2f} s, adapter {adapter_s:.2f} s, hf merged {hf_s:.2f} s\n"
    )
    assert through_adapter == expected
    assert through_adapter != base  # the adapter changes the outputs, so equality above means something

    first = served.model
    second = lora_server.publish(lora_policy(seed=2), 1)
    listed = vs._models(t.base_url)
    assert second.model in listed and first not in listed
    with pytest.raises(LLMError, match="404|does not exist|not found"):
        generate(OpenAICompatLLM(first, t.base_url, timeout=60, max_retries=0), LORA_PROMPTS[:1], tokens=4)
    assert generate(second, LORA_PROMPTS[:1], tokens=4)[0][0]


@pytest.mark.vllm
@pytest.mark.integration
def test_real_vllm_samples_an_mdpo_iteration(tmp_path: Path) -> None:
    """One mDPO iteration on 2 questions whose rollouts come from a real vLLM server on SmolLM2 (then stopped)."""
    require_real_vllm()
    from sleuth.assets import default_model_dir
    from tests.test_mdpo import _write_examples

    config = mdpo.MDPOConfig(
        model="default",
        output_dir=str(tmp_path / "run"),
        train_file=_write_examples(tmp_path / "train.jsonl", 2, "t"),
        dev_file=_write_examples(tmp_path / "dev.jsonl", 1, "d"),
        dev_limit=0,
        eval_initial=False,
        decompositions=1,
        solutions=2,
        iterations=1,
        batch_size=1,
        per_device_batch_size=1,
        max_steps=1,
        warmup_ratio=0.0,
        max_length=512,
        progress=False,
        engine=f"vllm:{{model}}?python={VLLM_PYTHON}",
        agent=AceSearcherConfig(
            k=1, max_subquestions=2, decompose_max_new_tokens=32, subanswer_max_new_tokens=8, final_max_new_tokens=8
        ),
    )
    started = time.perf_counter()
    mdpo.train_mdpo(config, retriever=ListRetriever(passages("Ann was born in Paris. Paris is in France.")))
    stats = json.loads((tmp_path / "run" / "iter1" / "stats.json").read_text())
    sys.stderr.write(
        f"\nmDPO iteration through vLLM: {time.perf_counter() - started:.0f} s, seconds {stats['seconds']}\n"
    )
    engine = stats["sampling_engine"]
    assert engine["backend"] == "VLLMServerLLM" and engine["model"] == str(default_model_dir())
    assert stats["rollouts"] == 2 * 1 * 2 and stats["failed_runs"] == 0
    port = engine["base_url"].rsplit(":", 1)[1].split("/")[0]
    assert [s for s in vs._LIVE if str(s.port) == port] == []
    assert [p for p in _pids_with_argument(f"--port {port}") if alive(p)] == []


@pytest.mark.vllm
@pytest.mark.integration
def test_real_vllm_samples_an_exsearch_e_step_scored_on_hf(tmp_path: Path) -> None:
    """One ExSearch E-step on 2 questions sampled by a real vLLM server on SmolLM2, best-of and weights on hf."""
    require_real_vllm()
    from sleuth.agents.exsearch import ExSearchConfig
    from sleuth.assets import default_model_dir
    from tests.test_exsearch_em import _loop_config

    config = _loop_config(tmp_path, default_model_dir(), iterations=1, warmup=False, train_limit=2, dev_limit=0)
    config = dataclasses.replace(
        config,
        engine=f"vllm:{{model}}?python={VLLM_PYTHON}",
        best_of=2,
        agent=ExSearchConfig(k=2, max_steps=2, sampling=Sampling(max_new_tokens=16), answer_max_new_tokens=8),
    )
    started = time.perf_counter()
    exsearch_em.train_exsearch(config)
    estep = json.loads((tmp_path / "run" / "iter0" / "estep.json").read_text())
    sys.stderr.write(f"\nExSearch E-step through vLLM: {time.perf_counter() - started:.0f} s, {estep['seconds']}\n")
    engine = estep["sampling_engine"]
    assert engine["backend"] == "VLLMServerLLM" and engine["model"] == str(default_model_dir())
    assert estep["best_of"]["applied"] and estep["best_of"]["scored"] > 0  # ranked by the hf scorer
    port = engine["base_url"].rsplit(":", 1)[1].split("/")[0]
    assert [s for s in vs._LIVE if str(s.port) == port] == []
    assert [p for p in _pids_with_argument(f"--port {port}") if alive(p)] == []


@pytest.mark.vllm
@pytest.mark.integration
def test_real_vllm_serves_online_rl_rollouts_from_a_vllm_rollout_server(tmp_path: Path) -> None:
    """Two GRPO steps (LoRA on SmolLM2) whose rollouts come from `rollout_server: vllm:...` (the ARENA and s3 path):
    the server sleuth starts loads each step's adapter, drops the previous one, and is gone when the run ends."""
    require_real_vllm()
    import gc

    from sleuth.assets import default_model_dir
    from sleuth.train.online_rl import train_online
    from tests.test_online_rl import DirectTask, _config, _examples

    spec = f"vllm:default?python={VLLM_PYTHON}&enable_lora=1&max_lora_rank=8"
    config = _config(tmp_path, default_model_dir(), lora=True, lora_r=8, rollout_server=spec, steps=2)
    started = time.perf_counter()
    train_online(config, DirectTask(lambda t: float("Ann" in (t.answer or ""))), _examples())
    sys.stderr.write(f"\nonline RL, 2 steps through vLLM: {time.perf_counter() - started:.0f} s\n")
    gc.collect()
    served = (tmp_path / "rl" / "served").resolve()
    (log,) = [p for p in vs.log_dir().glob("vllm-*.log") if str(served) in p.read_text(errors="replace")]
    text = log.read_text(errors="replace")
    names = [json.loads((served / "step-00001" / "served.json").read_text())["lora_name"]]
    names.insert(0, names[0].replace("step-00001", "step-00000"))
    for name in names:
        assert f"Loaded new LoRA adapter: name '{name}'" in text
    assert f"Removed LoRA adapter: name '{names[0]}'" in text
    # token-in, token-out (episode_tokens: sampled): the prompts go to /v1/completions as ids
    assert text.count('"POST /v1/completions HTTP/1.1" 200') >= 2 * 2 * 3  # 2 steps x 2 questions x group 3
    port = log.stem.rsplit("-", 1)[1]
    assert [p for p in _pids_with_argument(f"--port {port}") if alive(p)] == []


# -------------------------------------------------------------------- full fine-tuning on the real vLLM


def full_policy(seed: int) -> Any:
    """SmolLM2 in float32 with every weight moved by N(0, 0.01) noise (the embedding, tied to the LM head, too)."""
    import torch
    from transformers import AutoModelForCausalLM

    from sleuth.assets import default_model_dir

    model = AutoModelForCausalLM.from_pretrained(default_model_dir(), dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.01)
    return model.eval()


def greedy(llm: Any, prompts: list[str], tokens: int = 24) -> tuple[list[str], float]:
    started = time.perf_counter()
    sampling = Sampling(max_new_tokens=tokens, temperature=0.0)
    out = asyncio.run(llm.generate([Request.chat(p) for p in prompts], sampling))
    return [g.text for g in out], time.perf_counter() - started


@pytest.fixture(scope="module")
def full_server(tmp_path_factory: pytest.TempPathFactory):
    """A real vLLM server on the embedded SmolLM2, started by a full-weights ServedPolicy (so in dev mode)."""
    require_real_vllm()
    from sleuth.train.served_policy import ServedPolicy

    started = time.monotonic()
    spec = f"vllm:default?python={VLLM_PYTHON}"
    served = ServedPolicy(spec, tmp_path_factory.mktemp("served-full"), OneProcess(), mode="full")
    sys.stderr.write(f"\nreal vLLM server in dev mode ready in {time.monotonic() - started:.0f} s\n")
    yield served
    server = served.template.server
    served.close()
    assert not server.running()


@pytest.mark.vllm
def test_real_vllm_reloads_a_full_fine_tune_and_samples_what_hf_samples(full_server: Any) -> None:
    from transformers import AutoTokenizer

    from sleuth.assets import default_model_dir
    from sleuth.llm.hf import HFLLM
    from sleuth.llm.openai_compat import OpenAICompatLLM

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    t = full_server.template
    base, _ = greedy(OpenAICompatLLM(t.model, t.base_url, timeout=600, max_retries=0), LORA_PROMPTS)
    prompt, text = [{"role": "user", "content": LORA_PROMPTS[1]}], "It was written by William Shakespeare."
    seen = [base]
    for step, seed in enumerate((1, 2)):
        policy = full_policy(seed)
        started = time.perf_counter()
        served = full_server.publish(policy, step)
        publish_s = time.perf_counter() - started
        # the same prompts each time: KV cached from the old weights would be reused without the reset
        through_vllm, vllm_s = greedy(served, LORA_PROMPTS)
        expected, hf_s = greedy(HFLLM.from_model(policy, tokenizer), LORA_PROMPTS)
        parts = ", ".join(f"{k} {v:.2f} s" for k, v in full_server.seconds.items())
        sys.stderr.write(
            f"\nfull weights on vLLM, step {step}: publish {publish_s:.2f} s ({parts}); {len(LORA_PROMPTS)} prompts "
            f"x 24 tokens greedy: vllm {vllm_s:.2f} s, hf {hf_s:.2f} s\n"
        )
        assert served.model == t.model and served.base_url == t.base_url
        # token-exact log-probs: every weight, the tied LM head too, is the trained model's
        served_logprob = asyncio.run(t.score(prompt, text)).logprob
        assert served_logprob == pytest.approx(
            asyncio.run(HFLLM.from_model(policy, tokenizer).score(prompt, text)).logprob, abs=1e-3
        )
        assert through_vllm == expected
        assert all(through_vllm != before for before in seen)  # each reload changed what the server samples
        seen.append(through_vllm)
    assert [p.name for p in full_server.directory.iterdir()] == ["step-00001"]


@pytest.mark.vllm
@pytest.mark.integration
@pytest.mark.timeout(1800)
def test_real_vllm_serves_online_rl_rollouts_of_a_full_fine_tune(full_server: Any, tmp_path: Path) -> None:
    """Two GRPO steps of a fully fine-tuned SmolLM2 whose rollouts come from a vLLM server (attached here: the
    module's, in dev mode) that reloads the policy's weights before each step. (PPO, s3's reference setting, runs
    the same publish; its critic made the test pass 15 minutes on the loaded 2-core machine.)"""
    from sleuth.assets import default_model_dir
    from sleuth.train.online_rl import train_online
    from tests.test_online_rl import DirectTask, _config, _examples

    server_log = full_server.template.server.log_path
    before = server_log.read_text(errors="replace")
    spec = f"vllm:?url={full_server.template.base_url}"
    config = _config(tmp_path, default_model_dir(), rollout_server=spec, steps=2, group_size=2)
    started = time.perf_counter()
    train_online(config, DirectTask(lambda t: float("Ann" in (t.answer or ""))), _examples())
    sys.stderr.write(f"\nonline RL, 2 full-weight GRPO steps through vLLM: {time.perf_counter() - started:.0f} s\n")
    during = server_log.read_text(errors="replace")[len(before) :]
    assert during.count('"POST /collective_rpc HTTP/1.1" 200') == 2  # one reload per step
    assert during.count('"POST /reset_prefix_cache HTTP/1.1" 200') == 3  # the check at the start, then per step
    assert during.count('"POST /v1/completions HTTP/1.1" 200') >= 2 * 2 * 2  # 2 steps x 2 questions x group 2
    log = [json.loads(line) for line in (tmp_path / "rl" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [0, 1] and all(r["publish_seconds"] > 0 for r in log)
    sys.stderr.write(f"publish_seconds per step: {[r['publish_seconds'] for r in log]}\n")
    # each reload deleted the copy before it; the last stays, as a LoRA run's last adapter does
    assert [p.name for p in (tmp_path / "rl" / "served").iterdir()] == ["step-00001"]


@pytest.mark.vllm
@pytest.mark.integration
@pytest.mark.timeout(1800)
def test_real_vllm_rollouts_train_on_the_ids_the_server_sampled_with_its_log_probs(
    full_server: Any, tmp_path: Path
) -> None:
    """One GRPO step of a full fine-tune whose rollouts come token-in, token-out from the real vLLM server (the
    default ``episode_tokens: sampled``), at temperature 0.7: each episode's prompt ids are the hf backend's
    formatting of its messages, its sampled ids decode to its text, every episode trains on those ids, and the
    server's log-probs of them are the policy's own at the sampling temperature (a float32 forward of the same
    weights here, and the trainer's old log-probs in the step's mismatch log)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sleuth.assets import default_model_dir
    from sleuth.llm.base import encode_prompt
    from sleuth.train.online_rl import train_online
    from sleuth.train.rollouts import RolloutStore
    from tests.test_online_rl_tokens import TokenTask, _config, _examples, _log

    spec = f"vllm:?url={full_server.template.base_url}"
    temperature = 0.7
    config = _config(tmp_path, default_model_dir(), rollout_server=spec, temperature=temperature, learning_rate=1e-6)
    train_online(config, TokenTask(), _examples())
    entry = _log(config)
    sys.stderr.write(
        f"\nvLLM sampler vs trainer: mean |dlogp| {entry['sampler_mismatch_abs']:.2e}, max "
        f"{entry['sampler_mismatch_max']:.2e} over {entry['sampler_tokens']} tokens\n"
    )
    assert entry["sampled_episodes"] == 6 and entry["retokenized"] == 0
    assert entry["sampler_tokens"] > 0 and entry["sampler_mismatch_abs"] < 1e-2
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    model = AutoModelForCausalLM.from_pretrained(default_model_dir(), dtype=torch.float32).eval()  # step 0's weights
    worst = 0.0
    stored = list(RolloutStore(tmp_path / "rl" / "rollouts" / "step-00000"))
    assert len(stored) == 6
    for rollout in stored:
        step = rollout.trace.steps[-1]
        tokens = step.meta["tokens"]
        assert tokens["prompt"] == encode_prompt(tokenizer, step.messages)
        assert tokenizer.decode(tokens["sampled"], skip_special_tokens=True) == step.output
        ids = torch.tensor([tokens["prompt"] + tokens["sampled"]])
        with torch.no_grad():
            logits = model(ids).logits[0, len(tokens["prompt"]) - 1 : -1].float() / temperature
        expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens["sampled"])[:, None])[:, 0]
        worst = max(worst, float((expected - torch.tensor(tokens["logprobs"])).abs().max()))
    sys.stderr.write(f"vLLM sampled log-probs vs a float32 hf forward at T={temperature}: worst |d| {worst:.2e}\n")
    assert worst < 2e-2
