#include <stddef.h>
#include <stdint.h>

#include "api_webgpu.h"

/* webgpu.h's signatures, on opaque handles */
typedef void (*set_pipeline_fn)(void *pass, void *pipeline);
typedef void (*set_bind_group_fn)(void *pass, uint32_t index, void *group, size_t n_offsets, const uint32_t *offsets);
typedef void (*dispatch_fn)(void *pass, uint32_t x, uint32_t y, uint32_t z);

/* Dispatch i: pipelines[i] (set only where it changes), bind group 0 = bind_groups[i],
   workgroups groups[3i .. 3i+2]. */
void encode_dispatches(uintptr_t pass, uintptr_t set_pipeline, uintptr_t set_bind_group, uintptr_t dispatch,
                       const uint64_t *pipelines, const uint64_t *bind_groups, const uint32_t *groups, int64_t n) {
    set_pipeline_fn sp = (set_pipeline_fn)set_pipeline;
    set_bind_group_fn sb = (set_bind_group_fn)set_bind_group;
    dispatch_fn dp = (dispatch_fn)dispatch;
    void *p = (void *)pass;
    uint64_t current = 0;
    for (int64_t i = 0; i < n; i++) {
        if (pipelines[i] != current) {
            sp(p, (void *)(uintptr_t)pipelines[i]);
            current = pipelines[i];
        }
        sb(p, 0, (void *)(uintptr_t)bind_groups[i], 0, NULL);
        dp(p, groups[3 * i], groups[3 * i + 1], groups[3 * i + 2]);
    }
}
