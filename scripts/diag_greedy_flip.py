"""Where a compiled greedy generate parts from HF eager (device diagnosis of a failing GPU test).

Rebuilds test_compile_backend.py::test_cuda_compiled_greedy_generate_matches_eager's inputs from a seed (the
test's KT_TEST_SEED; the eager logits check the test makes first draws no random numbers) and prints, per
variant, the tokens, the largest logit difference per step against HF eager and, for ktorch (whose runtime
records its experts calls), the relative difference of each experts (= router) input against HF eager's:
    python scripts/diag_greedy_flip.py --seed 769923218 --family deepseek_v3
Variants: ktorch under CUDA graphs (the failing case) and ktorch compiled without them. (HF's own DeepSeek-V3
experts loop cannot be compiled with fullgraph, so there is no plain-Inductor variant.) What it found in session 8:
the recorder's fp32 copies aliased the runtime's pinned staging buffer (fixed in tests/models.py).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--family", default="deepseek_v3")
    parser.add_argument("--variants", default="ktorch_graphs,ktorch")
    parser.add_argument("--calls", type=int, default=80, help="experts calls to print")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run of the script (variant ktorch)")
    args = parser.parse_args()

    import ktorch
    from transformers import CompileConfig

    from models import NEW_TOKENS, PROMPT, RoutingRecorder, tiny_model

    torch.manual_seed(args.seed)
    model = tiny_model(args.family, dtype=torch.float32)
    prepared = ktorch.prepare(copy.deepcopy(model), device=args.device)
    model = model.to(args.device)
    prompt = torch.randint(0, 256, (1, PROMPT), device=args.device)
    kwargs = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                  cache_implementation="static", output_logits=True, return_dict_in_generate=True)

    def config(backend, mode):
        c = CompileConfig(backend=backend, mode=mode, fullgraph=True)
        c._compile_all_devices = True
        return c

    with torch.no_grad(), RoutingRecorder(model) as ref_routing:
        ref = model.generate(prompt, **kwargs, disable_compile=True)
    p = PROMPT
    print("HF eager tokens", ref.sequences[0, p:].tolist())
    for variant in args.variants.split(","):
        torch._dynamo.reset()
        if variant == "inductor_graphs":
            test_model, cc = copy.deepcopy(model), config("inductor", "reduce-overhead")
        else:
            test_model, cc = prepared, config("ktorch", "reduce-overhead" if variant == "ktorch_graphs" else None)
        with torch.no_grad(), RoutingRecorder(test_model) as routing:
            out = test_model.generate(prompt, **kwargs, compile_config=cc)
        print(f"== {variant}: tokens {out.sequences[0, p:].tolist()}")
        diffs = [(out.logits[j][0].float() - ref.logits[j][0].float()).abs().max().item() for j in range(NEW_TOKENS)]
        print("  max |logit diff| per step:", " ".join(f"{d:.1e}" for d in diffs))
        if len(routing.calls) == len(ref_routing.calls):
            rows = []
            for i, ((name, x_ref, ids_ref), (_, x, ids)) in enumerate(zip(ref_routing.calls, routing.calls)):
                if i >= args.calls:
                    break
                err = ((x[-1] - x_ref[-1]).norm() / x_ref[-1].norm()).item()
                flip = "" if torch.equal(ids[-1], ids_ref[-1]) else f" FLIP {ids_ref[-1].tolist()}->{ids[-1].tolist()}"
                rows.append(f"{i}:{name.split('.')[2]}:{err:.1e}{flip}")
            print("  experts input rel. diff, last token, per call:", " ".join(rows))
        else:
            print(f"  experts calls recorded: {len(routing.calls)} (HF eager: {len(ref_routing.calls)})")


if __name__ == "__main__":
    main()
