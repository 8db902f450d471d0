"""bench/device.py's kernel figures: the fused MoE (float and GGUF blocks) and the quantized decode products,
each against its reference, with the tile or block shapes worth choosing between on a device."""

import time

import torch

from backend.kernels.quant_gemv_triton import GemvConfig

# (BLOCK_M, BLOCK_N, BLOCK_K) of the float grouped GEMM tried at 4,096 tokens.
TILE_CANDIDATES = ((64, 64, 64), (64, 128, 64), (128, 64, 64), (128, 128, 64), (64, 128, 32), (128, 128, 32))

# Launch shapes of the block-wise GEMV tried on Mixtral's gate (Q4_K, 14,336 rows) and down (Q6_K, 4,096 rows).
GEMV_CANDIDATES = [GemvConfig(n, w, s) for n in (8, 16, 32, 64) for s in (1, 4) for w in (2, 4, 8)]


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()



def moe_kernels(device: str, dtype: torch.dtype, smoke: bool, shape: dict) -> list[dict]:
    """The fused MoE kernel against the torch reference and transformers' Mixtral block, at 1, 64 and 4,096 tokens;
    at 4,096 also each candidate tile shape of the grouped GEMM."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    from backend.kernels import moe_torch as ref
    from backend.kernels import moe_triton

    h, i, e, k = shape["hidden_size"], shape["intermediate_size"], shape["num_local_experts"], 2
    config = MixtralConfig(hidden_size=h, intermediate_size=i, num_local_experts=e, num_experts_per_tok=k)
    block = MixtralSparseMoeBlock(config).to(device=device, dtype=dtype).eval()
    w_gate_up = torch.randn(e, 2 * i, h, device=device, dtype=dtype) * 0.02
    w_down = torch.randn(e, h, i, device=device, dtype=dtype) * 0.02
    with torch.no_grad():  # the same weights in transformers' layout (fused gate_up and down per expert)
        for param in block.parameters():  # a standalone block is left uninitialised (its router too)
            param.normal_(0.0, 0.02)
        block.experts.gate_up_proj.copy_(w_gate_up)
        block.experts.down_proj.copy_(w_down)
    rows = []
    fused = moe_triton.fused_moe if device == "cuda" or smoke else ref.fused_moe

    def routed(experts):  # the router included, as transformers' block includes it
        def layer(x):
            weights, ids = ref.route(torch.nn.functional.linear(x, block.gate.weight), k, True)
            return experts(x, w_gate_up, w_down, weights.to(dtype), ids)
        return layer

    for tokens in ((1, 16) if smoke else (1, 64, 4096)):
        x = torch.randn(tokens, h, device=device, dtype=dtype)
        ours = _timed(device, smoke, routed(fused), x)
        reference = _timed(device, smoke, routed(_torch_moe), x)
        hf = _timed(device, smoke, block, x.unsqueeze(0))
        with torch.no_grad():  # the same numbers as transformers' block, or the speed means nothing
            expected = block(x.unsqueeze(0))
            expected = (expected[0] if isinstance(expected, tuple) else expected).squeeze(0).float()
            error = (routed(fused)(x).float() - expected).abs().max().item() / expected.abs().max().item()
        rows.append({"figure": "fused_moe", "tokens": tokens, "ms": round(ours * 1e3, 3),
                     "torch_reference_ms": round(reference * 1e3, 3), "transformers_ms": round(hf * 1e3, 3),
                     "vs_transformers": round(hf / ours, 2), "vs_reference": round(reference / ours, 2),
                     "relative_error_vs_transformers": float(f"{error:.3g}")})
        if tokens >= 4096 and fused is moe_triton.fused_moe:
            tiles = {str(t): round(_timed(device, smoke, routed(
                lambda *a, t=t: moe_triton.fused_moe(*a, tiles=t)), x) * 1e3, 3) for t in TILE_CANDIDATES}
            rows.append({"figure": "fused_moe_tiles", "tokens": tokens, "ms_by_tiles": tiles})
    return rows


def _timed(device: str, smoke: bool, fn, *args) -> float:
    repeats = 5 if smoke else 20
    with torch.no_grad():
        fn(*args)
        sync(device)
        start = time.perf_counter()
        for _ in range(repeats):
            fn(*args)
        sync(device)
    return (time.perf_counter() - start) / repeats


def _torch_moe(x, w_gate_up, w_down, weights, ids):
    """The torch reference's loop, forced (on CUDA the public function dispatches to Triton)."""
    import torch.nn.functional as F

    out = torch.zeros_like(x)
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w_gate_up.shape[0]).tolist()
    w = weights.flatten()
    start = 0
    for expert, count in enumerate(counts):
        if count:
            pairs = order[start:start + count]
            start += count
            tokens = pairs // ids.shape[1]
            gate, up = F.linear(x[tokens], w_gate_up[expert]).chunk(2, dim=-1)
            out.index_add_(0, tokens, F.linear(F.silu(gate) * up, w_down[expert]) * w[pairs, None])
    return out


def quant_gemv(device: str, dtype: torch.dtype, smoke: bool, shape: dict) -> list[dict]:
    """Batch-1 products over Mixtral-shaped Q4_K (gate) and Q6_K (down) blocks: GB/s of weights read by the
    block-wise kernel at each BLOCK_N and by the per-weight kernel; then the quantized MoE layer's decode step (one
    token, top 2 of 8 Q4_K_M experts) block-wise and through the grouped GEMM."""
    from backend.kernels import quant_gemv_triton as qgt
    from backend.kernels import quant_moe_triton
    from backend.quant.formats import BY_NAME, row_bytes

    h, inter, e = shape["hidden_size"], shape["intermediate_size"], shape["num_local_experts"]
    gen = torch.Generator(device=device).manual_seed(0)

    def blocks(name, rows, cols, lead=()):
        raw = torch.randint(0, 256, (*lead, rows, row_bytes(BY_NAME[name], cols)), dtype=torch.uint8, device=device,
                            generator=gen)
        return raw, BY_NAME[name].ggml_type, row_bytes(BY_NAME[name], cols)

    rows = []
    for name, n, k in (("Q4_K", inter, h), ("Q6_K", h, inter)):
        raw, fmt, rb = blocks(name, n, k)
        xk = torch.randn(1, k, device=device, dtype=dtype)
        gb = raw.numel() / 1e9
        figures = {}
        for cfg in GEMV_CANDIDATES[:1] if smoke else GEMV_CANDIDATES:
            try:  # a shape that fails to compile is a figure too
                figure = _3g(gb / _timed(device, smoke, qgt.gemv, xk, raw, fmt, n, k, rb, cfg))
            except Exception as e:
                figure = f"{type(e).__name__}: {e}"[:200]
            figures[f"n{cfg.block_n}_w{cfg.warps}_s{cfg.splits}"] = figure
        figures["default"] = _3g(gb / _timed(device, smoke, qgt.gemv, xk, raw, fmt, n, k, rb))
        figures["per_weight"] = _3g(gb / _timed(device, smoke, _per_weight_gemv, xk, raw, fmt, n, k, rb))
        rows.append({"figure": "quant_gemv", "format": name, "rows": n, "cols": k, "gb_s": figures})
        for m in ((8,) if smoke else (8, 32)):  # a decode batch: block-wise tiles vs the per-weight tiled GEMM
            xm = torch.randn(m, k, device=device, dtype=dtype)
            block_wise = _timed(device, smoke, qgt.gemm, xm, raw, fmt, n, k, rb)
            per_weight = _timed(device, smoke, _per_weight_gemm, xm, raw, fmt, n, k, rb)
            rows.append({"figure": "quant_gemm", "format": name, "rows_of_x": m, "block_wise_ms": _3g(block_wise * 1e3),
                         "per_weight_ms": _3g(per_weight * 1e3)})
    # The same product on bf16 weights: the block-wise kernel's reading alone (no decoding) against torch's GEMV.
    wf = torch.randn(inter, h, device=device, dtype=dtype, generator=gen)
    xk = torch.randn(1, h, device=device, dtype=dtype)
    gb = wf.numel() * wf.element_size() / 1e9
    rows.append({"figure": "float_gemv", "dtype": str(dtype).removeprefix("torch."), "rows": inter, "cols": h,
                 "gb_s": {"block_wise": _3g(gb / _timed(device, smoke, qgt.gemv, xk, wf, 0, inter, h, h)),
                          "torch": _3g(gb / _timed(device, smoke, torch.matmul, xk, wf.T))}})
    stacks = [blocks("Q4_K", inter, h, (e,)), blocks("Q4_K", inter, h, (e,)), blocks("Q6_K", h, inter, (e,))]
    for tokens in ((1,) if smoke else (1, 4, 8)):
        xt = torch.randn(tokens, h, device=device, dtype=dtype)
        ids = torch.stack([torch.randperm(e, device=device)[:2] for _ in range(tokens)])
        weights = torch.full((tokens, 2), 0.5, device=device)
        block_wise = _timed(device, smoke, quant_moe_triton.moe_gemv, xt, *stacks, weights, ids)
        grouped = _timed(device, smoke, lambda *a: quant_moe_triton.fused_moe(*a, tiles=(16, 32, 128)), xt, *stacks,
                         weights, ids)
        grouped_blocks = _timed(device, smoke, lambda *a: quant_moe_triton.fused_moe(*a, tiles=(16, 32, 256)), xt,
                                *stacks, weights, ids)
        rows.append({"figure": "quant_moe_decode", "tokens": tokens, "block_wise_ms": round(block_wise * 1e3, 3),
                     "grouped_ms": round(grouped * 1e3, 3), "grouped_block_tiles_ms": round(grouped_blocks * 1e3, 3)})
    return rows


def _3g(value: float) -> float:
    return float(f"{value:.3g}")


def _per_weight_gemm(x, raw, fmt, n, k, rb):
    """quant_triton's per-weight tiled GEMM, what a batch took before the block-wise product."""
    import triton

    from backend.kernels import quant_triton

    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    bm, bn, bk = quant_triton.linear_tiles(x.shape[0])
    quant_triton._qgemm_kernel[(triton.cdiv(x.shape[0], bm), triton.cdiv(n, bn))](
        x, raw, out, x.shape[0], n, k, rb, FMT=fmt, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
    return out


def _per_weight_gemv(x, raw, fmt, n, k, rb):
    """quant_triton's per-weight GEMV, the decode path before the block-wise kernel."""
    import triton

    from backend.kernels import quant_triton

    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    quant_triton._qgemv_kernel[(triton.cdiv(n, 64), x.shape[0])](x, raw, out, n, k, rb, FMT=fmt, BLOCK_N=64,
                                                                 BLOCK_K=128)
    return out
