"""kt.gguf_dequantize / kt.gguf_dequantize_into: GGUF blocks decoded natively, bit for bit as the gguf package does."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.library import opcheck

import ktorch  # noqa: F401  (loads the extension)

gguf = pytest.importorskip("gguf")

TYPES = ["Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K"]


def random_blocks(qtype: str, n: int, seed: int, finite: bool) -> np.ndarray:
    """n random blocks of qtype; with finite=True the half-precision scale fields are made finite."""
    _, type_size = gguf.GGML_QUANT_SIZES[getattr(gguf.GGMLQuantizationType, qtype)]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (n, type_size), dtype=np.uint8)
    if finite:
        halves = [slice(type_size - 2, type_size)] if qtype == "Q6_K" else [slice(0, 2)]
        if qtype in ("Q4_K", "Q5_K"):
            halves.append(slice(2, 4))
        for h in halves:
            scale = rng.uniform(-0.05, 0.05, n).astype(np.float16)
            blocks[:, h] = scale.view(np.uint8).reshape(n, 2)
    return blocks


def reference(qtype: str, blocks: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore", over="ignore"):
        return getattr(gguf.quants, qtype).dequantize_blocks(blocks.copy())


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("n", [1, 7, 3001])
@pytest.mark.parametrize("finite", [True, False])
def test_equals_the_gguf_package_bit_for_bit(qtype, n, finite, seed):
    blocks = random_blocks(qtype, n, seed, finite)
    want = reference(qtype, blocks)
    got = torch.ops.kt.gguf_dequantize(torch.from_numpy(blocks), qtype).numpy()
    assert got.shape == want.shape and got.dtype == np.float32
    same = (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))
    assert same.all(), f"seed={seed}: {qtype}: {(~same).sum()} of {same.size} values differ, first at {np.argwhere(~same)[0]}"


@pytest.mark.parametrize("qtype", TYPES)
def test_into_writes_the_same_values(qtype, seed):
    blocks = torch.from_numpy(random_blocks(qtype, 513, seed, True))
    want = torch.ops.kt.gguf_dequantize(blocks, qtype)
    out = torch.full((want.numel() // 32, 32), float("nan"))  # any shape with the right element count
    torch.ops.kt.gguf_dequantize_into(blocks, qtype, out)
    assert torch.equal(out.reshape(want.shape), want)


def test_loader_decodes_natively_and_matches_the_package(seed):
    from ktorch.integrations.gguf_loading import dequantize

    blocks = random_blocks("Q4_K", 4 * 3, seed, True).reshape(4, 3 * 144)  # 4 rows of 768 values, as a file holds them
    got = dequantize(blocks, gguf.GGMLQuantizationType.Q4_K)
    assert got.shape == (4, 768)
    want = reference("Q4_K", blocks.reshape(-1, 144)).reshape(4, 768)
    assert torch.equal(got, torch.from_numpy(want))
    buf = torch.empty(4 * 768)
    assert torch.equal(dequantize(blocks, gguf.GGMLQuantizationType.Q4_K, out=buf), got)


@pytest.mark.parametrize("qtype", TYPES)
def test_opcheck(qtype, seed):
    blocks = torch.from_numpy(random_blocks(qtype, 5, seed, True))
    opcheck(torch.ops.kt.gguf_dequantize, (blocks, qtype))
    out = torch.empty(5 * gguf.GGML_QUANT_SIZES[getattr(gguf.GGMLQuantizationType, qtype)][0])
    opcheck(torch.ops.kt.gguf_dequantize_into, (blocks, qtype, out))


def test_errors():
    q4k = torch.zeros(2, 144, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="qtype must be one of .* got 'Q3_K'"):
        torch.ops.kt.gguf_dequantize(q4k, "Q3_K")
    with pytest.raises(RuntimeError, match=r"Q4_K blocks must be \[n, 144\] bytes, got shape \[2, 143\]"):
        torch.ops.kt.gguf_dequantize(q4k[:, :143], "Q4_K")
    with pytest.raises(RuntimeError, match="blocks must be uint8, got Char"):
        torch.ops.kt.gguf_dequantize(q4k.view(torch.int8), "Q4_K")
    with pytest.raises(RuntimeError, match="out must hold 512 values"):
        torch.ops.kt.gguf_dequantize_into(q4k, "Q4_K", torch.empty(511))
    with pytest.raises(RuntimeError, match="out must be a contiguous float32 CPU tensor, got Double"):
        torch.ops.kt.gguf_dequantize_into(q4k, "Q4_K", torch.empty(512, dtype=torch.float64))
    assert torch.ops.kt.gguf_dequantize(q4k[:0], "Q4_K").shape == (0, 256)
