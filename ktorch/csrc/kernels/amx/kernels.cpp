// AMX kernels: not written yet (see the AMX issue). Until they are, the "amx" level is not offered by
// the dispatcher (runtime/dispatch.cpp), so nothing reaches this table.
#include "../kernels.h"

namespace kt::kernels {

const KernelSet& amx_kernels() { return avx512_kernels(); }

}  // namespace kt::kernels
