"""ktorch.generate (ktorch/generation.py): the one generation path of ``ktorch generate`` and the benchmarks.

CPU: greedy tokens equal transformers' ``generate`` on the same prepared model (families of tests/models.py and the
built-in model), deferral equals the eager deferral reference, seeded sampling repeats, the repetition penalty is
transformers', end-of-sequence stops, the decode step has no host sync (so it can be captured: checked by
recording every ``aten._local_scalar_dense`` / ``nonzero`` while a step runs), the kept decoder is reused only
when the length, sampling and deferral fit. GPU (device): the captured step gives the eager step's tokens, replays
one graph per decode step, with and without deferral (the eager deferral on the GPU is the reference).
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import ktorch
from ktorch.generation import Sampling, generate, sample_next
from models import tiny_model

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (the captured decode step)")


def _prepared(family: str, device: str = "cpu", **overrides):
    """A tiny random model, fp32 outside the experts (bf16 packed): greedy comparisons with another cache layout
    (transformers' dynamic cache, eager vs captured) then differ by rounding far below the logits' gaps."""
    torch.manual_seed(0)
    model = tiny_model(family, dtype=torch.float32, **overrides)
    model.generation_config.eos_token_id = None
    ktorch.prepare(model, device=device, experts_dtype="bf16", gpu_memory="off")  # the CPU op on a GPU too
    return model


def _hf_greedy(model, ids, n):
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "mixtral", "olmoe"])
def test_greedy_matches_transformers_generate(family):
    model = _prepared(family)
    ids = torch.randint(0, model.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(1))
    got = generate(model, ids, 12).ids
    assert got == _hf_greedy(model, ids, 12)


def test_builtin_model_and_its_end_of_sequence():
    model, tokenizer = ktorch.load("builtin", device="cpu")
    ids = tokenizer("The meaning of life is", return_tensors="pt").input_ids
    result = generate(model, ids, 24)
    assert result.ids == model.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1]:].tolist()
    # stop on the 5th token as if it were the end of sequence: it is the last one returned
    stop = generate(model, ids, 24, eos_token_id=result.ids[4]).ids
    first = result.ids.index(result.ids[4])
    assert stop == result.ids[:first + 1]
    t = result.timings
    assert t.prompt_tokens == ids.shape[1] and t.new_tokens == len(result.ids) and t.first_token_s > 0
    assert not t.cuda_graphs and t.warmup_s == 0


def test_deferral_applies_to_decode_only_and_matches_the_eager_reference():
    """generate with deferred_experts=d: the prefill's first token is the undeferred model's, and every later
    token is what the deferring model's own eager forward predicts for the sequence so far."""
    model = _prepared("qwen3_moe", num_hidden_layers=3)
    ids = torch.randint(0, model.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(3))
    plain = generate(model, ids, 10).ids
    ktorch.set_deferred_experts(model, 1)
    got = generate(model, ids, 10).ids
    assert got[0] == plain[0]
    with torch.inference_mode():
        # reference: the deferring eager model, decoding one token at a time over a dynamic cache after an
        # undeferred prefill
        from transformers import DynamicCache

        cache = DynamicCache(config=model.config)
        ktorch.set_deferred_experts(model, 0)
        model.kt_deferred_experts = 1
        from ktorch.generation import _set_deferral

        model(input_ids=ids, past_key_values=cache, use_cache=True)
        _set_deferral(model, 1)
        want = [got[0]]
        for _ in range(9):
            out = model(input_ids=torch.tensor([[want[-1]]]), past_key_values=cache, use_cache=True)
            want.append(int(out.logits[0, -1].float().argmax()))
    assert got == want
    ktorch.set_deferred_experts(model, 0)


def test_seeded_sampling_repeats_and_seeds_differ():
    model = _prepared("qwen3_moe")
    ids = torch.randint(0, model.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(4))
    a = generate(model, ids, 16, temperature=1.5, top_p=0.95, seed=7).ids
    b = generate(model, ids, 16, temperature=1.5, top_p=0.95, seed=7).ids
    c = generate(model, ids, 16, temperature=1.5, top_p=0.95, seed=8).ids
    assert a == b and a != c


def test_sample_next_top_p_and_repetition_penalty():
    torch.manual_seed(0)
    logits = torch.randn(1, 50)
    # top-p: only tokens of the nucleus are ever drawn
    probs = torch.softmax(logits[0] / 0.7, -1)
    order = probs.argsort(descending=True)
    mass = probs[order].cumsum(0)
    nucleus = set(order[: int((mass < 0.6).sum()) + 1].tolist())
    gen = torch.Generator().manual_seed(0)
    drawn = {int(sample_next(logits, Sampling(0.7, 0.6), None, gen)) for _ in range(300)}
    assert drawn <= nucleus and len(drawn) > 1
    # repetition penalty: transformers' processor on the same logits
    from transformers import RepetitionPenaltyLogitsProcessor

    seen_ids = torch.tensor([[3, 9, 9, 17]])
    seen = torch.zeros(50, dtype=torch.bool)
    seen[seen_ids[0]] = True
    want = RepetitionPenaltyLogitsProcessor(1.7)(seen_ids, logits.clone()).argmax(-1)
    assert int(sample_next(logits, Sampling(0.0, 1.0, 1.7), seen, None)) == int(want)
    with pytest.raises(ValueError, match="top_p"):
        Sampling(1.0, 0.0)
    with pytest.raises(ValueError, match="temperature"):
        Sampling(-1.0)


def test_repetition_penalty_matches_transformers_generate():
    model = _prepared("qwen3_moe")
    ids = torch.randint(0, model.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(5))
    got = generate(model, ids, 12, repetition_penalty=1.5).ids
    with torch.inference_mode():
        want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                              repetition_penalty=1.5, pad_token_id=0)[0, 5:].tolist()
    assert got == want


class _HostSyncs(TorchDispatchMode):
    """Records the ops that read a tensor's value on the host (a CUDA device sync, not allowed in a capture)."""

    SYNCING = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default,
               torch.ops.aten.masked_select.default, torch.ops.aten._unique2.default}

    def __init__(self):
        super().__init__()
        self.seen: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.SYNCING:
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "mixtral", "olmoe"])
@pytest.mark.parametrize("deferred", [0, 1])
def test_decode_step_reads_no_value_on_the_host(family, deferred):
    model = _prepared(family)
    ktorch.set_deferred_experts(model, deferred)
    ids = torch.randint(0, model.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(6))
    generate(model, ids, 3, temperature=0.8, top_p=0.9, repetition_penalty=1.2)
    decoder = model.kt_decoder
    with torch.inference_mode(), _HostSyncs() as mode:
        decoder._step()
    assert mode.seen == []


def test_the_kept_decoder_is_reused_where_it_fits_and_restepped_for_other_sampling():
    """The kept decoder serves a call that fits its cache; another sampling or deferral drops its decode step (and
    makes the repetition penalty's seen-token mask where one is asked) but keeps the decoder and its captured
    prefills; the tokens are those of a model that never kept one; a longer call makes a longer cache."""
    model = _prepared("qwen3_moe")
    fresh = _prepared("qwen3_moe")
    ids = torch.randint(0, model.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(8))
    generate(model, ids, 4)
    first = model.kt_decoder
    kept = first.prefill_graphs[256] = first.padded_prefill(256)  # as a capture leaves one
    assert generate(model, ids[:, :3], 6).ids == generate(fresh, ids[:, :3], 6).ids
    assert model.kt_decoder is first  # same model, shorter or equal length, same sampling: reused
    sampled = dict(temperature=0.5, repetition_penalty=1.3, seed=2)
    fresh.kt_decoder = None
    assert generate(model, ids, 4, **sampled).ids == generate(fresh, ids, 4, **sampled).ids
    assert model.kt_decoder is first and first.sampling.temperature == 0.5 and first.seen is not None
    assert first.prefill_graphs[256] is kept and first.graph is None
    ktorch.set_deferred_experts(model, 1)
    ktorch.set_deferred_experts(fresh, 1)
    fresh.kt_decoder = None
    assert generate(model, ids, 4).ids == generate(fresh, ids, 4).ids
    assert model.kt_decoder is first and first.deferred == 1 and first.seen is None
    with pytest.warns(UserWarning, match="pass this model's context"):  # a cache past the tiny model's 256 positions
        generate(model, ids, first.max_len, temperature=0.5)
    assert model.kt_decoder is not first and model.kt_decoder.max_len > first.max_len  # a longer cache


def _recorded_prefills(monkeypatch) -> list:
    """Records each Decoder.prefill: (decoder, prompt length, whether any experts module deferred during it)."""
    import ktorch.generation as generation
    from ktorch.placement import experts_modules

    calls = []
    prefill = generation.Decoder.prefill

    def recorded(self, ids):
        deferring = any(hasattr(m, "kt_deferral") for _, m in experts_modules(self.model))
        calls.append((self, ids.shape[1], deferring))
        return prefill(self, ids)

    monkeypatch.setattr(generation.Decoder, "prefill", recorded)
    return calls


def test_warm_up_does_nothing_on_the_cpu(monkeypatch):
    """ktorch.warm_up (what ktorch.load ends with) on a CPU model: no prefill, 0.0 s, no decoder kept; bad token
    counts are refused."""
    calls = _recorded_prefills(monkeypatch)
    model = _prepared("qwen3_moe")
    assert ktorch.warm_up(model) == 0.0 and ktorch.warm_up(model, 16) == 0.0
    assert calls == [] and getattr(model, "kt_decoder", None) is None
    for bad in (0, -3, True, 2.5, "16"):
        with pytest.raises(ValueError, match="tokens must be an int >= 1"):
            ktorch.warm_up(model, bad)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_load_on_a_gpu_imports_the_compiler_before_reading_the_weights(device, monkeypatch):
    """ktorch.load on a GPU starts the compiler's imports (preload_compiler) before it opens the checkpoint, as the
    command line does, so that they run beside the load and not beside the first prompt; on the CPU it does not.
    (The device check is stubbed: no GPU is needed to see the order.)"""
    from ktorch import generation, loading, placement

    order = []
    monkeypatch.setattr(placement, "usable_device", lambda device, what: torch.device(device))
    monkeypatch.setattr(generation, "preload_compiler", lambda: order.append("preload"))

    def opened(path):
        order.append("open")
        raise RuntimeError("stop here")

    monkeypatch.setattr(loading, "open_checkpoint", opened)
    with pytest.raises(RuntimeError, match="stop here"):
        ktorch.load("unused", device=device)
    assert order == (["preload", "open"] if device == "cuda" else ["open"])


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "top_p": 0.9, "repetition_penalty": 1.3}],
                         ids=["greedy", "sampled"])
@pytest.mark.parametrize("deferred", [0, 1])
def test_warm_up_prefill_leaves_the_tokens_and_the_kept_decoder(sampling, deferred, monkeypatch):
    """The warm-up's prefill (run here on the CPU; ktorch.warm_up runs it on a GPU only): WARM_UP_TOKENS capped by
    the model's maximum positions, through a decoder of its own that is not kept (the model's kept decoder is the same
    object with the same KV tensors after it; a model without one has none), expert deferral off as in generate's
    prefill and back on after it; generate gives the same tokens (greedy, and seeded sampling) with and without a
    warm-up before."""
    import ktorch.generation as generation
    from ktorch.placement import experts_modules

    def model_():
        m = _prepared("qwen3_moe", num_hidden_layers=3)
        ktorch.set_deferred_experts(m, deferred)
        return m

    ids = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(4))
    cold = generate(model_(), ids, 8, seed=3, **sampling).ids
    calls = _recorded_prefills(monkeypatch)

    model = model_()  # warmed up before its first generate
    assert generation._warm_up_prefill(model, generation.WARM_UP_TOKENS) > 0
    (decoder, length, deferring), = calls
    assert length == model.config.max_position_embeddings == 256 < generation.WARM_UP_TOKENS and not deferring
    assert getattr(model, "kt_decoder", None) is None and decoder.max_len == 256
    assert all(hasattr(m, "kt_deferral") == (deferred > 0) for _, m in experts_modules(model))
    assert generate(model, ids, 8, seed=3, **sampling).ids == cold

    kept = model.kt_decoder  # warmed up again between two generate calls
    keys = [layer.keys for layer in kept.cache.layers]
    calls.clear()
    assert generation._warm_up_prefill(model, 40) > 0 and len(calls) == 1 and calls[0][0] is not kept
    assert calls[0][1] == 40 and calls[0][0].max_len == 40
    assert model.kt_decoder is kept and all(a is b for a, b in zip(keys, [layer.keys for layer in kept.cache.layers]))
    assert generate(model, ids, 8, seed=3, **sampling).ids == cold
    assert model.kt_decoder is kept  # still the one the first call made


def test_bad_arguments_are_clear_errors():
    model = _prepared("qwen3_moe")
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, torch.tensor([[1, 2]]), 0)
    with pytest.raises(ValueError, match="batch 1"):
        generate(model, torch.tensor([[1, 2], [3, 4]]), 2)
    with pytest.raises(ValueError, match="batch 1"):
        generate(model, torch.zeros(1, 0, dtype=torch.long), 2)
    with pytest.raises(ValueError, match="input_ids must be integer token ids, got torch.float32"):
        generate(model, torch.tensor([[1.0, 2.0]]), 2)
    vocab = model.get_input_embeddings().num_embeddings
    for bad, low, high in (([[1, vocab]], 1, vocab), ([[-1, 3]], -1, 3)):
        with pytest.raises(ValueError, match=rf"input_ids must be token ids in \[0, {vocab}\) \(the model's "
                                             rf"vocabulary\), got values from {low} to {high}"):
            generate(model, torch.tensor(bad), 2)
    assert len(generate(model, torch.tensor([[0, vocab - 1]]), 2).ids) == 2  # both ends of the range are ids


def test_passing_the_context_warns():
    """Past config.max_position_embeddings generation runs (as transformers' does) but says so; within it, no
    warning."""
    import warnings

    model = _prepared("qwen3_moe", max_position_embeddings=16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        generate(model, torch.arange(1, 11)[None], 6)  # 10 + 6 = 16: within
    with pytest.warns(UserWarning, match=r"the prompt \(10 tokens\) and max_new_tokens \(7\) pass this model's "
                                         r"context of 16 positions"):
        result = generate(model, torch.arange(1, 11)[None], 7)
    assert len(result.ids) == 7


@pytest.mark.parametrize("context", [None, 16, 1000, 2048, 40960])
def test_cache_lengths_hold_the_positions_in_whole_attention_blocks(context):
    """Every cache length the decoder gets holds the positions asked for and is a whole number of the decode
    attention's blocks (its GPU kernel refuses any other: a 2102-token prompt with 2 new tokens past a 2048-position
    context once asked for a cache of 2104 and crashed on the GPU); within the context it is not made longer than
    the bucket or the context."""
    from ktorch.decode_attention import BLOCK
    from ktorch.generation import CACHE_BUCKET, cache_length

    for max_len in [1, 2, 15, 16, 17, 127, 128, 129, 255, 256, 257, 999, 1000, 1001, 2047, 2048, 2049, 2104, 5000,
                    40960, 40961]:
        length = cache_length(max_len, context)
        assert length >= max_len and length % BLOCK == 0, (max_len, context, length)
        bucket = -(-max_len // CACHE_BUCKET) * CACHE_BUCKET
        assert length <= bucket, (max_len, context, length)
        if context and max_len <= context:
            assert length <= -(-context // BLOCK) * BLOCK, (max_len, context, length)
    assert cache_length(2104, 2048) == 2176 and cache_length(2000, 2048) == 2048 and cache_length(100, None) == 256


def _greedy_steps(model, ids, n, compiled: bool) -> list:
    from ktorch.generation import Decoder, compiled_layers

    decoder = Decoder(model, 32, torch.device("cpu"), Sampling(), cuda_graphs=False)
    out = []
    with torch.inference_mode():
        decoder.prefill(ids)
        with compiled_layers(model, decoder.cache) if compiled else contextlib.nullcontext():
            for _ in range(n):
                decoder._step()
                out.append(int(decoder.token))
    return out


def test_compiled_layers_ask_inductor_for_programmatic_dependent_launch(monkeypatch):
    """The decode step's compiled layers ask Inductor for triton.enable_pdl (it emits it on sm_90+ GPUs only), one
    compile per layer class."""
    from torch._inductor import config as inductor_config

    from ktorch import generation

    if not hasattr(inductor_config.triton, "enable_pdl"):
        pytest.skip("this torch's Inductor has no triton.enable_pdl")
    seen = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: seen.append(kwargs) or fn)
    monkeypatch.setattr(generation, "_COMPILED_FORWARDS", {})

    class Layer:
        def forward(self):
            return None

    assert generation._compiled_forward(Layer) is generation._compiled_forward(Layer)
    assert len(seen) == 1 and seen[0]["options"]["triton.enable_pdl"] is True and seen[0]["dynamic"] is False


def test_compiled_layers_keep_compiling_past_dynamos_default_entries():
    """Many (class, shapes) compiled in one process: with transformers' layer and attention forwards wrapped in one
    decorator they share a code object and its cache entries, and past Dynamo's limit a frame runs eagerly (on the
    device a captured step then fails in flex attention's eager form: session 36). Here 3 configurations, with the
    process's limit lowered to 1 before: each still compiles its graphs; the limit comes back."""
    from torch._dynamo.utils import counters

    from ktorch.generation import Decoder, compiled_layers, decoder_layers

    before = torch._dynamo.config.recompile_limit
    seen = []
    with torch._dynamo.config.patch(recompile_limit=1):
        for heads in range(1, 4):
            model = _prepared("qwen3_moe", num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=1,
                              head_dim=8)
            layer = decoder_layers(model)[0]
            original = type(layer.mlp.gate).forward
            decoder = Decoder(model, 8, torch.device("cpu"), Sampling(), cuda_graphs=False)
            ids = torch.tensor([[3, 5]])
            counters.clear()
            with torch.inference_mode():
                decoder.prefill(ids)
                with compiled_layers(model, decoder.cache):
                    assert torch._dynamo.config.recompile_limit >= 256
                    assert torch._dynamo.config.fail_on_recompile_limit_hit  # past it: an error, not eager layers
                    decoder._step()
            seen.append(counters["stats"]["unique_graphs"])
            assert type(layer.mlp.gate).forward is original
        assert torch._dynamo.config.recompile_limit == 1
    assert torch._dynamo.config.recompile_limit == before
    assert all(n > 0 for n in seen), seen  # each configuration compiled its graphs: none fell back to eager


def test_compiled_layers_compile_one_layer_for_all_and_recompile_only_a_changed_model():
    """The decode step's regional compilation (what the GPU capture runs): the same tokens as the eager layers; the
    graphs compiled do not grow with the layer count (10 layers, more than Dynamo's 8 entries per function); a
    second model of the same config compiles nothing; a model of another shape compiles anew."""
    from torch._dynamo.utils import counters

    model = _prepared("qwen3_moe", num_hidden_layers=10)
    ids = torch.randint(0, model.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(20))
    eager = _greedy_steps(model, ids, 4, compiled=False)
    torch._dynamo.reset()
    counters.clear()
    assert _greedy_steps(model, ids, 4, compiled=True) == eager
    graphs = counters["stats"]["unique_graphs"]
    assert 0 < graphs <= 12, dict(counters["stats"])  # about 8 graphs for every layer, not 8 per layer
    assert _greedy_steps(model, ids, 4, compiled=False) == eager  # the context restores the eager model
    torch.manual_seed(1)
    same = _prepared("qwen3_moe", num_hidden_layers=10)  # other weights, the same code and shapes
    assert _greedy_steps(same, ids, 3, compiled=True) == _greedy_steps(same, ids, 3, compiled=False)
    assert counters["stats"]["unique_graphs"] == graphs
    other = _prepared("qwen3_moe", num_hidden_layers=2, hidden_size=96)
    assert _greedy_steps(other, ids, 3, compiled=True) == _greedy_steps(other, ids, 3, compiled=False)
    assert counters["stats"]["unique_graphs"] > graphs


def test_eager_attention_is_registered_once_per_implementation():
    """compiled_layers(eager_attention=True) (what ``ktorch serve`` captures with) runs the model's attention under
    ``ktorch_eager|<implementation>``: transformers' function wrapped in torch.compiler.disable, with the
    implementation's mask function; the same wrapper object every time (Dynamo guards it by identity); an
    implementation transformers does not register is an error naming it; the context puts the model's back."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from ktorch.generation import EAGER_ATTENTION_PREFIX, Decoder, _eager_attention_name, compiled_layers

    name = _eager_attention_name("sdpa")
    assert name == EAGER_ATTENTION_PREFIX + "sdpa"
    wrapped = ALL_ATTENTION_FUNCTIONS[name]
    assert wrapped is not ALL_ATTENTION_FUNCTIONS["sdpa"]
    assert getattr(wrapped, "__wrapped__", None) is ALL_ATTENTION_FUNCTIONS["sdpa"]
    assert ALL_MASK_ATTENTION_FUNCTIONS[name] is ALL_MASK_ATTENTION_FUNCTIONS["sdpa"]
    assert _eager_attention_name("sdpa") == name and ALL_ATTENTION_FUNCTIONS[name] is wrapped
    with pytest.raises(ValueError, match="'no_such_attention'"):
        _eager_attention_name("no_such_attention")
    model = _prepared("qwen3_moe")
    model.config._attn_implementation = "sdpa"
    decoder = Decoder(model, 32, torch.device("cpu"), Sampling(), cuda_graphs=False)
    with compiled_layers(model, decoder.cache, eager_attention=True):
        assert model.config._attn_implementation == name
    assert model.config._attn_implementation == "sdpa"
    assert not any("forward" in m.__dict__ for m in model.modules())


# ---------------------------------------------------------------- GPU: the captured step


@needs_cuda
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize("deferred", [0, 1])
def test_captured_step_matches_eager_and_replays_one_graph_per_step(family, deferred, monkeypatch):
    model = _prepared(family, device="cuda")
    ktorch.set_deferred_experts(model, deferred)
    ids = torch.randint(0, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(10))
    eager = generate(model, ids, 64, cuda_graphs=False).ids
    replays = []
    original = torch.cuda.CUDAGraph.replay
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", lambda self: replays.append(1) or original(self))
    result = generate(model, ids, 64)  # the capture compiles the decoder layers (compiled_layers)
    assert result.timings.cuda_graphs and result.timings.warmup_s > 0
    assert result.ids == eager
    # one replay per decode step after the capture's eager one, nothing else (a first prompt prefills eagerly)
    assert result.timings.prefill_capture_s == 0 and len(replays) == 62
    again = generate(model, ids, 64)  # the kept capture: no new warm-up; the length's second prompt: its prefill
    assert again.ids == eager and again.timings.warmup_s == 0 and again.timings.prefill_capture_s > 0  # captured after
    third = generate(model, ids, 64)  # the prefill replayed, then 63 decode steps
    assert third.ids == eager and third.timings.prefill_capture_s == 0 and len(replays) == 62 + 63 + 1 + 63
    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    model.kt_decoder = None
    assert generate(model, ids, 64).ids == eager  # a new capture of the same model: no recompilation
    assert counters["stats"]["unique_graphs"] == graphs


@needs_cuda
def test_captured_sampling_is_seeded():
    model = _prepared("qwen3_moe", device="cuda")
    ids = torch.randint(0, model.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(12))
    a = generate(model, ids, 24, temperature=1.2, top_p=0.9, seed=3).ids
    b = generate(model, ids, 24, temperature=1.2, top_p=0.9, seed=3).ids
    c = generate(model, ids, 24, temperature=1.2, top_p=0.9, seed=4).ids
    assert a == b and a != c


@needs_cuda
def test_a_failed_capture_leaves_the_stream_and_the_random_generators_usable():
    """ktorch.generation.capturing: a capture a host read invalidates raises, and after it the current stream is the
    one before, draws from the device's generator and from a generator registered with the graph work (at the same
    bits for the same seed), and a new capture with a random draw replays."""
    from ktorch.generation import capturing

    device = torch.device("cuda")
    before = torch.cuda.current_stream()
    mine = torch.Generator(device="cuda").manual_seed(5)
    graph = torch.cuda.CUDAGraph()
    graph.register_generator_state(mine)
    x = torch.ones(4, device="cuda")
    with pytest.raises(RuntimeError):
        with capturing(graph, device, generators=[mine]):
            torch.rand(4, device="cuda", generator=mine)
            torch.randn(4, device="cuda")
            (x * 2).sum().item()  # a host read: not allowed while capturing
    assert torch.cuda.current_stream() == before
    torch.manual_seed(0)
    a = torch.randn(8, device="cuda")
    torch.manual_seed(0)
    assert torch.equal(a, torch.randn(8, device="cuda"))
    mine.manual_seed(7)
    b = torch.rand(8, device="cuda", generator=mine)
    mine.manual_seed(7)
    assert torch.equal(b, torch.rand(8, device="cuda", generator=mine))
    again = torch.cuda.CUDAGraph()
    with capturing(again, device):
        y = torch.rand(1000, device="cuda") + x.sum()
    again.replay()
    first = y.clone()
    again.replay()
    torch.cuda.synchronize()
    assert not torch.equal(first, y) and bool(((y >= 4) & (y < 5)).all())


@needs_cuda
def test_a_prefill_capture_that_fails_leaves_generation_working(monkeypatch):
    """A model whose prefill cannot be captured (here: a host sync in the padded prefill while capturing) warns and
    prefills eagerly; sampled generation on the GPU after it still draws (seeded) and greedy ids stay the eager ones."""
    from ktorch import generation

    model = _prepared("qwen3_moe", device="cuda")
    ids = torch.randint(0, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(13))
    eager = generate(model, ids, 8, cuda_graphs=False).ids
    original = generation.Decoder._prefill_forward

    def syncing(self, g, waits):
        out = original(self, g, waits)
        if torch.cuda.is_current_stream_capturing():
            torch.cuda.synchronize()
        return out

    monkeypatch.setattr(generation.Decoder, "_prefill_forward", syncing)
    with pytest.warns(UserWarning, match="could not be captured"):
        for _ in range(generation.CAPTURE_AFTER):
            assert generate(model, ids, 8).ids == eager
    assert model.kt_prefill_capture_failed
    assert generate(model, ids, 8).ids == eager
    a = generate(model, ids, 12, temperature=1.1, seed=3).ids
    assert a == generate(model, ids, 12, temperature=1.1, seed=3).ids


@needs_cuda
@pytest.mark.parametrize("where", ["recording", "compile"])
def test_a_decode_step_that_cannot_be_captured_decodes_eagerly(where, monkeypatch):
    """A model whose decode step cannot be captured (a host sync while recording) or compiled (an error in the
    compiled layers' first call): generate warns once, decodes the same ids eagerly, and later calls do not try
    again (the failure stays in place: a second try would raise or warn); the process's random draws still work
    (seeded sampling after it)."""
    from ktorch import generation

    model = _prepared("qwen3_moe", device="cuda")
    ids = torch.randint(0, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(17))
    eager = generate(model, ids, 10, cuda_graphs=False).ids
    model.kt_decoder = None
    original = generation.Decoder._step

    def syncing(self):  # a host read while recording
        out = original(self)
        if torch.cuda.is_current_stream_capturing():
            torch.cuda.synchronize()
        return out

    @contextlib.contextmanager
    def broken(model, cache, **kwargs):  # the compile fails before the capture's eager step
        raise RuntimeError("a compile error")
        yield

    if where == "compile":
        monkeypatch.setattr(generation, "compiled_layers", broken)
    else:
        monkeypatch.setattr(generation.Decoder, "_step", syncing)
    with pytest.warns(UserWarning, match="decodes eagerly"):
        first = generate(model, ids, 10)
    assert model.kt_decode_capture_failed and model.kt_decoder.graph is None
    assert first.ids == eager and first.timings.warmup_tokens == (0 if where == "compile" else 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert generate(model, ids, 10).ids == eager
    a = generate(model, ids, 12, temperature=1.1, seed=3).ids
    assert a == generate(model, ids, 12, temperature=1.1, seed=3).ids


def test_prefill_attention_skips_cudnn_and_restores():
    """The prefill's SDPA context leaves cuDNN attention out (its plans are built per new shape) and puts the
    process's backends back after, exceptions included; flash, memory-efficient and math stay on."""
    import torch.backends.cuda as cb

    from ktorch.generation import prefill_attention

    before = (cb.cudnn_sdp_enabled(), cb.flash_sdp_enabled(), cb.mem_efficient_sdp_enabled(), cb.math_sdp_enabled())
    with prefill_attention():
        assert not cb.cudnn_sdp_enabled()
        assert cb.flash_sdp_enabled() and cb.mem_efficient_sdp_enabled() and cb.math_sdp_enabled()
    assert (cb.cudnn_sdp_enabled(), cb.flash_sdp_enabled(), cb.mem_efficient_sdp_enabled(), cb.math_sdp_enabled()) == before
    with pytest.raises(RuntimeError):
        with prefill_attention():
            raise RuntimeError("inside")
    assert cb.cudnn_sdp_enabled() == before[0]



@needs_cuda
@pytest.mark.parametrize("stream", ["off", "auto"])
def test_cuda_prefill_waits_for_the_cpu_experts_on_the_stream(stream, monkeypatch):
    """Decoder.prefill on a GPU (RUNTIME.async_waits): the launching thread makes no host wait for the CPU experts
    (each layer's wait is a GPU kernel), and the first token and every layer's KV cache equal those of blocking
    waits bit for bit; a failing CPU experts call raises at the end of the prefill, and the next prefill works."""
    from ktorch.compile.experts_runtime import RUNTIME, ExpertsLayer
    from ktorch.generation import _decoder_for

    torch.manual_seed(0)
    model = ktorch.prepare(tiny_model("qwen3_moe", dtype=torch.bfloat16), device="cuda", experts_dtype="int8",
                           stream_experts=stream, gpu_memory="off")
    ids = torch.randint(0, 256, (1, 96), device="cuda")
    decoder = _decoder_for(model, 128, Sampling(), cuda_graphs=False)

    def prefill():
        with torch.inference_mode():
            token = int(decoder.prefill(ids).item())
        return token, [layer.keys[:, :, :96].clone() for layer in decoder.cache.layers]

    before = dict(RUNTIME.stats)
    token, keys = prefill()
    assert RUNTIME.stats["host_waits"] == before.get("host_waits", 0)
    assert RUNTIME.stats["async_waits"] > before.get("async_waits", 0)
    with monkeypatch.context() as m:
        m.setattr(RUNTIME, "async_waits", lambda device: contextlib.nullcontext())  # blocking waits
        blocking_token, blocking_keys = prefill()
    assert RUNTIME.stats["host_waits"] > before.get("host_waits", 0)
    assert token == blocking_token and all(torch.equal(a, b) for a, b in zip(keys, blocking_keys))

    def fail(self, *args):
        raise ValueError("a failing CPU experts call")

    with monkeypatch.context() as m:
        m.setattr(ExpertsLayer, "run", fail)
        with pytest.raises(RuntimeError, match="CPU experts task failed"):
            prefill()
    again, again_keys = prefill()
    assert again == token and all(torch.equal(a, b) for a, b in zip(keys, again_keys))


def _prefill_rows_seen(model) -> tuple:
    """Forward hooks recording the expert ids each experts module computed with (after the padding mask), and their
    handles."""
    seen: list = []
    hooks = [m.register_forward_hook(lambda m, args, kwargs, out: seen.append(
        (kwargs.get("top_k_index", args[1] if len(args) > 1 else None)).clone()), with_kwargs=True)
        for m in model.modules() if getattr(m, "kt_w13", None) is not None]
    return seen, hooks


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_padded_prefill_gives_the_eager_tokens_and_gives_padding_no_experts(family):
    """A prompt prefilled padded to its bucket (what a captured prefill records; here run eagerly on the CPU) gives
    the unpadded prefill's tokens, decode after it included (the logits at the prompt's last position, the cache's
    length put back to the prompt's); the experts get expert id -1 on every padding row and the prompt's ids on the
    rest."""
    model = _prepared(family)
    P = 37
    ids = torch.randint(0, model.config.vocab_size, (1, P), generator=torch.Generator().manual_seed(3))
    eager = generate(model, ids, 12).ids
    decoder = model.kt_decoder
    tokens = decoder.prefill_bucket(P)
    assert tokens == 256 and decoder.prefill_bucket(decoder.max_len + 1) is None
    seen, hooks = _prefill_rows_seen(model)
    with torch.inference_mode():
        decoder.prefill(ids)
    plain = [t for t in seen if t.shape[0] == P]
    decoder.prefill_graphs[tokens] = decoder.padded_prefill(tokens)
    seen.clear()
    try:
        padded = generate(model, ids, 12)
    finally:
        for h in hooks:
            h.remove()
    assert padded.ids == eager
    assert [layer.cumulative_length.item() for layer in decoder.cache.layers] == [P + 11] * len(decoder.cache.layers)
    rows = [t for t in seen if t.shape[0] == tokens]
    assert len(rows) == len(plain) > 0
    for full, want in zip(rows, plain):
        assert (full[P:] == -1).all() and torch.equal(full[:P], want)


def test_a_prompt_runs_the_smallest_kept_prefill_that_holds_it():
    """Decoder.prefill_graph: a prompt runs its own bucket's kept prefill, else the smallest longer one (the
    warm-up's), padded (every row past the prompt given no experts), with the unpadded prefill's tokens; none
    where no kept prefill holds it."""
    from ktorch.generation import Decoder

    model = _prepared("qwen3_moe", max_position_embeddings=1024)
    P = 37
    ids = torch.randint(0, model.config.vocab_size, (1, P), generator=torch.Generator().manual_seed(5))
    eager = generate(model, ids, 6).ids
    decoder = model.kt_decoder = Decoder(model, 1024, torch.device("cpu"), Sampling(), cuda_graphs=False)
    assert decoder.prefill_graph(P) is None
    decoder.prefill_graphs[768] = decoder.padded_prefill(768)
    assert decoder.prefill_graph(P).tokens == 768 and decoder.prefill_graph(700).tokens == 768
    assert decoder.prefill_graph(769) is None and decoder.prefill_graph(1025) is None
    seen, hooks = _prefill_rows_seen(model)
    try:
        padded = generate(model, ids, 6)
        rows = [t for t in seen if t.shape[0] == 768]
        assert padded.ids == eager and rows and all((t[P:] == -1).all() for t in rows)
        decoder.prefill_graphs[256] = decoder.padded_prefill(256)
        seen.clear()
        assert decoder.prefill_graph(P).tokens == 256 and generate(model, ids, 6).ids == eager
        assert any(t.shape[0] == 256 for t in seen) and not any(t.shape[0] == 768 for t in seen)
    finally:
        for h in hooks:
            h.remove()


def _placed(placement: str):
    """A tiny qwen3_moe model on the GPU (fp32 outside the experts, bf16 experts): every expert resident (the
    default budget), none (the CPU op alone), or 3 of 8 a layer (the rest on the CPU op, no split staging)."""
    torch.manual_seed(0)
    model = tiny_model("qwen3_moe", dtype=torch.float32)
    model.generation_config.eos_token_id = None
    if placement == "resident":
        return ktorch.prepare(model, device="cuda", experts_dtype="bf16")
    model = ktorch.prepare(model, device="cuda", experts_dtype="bf16", gpu_memory="off")
    if placement == "part":
        from ktorch.gpu_memory import device_bytes_held, planned_outside, reserve_bytes

        m0 = next(m for m in model.modules() if getattr(m, "kt_w13", None) is not None)
        per_resident = (m0.kt_w13.shape[1] * 16 * m0.kt_w2.shape[1] * 16 * 3 // 2) * 4 * 2
        cuda = torch.device("cuda")
        floor = planned_outside(cuda) + device_bytes_held(model, cuda) + reserve_bytes(model, torch.float32)
        ktorch.set_stream_experts(model, "off", gpu_memory=floor + 3 * per_resident)
        assert all(len(m.kt_gpu_expert_ids) == 3 for m in model.modules() if getattr(m, "kt_w13", None) is not None)
    return model


@needs_cuda
@pytest.mark.parametrize("placement", ["resident", "cpu", "part"])
def test_captured_prefill_gives_the_eager_tokens_and_counts(placement, monkeypatch):
    """generate captures a bucket's prefill after the bucket's second prompt (reported apart) and the third replays
    it: the eager prefill's tokens and, where the split counts routing, its counters (padding rows not counted; a
    37-token prompt, under min_tokens, not counted either way)."""
    model = _placed(placement)
    vocab = model.config.vocab_size
    prompts = [torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(n)) for n in (37, 200, 150)]
    counting = placement == "part"

    def split_stats() -> dict:  # the counters of the call (last_hit, the latest counted call's, outlives a reset)
        return {k: v for k, v in ktorch.prefill_split_stats(model, reset=True).items() if k != "last_hit"}

    # with part of the experts resident, generate swaps residents after each prefill by the routing counted so far,
    # which differs between the eager and the captured runs here (the eager ones counted first): one token, no swap
    n = 1 if counting else 8
    eager = []
    for ids in prompts:
        eager.append(generate(model, ids, n, cuda_graphs=False).ids)
        if counting:
            eager.append(split_stats())
    model.kt_decoder = None
    replays = []
    original = torch.cuda.CUDAGraph.replay
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", lambda self: replays.append(1) or original(self))
    got = []
    captures = []
    for ids in prompts:
        result = generate(model, ids, n)
        got.append(result.ids)
        captures.append(result.timings.prefill_capture_s)
        if counting:
            got.append(split_stats())
    assert got == eager
    # the bucket (256) captured after its second prompt, replayed by the third
    assert captures[0] == 0 and captures[1] > 0 and captures[2] == 0 and list(model.kt_decoder.prefill_graphs) == [256]
    # decode: 6 replays after the capture's eager step, then 7 and 7 (the kept capture); the third's prefill
    assert len(replays) == (1 if counting else 6 + 7 + (1 + 7))


@needs_cuda
@pytest.mark.parametrize("placement", ["resident", "cpu", "part"])
def test_the_warm_ups_captured_prefill_serves_a_first_prompt(placement, monkeypatch):
    """ktorch.warm_up keeps a decoder with its prefill captured (the tiny model's 256 positions: one bucket of 256);
    a first, shorter prompt replays it padded (no capture of its own, the same decoder) with the eager tokens."""
    model = _placed(placement)
    ids = torch.randint(0, model.config.vocab_size, (1, 150), generator=torch.Generator().manual_seed(21))
    n = 1 if placement == "part" else 8  # resident swaps after an eager and a captured prefill may differ
    eager = generate(model, ids, n, cuda_graphs=False).ids
    model.kt_decoder = None
    assert ktorch.warm_up(model, capture=False) > 0 and model.kt_decoder is None  # (serve's, --no-compile's)
    assert ktorch.warm_up(model) > 0
    kept = model.kt_decoder
    assert list(kept.prefill_graphs) == [256] and kept.prefill_graphs[256].graph is not None
    replays = []
    original = torch.cuda.CUDAGraph.replay
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", lambda self: replays.append(1) or original(self))
    got = generate(model, ids, n)
    assert got.ids == eager and model.kt_decoder is kept and got.timings.prefill_capture_s == 0
    assert got.timings.prefill_replayed == 256
    assert len(replays) == (1 if n == 1 else 1 + 6)  # the prefill; the decode steps after the capture's eager one


@needs_cuda
@pytest.mark.parametrize("cheap", ["copies", "cpu", "copies-and-residents"])
def test_captured_prefill_runs_the_split_on_the_device(cheap):
    """With the routing-aware split (int8 experts, bf16: the grouped kernels read the copied blocks), generate's
    captured prefill makes the split's choice, copies and grouped products on the device: the eager split's first
    token, and its counters (experts hit and copied, rows copied: the same choice from the same counts). With a few
    resident experts a layer too: the copied and the resident experts' parts both on the device."""
    from ktorch.ops.routed_experts import SplitCosts

    costs = (SplitCosts(h2d_bytes_per_s=2e8, cpu_fixed_s=1e-4, cpu_row_s=1e-6, cpu_expert_s=1e-5) if cheap == "cpu"
             else SplitCosts(h2d_bytes_per_s=1e15, cpu_fixed_s=1.0, cpu_row_s=1.0, cpu_expert_s=1.0))
    torch.manual_seed(0)
    model = ktorch.prepare(tiny_model("qwen3_moe", dtype=torch.bfloat16), device="cuda", experts_dtype="int8",
                           stream_experts=costs, gpu_memory="off")
    model.generation_config.eos_token_id = None
    layers = [m for m in model.modules() if getattr(m, "kt_routed", None) is not None]
    if cheap == "copies-and-residents":  # a budget that holds a few experts a layer
        from ktorch.gpu_memory import device_bytes_held, planned_outside, reserve_bytes

        cuda = torch.device("cuda")
        floor = planned_outside(cuda) + device_bytes_held(model, cuda) + reserve_bytes(model, torch.bfloat16)
        E, step = layers[0].kt_w13.shape[0], len(layers) * layers[0].kt_routed.bytes_per_expert
        for extra in range(step, 8 * E * step, step // 2):
            ktorch.set_stream_experts(model, costs, gpu_memory=floor + extra)
            layers = [m for m in model.modules() if getattr(m, "kt_routed", None) is not None]
            held = [len(m.kt_gpu_expert_ids or ()) for m in layers]
            if min(held) >= 2:
                break
        assert 2 <= min(held) and max(held) < E // 2, held
    for m in model.modules():
        if getattr(m, "kt_routed", None) is not None:
            m.kt_routed.min_tokens = 8
    prompts = [torch.randint(0, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(n))
               for n in (48, 100, 130)]
    eager, captured = [], []
    for ids in prompts:
        eager.append((generate(model, ids, 1, cuda_graphs=False).ids, ktorch.prefill_split_stats(model, reset=True)))
    model.kt_decoder = None
    for ids in prompts:
        result = generate(model, ids, 1)
        captured.append((result.ids, ktorch.prefill_split_stats(model, reset=True)))
    assert result.timings.prefill_capture_s == 0 and list(model.kt_decoder.prefill_graphs) == [256]  # replayed
    assert result.timings.prefill_replayed == 256
    assert captured == eager
    copied = sum(stats["experts_copied"] for _, stats in eager)
    hit = sum(stats["experts_hit"] for _, stats in eager)
    resident = sum(stats["resident_hit"] for _, stats in eager)
    if cheap == "copies-and-residents":
        assert 0 < copied and 0 < resident and copied + resident == hit
    else:
        assert (copied == hit > 0) if cheap == "copies" else copied < hit


def test_captured_prefills_pinned_buffers_are_bounded(monkeypatch):
    """The pinned bytes a captured prefill's CPU calls take (a set a layer that calls the CPU op, per prompt length)
    are counted per (model, length); past ``CAPTURED_PINNED_LIMIT`` new lengths are refused (they prefill eagerly)
    with one warning, while a length made before stays allowed."""
    from ktorch import generation

    model = _prepared("qwen3_moe")
    config = model.config
    layers = sum(1 for m in model.modules() if getattr(m, "kt_w13", None) is not None)
    per_token = 2 * config.hidden_size * 4 + config.num_experts_per_tok * 12  # fp32 activations here
    assert generation.captured_prefill_pinned_bytes(model, 256) == 256 * per_token * layers
    monkeypatch.setattr(generation, "_captured_pinned", {"bytes": 0, "warned": False, "made": set()})
    monkeypatch.setattr(generation, "CAPTURED_PINNED_LIMIT", 768 * per_token * layers)
    assert generation._take_captured_pinned(model, 256) and generation._take_captured_pinned(model, 512)
    assert generation._take_captured_pinned(model, 256)  # made before: its buffers are reused
    with pytest.warns(UserWarning, match="prefill eagerly"):
        assert not generation._take_captured_pinned(model, 768)
    assert not generation._take_captured_pinned(model, 1024)  # refused again, without a second warning
    assert generation._captured_pinned["bytes"] == 768 * per_token * layers
