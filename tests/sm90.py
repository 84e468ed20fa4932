"""Triton kernels compiled for sm_90 (Hopper) without a GPU: Triton's own compiler and ptxas, for the tests that
check what the interpreter, which runs the kernels on the CPU, cannot (the instructions a kernel compiles to)."""


def sm90_ptx(fn, signature: dict, constexprs: dict, num_warps: int = 4) -> str:
    """The PTX of the Triton kernel ``fn`` for sm_90, its runtime arguments typed by ``signature`` (name -> "*bf16",
    "i32", ...) and specialized on ``constexprs``; the compile makes its cubin too (ptxas runs)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    source = ASTSource(fn, signature={**signature, **{k: "constexpr" for k in constexprs}}, constexprs=constexprs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    assert compiled.asm["cubin"]
    return compiled.asm["ptx"]


def pdl_instructions(ptx: str) -> tuple:
    """(griddepcontrol.wait, griddepcontrol.launch_dependents) present in ``ptx``: a programmatic-dependent-launch
    prologue (triton_experts.pdl_prologue) compiles to both."""
    return "griddepcontrol.wait" in ptx, "griddepcontrol.launch_dependents" in ptx
