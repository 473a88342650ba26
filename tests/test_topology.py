"""The compose topology as local processes: Redis (real server), S3 (moto's standalone server in
MinIO's place), one store and two workers started through the `loraserve` CLI, adapters registered
from S3 with `loraserve register`, requests routed across the workers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from loraserve.adapter_store.demo import DEMO_ADAPTERS, write_demo_adapters
from loraserve.clients.router import WorkerRouter, discover_workers
from loraserve.clients.store_client import StoreClient
from loraserve.clients.worker_client import WorkerClient
from tests.helpers.ports import await_listening

pytestmark = [pytest.mark.slow, pytest.mark.redis, pytest.mark.s3]
AWS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
PROMPT = [3, 14, 15, 92, 65]


def _wait_serving(address: str, proc: subprocess.Popen, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"process for {address} exited with {proc.returncode}")
            try:
                if (
                    stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                    == health_pb2.HealthCheckResponse.SERVING
                ):
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise TimeoutError(f"{address} not serving after {timeout}s")


def _cli(*args: str, env: dict[str, str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "loraserve.cli", *args],
        env=env,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )


@pytest.fixture(scope="module")
def topology(
    tiny_model_dir: Path, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict]:
    import boto3
    import redis
    from moto.server import ThreadedMotoServer

    tmp = tmp_path_factory.mktemp("topology")
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    moto.start()
    endpoint = "http://{}:{}".format(*moto.get_host_and_port())
    s3 = boto3.client(
        "s3",
        endpoint_url=endpoint,
        **{k.lower(): v for k, v in AWS.items() if k != "AWS_DEFAULT_REGION"},
        region_name="us-east-1",
    )
    s3.create_bucket(Bucket="adapters")
    for name, directory in write_demo_adapters(tmp / "demo", tiny_model_dir).items():
        for f in ("adapter_config.json", "adapter_model.safetensors"):
            s3.upload_file(str(directory / f), "adapters", f"{name}/{f}")

    prefix = f"loraserve-test-{uuid.uuid4().hex[:8]}:"
    env = {
        **os.environ,
        **AWS,
        "LORASERVE_REDIS_URL": redis_url,
        "LORASERVE_REDIS_PREFIX": prefix,
        "LORASERVE_LOG_LEVEL": "WARNING",
        "PYTHONUNBUFFERED": "1",
    }
    # every service binds port 0 and the test reads the address from its "listening on" line
    procs: list[subprocess.Popen] = []
    procs.append(
        _cli(
            "store",
            "--port",
            "0",
            "--base-model",
            str(tiny_model_dir),
            "--data-dir",
            str(tmp / "store"),
            "--serving-dtype",
            "float32",
            "--s3-endpoint-url",
            endpoint,
            env=env,
            log=tmp / "store.log",
        )
    )
    try:
        store_addr = await_listening(tmp / "store.log", procs[0])
        for i in range(2):
            procs.append(
                _cli(
                    "worker",
                    "--model",
                    str(tiny_model_dir),
                    "--port",
                    "0",
                    "--device",
                    "cpu",
                    "--dtype",
                    "float32",
                    "--store-address",
                    store_addr,
                    "--worker-id",
                    f"w{i}",
                    "--max-loras",
                    "2",
                    "--max-cpu-loras",
                    "3",
                    "--num-kv-blocks",
                    "128",
                    "--max-num-seqs",
                    "8",
                    env=env,
                    log=tmp / f"worker{i}.log",
                )
            )
        workers = [await_listening(tmp / f"worker{i}.log", proc) for i, proc in enumerate(procs[1:])]
        _wait_serving(store_addr, procs[0])
        for addr, proc in zip(workers, procs[1:], strict=True):
            _wait_serving(addr, proc)
        yield {
            "store": store_addr,
            "workers": workers,
            "procs": procs,
            "env": env,
            "prefix": prefix,
            "redis": redis.Redis.from_url(redis_url),
            "logs": tmp,
        }
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        moto.stop()
        r = redis.Redis.from_url(redis_url)
        keys = list(r.scan_iter(match=prefix + "*"))
        if keys:
            r.delete(*keys)


def test_register_from_s3_with_the_cli(topology: dict) -> None:
    for spec in DEMO_ADAPTERS:
        res = subprocess.run(
            [
                sys.executable,
                "-m",
                "loraserve.cli",
                "register",
                spec.name,
                f"s3://adapters/{spec.name}",
                "--store",
                topology["store"],
            ],
            env=topology["env"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert res.returncode == 0, res.stdout + res.stderr
        assert spec.name in res.stdout
    with StoreClient(topology["store"]) as c:
        assert {a.adapter_id for a in c.list()} >= {s.name for s in DEMO_ADAPTERS}


def test_workers_agree_and_share_state_in_redis(topology: dict) -> None:
    name = DEMO_ADAPTERS[1].name
    outs = []
    for addr in topology["workers"]:
        with WorkerClient(addr, timeout=120) as w:
            outs.append(w.generate(PROMPT, adapter_id=name, max_tokens=8))
    assert outs[0].token_ids == outs[1].token_ids and outs[0].adapter_digest == outs[1].adapter_digest
    with WorkerClient(topology["workers"][0], timeout=60) as w:
        base = w.generate(PROMPT, max_tokens=8)
    assert base.token_ids != outs[0].token_ids  # the adapter changes the function
    r, prefix = topology["redis"], topology["prefix"]
    assert {m.decode() for m in r.smembers(prefix + "workers")} >= {"w0", "w1"}
    # residency is published by each worker's coordinator sync thread, a poll interval after the load
    deadline = time.monotonic() + 15
    while not all(name.encode() in r.hkeys(prefix + f"residency:w{i}") for i in range(2)):
        assert time.monotonic() < deadline, {i: r.hkeys(prefix + f"residency:w{i}") for i in range(2)}
        time.sleep(0.2)


def test_router_spreads_and_serves(topology: dict, redis_url: str) -> None:
    assert sorted(discover_workers(redis_url, topology["prefix"])) == sorted(topology["workers"])
    with WorkerRouter(discover_workers(redis_url, topology["prefix"]), refresh_s=0.0, timeout=120) as router:
        for spec in DEMO_ADAPTERS:
            out = router.generate(PROMPT, adapter_id=spec.name, max_tokens=4)
            assert out.adapter_id == spec.name and len(out.token_ids) > 0


def test_generate_cli_routes_across_the_fleet(topology: dict, redis_url: str, capsys) -> None:
    from loraserve.clients.worker_cli import generate_main

    name = DEMO_ADAPTERS[0].name
    with WorkerClient(topology["workers"][0], timeout=60) as w:
        expected = w.generate("Hello world", adapter_id=name, max_tokens=6).text
    assert (
        generate_main(
            [
                "--redis-url",
                redis_url,
                "--redis-prefix",
                topology["prefix"],
                "--adapter",
                name,
                "--max-tokens",
                "6",
                "Hello world",
            ]
        )
        == 0
    )
    assert capsys.readouterr().out == expected + "\n"
    assert (
        generate_main(
            ["--worker", ",".join(topology["workers"]), "--adapter", name, "--max-tokens", "6", "Hello world"]
        )
        == 0
    )
    assert capsys.readouterr().out == expected + "\n"
    assert generate_main(["--redis-url", redis_url, "--redis-prefix", "no-such-fleet:", "hi"]) == 1
    assert "no live worker" in capsys.readouterr().err


def test_store_down_workers_keep_serving_cached(topology: dict) -> None:
    store = topology["procs"][0]
    name = DEMO_ADAPTERS[1].name  # cached on both workers by an earlier test
    store.send_signal(signal.SIGTERM)
    store.wait(timeout=60)
    assert store.returncode == 0
    with WorkerClient(topology["workers"][0], timeout=60) as w:
        assert w.generate(PROMPT, adapter_id=name, max_tokens=4).token_ids
        with pytest.raises(grpc.RpcError) as err:
            w.generate(PROMPT, adapter_id="never-registered", max_tokens=4)
    assert err.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND)
