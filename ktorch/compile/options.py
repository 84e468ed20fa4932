"""Options of ``torch.compile(model, backend="ktorch", mode=..., options={...})``."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Optional


@dataclass
class BackendOptions:
    """What the ktorch backend does with a graph.

    inductor:        compile everything but the CPU experts with Inductor (Triton on a GPU, C++ on the CPU);
                     False runs the rewritten FX graph as it is (fast to build; tests, debugging).
    async_experts:   split each CPU experts call into submit/wait (passes/async_boundary.py); False keeps the
                     blocking op with its hops to the CPU and back.
    overlap:         move work that does not need the experts' result between submit and wait.
    cuda_graphs:     replay graphs as CUDA graphs (Inductor's cudagraph trees); the host functions of the
                     submit/wait ops are captured with them. mode="reduce-overhead" or "max-autotune" sets it.
                     Ignored (with no error) for graphs that have no CUDA tensors.
    inductor_config: extra ``torch._inductor.config`` patches, e.g. {"max_autotune": True}.
    n_deferred_experts: reserved for the deferral pass (not implemented yet); must be 0.
    """

    inductor: bool = True
    async_experts: bool = True
    overlap: bool = True
    cuda_graphs: bool = False
    inductor_config: dict = field(default_factory=dict)
    n_deferred_experts: int = 0

    @classmethod
    def parse(cls, mode: Optional[str] = None, options: Optional[dict] = None) -> "BackendOptions":
        opts = cls()
        if mode in ("reduce-overhead", "max-autotune"):
            opts.cuda_graphs = True
        if mode in ("max-autotune", "max-autotune-no-cudagraphs"):
            opts.inductor_config["max_autotune"] = True
        elif mode not in (None, "default", "reduce-overhead"):
            raise ValueError(
                f"ktorch backend: unknown mode {mode!r}; use default, reduce-overhead, max-autotune or "
                "max-autotune-no-cudagraphs"
            )
        known = {f.name for f in fields(cls)}
        for key, value in (options or {}).items():
            if key not in known:
                raise ValueError(f"ktorch backend: unknown option {key!r}; options are {sorted(known)}")
            if key == "inductor_config":
                opts.inductor_config.update(value)
            else:
                setattr(opts, key, value)
        if opts.n_deferred_experts:
            raise NotImplementedError("ktorch backend: n_deferred_experts needs the deferral pass, not implemented yet")
        return opts
