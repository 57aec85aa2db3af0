/* Internal header: a product job of several weight matrices (parts), each with its own activations,
 * shared out over the pool (matmul.c); the dense products and the grouped expert products
 * (experts.c) both run through it. */
#ifndef EMBER_MATMUL_H
#define EMBER_MATMUL_H

#include <stdatomic.h>

#include "quant.h"

/* Up to this many tokens a product streams W from memory (one fixed run of rows per share). */
#define STREAM_TOKENS 4
/* Products of fewer tokens than this that run on microtiles (no panel) stream too: each run of rows is
 * reread from L1 for every 4 tokens, so W still comes from memory once (SmolLM2's Q4_1 576 x 576 at 5-6
 * tokens: 25-29 us instead of 32-36 with claimed runs; bench/NOTES.md). */
#define STREAM_TILE_TOKENS 20
/* Up to this many activation values the caller quantizes them alone: cheaper than a pass. */
#define SERIAL_QUANTIZE_VALUES 8192

/* One weight matrix of a job: W (m, k) and its output y (n, m), with the kernels chosen for it. */
typedef struct {
    int type;
    ember_tile tile;
    ember_panel panel;  /* .fn NULL: microtiles */
    const uint8_t *w;   /* (m, w_stride) */
    int64_t m, w_stride;
    float *y;           /* (n, m) */
    int unit;           /* rows handed out together: a panel, or a microtile's rows */
    int64_t units;      /* ceil(m / unit) */
    const uint8_t *act; /* (n, a_stride): this part's activations (quantized, or x itself) */
    int64_t n;          /* tokens */
} matmul_part;

/* Decoding: the units between two neighbouring shares' fixed runs, [front, back) packed in one word
 * (front in the low 32 bits), taken a chunk at a time by the two neighbours only: the left share from
 * the front (its own stream continued), the right one from the back. */
typedef struct {
    _Alignas(64) atomic_uint_fast64_t span;
    int64_t a, b; /* the region as first set: the neighbours' fixed runs end and start there */
} stream_gap;

typedef struct {
    matmul_part *part;
    int n_parts;
    int64_t k, n, units;        /* units: the parts' rows in units, all together */
    int64_t claim;              /* units a thread takes at a time (prompts) */
    atomic_int_fast64_t next;   /* first unit not yet taken (prompts) */
    ember_quantize_fn quantize; /* NULL for float weights: x is used as it is */
    const float *x;             /* (n, k) */
    uint8_t *scratch;           /* (n, a_stride) when quantizing */
    int64_t a_stride;
    stream_gap *gaps;           /* decoding: nth - 1 regions shared by neighbours, or NULL (fixed runs) */
    int64_t chunk;              /* units taken from a gap at a time */
} matmul_job;

/* The part's kernels for n tokens of activations at act (quantized with `rounding`); 0, or -1 for an
 * unsupported type or shape. */
int ember_part_init(matmul_part *p, int type, const void *w, int64_t m, int64_t k, int64_t n, float *y,
                    const uint8_t *act, int rounding);

/* Runs every part of the job: decoding-sized parts (stream = 1) in fixed shares of the bytes, else in
 * runs claimed from a counter. j->units must be the sum of the parts' units. */
void ember_job_run(ember_pool *pool, matmul_job *j, int stream);

/* The quantizer of activation kind act with `rounding`. */
ember_quantize_fn ember_quantizer(int act, int rounding);

#endif
