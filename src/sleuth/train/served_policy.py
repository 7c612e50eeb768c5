"""Rollouts sampled by a vLLM server that serves the policy being trained, as a LoRA adapter reloaded every step.

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
The old log-probs of the update are still computed by the trainer's own forward pass, as before.

Adapter names are ``NAME-RUNID-step-NNNNN``, ``RUNID`` a random id drawn per :class:`ServedPolicy`: a long-lived
server may still hold the adapters of an earlier run (vLLM refuses to load a name it holds, HTTP 400), and two runs
may share one server. Each adapter directory records its name (``served.json``), so a resumed run unloads what the
run before it left loaded.

With several processes, process 0 publishes and the others wait for it. A ``vllm:`` spec that starts a server starts
it in process 0 only; the other processes send their rollouts to that server (on several machines give it a
reachable ``host=``, or start one yourself and pass its ``url=``). Full fine-tuning has no comparable server
API (the weights would have to be broadcast into the server's workers), so ``rollout_server`` requires ``lora``.
"""

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
NAME_FILE = "served.json"


def _client_settings(llm: Any) -> dict[str, Any]:
    keys = ("model", "base_url", "concurrency", "timeout", "deadline", "max_retries", "backoff", "key_env")
    return {key: getattr(llm, key) for key in keys}


class ServedPolicyError(RuntimeError):
    """The rollout server could not load the policy's adapter."""


class ServedPolicy:
    """Publishes the policy's LoRA adapter to a vLLM server each step and hands out a backend that samples from it."""

    def __init__(
        self,
        spec: str,
        directory: Path,
        dist: Any,
        name: str = "policy",
        max_retries: int | None = None,
        run_id: str | None = None,
    ) -> None:
        from sleuth.llm import load_llm
        from sleuth.llm.base import parse_spec
        from sleuth.llm.openai_compat import OpenAICompatLLM

        backend, _, options = parse_spec(spec)
        starts_server = backend == "vllm" and not options.get("url")
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
        self.directory = directory
        self.dist = dist
        self.name = name
        # the spec's own max_retries (openai:...?max_retries=N) unless the caller sets one
        self.max_retries = template.max_retries if max_retries is None else max_retries
        self.run_id = shared_id
        self.current: tuple[str, Path] | None = None  # the adapter the server samples from (process 0)
        if dist.main and directory.is_dir():  # a resumed run: unload and delete the adapters an earlier run left
            for stale in sorted(directory.glob("step-*")):
                with contextlib.suppress(ServedPolicyError):
                    self._post("unload_lora_adapter", {"lora_name": self._recorded_name(stale)})
                shutil.rmtree(stale, ignore_errors=True)

    def _recorded_name(self, path: Path) -> str:
        """The name the adapter in ``path`` was loaded under (before names had a run id: ``NAME-step-NNNNN``)."""
        with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
            return str(json.loads((path / NAME_FILE).read_text())["lora_name"])
        return f"{self.name}-{path.name}"

    def adapter_name(self, step: int) -> str:
        return f"{self.name}-{self.run_id}-step-{step:05d}"

    def _post(self, endpoint: str, body: dict[str, Any]) -> None:
        import httpx

        url = f"{self.template.base_url}/{endpoint}"
        for attempt in range(self.max_retries + 1):
            try:
                response = httpx.post(url, json=body, timeout=self.template.timeout)
            except httpx.TransportError as exc:
                if attempt == self.max_retries:
                    raise ServedPolicyError(f"{url}: {exc!r}; is the vLLM server running? {HINT}") from exc
                time.sleep(backoff_delay(attempt, self.template.backoff))
                continue
            if response.status_code < 400:
                return
            if not is_retryable_status(response.status_code) or attempt == self.max_retries:
                message = f"{url} ({body.get('lora_name')!r}) answered HTTP {response.status_code}: "
                message += _error_message(response)
                if response.status_code in (404, 405) and endpoint == "load_lora_adapter":
                    message += f"; no runtime LoRA loading here? {HINT}"  # the route is missing
                raise ServedPolicyError(message)
            time.sleep(backoff_delay(attempt, self.template.backoff, response.headers.get("retry-after")))

    def publish(self, policy: Any, step: int) -> Any:
        """Make the current adapter the one the server samples from; return a backend naming it."""
        from sleuth.llm.openai_compat import OpenAICompatLLM

        if self.dist.main:
            path = (self.directory / f"step-{step:05d}").resolve()
            shutil.rmtree(path, ignore_errors=True)
            policy.save_pretrained(path)
            (path / NAME_FILE).write_text(json.dumps({"lora_name": self.adapter_name(step)}) + "\n")
            name = self.adapter_name(step)
            self._post("load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
            if self.current is not None:
                self._post("unload_lora_adapter", {"lora_name": self.current[0]})
                shutil.rmtree(self.current[1], ignore_errors=True)
            self.current = (name, path)
        self.dist.barrier()
        return OpenAICompatLLM(**{**_client_settings(self.template), "model": self.adapter_name(step)})

    def close(self) -> None:
        """Unload the current adapter and stop the server if this object's spec started it (``vllm:``)."""
        if self.dist.main and self.current is not None:
            with contextlib.suppress(ServedPolicyError):
                self._post("unload_lora_adapter", {"lora_name": self.current[0]})
            self.current = None
        close = getattr(self.template, "close", None)
        if callable(close):
            close()
