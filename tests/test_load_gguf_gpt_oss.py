"""ktorch.load on gpt-oss GGUF files with MXFP4 experts, written (ktorch/integrations/gguf_writer.py) from a tiny
random transformers gpt_oss model with names, types and metadata as llama.cpp's converter writes them.

- MXFP4 experts are exact, kept as 4-bit codes with their scales (auto: 0.625 bytes a weight, the op's output that of
  the int8 codes of the same blocks bit for bit) or decoded to bf16 (explicit): the packed experts equal
  ``gguf.quants.dequantize`` of the file bit for bit, biases too, and every E8M0 scale byte the loader accepts
  (<= 252) decodes to values bf16 holds exactly;
- the model: ktorch's bf16 logits against transformers' eager gpt_oss (bf16) holding the weights the file stores,
  routing flips at near-ties handled as tests/test_integrations_families.py does;
- ``ktorch generate`` on the file (no tokenizer: byte ids);
- bad files (a scale past the exact range, an MXFP4 tensor of the wrong size, a missing bias): CheckpointError.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import ktorch
from ktorch.integrations import packed_experts_of
from ktorch.integrations.checkpoint_loading import CheckpointError
from ktorch.integrations.gguf_loading import MXFP4_MAX_SCALE
from ktorch.integrations.gguf_writer import PlannedTensor, encode, write_gguf_from_model
from models import moe_experts_modules
from test_integrations_families import assert_logits_close, tiny_family_model

gguf = pytest.importorskip("gguf")
MXFP4 = gguf.GGMLQuantizationType.MXFP4
ROPE = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": False, "original_max_position_embeddings": 64}


def _tiny(seed: int = 0):
    torch.manual_seed(seed)
    model = tiny_family_model("gpt_oss").float()
    model.config.rope_parameters = dict(ROPE)  # yarn as gpt-oss has it, sized for the tiny context
    model.model.rotary_emb = type(model.model.rotary_emb)(config=model.config)  # its frequencies from ROPE
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 1.0)
            layer.mlp.router.bias.normal_(0.0, 0.1)
    return model


def _file_tensors(path) -> dict:
    return {t.name: t for t in gguf.GGUFReader(str(path)).tensors}


def _file_values(tensors: dict, name: str) -> torch.Tensor:
    t = tensors[name]
    return torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32))


@pytest.fixture(scope="module")
def gpt_oss_file(tmp_path_factory):
    model = _tiny()
    path = write_gguf_from_model(model, tmp_path_factory.mktemp("gpt_oss") / "gpt-oss-mxfp4.gguf",
                                 experts_type="MXFP4", other_type="F16")
    return model, path


def test_every_accepted_scale_decodes_exactly_to_bf16():
    """All 16 E2M1 codes under every E8M0 byte <= MXFP4_MAX_SCALE, decoded by the gguf package, survive bf16;
    the next byte overflows float32 (hence the loader's error)."""
    blocks = np.zeros((256, 17), dtype=np.uint8)
    blocks[:, 0] = np.arange(256)
    blocks[:, 1:] = np.arange(16, dtype=np.uint8) | (np.arange(16, dtype=np.uint8)[::-1] << 4)  # codes 0..15 twice
    with np.errstate(over="ignore"):
        values = torch.from_numpy(np.array(gguf.quants.dequantize(blocks, MXFP4), dtype=np.float32))  # [256, 32]
    codes = torch.cat([torch.arange(16), torch.arange(16).flip(0)])
    ok = values[: MXFP4_MAX_SCALE + 1]
    assert torch.isfinite(ok).all() and (ok[:, codes % 8 != 0] != 0).all()  # no nonzero code underflows to zero
    assert torch.equal(ok.bfloat16().float(), ok)
    assert not torch.isfinite(values[MXFP4_MAX_SCALE + 1]).all()


@pytest.mark.parametrize("experts_dtype", ["auto", "bf16"])
def test_config_and_exact_experts(gpt_oss_file, experts_dtype):
    model, path = gpt_oss_file
    tensors = _file_tensors(path)
    assert tensors["blk.0.ffn_gate_exps.weight"].tensor_type == MXFP4
    assert tensors["blk.1.ffn_down_exps.weight"].tensor_type == MXFP4
    assert "blk.0.attn_sinks.weight" in tensors and "blk.0.ffn_gate_exps.bias" in tensors
    loaded, tokenizer = ktorch.load(path, device="cpu", dtype=torch.bfloat16, experts_dtype=experts_dtype,
                                    progress=False)
    assert tokenizer is None and type(loaded).__name__ == "GptOssForCausalLM"
    c, want = loaded.config, model.config
    for key in ("num_local_experts", "num_experts_per_tok", "intermediate_size", "head_dim", "sliding_window",
                "layer_types", "attention_bias", "num_key_value_heads", "swiglu_limit", "swiglu_alpha"):
        assert getattr(c, key) == getattr(want, key), key
    for key in ("rope_type", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow"):
        assert c.rope_parameters[key] == ROPE[key], key
    assert c.rope_parameters["rope_theta"] == pytest.approx(ROPE["rope_theta"])
    for layer, module in enumerate(moe_experts_modules(loaded)):
        # auto: the MXFP4 codes as nibbles (float4_e2m1fn_x2 in the int4 layout: 0.5 bytes a weight, a float32
        # power-of-two scale per 32) ; bf16: decoded; exact either way
        assert module.kt_format == ("gguf:MXFP4" if experts_dtype == "auto" else "bf16") and module.kt_activation == "swiglu_oai(alpha=1.702,limit=7.0)"
        packed = packed_experts_of(module)
        E, I, H = c.num_local_experts, c.intermediate_size, c.hidden_size
        if experts_dtype == "auto":
            assert packed.w13.dtype == packed.w2.dtype == torch.float4_e2m1fn_x2
            assert packed.w13.shape == (E, 2 * I // 16, H // 8, 16, 4) and packed.w2.shape == (E, H // 16, I // 8, 16, 4)
            weights = E * 3 * H * I
            assert sum(t.nbytes for t in packed.tensors()) == weights * (0.5 + 4 / 32)
            # the op's output on the nibbles is its output on the int8 codes of the same blocks, bit for bit
            from ktorch.integrations.gguf_loading import exact_codes
            from ktorch.ops.moe import pack_quantized

            blk = f"blk.{layer}.ffn"
            parts = [exact_codes(np.asarray(tensors[f"{blk}_{p}_exps.weight"].data), "MXFP4") for p in ("gate", "up", "down")]
            w13, s13 = pack_quantized(torch.cat([parts[0][0], parts[1][0]], 1), torch.cat([parts[0][1], parts[1][1]], 1),
                                      bits=8, gate_up=True)
            w2, s2 = pack_quantized(parts[2][0], parts[2][1], bits=8)
            x = torch.randn(5, H).bfloat16()
            ids = torch.rand(5, E).argsort(dim=1)[:, :c.num_experts_per_tok]
            wts = torch.rand(5, c.num_experts_per_tok)
            args = (module.kt_activation, packed.w13_bias, packed.w2_bias)
            assert torch.equal(torch.ops.kt.fused_moe(x, ids, wts, *packed.tensors(), *args),
                               torch.ops.kt.fused_moe(x, ids, wts, w13, s13, w2, s2, *args))
        gate_up, down = packed.dequantize()
        blk = f"blk.{layer}.ffn"
        want_gate_up = torch.cat([_file_values(tensors, f"{blk}_gate_exps.weight"),
                                  _file_values(tensors, f"{blk}_up_exps.weight")], dim=1)
        want_down = _file_values(tensors, f"{blk}_down_exps.weight")
        for got, want_w in ((gate_up, want_gate_up), (down, want_down)):
            assert ((got.float() - want_w).norm() / want_w.norm()).item() <= 1e-6
            assert torch.equal(got.float(), want_w)  # exact: MXFP4 values are bf16 values (and codes * 2**(e-128))
        assert torch.equal(packed.w13_bias.float(), torch.cat([_file_values(tensors, f"{blk}_gate_exps.bias"),
                                                               _file_values(tensors, f"{blk}_up_exps.bias")], dim=1))
        assert torch.equal(packed.w2_bias.float(), _file_values(tensors, f"{blk}_down_exps.bias"))
    sinks = loaded.model.layers[1].self_attn.sinks
    assert sinks.dtype == torch.bfloat16 and torch.equal(sinks, model.model.layers[1].self_attn.sinks.bfloat16())


def _as_stored(model, path):
    """``model`` (bf16) holding what the file stores: experts decoded from MXFP4, other matrices through F16."""
    tensors = _file_tensors(path)
    with torch.no_grad():
        for layer, m in enumerate(moe_experts_modules(model)):
            blk = f"blk.{layer}.ffn"
            gate, up = (_file_values(tensors, f"{blk}_{p}_exps.weight") for p in ("gate", "up"))  # [E, I, H]
            m.gate_up_proj.copy_(torch.stack([gate, up], dim=2).reshape(gate.shape[0], -1, gate.shape[2]).transpose(1, 2))
            m.down_proj.copy_(_file_values(tensors, f"{blk}_down_exps.weight").transpose(1, 2))
        for name, p in model.named_parameters():
            if p.ndim >= 2 and ".experts." not in name and ".router." not in name:
                p.copy_(p.half().float())
    return model.bfloat16()


@pytest.mark.parametrize("seed", [0, 1])
def test_logits_match_hf_eager(gpt_oss_file, seed):
    model, path = gpt_oss_file
    import copy

    reference = _as_stored(copy.deepcopy(model), path)
    loaded, _ = ktorch.load(path, device="cpu", dtype=torch.bfloat16, progress=False)
    torch.manual_seed(seed)
    ids = torch.randint(0, 256, (1, 40))  # past the sliding window (16): both layer types attend differently
    assert_logits_close(reference, loaded, ids, what=f"seed={seed} gpt-oss GGUF")


def test_generate_cli(gpt_oss_file, capsys):
    from ktorch.cli import main

    _, path = gpt_oss_file
    if torch.cuda.is_available():  # the GPU default: experts the device side cannot run stay on the CPU, said once
        assert main(["generate", "--model", str(path), "--prompt", "hi", "--max-new-tokens", "4"]) == 0
        assert "every expert stays on the CPU (GptOssExperts has biases" in capsys.readouterr().err
        # asked for by name, GPU experts are refused with the option named
        assert main(["generate", "--model", str(path), "--prompt", "hi", "--gpu-memory", "1GiB"]) != 0
        assert "--gpu-memory 1GiB: stream_experts/gpu_memory: GptOssExperts has biases" in capsys.readouterr().err
    assert main(["generate", "--model", str(path), "--prompt", "hi", "--max-new-tokens", "4", "--device", "cpu"]) == 0
    out = capsys.readouterr()
    assert "decode: 3 tokens" in out.err
    line = next(line for line in out.out.splitlines() if line.startswith("[token ids]"))
    prompt, new = (list(map(int, part.split())) for part in line[len("[token ids]"):].split("->"))
    assert prompt == list(b"hi") and len(new) == 4
    loaded, _ = ktorch.load(path, device="cpu", dtype=torch.float32, progress=False)  # the CLI's CPU default
    ids = torch.tensor([prompt])
    with torch.no_grad():  # greedy, one full forward per token
        for _ in range(4):
            ids = torch.cat([ids, loaded(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert ids[0, 2:].tolist() == new


# ---------------------------------------------------------------- bad files


def _write(tmp_path, name, edit):
    return write_gguf_from_model(_tiny(), tmp_path / name, experts_type="MXFP4", edit=edit)


def _with_scale(plan, tensor: str, scale: int):
    def edit(plan):
        for i, t in enumerate(plan):
            if t.name == tensor:
                blocks = encode(t.produce(), "MXFP4")
                blocks.reshape(-1, 17)[5, 0] = scale  # one block's E8M0 byte
                plan[i] = PlannedTensor(t.name, t.shape, "MXFP4", lambda b=blocks: b, encoded=True)
        return plan

    return edit(plan)


def test_experts_read_in_chunks_equal_one_read(gpt_oss_file, monkeypatch):
    """MXFP4 experts (their nibbles packed into the layer's float4 tensor from the second chunk on) and their biases
    read a few experts at a time: the packed tensors of one read, bit for bit."""
    import ktorch.integrations.checkpoint_loading as loading

    model, path = gpt_oss_file

    def packed():
        loaded = ktorch.load(path, device="cpu", progress=False, tokenizer=False)[0]
        return [t.view(torch.uint8) if t.element_size() == 1 else t for m in moe_experts_modules(loaded)
                for t in (*packed_experts_of(m).tensors(), *packed_experts_of(m).biases()) if t is not None]

    whole = packed()
    E, I, H = model.config.num_local_experts, model.config.intermediate_size, model.config.hidden_size
    monkeypatch.setattr(loading, "CHUNK_ELEMENTS", 3 * 3 * I * H)
    assert loading._chunk_size(E, I, H) == 3 < E
    chunked = packed()
    assert len(whole) == len(chunked) and all(torch.equal(a, b) for a, b in zip(whole, chunked))


def test_scale_at_the_limit_is_exact_past_it_an_error(tmp_path):
    name = "blk.1.ffn_up_exps.weight"
    path = _write(tmp_path, "edge.gguf", lambda plan: _with_scale(plan, name, MXFP4_MAX_SCALE))
    loaded, _ = ktorch.load(path, device="cpu", dtype=torch.bfloat16, progress=False)
    gate_up, _ = packed_experts_of(moe_experts_modules(loaded)[1]).dequantize()
    want = _file_values(_file_tensors(path), name)
    assert want.abs().max() > 2.0 ** 120 and torch.equal(gate_up[:, want.shape[1]:].float(), want)
    path = _write(tmp_path, "over.gguf", lambda plan: _with_scale(plan, name, MXFP4_MAX_SCALE + 1))
    with pytest.raises(CheckpointError, match=rf"{name}.*E8M0 byte 253.*cannot be held exactly"):
        ktorch.load(path, device="cpu", dtype=torch.bfloat16, progress=False)


def test_mxfp4_tensor_of_the_wrong_size(tmp_path):
    def edit(plan):
        for i, t in enumerate(plan):
            if t.name == "blk.0.ffn_down_exps.weight":  # [E, H, I] -> [E, H, I - 32]
                shape = (*t.shape[:-1], t.shape[-1] - 32)
                plan[i] = PlannedTensor(t.name, shape, "MXFP4", lambda s=shape: np.ones(s, dtype=np.float32))
        return plan

    path = _write(tmp_path, "short.gguf", edit)
    with pytest.raises(CheckpointError, match=r"blk\.0\.ffn_down_exps\.weight.*shape \[8, 64, 32\].*needs \[8, 64, 64\]"):
        ktorch.load(path, device="cpu", progress=False)


def test_missing_expert_bias(tmp_path):
    path = _write(tmp_path, "nobias.gguf", lambda plan: [t for t in plan if t.name != "blk.1.ffn_up_exps.bias"])
    with pytest.raises(CheckpointError, match=r"blk\.1\.ffn_up_exps\.bias.*missing from the file"):
        ktorch.load(path, device="cpu", progress=False)
