"""`loraserve up`: the system on its embedded default, in one process.

The default model is the real SmolLM2-135M-Instruct, fetched once into --data-dir (`loraserve model
fetch`, with a progress display) with the demo adapter `smollm2-pirate` (trained by
scripts/train_demo_adapter.py, shipped in adapter_store/demo_adapters/); without network it falls
back, saying so in one line, to `--model tiny`: a tiny random Llama and generated demo adapters.
Starts the adapter store in-process (SQLite registry, local adapter root) and registers the demo
adapters, starts an inference worker fetching from that store (in-process coordination) and the
OpenAI-compatible HTTP API in front of them, prints sample answers of the base model and each
adapter, then serves until interrupted (--once: exit after that).
Each service is started by its own `start_*` function returning what it runs and its address.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from loraserve.adapter_store.config import StoreConfig
from loraserve.adapter_store.demo import write_demo_adapters
from loraserve.adapter_store.server import BackgroundStore
from loraserve.clients.cli_help import DefaultsHelpFormatter
from loraserve.clients.store_cli import format_table
from loraserve.clients.store_client import StoreClient
from loraserve.clients.worker_client import WorkerClient
from loraserve.serving.ports import PortUnavailable

SAMPLE_PROMPT = "Once upon a time"
# the questions `up` asks the real model, answered by the base model and by each demo adapter
SAMPLE_QUESTIONS = ("What is the capital of France?", "Give me one tip for staying healthy.")
# the committed demo adapters of the real model (scripts/train_demo_adapter.py made them)
SMOLLM2_ADAPTERS = ("smollm2-pirate",)
MODELS = ("smollm2", "tiny")


@dataclass(frozen=True)
class EmbeddedDefault:
    data_dir: Path
    model_dir: Path  # the model in HF layout
    adapter_root: Path  # demo adapters, one directory each
    adapters: dict[str, Path]  # demo adapter id -> directory
    chat: bool = False  # the samples are chat answers (a real instruct model), not text continuations

    @property
    def store_dir(self) -> Path:
        return self.data_dir / "store"


def prepare_embedded_default(data_dir: str | Path) -> EmbeddedDefault:
    """Write the tiny model and the demo adapters under data_dir unless they are already there."""
    from loraserve.inference_worker.model.tiny import write_tiny_llama

    data = Path(data_dir).resolve()
    model_dir = data / "model"
    if not all((model_dir / f).exists() for f in ("config.json", "model.safetensors", "tokenizer.json")):
        write_tiny_llama(model_dir)
    root = data / "adapters"
    adapters = write_demo_adapters(root, model_dir)
    return EmbeddedDefault(data, model_dir, root, adapters)


def prepare_smollm2(data_dir: str | Path, show_progress: bool = True) -> EmbeddedDefault:
    """SmolLM2 (fetched unless already there) and its demo adapters under data_dir/smollm2; raises
    ModelFetchError when the model cannot be fetched."""
    from loraserve.adapter_store import demo
    from loraserve.inference_worker.model.fetch_cli import fetch

    data = Path(data_dir).resolve() / "smollm2"
    model_dir = fetch("smollm2", data / "model", show_progress=show_progress)
    root = data / "adapters"
    adapters = {}
    for name in SMOLLM2_ADAPTERS:
        shutil.copytree(Path(demo.__file__).parent / "demo_adapters" / name, root / name, dirs_exist_ok=True)
        adapters[name] = root / name
    return EmbeddedDefault(data, model_dir, root, adapters, chat=True)


def prepare_model(model: str, data_dir: str | Path) -> EmbeddedDefault:
    """The embedded default for `model`; SmolLM2 falls back to the tiny model, in one printed line,
    when it cannot be fetched (no network)."""
    if model == "smollm2":
        from loraserve.inference_worker.model.catalog import ModelFetchError

        try:
            return prepare_smollm2(data_dir)
        except ModelFetchError as exc:
            print(f"SmolLM2 is unavailable, serving the tiny random model instead: {exc}")
    return prepare_embedded_default(data_dir)


def serving_dtype() -> str:
    """bf16 on a GPU, fp32 on the CPU: the store's --serving-dtype and the worker's --dtype both,
    so adapters arrive in the dtype the worker computes in."""
    import torch

    return "bfloat16" if torch.cuda.is_available() else "float32"


def start_store(
    default: EmbeddedDefault, host: str = "127.0.0.1", port: int = 50051, **overrides: object
) -> BackgroundStore:
    """The adapter store on the embedded default, running in a background thread; `.address`, `.stop()`."""
    overrides.setdefault("serving_dtype", serving_dtype())
    config = StoreConfig(
        base_model=str(default.model_dir),
        host=host,
        port=port,
        data_dir=str(default.store_dir),
        adapter_root=str(default.adapter_root),
        **overrides,  # type: ignore[arg-type]
    )
    return BackgroundStore(config)


def start_worker(
    default: EmbeddedDefault,
    store_address: str,
    host: str = "127.0.0.1",
    port: int = 50052,
    **overrides: object,
):
    """An inference worker on the embedded model fetching adapters from the store, in a background
    thread (in-process coordination); `.address`, `.stop()`."""
    from loraserve.inference_worker.config import WorkerConfig
    from loraserve.inference_worker.server import BackgroundWorker

    overrides.setdefault("dtype", serving_dtype())  # the dtype the store optimizes adapters into
    config = WorkerConfig(
        model=str(default.model_dir),
        host=host,
        port=port,
        store_address=store_address,
        **overrides,  # type: ignore[arg-type]
    )
    return BackgroundWorker(config)


def start_gateway(
    store_address: str,
    worker_address: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    store_token: str | None = None,
):
    """The OpenAI-compatible API in front of the worker, listing the store's adapters, in a
    background thread; `.url`, `.stop()`."""
    from loraserve.gateway.config import GatewayConfig
    from loraserve.gateway.server import BackgroundGateway

    return BackgroundGateway(
        GatewayConfig(
            host=host,
            port=port,
            worker=worker_address,
            store=store_address,
            store_token=store_token,
            log_level="WARNING",
        )
    )


def sample_generations(
    worker_address: str, adapter_ids: Sequence[str], prompt: str = SAMPLE_PROMPT, max_tokens: int = 16
) -> list[tuple[str, str]]:
    """(adapter or "(base)", completion) for the base model and each adapter, greedy."""
    out = []
    with WorkerClient(worker_address, timeout=120) as w:
        for adapter_id in ("", *adapter_ids):
            text = w.generate(prompt, adapter_id=adapter_id, max_tokens=max_tokens).text
            out.append((adapter_id or "(base)", text))
    return out


def sample_chats(
    worker_address: str, adapter_ids: Sequence[str], questions: Sequence[str], max_tokens: int = 64
) -> list[tuple[str, list[tuple[str, str]]]]:
    """(question, [(adapter or "(base)", answer)]) for the base model and each adapter, greedy chat;
    all requests at once, so the worker batches them."""

    def ask(question: str, adapter_id: str) -> str:
        msgs = [{"role": "user", "content": question}]
        return w.generate(messages=msgs, adapter_id=adapter_id, max_tokens=max_tokens).text

    names = ["", *adapter_ids]
    with (
        WorkerClient(worker_address, timeout=300) as w,
        ThreadPoolExecutor(len(names) * len(questions)) as pool,
    ):
        answers = {(q, a): pool.submit(ask, q, a) for q in questions for a in names}
        return [(q, [(a or "(base)", answers[q, a].result()) for a in names]) for q in questions]


def register_demo_adapters(store_address: str, default: EmbeddedDefault, token: str | None = None) -> list:
    """Register (or re-register, idempotently) every demo adapter; returns their AdapterInfo."""
    with StoreClient(store_address, token=token) as client:
        return [client.register(name, name, overwrite=True) for name in default.adapters]


def print_samples(worker_address: str, default: EmbeddedDefault) -> None:
    if not default.chat:
        print(f"\nsample generations (greedy, 16 tokens) for {SAMPLE_PROMPT!r}:")
        for name, text in sample_generations(worker_address, list(default.adapters)):
            print(f"  {name:<14} -> {text!r}")
        return
    print("\nsample chat answers (greedy, at most 64 tokens), the base model and each adapter:")
    for question, answers in sample_chats(worker_address, list(default.adapters), SAMPLE_QUESTIONS):
        print(f"\n  Q: {question}")
        for name, text in answers:
            print(f"  {name:<16} -> {text.strip()}")


def print_try_lines(worker_address: str, api_url: str, adapter: str, chat: bool) -> None:
    """A command line and a curl call to try next: chat for an instruct model, else a completion."""
    if chat:
        print(
            f"\ntry: loraserve generate --worker {worker_address} --adapter {adapter} --chat 'Why is the sky blue?'"
        )
        body = f'''{{"model": "{adapter}", "messages": [{{"role": "user", "content": "Hello!"}}], "max_tokens": 32}}'''
        print(f"     curl {api_url}/v1/chat/completions -H 'Content-Type: application/json' -d '{body}'")
        return
    print(f"\ntry: loraserve generate --worker {worker_address} --adapter {adapter} 'Hello world'")
    body = f'''{{"model": "{adapter}", "prompt": "Hello world", "max_tokens": 16}}'''
    print(f"     curl {api_url}/v1/completions -H 'Content-Type: application/json' -d '{body}'")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        formatter_class=DefaultsHelpFormatter,
        prog="loraserve up",
        description="Run the system on its embedded default.",
    )
    parser.add_argument(
        "--data-dir", default=".loraserve-demo", help="where the model, adapters and registry live"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument(
        "--store-port", type=int, default=50051, help="adapter store port (0 picks a free one)"
    )
    parser.add_argument(
        "--worker-port", type=int, default=50052, help="inference worker port (0 picks a free one)"
    )
    parser.add_argument(
        "--openai-port", type=int, default=8000, help="OpenAI-compatible HTTP API port (0 picks a free one)"
    )
    parser.add_argument(
        "--read-token",
        default=os.environ.get("LORASERVE_READ_TOKEN"),
        help="the store's read token, presented by the worker and the gateway (default: reads open; "
        "env LORASERVE_READ_TOKEN)",
    )
    parser.add_argument(
        "--model",
        choices=MODELS,
        default="smollm2",
        help="smollm2: the real SmolLM2-135M-Instruct (downloaded once); tiny: a tiny random Llama",
    )
    parser.add_argument("--once", action="store_true", help="exit after setting up instead of serving")
    args = parser.parse_args(list(argv or []))
    try:
        return _up(args)
    except PortUnavailable as exc:  # one line, no traceback
        print(f"loraserve up: {exc}", file=sys.stderr)
        return 1


def _up(args: argparse.Namespace) -> int:
    default = prepare_model(args.model, args.data_dir)
    print(
        f"embedded default in {default.data_dir}: model {default.model_dir}, "
        f"{len(default.adapters)} demo adapter(s)"
    )
    # store and worker share a host: payloads are handed over as files, not streamed
    handover = str(default.data_dir / "handover")
    store = start_store(
        default, args.host, args.store_port, read_token=args.read_token, handover_dir=handover
    )
    worker = gateway = None
    try:
        print(f"adapter store on {store.address}")
        infos = register_demo_adapters(store.address, default, args.read_token)
        print(format_table(infos))
        worker = start_worker(
            default,
            store.address,
            args.host,
            args.worker_port,
            store_token=args.read_token,
            store_handover_dir=handover,
        )
        print(f"inference worker on {worker.address}")
        with WorkerClient(worker.address, timeout=30) as w:
            base_model = w.info().model
        print_samples(worker.address, default)
        gateway = start_gateway(store.address, worker.address, args.host, args.openai_port, args.read_token)
        adapter = next(iter(default.adapters))
        print(f"OpenAI-compatible API on {gateway.url}/v1 (model: an adapter id, or {base_model!r})")
        print_try_lines(worker.address, gateway.url, adapter, default.chat)
        if not args.once:
            print("serving; Ctrl-C to stop")
            stop = threading.Event()
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, lambda *_: stop.set())
            stop.wait()
    finally:
        if gateway is not None:
            gateway.stop()
        if worker is not None:
            worker.stop(grace=1.0)
        store.stop(grace=1.0, drain=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
