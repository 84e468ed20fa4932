# C++ backtrace of the fused_moe crash seen on the device only (hidden 1-D), through cuda-gdb (no gdb there).
cat > /tmp/crash.py <<'PY'
import torch, ktorch
p = ktorch.pack_experts(torch.randn(6, 128, 96), torch.randn(6, 96, 64), "bf16")
try:
    torch.ops.kt.fused_moe(torch.randn(96), torch.zeros(5, 2, dtype=torch.long), torch.rand(5, 2), *p.tensors(), "silu")
except RuntimeError as e:
    print("raised:", str(e).splitlines()[0])
PY
cuda-gdb -batch -ex run -ex bt -ex "info registers rip" --args python3 /tmp/crash.py 2>&1 | grep -vE "^\[New Thread|^\[Thread|Detaching" | head -60
