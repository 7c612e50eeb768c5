"""Rollouts sampled by a vLLM server that serves the policy being trained: its LoRA adapter, or its full weights,
pushed to the server every step.

A transformers ``generate`` is the slow half of an RL step on a GPU; vLLM samples the same rollouts many times
faster. The policy must then reach the server after every update. With LoRA that is a small, documented operation:
vLLM's OpenAI server, started with runtime LoRA updating, loads an adapter directory by name and serves it as a
model::

    # cfg.yaml: sleuth starts the server (and stops it when the run ends)
    lora: true
    rollout_server: vllm:BASE_MODEL?enable_lora=1&max_lora_rank=16

    # or a server of your own, started with runtime LoRA updating
    #   VLLM_ALLOW_RUNTIME_LORA_UPDATING=True vllm serve BASE_MODEL --enable-lora --max-lora-rank 16 --port 8000
    rollout_server: openai:BASE_MODEL@http://127.0.0.1:8000/v1?concurrency=64

Before each step's rollouts, :meth:`ServedPolicy.publish` saves the adapter to ``DIR/step-NNNNN`` (``DIR`` =
``rollout_adapter_dir``, by default ``OUT/served``: the server must be able to read it, so the same machine or a
shared file system), asks the server to load it (``POST /v1/load_lora_adapter {"lora_name", "lora_path"}``),
unloads and deletes the previous step's adapter, and returns an ``openai`` backend whose model is the new adapter's
name: every rollout request of the step names the adapter it samples from, so no request can hit stale weights.
With ``episode_tokens: sampled`` (the default) the backend is token-in, token-out (``token_out``, the policy's
tokenizer): prompts go to the server as ids and the sampled ids come back with the server's log-probs, so the update
trains on exactly the sampled tokens and corrects for the difference between the server's distribution and the
trainer's old log-probs, which the trainer still computes with its own forward pass (``sampler_correction``).

Adapter names are ``NAME-RUNID-step-NNNNN``, ``RUNID`` a random id drawn per :class:`ServedPolicy`: a long-lived
server may still hold the adapters of an earlier run (vLLM refuses to load a name it holds, HTTP 400), and two runs
may share one server. Each adapter directory records its name (``served.json``), so a resumed run unloads what the
run before it left loaded.

With several processes, process 0 publishes and the others wait for it. A ``vllm:`` spec that starts a server starts
it in process 0 only; the other processes send their rollouts to that server (on several machines give it a
reachable ``host=``, or start one yourself and pass its ``url=``).

**Full fine-tuning** (``mode="full"``, what :func:`sleuth.train.online_rl.train_online` picks when ``lora`` is off).
vLLM's server can reload a model's weights in place from a directory: its development routes (on with
``VLLM_SERVER_DEV_MODE=1``) include ``POST /collective_rpc``, which calls a method on every worker, and the workers'
``reload_weights(weights_path=DIR)`` reads the checkpoint in ``DIR`` through the model loader into the parameters the
server already holds (same storage, so compiled graphs stay valid). Before each step's rollouts :meth:`publish` saves
the policy (:func:`save_full_weights`: safetensors, a tied LM head too) to ``DIR/step-NNNNN``, posts ``{"method":
"reload_weights", "kwargs": {"weights_path": ...}}``, then ``POST /reset_prefix_cache`` (the reload does not drop the
prefix cache, whose KV was computed by the old weights) and deletes the previous step's directory. The served model
keeps its name, so the backend it returns names the base model. A ``vllm:`` spec that starts a server gets
``dev_mode=1`` (``VLLM_SERVER_DEV_MODE=1``) added; a server of your own must be started with
``VLLM_SERVER_DEV_MODE=1``, and one without it is refused when this object is made, with a message saying so. vLLM's
other weight-update path (the ``/init_weight_transfer_engine`` and ``/update_weights`` routes of the same dev mode,
TRL's ``vllm-serve``) sends the tensors over NCCL or CUDA IPC and needs a GPU on both sides; the reload from a
directory works on the CPU build too. Measured on the 2-core CPU with SmolLM2-135M in float32 (docs/vllm.md): 1-4 s to
save and 1-9 s to reload, against 67-170 s to start a new server on the new weights (the fallback this avoids)."""

from __future__ import annotations

import contextlib
import json
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

from sleuth._http import backoff_delay, is_retryable_status
from sleuth._http import error_message as _error_message

__all__ = ["ServedPolicy", "ServedPolicyError"]

HINT = (
    "the server must load LoRA adapters at run time: let sleuth start it with rollout_server=vllm:BASE?enable_lora=1, "
    "or start it with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True vllm serve BASE --enable-lora --max-lora-rank R"
)
FULL_HINT = (
    "a fully fine-tuned policy reaches the server through vLLM's development routes (POST /collective_rpc, "
    "/reset_prefix_cache): let sleuth start the server (rollout_server=vllm:BASE, which sets dev_mode=1), or start "
    "yours with VLLM_SERVER_DEV_MODE=1 in its environment"
)
NAME_FILE = "served.json"
MODES = ("lora", "full")
DEV_ROUTES = ("collective_rpc", "reset_prefix_cache")  # at the server's root, not under /v1
RESET_TRIES = 20  # /reset_prefix_cache answers success=false while running requests hold blocks


def _client_settings(llm: Any) -> dict[str, Any]:
    keys = (
        "model",
        "base_url",
        "concurrency",
        "timeout",
        "deadline",
        "max_retries",
        "backoff",
        "key_env",
        "send_seed",
    )
    return {key: getattr(llm, key) for key in keys}


TIED_HEAD_FILE = "tied-lm-head.safetensors"


def save_full_weights(model: Any, path: Path) -> None:
    """``model.save_pretrained(path)`` (safetensors), plus the LM head under its own name when it is tied to the input
    embedding.

    ``save_pretrained`` leaves a tied head out (the embedding stands for both). vLLM's in-place reload processes a
    layer again only when the checkpoint holds its weights, and on a CPU the head multiplies with a copy of its weight
    that oneDNN packed when it was loaded: left out, the head kept the old weights while the embedding took the new
    ones (the served log-probs then differed from the trained model's). The extra file is named in the index of a
    sharded save, which vLLM's loader follows."""
    from safetensors.torch import save_file

    model.save_pretrained(path)
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    if head is None or embedding is None or head.weight is not embedding.weight:
        return
    (name,) = [n for n, module in model.named_modules() if module is head]
    key = f"{name}.weight"
    save_file({key: head.weight.detach().to("cpu").contiguous().clone()}, str(path / TIED_HEAD_FILE))
    index = path / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        data.setdefault("weight_map", {})[key] = TIED_HEAD_FILE
        index.write_text(json.dumps(data, indent=2) + "\n")


class ServedPolicyError(RuntimeError):
    """The rollout server could not load the policy's adapter."""


class ServedPolicy:
    """Publishes the policy to a vLLM server each step, as a LoRA adapter (``mode="lora"``) or by reloading the
    server's weights from a saved checkpoint (``mode="full"``), and hands out a backend that samples from it."""

    def __init__(
        self,
        spec: str,
        directory: Path,
        dist: Any,
        name: str = "policy",
        max_retries: int | None = None,
        run_id: str | None = None,
        mode: str = "lora",
        tokenizer: Any = None,
        token_out: bool = False,
    ) -> None:
        from sleuth.llm import load_llm
        from sleuth.llm.base import parse_spec
        from sleuth.llm.openai_compat import OpenAICompatLLM

        if mode not in MODES:
            raise ValueError(f"ServedPolicy mode={mode!r}; expected one of {MODES}")
        backend, _, options = parse_spec(spec)
        starts_server = backend == "vllm" and not options.get("url")
        if mode == "full" and starts_server and "dev_mode" not in options:
            spec += "&dev_mode=1" if "?" in spec else "?dev_mode=1"
        template = load_llm(spec) if dist.main or not starts_server else None
        if template is not None and not isinstance(template, OpenAICompatLLM):
            raise ValueError(
                f"rollout_server={spec!r} must name a vLLM server: 'vllm:BASE?enable_lora=1' or 'openai:BASE@URL'"
            )
        client = _client_settings(template) if template is not None else None
        # process 0's run id, and its server for the processes that started none
        shared_id, shared_client = dist.gather((run_id or uuid.uuid4().hex[:8], client))[0]
        if template is None:
            template = OpenAICompatLLM(**shared_client)
        self.template = template
        self.root = template.base_url.removesuffix("/v1")  # where vLLM's development routes are
        self.directory = directory
        self.dist = dist
        self.name = name
        self.mode = mode
        # token-in, token-out sampling (the backend's ``token_out``) with the policy's tokenizer
        self.client_extras: dict[str, Any] = {"score_tokenizer": tokenizer, "token_out": token_out}
        # the last publish's parts on process 0 (lora: save, load; full: save, reload, reset)
        self.seconds: dict[str, float] = {}
        # the spec's own max_retries (openai:...?max_retries=N) unless the caller sets one
        self.max_retries = template.max_retries if max_retries is None else max_retries
        self.run_id = shared_id
        self.current: tuple[str, Path] | None = None  # the adapter (or weights) the server samples from (process 0)
        if dist.main and directory.is_dir():  # a resumed run: unload and delete what an earlier run left
            for stale in sorted(directory.glob("step-*")):
                if mode == "lora":
                    with contextlib.suppress(ServedPolicyError):
                        self._post("unload_lora_adapter", {"lora_name": self._recorded_name(stale)})
                shutil.rmtree(stale, ignore_errors=True)
        if dist.main and mode == "full":  # a server without the development routes is refused now, not at step 0
            self._reset_prefix_cache()

    def _recorded_name(self, path: Path) -> str:
        """The name the adapter in ``path`` was loaded under (before names had a run id: ``NAME-step-NNNNN``)."""
        with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
            return str(json.loads((path / NAME_FILE).read_text())["lora_name"])
        return f"{self.name}-{path.name}"

    def adapter_name(self, step: int) -> str:
        return f"{self.name}-{self.run_id}-step-{step:05d}"

    def _post(self, endpoint: str, body: dict[str, Any] | None = None) -> Any:
        """POST ``body`` to ``endpoint`` (under the OpenAI base URL; the development routes at the server's root);
        return the answer's JSON (None when it has none)."""
        import httpx

        base = self.root if endpoint in DEV_ROUTES else self.template.base_url
        url = f"{base}/{endpoint}"
        hint = FULL_HINT if self.mode == "full" else HINT
        for attempt in range(self.max_retries + 1):
            try:
                response = httpx.post(url, json=body, timeout=self.template.timeout)
            except httpx.TransportError as exc:
                if attempt == self.max_retries:
                    raise ServedPolicyError(f"{url}: {exc!r}; is the vLLM server running? {hint}") from exc
                time.sleep(backoff_delay(attempt, self.template.backoff))
                continue
            if response.status_code < 400:
                try:
                    return response.json()
                except ValueError:
                    return None
            if not is_retryable_status(response.status_code) or attempt == self.max_retries:
                what = f" ({body['lora_name']!r})" if body and "lora_name" in body else ""
                message = f"{url}{what} answered HTTP {response.status_code}: {_error_message(response)}"
                if response.status_code in (404, 405) and endpoint == "load_lora_adapter":
                    message += f"; no runtime LoRA loading here? {HINT}"  # the route is missing
                elif response.status_code in (404, 405) and endpoint in DEV_ROUTES:
                    message += f"; no development routes here (VLLM_SERVER_DEV_MODE unset)? {FULL_HINT}"
                raise ServedPolicyError(message)
            time.sleep(backoff_delay(attempt, self.template.backoff, response.headers.get("retry-after")))
        raise AssertionError("unreachable")

    def _reset_prefix_cache(self) -> None:
        """Drop the server's cached KV blocks (computed by the weights before a reload); vLLM refuses while running
        requests hold blocks, so it is asked again a few times."""
        for attempt in range(RESET_TRIES):
            answer = self._post("reset_prefix_cache")
            if not isinstance(answer, dict) or answer.get("success", True):
                return
            time.sleep(min(0.05 * 2**attempt, 1.0))
        raise ServedPolicyError(
            f"{self.root}/reset_prefix_cache kept answering success=false (requests running on the server hold "
            "cache blocks); its cached KV from the previous weights would be reused"
        )

    def _publish_full(self, policy: Any, step: int) -> None:
        """Save the full weights and have the server reload them in place (process 0)."""
        path = (self.directory / f"step-{step:05d}").resolve()
        shutil.rmtree(path, ignore_errors=True)
        started = time.perf_counter()
        save_full_weights(policy, path)  # safetensors, as vLLM's default loader reads them
        saved = time.perf_counter()
        self._post("collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(path)}})
        reloaded = time.perf_counter()
        self._reset_prefix_cache()
        # the server holds the weights in memory now: the previous step's copy on disk is not read again
        if self.current is not None and self.current[1] != path:
            shutil.rmtree(self.current[1], ignore_errors=True)
        self.current = (self.template.model, path)
        self.seconds = {"save": saved - started, "reload": reloaded - saved, "reset": time.perf_counter() - reloaded}

    def publish(self, policy: Any, step: int) -> Any:
        """Make the policy's current weights the ones the server samples from; return a backend that samples them.

        ``lora``: ``policy`` is a PEFT model, its adapter is loaded under a new name that the backend names.
        ``full``: ``policy`` is a transformers model, the server reloads all its weights and keeps its model name."""
        from sleuth.llm.openai_compat import OpenAICompatLLM

        if self.mode == "full":
            if self.dist.main:
                self._publish_full(policy, step)
            self.dist.barrier()
            return OpenAICompatLLM(**_client_settings(self.template), **self.client_extras)
        if self.dist.main:
            path = (self.directory / f"step-{step:05d}").resolve()
            shutil.rmtree(path, ignore_errors=True)
            started = time.perf_counter()
            policy.save_pretrained(path)
            (path / NAME_FILE).write_text(json.dumps({"lora_name": self.adapter_name(step)}) + "\n")
            name = self.adapter_name(step)
            saved = time.perf_counter()
            self._post("load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
            self.seconds = {"save": saved - started, "load": time.perf_counter() - saved}
            if self.current is not None:
                self._post("unload_lora_adapter", {"lora_name": self.current[0]})
                shutil.rmtree(self.current[1], ignore_errors=True)
            self.current = (name, path)
        self.dist.barrier()
        settings = {**_client_settings(self.template), "model": self.adapter_name(step)}
        return OpenAICompatLLM(**settings, **self.client_extras)

    def close(self) -> None:
        """Unload the current adapter (full: delete the last weights saved for the server) and stop the server if
        this object's spec started it (``vllm:``)."""
        if self.dist.main and self.current is not None and self.mode == "full":
            shutil.rmtree(self.current[1], ignore_errors=True)
            self.current = None
        if self.dist.main and self.current is not None:
            with contextlib.suppress(ServedPolicyError):
                self._post("unload_lora_adapter", {"lora_name": self.current[0]})
            self.current = None
        close = getattr(self.template, "close", None)
        if callable(close):
            close()
