"""What the serving benchmark runs against: a random Llama checkpoint and many distinct PEFT
adapters written to disk, and the services as real processes (`loraserve store`, `loraserve
worker`, optionally `redis-server`) on 127.0.0.1, stopped when the fleet closes.

Shapes: "1b" is Llama-3.2-1B (hidden 2048, 16 layers, 32/8 heads, vocab 128256, random bf16
weights); "tiny" is a CPU-sized stand-in. The tokenizer is a small trained BPE: prompts are token
ids, and ids past its vocabulary decode to nothing.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

from loraserve.adapter_store.demo import DemoAdapterSpec, write_peft_adapter
from loraserve.contract.adapter_layout import MODULES
from loraserve.inference_worker.model.tiny import (
    BOS,
    EOS,
    TinyLlamaSpec,
    build_tokenizer,
    llama_config,
    random_llama_weights,
)

SHAPES = {
    "1b": TinyLlamaSpec(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        tie_word_embeddings=True,
        init_std=0.02,
        name="llama-3.2-1b-shape",
    ),
    "tiny": TinyLlamaSpec(),
}


# what a store or worker prints once it serves (ports bound, --port 0 and --metrics-port 0)
LISTENING = re.compile(r"listening on ([\d.]+):(\d+)(?:.*?metrics on ([\d.]+):(\d+))?")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---------------------------------------------------------------------------------- data on disk
def write_model(directory: Path, shape: str) -> Path:
    """A random checkpoint of `shape` in Hugging Face layout (kept when already written)."""
    spec = SHAPES[shape]
    if (directory / "config.json").exists():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(512)
    tok.save(str(directory / "tokenizer.json"))
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    config = llama_config(spec, spec.vocab_size, bos, eos)
    config["torch_dtype"] = "bfloat16"
    if shape == "tiny":
        weights = random_llama_weights(spec, spec.vocab_size)
    else:  # 1.2 B parameters: drawn on the GPU when there is one
        device = "cuda" if torch.cuda.is_available() else "cpu"
        g = torch.Generator(device).manual_seed(spec.seed)
        shapes = {k: v.shape for k, v in weight_shapes(spec).items()}
        weights = {}
        for name, size in shapes.items():
            w = torch.randn(size, generator=g, device=device, dtype=torch.bfloat16) * spec.init_std
            weights[name] = (w + 1.0 if name.endswith("norm.weight") else w).cpu()
    save_file(
        {k: v.to(torch.bfloat16).contiguous() for k, v in weights.items()},
        str(directory / "model.safetensors"),
    )
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory


def weight_shapes(spec: TinyLlamaSpec) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors as meta tensors (shapes only), as `random_llama_weights` names them."""
    with torch.device("meta"):
        return _empty_weights(spec)


def _empty_weights(spec: TinyLlamaSpec) -> dict[str, torch.Tensor]:
    h, i, d = spec.hidden_size, spec.intermediate_size, spec.head_dim
    nh, nkv = spec.num_attention_heads, spec.num_key_value_heads
    w = {"model.embed_tokens.weight": torch.empty(spec.vocab_size, h)}
    for layer in range(spec.num_hidden_layers):
        p = f"model.layers.{layer}."
        w[p + "self_attn.q_proj.weight"] = torch.empty(nh * d, h)
        w[p + "self_attn.k_proj.weight"] = torch.empty(nkv * d, h)
        w[p + "self_attn.v_proj.weight"] = torch.empty(nkv * d, h)
        w[p + "self_attn.o_proj.weight"] = torch.empty(h, nh * d)
        w[p + "mlp.gate_proj.weight"] = torch.empty(i, h)
        w[p + "mlp.up_proj.weight"] = torch.empty(i, h)
        w[p + "mlp.down_proj.weight"] = torch.empty(h, i)
        w[p + "input_layernorm.weight"] = torch.empty(h)
        w[p + "post_attention_layernorm.weight"] = torch.empty(h)
    w["model.norm.weight"] = torch.empty(h)
    if not spec.tie_word_embeddings:
        w["lm_head.weight"] = torch.empty(spec.vocab_size, h)
    return w


def adapter_name(i: int) -> str:
    return f"adapter-{i:04d}"


def adapter_rank(i: int) -> int:
    return 8 if i % 2 == 0 else 16  # ranks 8 and 16 mixed, the popular ones included


def _write_adapter(job: tuple[Path, dict, int]) -> None:
    root, base_config, i = job
    torch.set_num_threads(1)
    out = root / adapter_name(i)
    if (out / "adapter_config.json").exists():
        return
    r = adapter_rank(i)
    spec = DemoAdapterSpec(adapter_name(i), r=r, lora_alpha=2.0 * r, target_modules=MODULES, seed=1000 + i)
    write_peft_adapter(out, base_config, spec, dtype=torch.bfloat16)


def write_adapters(root: Path, model_dir: Path, count: int, processes: int) -> list[str]:
    """`count` adapters with distinct random weights on all seven modules (kept when written)."""
    root.mkdir(parents=True, exist_ok=True)
    base_config = json.loads((model_dir / "config.json").read_text())
    jobs = [(root, base_config, i) for i in range(count)]
    with mp.get_context("fork").Pool(processes) as pool:
        pool.map(_write_adapter, jobs, chunksize=4)
    return [adapter_name(i) for i in range(count)]


# ---------------------------------------------------------------------------------- processes
@dataclass
class Service:
    name: str
    address: str
    process: subprocess.Popen
    log: Path
    metrics_address: str = ""

    def stop(self, timeout: float = 15.0) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)

    def check_alive(self) -> None:
        if self.process.poll() is not None:
            tail = self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""
            raise RuntimeError(f"{self.name} exited with {self.process.returncode}:\n{tail}")

    def await_listening(self, timeout: float) -> None:
        """Started with port 0: the ports it bound, from its "listening on" line (no port picked
        here can be taken by another process before the service binds it)."""
        end = time.monotonic() + timeout
        while not self.address:
            self.check_alive()
            text = self.log.read_text(errors="replace") if self.log.exists() else ""
            found = sorted(LISTENING.finditer(text), key=lambda m: m.group(3) is not None)
            if found:  # the printed line (with the metrics port) over a log line that says less
                m = found[-1]
                self.address = f"{m.group(1)}:{m.group(2)}"
                self.metrics_address = f"{m.group(3)}:{m.group(4)}" if m.group(3) else ""
                return
            if time.monotonic() > end:
                raise TimeoutError(
                    f"{self.name} did not say where it listens in {timeout:.0f} s (log {self.log})"
                )
            time.sleep(0.05)


@dataclass
class WorkerOptions:
    device: str = "cuda"
    dtype: str = "bfloat16"
    max_loras: int = 64
    max_cpu_loras: int = 256
    max_lora_rank: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096
    max_model_len: int = 1024
    kv_cache_mb: int = 8192
    max_queue_size: int = 4096
    lookahead: int = 16
    prefetch: int = 0
    poll_interval_s: float = 0.5
    cuda_graphs: bool = True
    extra: list[str] = field(default_factory=list)
    code_tree: str = ""  # another checkout of this repository to run the worker from ("": this one)


# the folders setup.py maps under the `loraserve` namespace (besides `loraserve` itself)
PACKAGE_FOLDERS = ("adapter_store", "inference_worker", "kernels", "clients", "gateway")


def tree_shim(tree: Path, dest: Path) -> Path:
    """A folder that, first on PYTHONPATH of a process started outside any checkout, makes
    `loraserve` import from the checkout `tree`: the package laid out as setup.py installs it, by
    links (`dest`/loraserve). The worker's own processes (front, fetch process) inherit it."""
    tree = tree.resolve()
    if not (tree / "loraserve" / "__init__.py").is_file():
        raise SystemExit(f"{tree} is not a checkout of this repository (no loraserve/__init__.py)")
    package = dest / "loraserve"
    if package.exists():
        shutil.rmtree(package)
    package.mkdir(parents=True)
    for entry in (tree / "loraserve").iterdir():
        (package / entry.name).symlink_to(entry)
    for folder in PACKAGE_FOLDERS:
        (package / folder).symlink_to(tree / folder)
    return dest


def _spawn(
    name: str, args: Sequence[str], log: Path, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.Popen:
    out = open(log, "wb")
    return subprocess.Popen(
        list(args),
        stdout=out,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        cwd=cwd,
    )


def _wait_ready(service: Service, probe, timeout: float) -> None:
    end = time.monotonic() + timeout
    service.await_listening(timeout)
    while True:
        service.check_alive()
        try:
            probe()
            return
        except Exception:
            if time.monotonic() > end:
                raise TimeoutError(
                    f"{service.name} not ready after {timeout:.0f} s (log {service.log})"
                ) from None
            time.sleep(0.5)


class Fleet:
    """The processes of one benchmark; `close` stops them all."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.services: list[Service] = []

    def start_store(
        self,
        model_dir: Path,
        adapter_root: Path,
        *,
        cache_adapters: int,
        dtype: str,
        handover_dir: str = "",
        handover_max_bytes: int = 4 << 30,
    ) -> Service:
        data = self.workdir / "store-data"
        args = [sys.executable, "-m", "loraserve.cli", "store", "--base-model", str(model_dir)]
        args += ["--adapter-root", str(adapter_root), "--data-dir", str(data), "--port", "0"]
        args += [
            "--cache-max-adapters",
            str(cache_adapters),
            "--serving-dtype",
            dtype,
            "--max-lora-rank",
            "16",
        ]
        args += [
            "--max-pending-registrations",
            "64",
            "--log-level",
            "WARNING",
            "--metrics-port",
            "0",
        ]
        if handover_dir:
            args += ["--handover-dir", handover_dir, "--handover-max-bytes", str(handover_max_bytes)]
        svc = Service(
            "store", "", _spawn("store", args, self.workdir / "store.log"), self.workdir / "store.log"
        )
        self.services.append(svc)
        from loraserve.clients.store_client import StoreClient

        def probe() -> None:
            with StoreClient(svc.address, timeout=2) as c:
                c.list_page(page_size=1)

        _wait_ready(svc, probe, 120)
        return svc

    def start_worker(
        self,
        name: str,
        model_dir: Path,
        store: str,
        opts: WorkerOptions,
        *,
        redis_url: str = "",
        wait: bool = True,
    ) -> Service:
        o = asdict(opts)
        args = [
            sys.executable,
            "-m",
            "loraserve.cli",
            "worker",
            "--model",
            str(Path(model_dir).resolve()),  # (a worker from another checkout runs elsewhere)
            "--port",
            "0",
        ]
        args += ["--store-address", store, "--metrics-port", "0", "--worker-id", name]
        for key in (
            "device", "dtype", "max_loras", "max_cpu_loras", "max_lora_rank", "max_num_seqs",
            "max_num_batched_tokens", "max_model_len", "kv_cache_mb", "max_queue_size",
        ):  # fmt: skip
            args += ["--" + key.replace("_", "-"), str(o[key])]
        args += ["--adapter-lookahead", str(opts.lookahead), "--adapter-prefetch", str(opts.prefetch)]
        args += ["--adapter-poll-interval-s", str(opts.poll_interval_s), "--log-level", "WARNING"]
        args += ["--cuda-graphs" if opts.cuda_graphs else "--no-cuda-graphs", *opts.extra]
        if redis_url:
            args += ["--redis-url", redis_url]
        log = self.workdir / f"{name}.log"
        env, cwd = None, None
        if opts.code_tree:  # started outside this checkout, so its folders do not come first
            # absolute: the worker resolves its path from its own working directory
            shim = tree_shim(Path(opts.code_tree), self.workdir / f"code-{name}").resolve()
            env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(shim), os.environ.get("PYTHONPATH", "")]))}
            cwd = self.workdir.resolve()
        svc = Service(name, "", _spawn(name, args, log, env, cwd), log)  # its address: once it listens
        self.services.append(svc)
        if wait:
            self.wait_worker(svc)
        return svc

    def wait_worker(self, svc: Service, timeout: float = 300) -> None:
        from loraserve.clients.worker_client import WorkerClient

        def probe() -> None:
            with WorkerClient(svc.address, timeout=2) as c:
                c.info()

        _wait_ready(svc, probe, timeout)

    def start_redis(self, binary: str) -> tuple[Service, str]:
        port = free_port()
        args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        log = self.workdir / "redis.log"
        svc = Service("redis", f"127.0.0.1:{port}", _spawn("redis", args, log), log)
        self.services.append(svc)
        import redis

        url = f"redis://127.0.0.1:{port}/0"
        _wait_ready(svc, lambda: redis.Redis.from_url(url, socket_timeout=1).ping(), 30)
        return svc, url

    def stop(self, svc: Service) -> None:
        svc.stop()
        self.services.remove(svc)

    def close(self) -> None:
        for svc in reversed(self.services):
            svc.stop()
        self.services.clear()


def register_all(store: str, adapter_root: Path, names: Sequence[str], threads: int = 16) -> None:
    from loraserve.clients.store_client import StoreClient

    def one(name: str) -> None:
        with StoreClient(store, timeout=600) as c:
            try:
                c.get(name)
            except Exception:
                c.register(name, str(adapter_root / name))

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, names))
