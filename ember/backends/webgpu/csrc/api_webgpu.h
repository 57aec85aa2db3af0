/* A recorded step's dispatches encoded into a compute pass in one call: wgpu-native's pass
   functions (their addresses, from the wgpu module's own binding) called on the step's handles. */
#include <stdint.h>

void encode_dispatches(uintptr_t pass, uintptr_t set_pipeline, uintptr_t set_bind_group, uintptr_t dispatch,
                       const uint64_t *pipelines, const uint64_t *bind_groups, const uint32_t *groups, int64_t n);
