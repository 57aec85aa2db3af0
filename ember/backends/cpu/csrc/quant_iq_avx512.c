#include "quant_iq.h"
const ember_kernels ember_kernels_iq_avx512 = {0};
