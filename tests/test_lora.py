"""LoRA through the packed experts (ktorch/lora.py) against peft on transformers' eager experts.

The reference is peft itself: ``LoraConfig(target_modules=[attention], target_parameters=[experts' gate_up_proj,
down_proj])`` on the unpacked transformers model, which adapts the 3-D expert parameters per expert. ktorch holds
the same factors beside its packed experts; the tests check that the two give the same loss and gradients, that
adapters move between them through peft's files, and that a few hundred fine-tuning steps lower the held-out loss
as much as peft on eager experts does (within 2%).
"""

from __future__ import annotations

import copy

import pytest
import torch

import ktorch
import ktorch.ops.host_transfer
from ktorch.builtin import BUILTIN_PATH, token_stream

peft = pytest.importorskip("peft")
from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


@pytest.fixture
def one_thread():
    """One intra-op thread: these steps are tiny, and OpenMP's barriers cost more than they give on a shared CI
    machine (2 threads measured 15x slower than 1 at load 12 on 2 cores)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _eager_builtin():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(BUILTIN_PATH), dtype=torch.float32)


def _peft_eager(r: int, alpha: int, random_b: bool):
    """The builtin model in transformers alone with peft adapters on attention and on the experts' parameters."""
    model = get_peft_model(_eager_builtin(), LoraConfig(r=r, lora_alpha=alpha, target_modules=ATTENTION,
                                                        target_parameters=EXPERTS))
    if random_b:  # B starts at zero; random B makes the adapters change the output, so that the check means something
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.05)
    return model


def _ktorch_from_folder(folder: str, experts_dtype: str = "bf16"):
    """The builtin model loaded by ktorch (experts packed) with the adapters of a peft folder, trainable."""
    model, _ = ktorch.load("builtin", device="cpu", dtype=torch.float32, experts_dtype=experts_dtype, progress=False)
    ktorch.prepare(model, device="cpu", trainable=True, gradient_checkpointing=False)
    return ktorch.lora.load_adapter(model, folder, is_trainable=True)


def _expert_adapter_pairs(kt_model, eager_model):
    """(name, ktorch parameter, peft parameter) for layer 0's expert adapters."""
    ours = kt_model.base_model.model.model.layers[0].mlp.experts.kt_lora
    theirs = eager_model.base_model.model.model.layers[0].mlp.experts  # down_proj wraps gate_up_proj (sorted names)
    return [
        ("gate_up A", ours.gate_up_proj.lora_A.weight, theirs.base_layer.lora_A["default"].weight),
        ("gate_up B", ours.gate_up_proj.lora_B.weight, theirs.base_layer.lora_B["default"].weight),
        ("down A", ours.down_proj.lora_A.weight, theirs.lora_A["default"].weight),
        ("down B", ours.down_proj.lora_B.weight, theirs.lora_B["default"].weight),
    ]


def test_loss_and_gradients_match_peft_on_eager_experts(tmp_path, one_thread):
    eager = _peft_eager(r=4, alpha=8, random_b=True)
    eager.save_pretrained(tmp_path)  # peft's own files, read back by ktorch.lora.load_adapter
    kt = _ktorch_from_folder(str(tmp_path))
    for name, ours, theirs in _expert_adapter_pairs(kt, eager):
        assert torch.equal(ours, theirs), name
    eager.train()
    kt.train()
    x = torch.randint(0, 4096, (2, 24))
    loss_e = eager(input_ids=x, labels=x).loss
    loss_k = kt(input_ids=x, labels=x).loss
    # fp32 hidden states and bf16 checkpoint weights (packed without loss): the same function up to summation order
    assert abs(loss_e.item() - loss_k.item()) < 1e-4 * abs(loss_e.item())
    loss_e.backward()
    loss_k.backward()
    grads_e = {n: p.grad for n, p in eager.named_parameters() if p.requires_grad and "experts" not in n}
    grads_k = {n: p.grad for n, p in kt.named_parameters() if p.requires_grad and "kt_lora" not in n}
    assert grads_e.keys() == grads_k.keys() and len(grads_e) == 8 * eager.config.num_hidden_layers
    for n in grads_e:
        err = (grads_k[n] - grads_e[n]).norm() / grads_e[n].norm()
        assert err < 1e-4, (n, err.item())
    for name, ours, theirs in _expert_adapter_pairs(kt, eager):
        err = (ours.grad - theirs.grad).norm() / theirs.grad.norm()
        assert err < 1e-4, (name, err.item())


def test_adapter_saved_by_ktorch_loads_into_peft(tmp_path, one_thread):
    eager = _peft_eager(r=4, alpha=8, random_b=True)
    eager.save_pretrained(tmp_path / "start")
    kt = _ktorch_from_folder(str(tmp_path / "start"))
    with torch.no_grad():  # change every adapter so the round trip carries new values
        for p in kt.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.01)
    ktorch.lora.save_adapter(kt, str(tmp_path / "trained"))
    loaded = PeftModel.from_pretrained(_eager_builtin(), str(tmp_path / "trained"))
    kt.eval()
    loaded.eval()
    x = torch.randint(0, 4096, (2, 16))
    with torch.no_grad():
        a, b = kt(input_ids=x).logits, loaded(input_ids=x).logits
    assert (a - b).abs().max() < 1e-3 * b.abs().max()
    with torch.no_grad():  # and the adapters did change the model
        base = _eager_builtin()(input_ids=x).logits
    assert (b - base).abs().max() > 1e-2 * base.abs().max()


def test_lora_without_experts_adapters_trains_attention_through_the_fused_op(one_thread):
    """Attention-only LoRA: the experts run through kt.fused_moe itself (its backward carries the gradient)."""
    model, _ = ktorch.load("builtin", device="cpu", dtype=torch.float32, experts_dtype="int8", progress=False)
    ktorch.prepare(model, device="cpu", trainable=True)  # with gradient checkpointing
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=ATTENTION))
    model.train()
    x = torch.randint(0, 4096, (2, 16))
    model(input_ids=x, labels=x).loss.backward()
    grads = [p.grad for n, p in model.named_parameters() if p.requires_grad]
    assert grads and all(g is not None for g in grads)
    # layer 0's adapters get gradient only through the later layers' experts
    a = model.base_model.model.model.layers[0].self_attn.q_proj.lora_A["default"].weight.grad
    b = model.base_model.model.model.layers[0].self_attn.q_proj.lora_B["default"].weight.grad
    assert a.abs().sum() == 0 and b.abs().sum() > 0  # B = 0 at start: only B moves at step one


class _CountCpuExpertCalls(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the CPU experts' op executions (kt.fused_moe, kt.fused_moe_delta). Outside selective checkpointing's
    own mode: a call answered from its cache never reaches this one."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.kt.fused_moe.default, torch.ops.kt.fused_moe_delta.default):
            self.calls += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("expert_lora", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_checkpointing_keeps_the_cpu_experts_outputs(expert_lora, dtype, one_thread):
    """prepare(trainable=True) checkpoints the decoder layers and keeps the CPU experts' outputs (selective
    activation checkpointing): the backward recomputes the layers but not the CPU op (one call a MoE layer a step
    with checkpointing, as without), and the loss and every gradient equal those of the model without checkpointing
    (the same ops on the same values)."""
    x = torch.randint(0, 4096, (2, 24), generator=torch.Generator().manual_seed(3))
    results = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model, _ = ktorch.load("builtin", device="cpu", dtype=dtype, experts_dtype="int8", progress=False)
        ktorch.prepare(model, device="cpu", trainable=True, gradient_checkpointing=checkpointing)
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=ATTENTION))
        if expert_lora:
            ktorch.lora.add_expert_lora(model, r=4, lora_alpha=8)
        with torch.no_grad():  # B = 0 at the start; random B so that the adapters act on the output
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.05)
        model.train()
        with _CountCpuExpertCalls() as count:
            loss = model(input_ids=x, labels=x).loss
            forward_calls = count.calls
            loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        results.append((loss.item(), forward_calls, count.calls, grads))
    (loss0, f0, c0, g0), (loss1, f1, c1, g1) = results
    layers = model.config.num_hidden_layers
    assert f0 == f1 == layers and c0 == c1 == layers, (f0, c0, f1, c1)
    assert loss0 == loss1
    assert g0.keys() == g1.keys() and len(g0) > 0
    for name in g0:
        assert torch.equal(g0[name], g1[name]), name


STEPS, BATCH, SEQ, LR = 200, 4, 32, 1e-3


def _batches(stream: torch.Tensor, steps: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, stream.numel() - SEQ, (BATCH,), generator=g)
        yield torch.stack([stream[s:s + SEQ] for s in starts.tolist()])


def _held_out_loss(model, held_out: torch.Tensor) -> float:
    model.eval()
    n = held_out.numel() // SEQ
    chunks = held_out[: n * SEQ].view(n, SEQ)
    with torch.no_grad():
        loss = sum(model(input_ids=chunks[i:i + 8], labels=chunks[i:i + 8]).loss.item() * chunks[i:i + 8].shape[0]
                   for i in range(0, n, 8)) / n
    model.train()
    return loss


def _fine_tune(model, train: torch.Tensor, held_out: torch.Tensor) -> tuple[float, float]:
    torch.manual_seed(0)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.0)
    before = _held_out_loss(model, held_out)
    model.train()
    for x in _batches(train, STEPS, seed=1):
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    return before, _held_out_loss(model, held_out)


ADJECTIVES = ["quiet", "red", "old", "brave", "small", "bright", "lazy", "clever"]
NOUNS = ["fox", "river", "teacher", "robot", "garden", "engine", "violin", "market"]
VERBS = ["follows", "paints", "repairs", "watches", "carries", "visits"]
PLACES = ["the bridge", "the station", "a hill", "the harbor", "the library"]


def small_text(sentences: int, seed: int) -> str:
    """A small text in a fixed pattern, which the built-in model (trained on fortunes and Python documentation)
    has not seen: fine-tuning has something to learn, and held-out sentences of the same pattern show it."""
    g = torch.Generator().manual_seed(seed)

    def pick(words):
        return words[int(torch.randint(len(words), (1,), generator=g))]

    lines = []
    for i in range(sentences):
        lines.append(f"{i % 10}. The {pick(ADJECTIVES)} {pick(NOUNS)} {pick(VERBS)} the {pick(NOUNS)} near "
                     f"{pick(PLACES)}.")
    return "\n".join(lines)


def test_fine_tuning_lowers_held_out_loss_like_peft_on_eager_experts(tmp_path, one_thread):
    """200 steps of LoRA (attention + experts, r=8) on a small text, scored on held-out sentences of it: ktorch
    (experts packed bf16, kt.fused_moe_delta and its backward) against peft on transformers' eager experts, from the
    same initial adapters and the same batches."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(BUILTIN_PATH))
    train = token_stream(tokenizer, [small_text(600, seed=1)])
    held_out = token_stream(tokenizer, [small_text(200, seed=2)])[: 32 * SEQ]

    eager = _peft_eager(r=8, alpha=16, random_b=False)
    eager.save_pretrained(tmp_path)
    kt = _ktorch_from_folder(str(tmp_path))
    eager_before, eager_after = _fine_tune(eager, train, held_out)
    kt_before, kt_after = _fine_tune(kt, train, held_out)
    assert abs(kt_before - eager_before) < 1e-3 * eager_before
    assert eager_after < 0.7 * eager_before, (eager_before, eager_after)  # the fine-tuning learns the text
    assert kt_after < 0.7 * kt_before, (kt_before, kt_after)
    assert abs(kt_after - eager_after) <= 0.02 * eager_after, (kt_after, eager_after)


# ---------------------------------------------------------------- the crossings and the adapters' products


def _builtin_experts(device: str, dtype: torch.dtype):
    """Layer 0's packed experts of the built-in model (bf16 experts) with random adapters on gate_up and down."""
    model, _ = ktorch.load("builtin", device=device, dtype=dtype, experts_dtype="bf16", progress=False)
    ktorch.prepare(model, device=device, trainable=True, gradient_checkpointing=False)
    ktorch.lora.add_expert_lora(model, r=4, lora_alpha=8, device=device)
    experts = model.model.layers[0].mlp.experts
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for f in (experts.kt_lora.gate_up_proj, experts.kt_lora.down_proj):
            f.lora_B.weight.copy_(torch.randn(f.lora_B.weight.shape, generator=g) * 0.05)
    return experts


def _routing(T: int, E: int, K: int, device: str, seed: int):
    """Top-k ids (distinct per token, a few slots skipped: -1) and weights [T, K]."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    ids[1, 2] = -1
    ids[4, 0] = -1
    weights = torch.rand(T, K, generator=g)
    return ids.to(device), weights.to(device)


def test_project_out_sum_equals_the_pairs_products():
    """The down adapter's per-token product against each pair's B_e u summed with its coefficient (the
    formulation it replaced), float64, with repeated experts in a token and skipped slots (clamped, coef 0)."""
    f = ktorch.lora.ExpertLoRAFactors(6, 10, 12, 3, dtype=torch.float64)
    with torch.no_grad():
        f.lora_B.weight.normal_()
    T, K = 5, 3
    ids = torch.tensor([[0, 1, 2], [3, 3, 5], [4, 0, 0], [5, 2, 1], [1, 4, 3]])
    u = torch.randn(T, K, 3, dtype=torch.float64, requires_grad=True)
    coef = torch.rand(T, K, dtype=torch.float64)
    coef[2, 1:] = 0  # skipped slots: id clamped to 0, no weight
    coef.requires_grad_(True)
    ours = f.project_out_sum(u, ids, coef)
    pairs = (f.project_out(u, ids) * coef.unsqueeze(-1)).sum(1)
    torch.testing.assert_close(ours, pairs, rtol=1e-12, atol=1e-12)
    g = torch.randn_like(ours)
    a = torch.autograd.grad(ours, (u, coef, f.lora_B.weight), g)
    b = torch.autograd.grad(pairs, (u, coef, f.lora_B.weight), g)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)
    torch.autograd.gradcheck(lambda u_, c_: f.project_out_sum(u_, ids, c_), (u, coef))


def test_expert_lora_forward_bf16_deltas_match_fp32(monkeypatch, one_thread):
    """bf16 hidden states: the deltas cross (and their gradient returns) in bf16; output and gradients (hidden,
    routing weights, adapters) within bf16 tolerance of the same module on fp32 hidden states (fp32 deltas, the
    decoded exact path)."""
    experts = _builtin_experts("cpu", torch.float32)
    E, H = experts.kt_lora.gate_up_proj.num_experts, experts.kt_w2.shape[1] * 16
    seen = []
    real = ktorch.ops.host_transfer.host_copies
    monkeypatch.setattr(ktorch.ops.host_transfer, "host_copies",
                        lambda ts: seen.append([t.dtype for t in ts]) or real(ts))
    ids, w = _routing(12, E, 4, "cpu", seed=5)
    x = torch.randn(12, H, generator=torch.Generator().manual_seed(6))
    params = list(experts.kt_lora.parameters())
    results = []
    for dtype in (torch.float32, torch.bfloat16):
        seen.clear()
        xd = x.to(dtype).requires_grad_(True)
        wd = w.to(dtype).requires_grad_(True)
        out = ktorch.lora.expert_lora_forward(experts, xd, ids, wd)
        assert out.dtype == dtype
        assert seen[0][-1] == dtype  # the deltas cross in hidden's dtype
        go = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(dtype)
        grads = torch.autograd.grad(out, [xd, wd] + params, go)
        assert seen[-1] == [dtype, dtype]  # d out and d h return to the CPU in hidden's dtype
        results.append([out.float()] + [gr.float() for gr in grads])
    names = ["out", "d hidden", "d weights", "gate_up A", "gate_up B", "down A", "down B"]
    for name, a, b in zip(names, *results):
        err = (b - a).norm() / a.norm()
        assert err < 2e-2, (name, err.item())


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="the pinned host<->GPU crossings need a CUDA device")


@cuda
def test_expert_lora_forward_on_cuda_equals_plain_copies(monkeypatch):
    """The pinned, non-blocking crossings change nothing but the copies: output and every gradient bit for bit
    equal to the same function with plain (pageable, blocking) .to() copies, bf16 and fp32 hidden states."""
    experts = _builtin_experts("cuda", torch.bfloat16)
    E, H = experts.kt_lora.gate_up_proj.num_experts, experts.kt_w2.shape[1] * 16
    params = list(experts.kt_lora.parameters())
    ids, w = _routing(64, E, 4, "cuda", seed=8)

    def run(dtype):
        x = torch.randn(64, H, generator=torch.Generator().manual_seed(9)).to("cuda", dtype).requires_grad_(True)
        wd = w.to(dtype).requires_grad_(True)
        out = ktorch.lora.expert_lora_forward(experts, x, ids, wd)
        go = torch.randn(out.shape, generator=torch.Generator().manual_seed(10)).to("cuda", dtype)
        return [out] + list(torch.autograd.grad(out, [x, wd] + params, go))

    for dtype in (torch.bfloat16, torch.float32):
        ours = run(dtype)
        with monkeypatch.context() as m:
            m.setattr(ktorch.ops.host_transfer, "host_copies", lambda ts: [t.to("cpu") for t in ts])
            m.setattr(ktorch.ops.host_transfer, "device_copy", lambda t, device: t.to(device))
            plain = run(dtype)
        for a, b in zip(ours, plain):
            assert a.device.type == "cuda" and torch.equal(a, b)
