/* Core of the CPU backend: thread pool and instruction-set dispatch.
 * Files named api_*.h hold only plain declarations: they are parsed by cffi
 * (no preprocessor directives) and included by the C sources. */

typedef struct ember_pool ember_pool;

/* A pool of n_threads threads in all, the calling thread included (n_threads >= 1). */
ember_pool *ember_pool_create(int n_threads);
void ember_pool_destroy(ember_pool *pool);
int ember_pool_threads(const ember_pool *pool);

/* Instruction-set path used by the kernels: "avx512", "avx2", "neon" or "scalar". */
const char *ember_cpu_isa(void);
/* Force a path by name; returns 0, or -1 when this CPU (or build) cannot run it. */
int ember_cpu_set_isa(const char *name);
/* GFNI in the AVX-512 kernels (1, the default where the CPU has it) or not (0); -1 when asked for and absent. */
int ember_cpu_set_gfni(int on);
/* Space-separated list of the CPU features the kernels care about. */
const char *ember_cpu_features(void);

/* Reads bytes (a multiple of 64) at buf with every thread of the pool, each a contiguous share, and
 * returns the XOR of the 64-bit words read: how fast the machine streams memory to these threads (the
 * ceiling of a decode step, which reads every weight once). */
uint64_t ember_stream_read(ember_pool *pool, const void *buf, int64_t bytes);
