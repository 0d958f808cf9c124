/*
 * What this CPU runs (see ggml_quant.h): the instruction sets cpuid reports, its vendor, and
 * where the tile kernels' software prefetches put the next weight rows, which the loader
 * decides (ggml_quant_cpu.py, prefetch_level, with the measurements): calls of up to
 * sl_prefetch_l2_rows activation rows into L2 (PREFETCHT1), wider ones into L1 (PREFETCHT0).
 */
#include "ggml_quant.h"

int64_t sl_prefetch_l2_rows = 0; /* the loader's choice */
int sl_prefetch_l2_now = 0;       /* this call's */
void sl_quant_set_prefetch_l2_rows(int64_t rows) { sl_prefetch_l2_rows = rows; }
int sl_quant_cpu_is_intel(void) { return __builtin_cpu_init(), __builtin_cpu_is("intel") != 0; }

/* Whether this CPU (and its OS, which must save the wide registers) runs `isa`. */
int sl_quant_isa_supported(int isa) {
    __builtin_cpu_init();
    switch (isa) {
    case SL_ISA_SCALAR: return 1;
    case SL_ISA_AVX2:
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case SL_ISA_AVX512:
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
               __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx2") &&
               __builtin_cpu_supports("fma");
    default: return 0;
    }
}
