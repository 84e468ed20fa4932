"""The captured decode step's FlexAttention (ktorch/decode_attention.py): exact causal attention over the filled
blocks of a static cache, for grouped and plain heads, at block edges, and through a model's decode step; where it
applies. On the CPU FlexAttention runs eagerly (its reference implementation), which is what these tests compare;
the compiled CUDA kernels run on the device (tests/test_generation.py's captured-step tests)."""

from __future__ import annotations

import pytest
import torch

from ktorch import decode_attention
from ktorch.decode_attention import BLOCK, DecodeAttention
from ktorch.generation import Decoder, Sampling
from models import tiny_model
from reference import relative_error


def _reference(q, k, v, position, scale):
    """float64 causal attention of one query at ``position`` over keys [0, position], heads grouped as SDPA does."""
    Hq, Hkv = q.shape[1], k.shape[1]
    k = k.double().repeat_interleave(Hq // Hkv, 1)[:, :, : position + 1]
    v = v.double().repeat_interleave(Hq // Hkv, 1)[:, :, : position + 1]
    weights = torch.softmax(q.double() @ k.transpose(-1, -2) * scale, -1)
    return (weights @ v).transpose(1, 2)  # [1, 1, Hq, D]


@pytest.mark.parametrize("Hq,Hkv,D", [(8, 2, 64), (4, 4, 32)])
def test_block_mask_attends_exactly_the_filled_positions(Hq, Hkv, D):
    """At positions inside the first block, on both sides of a block edge and at the cache's end: the attention of
    the step's query equals the float64 reference over keys [0, position] (the cache past it holds garbage that must
    not be read), with grouped heads read in place."""
    torch.manual_seed(Hq + D)
    L = 3 * BLOCK
    position = torch.zeros(1, dtype=torch.long)
    state = DecodeAttention(L, position)
    k = torch.randn(1, Hkv, L, D).to(torch.bfloat16)
    v = torch.randn(1, Hkv, L, D).to(torch.bfloat16)
    module = torch.nn.Module()
    for p in (0, 5, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK + 7, L - 1):
        position.fill_(p)
        state.update()
        assert int(state.kv_num_blocks) == p // BLOCK + 1
        q = torch.randn(1, Hq, 1, D).to(torch.bfloat16)
        out, weights = decode_attention._attention(module, q, k, v, None, scaling=D ** -0.5, kt_decode=state)
        assert weights is None and out.shape == (1, 1, Hq, D) and out.dtype == torch.bfloat16
        assert relative_error(out, _reference(q, k, v, p, D ** -0.5)) < 1e-2, p


def test_bad_uses_are_refused():
    with pytest.raises(ValueError, match="multiple of 128"):
        DecodeAttention(200, torch.zeros(1, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\[1\] int64"):
        DecodeAttention(256, torch.zeros(1, dtype=torch.int32))
    q, kv = torch.randn(1, 4, 1, 16), torch.randn(1, 2, 256, 16)
    with pytest.raises(RuntimeError, match="no block mask"):
        decode_attention._attention(torch.nn.Module(), q, kv, kv, None)
    state = DecodeAttention(256, torch.zeros(1, dtype=torch.long))
    with pytest.raises(RuntimeError, match="one query of batch 1"):
        decode_attention._attention(torch.nn.Module(), torch.randn(1, 4, 2, 16), kv, kv, None, kt_decode=state)


def test_where_it_applies():
    """Full causal attention with head sizes FlexAttention takes, on CUDA; not on the CPU, not with multi-head latent
    attention's unequal key and value sizes (DeepSeek-V3), not with sliding windows, not with another attention
    implementation."""
    qwen = tiny_model("qwen3_moe", attn_implementation="sdpa")
    assert decode_attention.applies(qwen, torch.device("cuda")) is None
    assert "CUDA" in decode_attention.applies(qwen, torch.device("cpu"))
    assert "head size" in decode_attention.applies(tiny_model("deepseek_v3", attn_implementation="sdpa"), "cuda")
    windowed = tiny_model("mixtral", attn_implementation="sdpa", sliding_window=64)
    assert "sliding" in decode_attention.applies(windowed, "cuda")
    assert "'eager'" in decode_attention.applies(tiny_model("qwen3_moe", attn_implementation="eager"), "cuda")


def test_a_models_decode_steps_match_sdpa_across_a_block_edge():
    """The tiny Qwen3-MoE model's decode steps from a 125-token prompt through position 130 (the first block's end
    and the second's start), teacher-forced on the same tokens: the step with the switched attention (its block mask,
    the model's mask skipped) gives SDPA's logits within bf16 rounding, and the model is back on SDPA after."""
    torch.manual_seed(0)
    model = tiny_model("qwen3_moe", dtype=torch.bfloat16, attn_implementation="sdpa")
    decoder = Decoder(model, 256, torch.device("cpu"), Sampling(), cuda_graphs=False)
    state = DecodeAttention(decoder.max_len, decoder.position)
    prompt = torch.randint(0, 256, (1, 125))
    tokens = torch.randint(0, 256, (6,))
    got, want = [], []
    for flex, out in ((False, want), (True, got)):
        _decode(model, decoder, state, prompt, tokens, flex, out)
    assert model.config._attn_implementation == "sdpa"
    with decode_attention.switched(model), torch.no_grad(), pytest.raises(RuntimeError, match="no block mask"):
        decoder._forward(tokens[:1].view(1, 1), torch.tensor([131]))  # the switched step does run the flex attention
    for i, (a, b) in enumerate(zip(got, want)):
        assert relative_error(a, b) < 2e-2, f"step at position {125 + i}"


@torch.no_grad()
def _decode(model, decoder, state, prompt, tokens, flex, out):
    """Prefill, then teacher-forced steps from position 125 on, with the switched attention or SDPA."""
    decoder.prefill(prompt)
    for i, t in enumerate(tokens):
        position = torch.tensor([125 + i])
        decoder.position.copy_(position)
        if flex:
            with decode_attention.switched(model):
                assert model.config._attn_implementation == decode_attention.NAME
                state.update()
                out.append(decoder._forward(t.view(1, 1), position, kt_decode=state).float())
        else:
            out.append(decoder._forward(t.view(1, 1), position).float())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the captured decode step)")
def test_cuda_captured_generate_takes_it_and_matches_sdpa(monkeypatch):
    """On CUDA, ktorch.generate's captured step takes the flex attention (its decoder holds the block mask) and
    decodes, past a block edge, the greedy tokens of the same captured step on SDPA (a float32 model: rounding far
    below the logits' gaps)."""
    import ktorch

    torch.manual_seed(0)
    model = tiny_model("qwen3_moe", dtype=torch.float32, attn_implementation="sdpa")
    model.generation_config.eos_token_id = None
    ktorch.prepare(model, device="cuda", experts_dtype="bf16", gpu_memory="off")
    ids = torch.randint(0, 256, (1, 100), generator=torch.Generator().manual_seed(3))
    flex = ktorch.generate(model, ids, 60)
    assert model.kt_decoder.attention is not None and flex.timings.cuda_graphs
    model.kt_decoder = None
    monkeypatch.setattr(decode_attention, "applies", lambda *args: "off for the comparison")
    sdpa = ktorch.generate(model, ids, 60)
    assert model.kt_decoder.attention is None
    assert flex.ids == sdpa.ids
