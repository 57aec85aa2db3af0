#include "quant_iq.h"
const ember_kernels ember_kernels_iq_neon = {0};
