"""The one-row norm + projection kernel (model/skinny_norm.py) against a float64 oracle: the Triton
kernel through the interpreter on CPU (float32 and float16), in a subprocess of its own; the
plain-torch twin on CPU; argument checks; on CUDA bf16 at the Llama-3.2-1B / Llama-3-8B shapes, in
a CUDA graph, and the decoder layer's one-row step with and without the fusion."""

from __future__ import annotations

import contextlib

import pytest
import torch

from loraserve.inference_worker.model.skinny_gemm import SkinnyConfig
from loraserve.inference_worker.model.skinny_norm import norm_linear, norm_linear_reference
from tests.helpers.interpreter import interpreted_value

CASE = r"""
import torch
from loraserve.inference_worker.model.skinny_gemm import SkinnyConfig
from loraserve.inference_worker.model.skinny_norm import norm_linear

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
EPS = 1e-5

def oracle(x, res, nw, w, b, pair):
    r = x.double() + (res.double() if res is not None else 0)
    h = nw.double() * r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + EPS)
    y = h @ w.double().T + (b.double() if b is not None else 0)
    if pair:
        g, u = y.chunk(2, dim=-1)
        y = torch.nn.functional.silu(g) * u
    return y, r

def check(device, dtype, n, k, res, bias, pair, config, name, failures):
    g = torch.Generator().manual_seed(n * 31 + k)
    x = torch.randn(1, k, generator=g).to(device, dtype)
    rs = torch.randn(1, k, generator=g).to(device, dtype) if res else None
    nw = (1 + 0.1 * torch.randn(k, generator=g)).to(device, dtype)
    w = (torch.randn(n, k, generator=g) * k ** -0.5).to(device, dtype)
    b = torch.randn(n, generator=g).to(device, dtype) if bias else None
    y, ro = norm_linear(x, rs, nw, EPS, w, b, pair=pair, config=config)
    again, _ = norm_linear(x, rs, nw, EPS, w, b, pair=pair, config=config)
    try:
        want, r = oracle(x, rs, nw, w, b, pair)
        assert y.dtype == dtype and y.shape == (1, n // 2 if pair else n), (y.dtype, y.shape)
        tol = TOL[dtype]
        torch.testing.assert_close(y.double(), want, rtol=tol, atol=tol)
        torch.testing.assert_close(ro.double(), r, rtol=tol, atol=tol)
        if not res:
            assert ro is x, "without a residual the stream is x itself"
        assert torch.equal(y, again), "two launches differ"
    except AssertionError as e:
        failures.append(f"{name}: {e}")

def rope_check(device, dtype, nh, nkv, d, k, res, bias, config, name, failures):
    from loraserve.inference_worker.model.skinny_norm_rope import norm_qkv_rope
    g = torch.Generator().manual_seed(nh * 7 + d + k)
    n = (nh + 2 * nkv) * d
    x = torch.randn(1, k, generator=g).to(device, dtype)
    rs = torch.randn(1, k, generator=g).to(device, dtype) if res else None
    nw = (1 + 0.1 * torch.randn(k, generator=g)).to(device, dtype)
    w = (torch.randn(n, k, generator=g) * k ** -0.5).to(device, dtype)
    b = torch.randn(n, generator=g).to(device, dtype) if bias else None
    angles = torch.rand(d // 2, generator=g) * 6.0
    cs = torch.cat([angles.cos(), angles.sin()])[None, :].to(device)
    slot = torch.tensor([5], device=device)
    kc = torch.zeros(2, 4, nkv, d, dtype=dtype, device=device)
    vc = torch.zeros_like(kc)
    q, kk, v, ro = norm_qkv_rope(x, rs, nw, EPS, w, b, cs, slot, kc, vc, nh, nkv, d, config=config)
    try:
        y, r = oracle(x, rs, nw, w, b, False)
        half = d // 2
        cos, sin = cs.double()[:, None, :half], cs.double()[:, None, half:]
        def rot(t):
            return torch.cat([t[..., :half] * cos - t[..., half:] * sin, t[..., half:] * cos + t[..., :half] * sin], -1)
        want_q = rot(y[:, : nh * d].view(1, nh, d))
        want_k = rot(y[:, nh * d : (nh + nkv) * d].view(1, nkv, d))
        want_v = y[:, (nh + nkv) * d :].view(1, nkv, d)
        tol = TOL[dtype]
        for got, want in ((q, want_q), (kk, want_k), (v, want_v), (ro, r)):
            torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
        assert torch.equal(kc[1, 1], kk[0]) and torch.equal(vc[1, 1], v[0]), "cache slot 5"
        assert not kc[0].any() and not kc[1, [0, 2, 3]].any(), "only slot 5 written"
    except AssertionError as e:
        failures.append(f"rope {name}: {e}")

def interpreter_cases():
    failures = []
    for dtype in (torch.float32, torch.float16):
        for res in (False, True):
            for pair in (False, True):
                for bias in ((False,) if pair else (False, True)):
                    # 40 rows (20 a half) x 80: neither a multiple of the 16 x 32 tiles
                    config = SkinnyConfig(16, 32, 1, num_warps=2, use_dot=False)
                    name = f"{dtype} res={res} bias={bias} pair={pair}"
                    check("cpu", dtype, 40, 80, res, bias, pair, config, name, failures)
        check("cpu", dtype, 48, 64, True, False, True, SkinnyConfig(8, 16, 1, use_dot=False), f"{dtype} even", failures)
        check("cpu", dtype, 24, 96, True, True, False, None, f"{dtype} default", failures)
        # a row past what one load holds at one warp (2,048 elements): the mean square in a loop
        loop = SkinnyConfig(8, 512, 1, num_warps=1, use_dot=False)
        check("cpu", dtype, 16, 2100, True, False, True, loop, f"{dtype} loop", failures)
        # q|k|v with RoPE: 3 q heads, 1 kv head of 16; 4 pairs a program, and the default (8)
        for res, bias in ((True, True), (False, False)):
            rope = SkinnyConfig(4, 32, 1, num_warps=2, use_dot=False)
            rope_check("cpu", dtype, 3, 1, 16, 80, res, bias, rope, f"{dtype} res={res} bias={bias}", failures)
        rope_check("cpu", dtype, 2, 2, 8, 48, True, False, None, f"{dtype} default", failures)
    return failures
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA test covers the kernel")
def test_kernel_in_triton_interpreter() -> None:
    pytest.importorskip("triton")
    assert interpreted_value(CASE, "interpreter_cases()") == []


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("pair", [False, True])
def test_reference_twin_matches_float64_and_the_model_twins(dtype, pair) -> None:
    """The twin against the oracle, and equal to what the model's separate steps compute on CPU
    (RMSNorm.forward, the projection in float32 rounded once, silu(gate) * up)."""
    from loraserve.inference_worker.model.llama import RMSNorm

    ns: dict = {}
    exec(CASE, ns)
    g = torch.Generator().manual_seed(2)
    x, res = (torch.randn(1, 96, generator=g).to(dtype) for _ in range(2))
    w = (torch.randn(64, 96, generator=g) * 0.1).to(dtype)
    norm = RMSNorm(96, 1e-5, dtype, "cpu")
    norm.weight.copy_(1 + 0.1 * torch.randn(96, generator=g))
    y, r = norm_linear_reference(x, res, norm.weight, 1e-5, w, pair=pair)
    want, want_r = ns["oracle"](x, res, norm.weight, w, None, pair)
    tol = {torch.bfloat16: 2e-2, torch.float16: 2e-3, torch.float32: 1e-5}[dtype]
    torch.testing.assert_close(y.double(), want, rtol=tol, atol=tol)
    h, stream = norm(x, res)
    assert torch.equal(r, stream)
    proj = (h.float() @ w.float().T).to(dtype)
    if pair:
        gate, up = proj.chunk(2, dim=-1)
        proj = (gate.float() / (1 + torch.exp(-gate.float()))).to(dtype) * up
    assert torch.equal(y, proj)


@pytest.mark.parametrize("fn", [norm_linear, norm_linear_reference])
def test_bad_arguments_raise_before_launch(fn) -> None:
    bf = torch.bfloat16
    x, nw, w = torch.zeros(1, 32, dtype=bf), torch.ones(32, dtype=bf), torch.zeros(8, 32, dtype=bf)
    with pytest.raises(ValueError, match="one row"):
        fn(torch.zeros(2, 32, dtype=bf), None, nw, 1e-5, w)
    with pytest.raises(ValueError, match="K=31"):
        fn(x[:, :31], None, nw, 1e-5, w)
    with pytest.raises(ValueError, match="norm weight"):
        fn(x, None, nw[:16], 1e-5, w)
    with pytest.raises(ValueError, match="residual"):
        fn(x, torch.zeros(1, 16, dtype=bf), nw, 1e-5, w)
    with pytest.raises(ValueError, match="share one of"):
        fn(x, x.half(), nw, 1e-5, w)
    with pytest.raises(ValueError, match="pair"):
        fn(x, None, nw, 1e-5, w[:7], pair=True)
    with pytest.raises(ValueError, match="pair"):
        fn(x, None, nw, 1e-5, w, torch.zeros(8, dtype=bf), pair=True)
    with pytest.raises(ValueError, match="bias"):
        fn(x, None, nw, 1e-5, w, torch.zeros(9, dtype=bf))
    with pytest.raises(ValueError, match="one column"):
        fn(x[:, :0], None, nw[:0], 1e-5, w[:, :0])


# (N, K, pair) of the fused projections: q|k|v and gate | up
SHAPES = {
    "1b": [(3072, 2048, False), (16384, 2048, True)],
    "8b": [(6144, 4096, False), (28672, 4096, True)],
}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("model", list(SHAPES))
def test_kernel_on_cuda(model) -> None:
    ns: dict = {}
    exec(CASE, ns)
    failures: list[str] = []
    for n, k, pair in SHAPES[model]:
        for res in (False, True):
            for config in (None, SkinnyConfig(16, 256, 1, num_warps=4, use_dot=False)):
                name = f"{n}x{k} res={res} pair={pair} {config}"
                ns["check"]("cuda", torch.bfloat16, n, k, res, not pair and res, pair, config, name, failures)
    for dtype in (torch.float16, torch.float32):
        ns["check"]("cuda", dtype, 2048, 2048, True, False, True, None, f"{dtype}", failures)
    assert failures == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernel_in_cuda_graph() -> None:
    """Captured once, replayed on new inputs: the graph's outputs are a fresh launch's."""
    dev, dtype, (n, k, _) = torch.device("cuda"), torch.bfloat16, SHAPES["8b"][1]
    g = torch.Generator(device=dev).manual_seed(0)
    w = (torch.randn(n, k, device=dev, generator=g) * k**-0.5).to(dtype)
    nw = torch.ones(k, device=dev, dtype=dtype)
    x, res = (torch.randn(1, k, device=dev, generator=g).to(dtype) for _ in range(2))
    norm_linear(x, res, nw, 1e-5, w, pair=True)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y, ro = norm_linear(x, res, nw, 1e-5, w, pair=True)
    for _ in range(2):
        x.copy_(torch.randn(1, k, device=dev, generator=g))
        res.copy_(torch.randn(1, k, device=dev, generator=g))
        graph.replay()
        torch.cuda.synchronize()
        want, want_r = norm_linear(x, res, nw, 1e-5, w, pair=True)
        assert torch.equal(y, want) and torch.equal(ro, want_r)


def _one_row_step(model, position: int) -> torch.Tensor:
    """model's hidden states for one decode row at `position` (its cache: block 1 onwards)."""
    from loraserve.inference_worker.model.forward_batch import ForwardBatch

    dev = model.device
    ints = lambda *v, dtype=torch.int64: torch.tensor(v, dtype=dtype, device=dev)  # noqa: E731
    batch = ForwardBatch(
        input_ids=ints(position % model.config.vocab_size),
        positions=ints(position),
        slot_mapping=ints(16 + position),
        block_tables=torch.arange(1, 5, dtype=torch.int32, device=dev)[None, :],
        context_lens=ints(position + 1, dtype=torch.int32),
        logits_indices=ints(0),
        token_slots=ints(-1, dtype=torch.int32),
        num_decodes=1,
        query_start=[0, 1],
        context_lens_cpu=[position + 1],
    )
    return model(batch)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("qkv_bias", [False, True])
def test_model_one_row_steps_with_and_without_the_fusion(monkeypatch, qkv_bias) -> None:
    """A model's one-row decode steps with the norms folded in (and RoPE + the cache write into the
    q|k|v kernel) give the hidden states of the same steps with them apart, the KV cache written
    alike; the fused kernels run twice a layer (q|k|v and gate | up) only with the fusion on."""
    from loraserve.inference_worker.model import linear, skinny_norm, skinny_norm_rope
    from loraserve.inference_worker.model.config import ModelConfig
    from loraserve.inference_worker.model.llama import LlamaModel

    cfg = ModelConfig.from_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": 512,
            "hidden_size": 256,
            "intermediate_size": 704,
            "num_hidden_layers": 3,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 256,
            "rms_norm_eps": 1e-5,
            "attention_bias": qkv_bias,
        }
    )
    assert cfg.qkv_bias == qkv_bias
    calls: list[int] = []
    for module, name in ((skinny_norm, "norm_linear"), (skinny_norm_rope, "norm_qkv_rope")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _real=real, **k: calls.append(1) or _real(*a, **k))
    outs = []
    for fuse in (True, False):
        model = LlamaModel(cfg, torch.bfloat16, "cuda")
        model.init_random(seed=3)
        g = torch.Generator(device="cuda").manual_seed(4)
        for layer in model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight.normal_(1.0, 0.1, generator=g)
            if layer.self_attn.qkv.bias is not None:
                layer.self_attn.qkv.bias.normal_(0.0, 0.1, generator=g)
            layer.self_attn.k_cache = torch.zeros(8, 16, 2, 64, dtype=torch.bfloat16, device="cuda")
            layer.self_attn.v_cache = torch.zeros_like(layer.self_attn.k_cache)
        with contextlib.nullcontext() if fuse else linear.norm_fusion_off():
            outs.append(
                (
                    torch.cat([_one_row_step(model, p) for p in range(20)]),
                    model.layers[-1].self_attn.k_cache.clone(),
                )
            )
        assert len(calls) == 2 * cfg.num_layers * 20
    (fused, k_fused), (apart, k_apart) = outs
    torch.testing.assert_close(fused, apart, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(k_fused, k_apart, atol=3e-2, rtol=3e-2)
    assert k_fused[1:3].abs().sum() > 0, "the steps wrote the cache"


def test_rope_twin_matches_the_model_steps() -> None:
    """norm_qkv_rope's twin is the model's CPU steps bit for bit: the norm + projection twin, then
    apply_rope and write_kv."""
    from loraserve.inference_worker.model.attention import write_kv
    from loraserve.inference_worker.model.rope import apply_rope
    from loraserve.inference_worker.model.skinny_norm_rope import norm_qkv_rope_reference

    bf, (nh, nkv, d, k) = torch.bfloat16, (4, 2, 16, 64)
    g = torch.Generator().manual_seed(5)
    x, res = (torch.randn(1, k, generator=g).to(bf) for _ in range(2))
    nw = (1 + 0.1 * torch.randn(k, generator=g)).to(bf)
    w = (torch.randn((nh + 2 * nkv) * d, k, generator=g) * 0.1).to(bf)
    cs = torch.randn(1, d, generator=g)
    slot = torch.tensor([3])
    caches = [torch.zeros(2, 4, nkv, d, dtype=bf) for _ in range(4)]
    q, kk, v, r = norm_qkv_rope_reference(
        x, res, nw, 1e-5, w, None, cs, slot, caches[0], caches[1], nh, nkv, d
    )
    y, stream = norm_linear_reference(x, res, nw, 1e-5, w)
    want_q = apply_rope(y[:, : nh * d].view(1, nh, d), cs)
    want_k = apply_rope(y[:, nh * d : (nh + nkv) * d].view(1, nkv, d), cs)
    write_kv(caches[2], caches[3], want_k, y[:, (nh + nkv) * d :].view(1, nkv, d), slot)
    assert torch.equal(q, want_q) and torch.equal(kk, want_k) and torch.equal(r, stream)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


@pytest.mark.parametrize("twin", [False, True])
def test_rope_bad_arguments_raise_before_launch(twin) -> None:
    from loraserve.inference_worker.model import skinny_norm_rope

    fn = skinny_norm_rope.norm_qkv_rope_reference if twin else skinny_norm_rope.norm_qkv_rope
    bf = torch.bfloat16
    x, nw, w = torch.zeros(1, 32, dtype=bf), torch.ones(32, dtype=bf), torch.zeros(4 * 8, 32, dtype=bf)
    cs, slot, cache = torch.zeros(1, 8), torch.zeros(1, dtype=torch.int64), torch.zeros(2, 4, 1, 8, dtype=bf)
    good = (x, None, nw, 1e-5, w, None, cs, slot, cache, cache.clone(), 2, 1, 8)
    for at, bad, match in (
        (4, w[:24], "rows"),
        (6, cs.double(), "cos_sin"),
        (7, slot.int(), "slot_mapping"),
        (8, torch.zeros(2, 4, 2, 8, dtype=bf), "caches"),
        (9, cache.half(), "caches"),
        (12, 7, "head_dim even"),
    ):
        args = list(good)
        args[at] = bad
        with pytest.raises(ValueError, match=match):
            fn(*args)
