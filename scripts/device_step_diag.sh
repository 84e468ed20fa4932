# How the extension was linked (a static libstdc++ inside _C.so crashes c10::str formatting), then the 1-D hidden call.
python3 -c "import sysconfig as s; print('LDSHARED', s.get_config_var('LDSHARED')); print('LDCXXSHARED', s.get_config_var('LDCXXSHARED')); print('CC', s.get_config_var('CC'), 'CXX', s.get_config_var('CXX'))"
grep -E "^(g\+\+|gcc|c\+\+|x86_64).*-shared" "$OUT/build.log" | tail -2 | cut -c1-600
so=$(ls ktorch/_C*.so); ldd "$so" | grep -E "stdc|gcc|gomp"
echo "libstdc++ symbols defined in _C.so: $(nm -DC --defined-only "$so" | grep -cE 'std::(basic_ostream|ostream|locale|num_put)')"
nm -DC "$so" | grep -E "_M_insert<long>" | head -3
python3 - <<'PY'
import torch, ktorch
p = ktorch.pack_experts(torch.randn(6, 128, 96), torch.randn(6, 96, 64), "bf16")
try:
    torch.ops.kt.fused_moe(torch.randn(96), torch.zeros(5, 2, dtype=torch.long), torch.rand(5, 2), *p.tensors(), "silu")
except RuntimeError as e:
    print("1-D hidden raised:", str(e).splitlines()[0])
PY
