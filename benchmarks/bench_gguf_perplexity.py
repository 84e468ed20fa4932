"""Perplexity of the built-in model written as GGUF with quantized experts, loaded by ktorch, against the same file's
values computed in fp32 by transformers' eager experts: what the exact formats (experts_dtype="auto") and the
requantizing ones (int8, int4) cost in perplexity, on ktorch/builtin/eval.txt.

    python benchmarks/bench_gguf_perplexity.py                         # Q4_K gate/up + Q8_0 down, and Q8_0
    python benchmarks/bench_gguf_perplexity.py --types Q4_K/Q8_0 --max-tokens 8192

Types: GATE_UP/DOWN GGML names (one name: all three). The built-in model's expert rows are H = 256 long (gate/up:
any type) and I = 128 long (down: a 32-block type, Q8_0/Q4_0; K-quants need rows of 256, and llama.cpp falls back to
such types for them too). Non-expert weights are written F32 (the model's bf16 values exactly), so the rows differ
only in the experts. The llama.cpp comparison the issue asks for (``llama-perplexity`` on the same file and text) needs
llama.cpp built on the device: ``llama-perplexity -m FILE -f ktorch/builtin/eval.txt -c 512`` beside this script's
``ktorch auto`` row for the file this script leaves with ``--keep DIR``. Benchmarks never assert; they print.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import ktorch
from ktorch.builtin import eval_perplexity, load_builtin
from ktorch.integrations.gguf_writer import write_gguf_from_model


def file_values_model(model, path: Path):
    """``model`` (fp32, eager experts) with its experts replaced by the file's values (gguf.quants.dequantize)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}

    def values(name):
        t = tensors[name]
        return torch.from_numpy(np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32))

    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            experts = layer.mlp.experts
            experts.gate_up_proj.copy_(torch.cat([values(f"blk.{i}.ffn_gate_exps.weight"),
                                                  values(f"blk.{i}.ffn_up_exps.weight")], dim=1))
            experts.down_proj.copy_(values(f"blk.{i}.ffn_down_exps.weight"))
    return model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", nargs="+", default=["Q4_K/Q8_0", "Q8_0"])
    ap.add_argument("--max-tokens", type=int, default=None, help="score the first N tokens (default: all of eval.txt)")
    ap.add_argument("--keep", type=Path, default=None, help="write the files here and keep them")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, kernel {torch.ops.kt.selected_kernel()}, threads {torch.get_num_threads()}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.keep or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        for spec in args.types:
            gate_up, _, down = spec.partition("/")
            down = down or gate_up
            model, tokenizer = load_builtin("cpu", torch.float32, experts_implementation="eager")
            path = folder / f"builtin-{gate_up}-{down}.gguf"
            write_gguf_from_model(model, path, experts_type=gate_up, experts_types={"down": down}, other_type="F32")
            ref = eval_perplexity(file_values_model(model, path), tokenizer, max_tokens=args.max_tokens)
            rows.append((spec, "fp32 eager, file values", ref["perplexity"], 0.0, ref["tokens"]))
            for dtype in ("auto", "int8", "int4"):
                t0 = time.perf_counter()
                loaded, _ = ktorch.load(path, device="cpu", dtype=torch.float32, experts_dtype=dtype, progress=False,
                                        tokenizer=False)
                fmt = loaded.model.layers[0].mlp.experts.kt_format
                r = eval_perplexity(loaded, tokenizer, max_tokens=args.max_tokens)
                rows.append((spec, f"ktorch {dtype} ({fmt})", r["perplexity"],
                             100 * (r["perplexity"] / ref["perplexity"] - 1), r["tokens"]))
                print(f"{spec:<10} {rows[-1][1]:<32} ppl {r['perplexity']:.4f} ({rows[-1][3]:+.3f}%) "
                      f"{time.perf_counter() - t0:.1f} s", flush=True)
    print()
    print("| experts (gate_up/down) | model | perplexity | vs file values | tokens |")
    print("|---|---|---|---|---|")
    for spec, what, ppl, delta, tokens in rows:
        print(f"| {spec} | {what} | {ppl:.4f} | {delta:+.3f}% | {tokens} |")


if __name__ == "__main__":
    main()
