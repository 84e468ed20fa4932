"""ktorch.load on llama.cpp GGUF files written (ktorch/integrations/gguf_writer.py) from tiny random transformers
models, names and shapes as llama.cpp's converter writes them.

- conversion: for every experts type, the packed experts (``PackedExperts.dequantize``) against the file's own
  values (``gguf.quants.dequantize``): Q4_0 exact, the others within the loss docs/loading.md states;
- model: per architecture (qwen3moe, qwen2moe, llama/Mixtral, deepseek2), ktorch's logits against an fp32 HF eager
  model holding the weights the file stores (each tensor round-tripped through the GGUF encoding here, with
  gguf's own functions), routing flips at near-ties handled as tests/models.py explains;
- tokenizer: a byte-level BPE tokenizer embedded in the file encodes like the original; "none" gives None.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import ktorch
import ktorch.lora
from ktorch.integrations import packed_experts_of
from ktorch.integrations.gguf_writer import encode, write_gguf_from_model
from models import LOGIT_ATOL, assert_logits_match, moe_experts_modules, tiny_model

gguf = pytest.importorskip("gguf")

# Largest relative error (||packed - file|| / ||file||) of each conversion, measured on these random weights
# (Gaussian, one draw per type): the bound is the measurement with headroom. docs/loading.md has the table.
# "auto" keeps every GGUF type with an exact form exact (bound 0: bit for bit).
CONVERSION_BOUND = {
    ("Q8_0", "auto"): 0.0,
    ("Q4_0", "auto"): 0.0,
    ("Q4_K", "auto"): 0.0,
    ("Q5_K", "auto"): 0.0,
    ("Q6_K", "auto"): 0.0,
    ("BF16", "auto"): 0.0,
    ("F16", "auto"): 0.004,
    ("F32", "auto"): 0.004,
    ("Q8_0", "int8"): 0.012,
    ("Q4_0", "int4"): 0.0,
    ("Q4_K", "int4"): 0.11,
    ("Q5_K", "int8"): 0.012,
    ("Q6_K", "int8"): 0.012,
    ("Q4_K", "int8"): 0.012,
    ("Q8_0", "int4"): 0.11,
}


def _file_values(path, name: str) -> torch.Tensor:
    reader = gguf.GGUFReader(str(path))
    t = next(t for t in reader.tensors if t.name == name)
    return torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type)))


@pytest.fixture(scope="module")
def wide_qwen3(tmp_path_factory):
    """A tiny Qwen3-MoE whose rows are 256 long (K-quant blocks), and a folder for its files."""
    torch.manual_seed(0)
    return tiny_model("qwen3_moe", hidden_size=256, moe_intermediate_size=256, initializer_range=0.04), \
        tmp_path_factory.mktemp("gguf")


@pytest.mark.parametrize("file_type,experts_dtype", list(CONVERSION_BOUND))
def test_experts_conversion_against_file_values(wide_qwen3, file_type, experts_dtype):
    model, folder = wide_qwen3
    path = folder / f"experts_{file_type}.gguf"
    if not path.exists():
        write_gguf_from_model(model, path, experts_type=file_type, other_type="F16")
    loaded, tokenizer = ktorch.load(path, device="cpu", experts_dtype=experts_dtype, progress=False)
    assert tokenizer is None
    want_format = experts_dtype
    if experts_dtype == "auto":
        want_format = "bf16" if file_type in ("BF16", "F16", "F32") else f"gguf:{file_type}"
    elif (file_type, experts_dtype) == ("Q4_0", "int4"):
        want_format = "gguf:Q4_0"  # re-laid exactly
    for layer, module in enumerate(moe_experts_modules(loaded)):
        assert module.kt_format == want_format
        gate_up, down = packed_experts_of(module).dequantize()
        want_gate_up = torch.cat([_file_values(path, f"blk.{layer}.ffn_gate_exps.weight"),
                                  _file_values(path, f"blk.{layer}.ffn_up_exps.weight")], dim=1)
        want_down = _file_values(path, f"blk.{layer}.ffn_down_exps.weight")
        for got, want in ((gate_up, want_gate_up), (down, want_down)):
            err = ((got - want).norm() / want.norm()).item()
            assert err <= CONVERSION_BOUND[(file_type, experts_dtype)], f"{file_type} -> {experts_dtype}: {err:.4g}"
            if CONVERSION_BOUND[(file_type, experts_dtype)] == 0.0:
                assert torch.equal(got, want)


def test_q4_k_with_symmetric_scales_is_exact(tmp_path):
    """Q4_K blocks whose sub-block minimum is exactly 8 steps are symmetric int4 and are re-laid, not requantized."""
    torch.manual_seed(1)
    model = tiny_model("qwen3_moe", hidden_size=256, moe_intermediate_size=256, num_hidden_layers=1)
    with torch.no_grad():  # weights already on a symmetric int4 grid with one step per 32-group row
        for p in (model.model.layers[0].mlp.experts.gate_up_proj, model.model.layers[0].mlp.experts.down_proj):
            q = torch.randint(-8, 8, p.shape).float()
            q[..., ::32] = -8  # each 32-group reaches -8, so the encoder's minimum is exactly 8 steps
            q[..., 1::32] = 7
            p.copy_(q * 0.01)
    path = write_gguf_from_model(model, tmp_path / "sym.gguf", experts_type="Q4_K")
    loaded, _ = ktorch.load(path, device="cpu", progress=False)
    gate_up, _ = packed_experts_of(moe_experts_modules(loaded)[0]).dequantize()
    want = torch.cat([_file_values(path, "blk.0.ffn_gate_exps.weight"), _file_values(path, "blk.0.ffn_up_exps.weight")], 1)
    assert torch.equal(gate_up, want)


def test_explicit_conversion_prints_its_loss(wide_qwen3, capfd):
    model, folder = wide_qwen3
    path = folder / "experts_Q4_K.gguf"
    if not path.exists():
        write_gguf_from_model(model, path, experts_type="Q4_K", other_type="F16")
    ktorch.load(path, device="cpu", experts_dtype="int4", progress=False)
    err = capfd.readouterr().err
    assert err.count("relative error") == 1, err
    assert "converted to int4" in err and "experts_dtype='auto' keeps them exact" in err
    line = next(x for x in err.splitlines() if "relative error" in x)
    assert 0.03 < float(line.split("relative error ")[1].split()[0]) < 0.11
    ktorch.load(path, device="cpu", progress=False)  # auto: exact, nothing to report
    assert "relative error" not in capfd.readouterr().err


@pytest.mark.parametrize("types", [{"gate": "Q4_K", "up": "Q4_K", "down": "Q6_K"},
                                   {"gate": "Q4_K", "up": "Q6_K", "down": "Q5_K"},
                                   {"gate": "Q8_0", "up": "Q4_0", "down": "Q4_K"}],
                         ids=["Q4_K_M", "gate_up_differ", "q8_q4_0"])
def test_mixed_types_load_exactly(wide_qwen3, types):
    """Q4_K_M's layers (Q4_K gate/up, Q6_K down: int4 and int8 in one op call) and gate/up of different types (both
    held in the wider form) load exact with auto."""
    model, folder = wide_qwen3
    path = folder / f"mixed_{'_'.join(types.values())}.gguf"
    write_gguf_from_model(model, path, experts_type=types["gate"], experts_types=types, other_type="F16")
    loaded, _ = ktorch.load(path, device="cpu", progress=False)
    for layer, module in enumerate(moe_experts_modules(loaded)):
        assert module.kt_format == "gguf:" + "/".join(dict.fromkeys(types.values()))
        gate_up, down = packed_experts_of(module).dequantize()
        assert torch.equal(gate_up, torch.cat([_file_values(path, f"blk.{layer}.ffn_gate_exps.weight"),
                                               _file_values(path, f"blk.{layer}.ffn_up_exps.weight")], dim=1))
        assert torch.equal(down, _file_values(path, f"blk.{layer}.ffn_down_exps.weight"))
    packed = packed_experts_of(moe_experts_modules(loaded)[0])
    if types["down"] == "Q6_K":
        assert packed.w13.dtype == torch.uint8 and packed.w2.dtype == torch.int8
    # Q4_K/Q5_K/Q6_K scales at the file's size (two-level: uint8 Q4_K and Q5_K, int8 Q6_K) per projection; Q8_0 and
    # gate/up of different types: float32 per group (gguf_loading.KSCALES_ON_LOAD)
    kscale = {"Q4_K": torch.uint8, "Q5_K": torch.uint8, "Q6_K": torch.int8}
    assert packed.w13_scales.dtype == (kscale.get(types["gate"], torch.float32) if types["gate"] == types["up"]
                                       else torch.float32)
    assert packed.w2_scales.dtype == kscale.get(types["down"], torch.float32)


def _packed_tensors(model) -> list:
    return [(t if t is None else t.view(torch.uint8) if t.element_size() == 1 else t)
            for m in moe_experts_modules(model) for t in (*packed_experts_of(m).tensors(), *packed_experts_of(m).biases())]


@pytest.mark.parametrize("types", [{"gate": t, "up": t, "down": t} for t in ("Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K")]
                         + [{"gate": "Q4_K", "up": "Q4_K", "down": "Q6_K"}, {"gate": "Q4_K", "up": "Q6_K", "down": "Q5_K"}],
                         ids=["Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K", "Q4_K_M", "gate_up_differ"])
def test_experts_read_in_chunks_equal_one_read(wide_qwen3, types, monkeypatch):
    """A layer's experts read a few at a time (file bytes read into reused buffers, the codes packed straight into
    the layer's tensors from the second chunk on: gguf_loading._read_bytes, pack_quantized(out=)) give the packed
    tensors of one read of every expert, bit for bit."""
    import ktorch.integrations.checkpoint_loading as loading

    model, folder = wide_qwen3
    path = folder / f"chunks_{'_'.join(types.values())}.gguf"
    write_gguf_from_model(model, path, experts_type=types["gate"], experts_types=types, other_type="F16")
    whole = _packed_tensors(ktorch.load(path, device="cpu", progress=False, tokenizer=False)[0])
    E, H = model.config.num_experts, model.config.hidden_size
    monkeypatch.setattr(loading, "CHUNK_ELEMENTS", 3 * 3 * model.config.moe_intermediate_size * H)  # 3 a chunk
    assert loading._chunk_size(E, model.config.moe_intermediate_size, H) == 3 < E
    chunked = _packed_tensors(ktorch.load(path, device="cpu", progress=False, tokenizer=False)[0])
    assert len(whole) == len(chunked) and all((a is None and b is None) or torch.equal(a, b)
                                              for a, b in zip(whole, chunked))


# ---------------------------------------------------------------- whole models


def _model(family: str):
    if family == "qwen2_moe":
        from models import _COMMON  # the shared tiny sizes

        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.for_model("qwen2_moe", **{**_COMMON, **dict(
            num_hidden_layers=2, intermediate_size=96, moe_intermediate_size=64, shared_expert_intermediate_size=96,
            num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=False)})
        config._experts_implementation = "eager"
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    return tiny_model(family)


def _as_stored(model, experts_type: str, other_type: str = "F16", experts_types: dict | None = None):
    """``model`` with each weight replaced by what the GGUF stores (encoded and decoded with gguf's functions);
    ``experts_types`` as write_gguf_from_model takes it (per projection)."""
    types = {"gate": experts_type, "up": experts_type, "down": experts_type, **(experts_types or {})}
    with torch.no_grad():
        for name, p in model.named_parameters():
            x = p.detach().float().numpy()
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                if name.endswith("gate_up_proj"):  # gate and up are separate GGUF tensors
                    half = x.shape[1] // 2
                    parts = [(x[:, :half], types["gate"]), (x[:, half:], types["up"])]
                else:
                    parts = [(x, types["down"])]
                decoded = [gguf.quants.dequantize(encode(part, t), gguf.GGMLQuantizationType[t]) for part, t in parts]
                p.copy_(torch.from_numpy(np.concatenate(decoded, axis=1)))
            elif x.ndim >= 2 and ".gate.weight" not in name and "shared_expert_gate" not in name:
                p.copy_(p.half().float() if other_type == "F16" else p)
    return model


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3"])
def test_logits_match_hf_eager(family, tmp_path):
    torch.manual_seed(0)
    model = _model(family)
    path = write_gguf_from_model(model, tmp_path / f"{family}.gguf", experts_type="Q8_0", other_type="F16")
    reference = _as_stored(model, "Q8_0")
    loaded, _ = ktorch.load(path, device="cpu", dtype=torch.float32, experts_dtype="bf16", progress=False)
    assert type(loaded).__name__ == type(reference).__name__
    assert_logits_match(reference, loaded, torch.float32, torch.randint(0, 256, (1, 48)))


def test_tokenizer_from_file(tmp_path):
    from ktorch.builtin import BUILTIN_PATH
    from transformers import AutoTokenizer

    original = AutoTokenizer.from_pretrained(str(BUILTIN_PATH))
    torch.manual_seed(0)
    model = tiny_model("qwen3_moe", vocab_size=len(original), num_hidden_layers=1)
    path = write_gguf_from_model(model, tmp_path / "tok.gguf", experts_type="Q8_0", tokenizer=original)
    _, tokenizer = ktorch.load(path, device="cpu", progress=False)
    text = "The meaning of life is 42, said the model. Ünïcode too!"
    assert tokenizer(text).input_ids == original(text).input_ids
    assert tokenizer.decode(original(text).input_ids, skip_special_tokens=True) == text


def test_add_bos_flag_is_enforced():
    """The file's tokenizer.ggml.add_bos_token decides, whatever transformers' GGUF conversion did with it."""
    from ktorch.builtin import BUILTIN_PATH
    from ktorch.integrations.gguf_loading import _set_add_bos
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(BUILTIN_PATH))
    bos = tokenizer.bos_token_id
    assert bos is not None
    text = "Hello there, general Kenobi."
    plain = [i for i in tokenizer(text).input_ids if i != bos]
    _set_add_bos(tokenizer, False, bos)
    assert tokenizer(text).input_ids == plain
    _set_add_bos(tokenizer, True, bos)
    assert tokenizer(text).input_ids == [bos] + plain
    assert tokenizer.decode(tokenizer(text).input_ids, skip_special_tokens=True) == text


@pytest.mark.parametrize("experts_types", [{"gate": "Q4_K", "up": "Q4_K", "down": "Q6_K"}, {"gate": "Q5_K", "up": "Q5_K", "down": "Q8_0"}],
                         ids=["Q4_K_M", "Q5_K-Q8_0"])
def test_exact_experts_logits_match_hf_eager(experts_types, tmp_path):
    """A one-layer Qwen3-MoE written with K-quant experts, loaded with auto (exact): its logits against an fp32 HF
    eager model holding the file's values, within the int8 op tolerance (its int8 activations are the only
    difference; one layer, so the router sees the same input in both and no routing flips)."""
    torch.manual_seed(0)
    model = tiny_model("qwen3_moe", hidden_size=256, moe_intermediate_size=256, initializer_range=0.04,
                       num_hidden_layers=1)
    path = write_gguf_from_model(model, tmp_path / "k.gguf", experts_type=experts_types["gate"],
                                 experts_types=experts_types, other_type="F16")
    reference = _as_stored(model, experts_types["gate"], experts_types=experts_types)
    loaded, _ = ktorch.load(path, device="cpu", dtype=torch.float32, progress=False)
    assert moe_experts_modules(loaded)[0].kt_format == "gguf:" + "/".join(dict.fromkeys(experts_types.values()))
    ids = torch.randint(0, 256, (2, 48))
    with torch.no_grad():
        want, got = reference(input_ids=ids).logits.double(), loaded(input_ids=ids).logits.double()
    err = float((got - want).norm() / want.norm())
    assert 0 < err <= 3e-2, f"{experts_types}: logits off by {err:.3g}"


@pytest.mark.parametrize("experts_types", [{"gate": "Q4_K", "up": "Q4_K", "down": "Q6_K"},
                                           {"gate": "Q5_K", "up": "Q5_K", "down": "Q8_0"}], ids=["Q4_K_M", "Q5_K-Q8_0"])
def test_exact_experts_fine_tune_like_hf_eager(experts_types, tmp_path):
    """Fine-tuning a GGUF model as users have them (K-quant experts loaded exact, scales at the file's size): with
    ``prepare(trainable=True)`` and expert LoRA (zero B: the float32 forward is the exact function of the file's
    values), the loss and the gradients of every trainable parameter outside the experts equal an fp32 HF eager model
    holding the file's values (the backward decodes the K-quant layouts: affine int4 and int8, grouped int8, two
    formats in one call); then a few AdamW steps on one batch lower its loss."""
    torch.manual_seed(0)
    model = tiny_model("qwen3_moe", hidden_size=256, moe_intermediate_size=256, initializer_range=0.04,
                       num_hidden_layers=1)
    path = write_gguf_from_model(model, tmp_path / "k.gguf", experts_type=experts_types["gate"],
                                 experts_types=experts_types, other_type="F16")
    reference = _as_stored(model, experts_types["gate"], experts_types=experts_types).train()
    loaded, _ = ktorch.load(path, device="cpu", dtype=torch.float32, progress=False)
    ktorch.prepare(loaded, device="cpu", trainable=True, gradient_checkpointing=False)
    adapters = ktorch.lora.add_expert_lora(loaded, r=4, lora_alpha=8)
    ids = torch.randint(0, 256, (2, 32))
    loss_r, loss_k = reference(input_ids=ids, labels=ids).loss, loaded(input_ids=ids, labels=ids).loss
    assert abs(loss_k.item() - loss_r.item()) < 1e-4 * abs(loss_r.item()), (loss_k.item(), loss_r.item())
    loss_r.backward()
    loss_k.backward()
    grads_r = {n: p.grad for n, p in reference.named_parameters() if "experts" not in n}
    grads_k = {n: p.grad for n, p in loaded.named_parameters() if p.requires_grad and "kt_lora" not in n}
    assert grads_k.keys() == grads_r.keys()
    for n in grads_r:
        err = float((grads_k[n] - grads_r[n]).norm() / grads_r[n].norm())
        assert err < 1e-4, (n, err)
    assert all(a.grad is not None for a in adapters) and any(a.grad.abs().sum() > 0 for a in adapters)
    opt = torch.optim.AdamW([p for p in loaded.parameters() if p.requires_grad], lr=1e-3)
    first = loss_k.item()
    for _ in range(8):
        opt.step()
        opt.zero_grad()
        loss = loaded(input_ids=ids, labels=ids).loss
        loss.backward()
    assert loss.item() < 0.9 * first, (first, loss.item())
