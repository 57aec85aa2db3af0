/* Persistent thread pool: workers spin briefly for the next job, then sleep on a
 * condition variable, so back-to-back kernels pay no thread start-up and an idle
 * pool costs no CPU.
 *
 * A job is nth shares; any thread may run any share: threads claim shares from a
 * counter tagged with the job's generation. On a busy machine a worker that is not
 * running when a job starts leaves its share to the threads that are, instead of
 * making them wait a whole scheduler time slice for it. */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "ember_cpu.h"

#if defined(EMBER_X86)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#elif defined(EMBER_ARM64)
#define CPU_RELAX() __asm__ __volatile__("yield")
#else
#define CPU_RELAX() ((void)0)
#endif

#define SPIN_ROUNDS (1 << 14)

struct ember_pool {
    int n_threads;
    pthread_t *workers;           /* n_threads - 1 */
    pthread_mutex_t run_lock;     /* one job at a time per pool */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    atomic_uint_fast64_t gen;     /* bumped for each job */
    atomic_uint_fast64_t claim;   /* (job generation << 16) | next unclaimed share */
    atomic_int done;              /* shares finished in the current job */
    atomic_int sleeping;
    atomic_int resting;           /* set between steps: idle workers sleep at once instead of spinning */
    atomic_int stop;
    ember_task_fn fn;
    void *ctx;
};

struct worker_arg { ember_pool *pool; int ith; };

/* Next unclaimed share of job `gen`, or -1 when none is left (or the job is over). */
static int claim_share(ember_pool *pool, uint64_t gen) {
    uint64_t cur = atomic_load(&pool->claim);
    for (;;) {
        if ((cur >> 16) != gen || (int)(cur & 0xffff) >= pool->n_threads) return -1;
        if (atomic_compare_exchange_weak(&pool->claim, &cur, cur + 1)) return (int)(cur & 0xffff);
    }
}

static void run_shares(ember_pool *pool, uint64_t gen) {
    int i;
    while ((i = claim_share(pool, gen)) >= 0) {
        pool->fn(pool->ctx, i, pool->n_threads);
        atomic_fetch_add_explicit(&pool->done, 1, memory_order_release);
    }
}

static void *worker_main(void *p) {
    struct worker_arg arg = *(struct worker_arg *)p;
    free(p);
    ember_pool *pool = arg.pool;
    uint64_t seen = 0;
    for (;;) {
        uint64_t g = atomic_load(&pool->gen);
        for (int i = 0; g == seen && i < SPIN_ROUNDS && !atomic_load_explicit(&pool->resting, memory_order_relaxed);
             i++) {
            CPU_RELAX();
            g = atomic_load(&pool->gen);
        }
        if (g == seen) {
            pthread_mutex_lock(&pool->mu);
            atomic_fetch_add(&pool->sleeping, 1);
            while ((g = atomic_load(&pool->gen)) == seen && !atomic_load(&pool->stop))
                pthread_cond_wait(&pool->cv, &pool->mu);
            atomic_fetch_sub(&pool->sleeping, 1);
            pthread_mutex_unlock(&pool->mu);
        }
        if (atomic_load(&pool->stop)) return NULL;
        seen = g;
        run_shares(pool, g);
    }
}

ember_pool *ember_pool_create(int n_threads) {
    if (n_threads < 1) n_threads = 1;
    ember_pool *pool = calloc(1, sizeof *pool);
    if (!pool) return NULL;
    pool->n_threads = n_threads;
    pthread_mutex_init(&pool->run_lock, NULL);
    pthread_mutex_init(&pool->mu, NULL);
    pthread_cond_init(&pool->cv, NULL);
    pool->workers = calloc((size_t)n_threads, sizeof(pthread_t));
    pthread_attr_t attr; /* kernels keep bounded scratch on the stack: do not rely on the libc default */
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, 1 << 21);
    for (int i = 1; i < n_threads; i++) {
        struct worker_arg *arg = malloc(sizeof *arg);
        arg->pool = pool;
        arg->ith = i;
        if (pthread_create(&pool->workers[i - 1], &attr, worker_main, arg) != 0) {
            free(arg);
            pool->n_threads = i; /* run with the threads we got */
            break;
        }
    }
    pthread_attr_destroy(&attr);
    return pool;
}

void ember_pool_destroy(ember_pool *pool) {
    if (!pool) return;
    pthread_mutex_lock(&pool->mu);
    atomic_store(&pool->stop, 1);
    atomic_fetch_add(&pool->gen, 1);
    pthread_cond_broadcast(&pool->cv);
    pthread_mutex_unlock(&pool->mu);
    for (int i = 1; i < pool->n_threads; i++) pthread_join(pool->workers[i - 1], NULL);
    pthread_cond_destroy(&pool->cv);
    pthread_mutex_destroy(&pool->mu);
    pthread_mutex_destroy(&pool->run_lock);
    free(pool->workers);
    free(pool);
}

int ember_pool_threads(const ember_pool *pool) { return pool ? pool->n_threads : 1; }

void ember_pool_rest(ember_pool *pool) {
    if (pool) atomic_store_explicit(&pool->resting, 1, memory_order_relaxed);
}

void ember_parallel(ember_pool *pool, ember_task_fn fn, void *ctx) {
    if (!pool || pool->n_threads == 1) {
        fn(ctx, 0, 1);
        return;
    }
    pthread_mutex_lock(&pool->run_lock);
    atomic_store_explicit(&pool->resting, 0, memory_order_relaxed);
    pool->fn = fn;
    pool->ctx = ctx;
    atomic_store(&pool->done, 0);
    uint64_t gen = atomic_load(&pool->gen) + 1;
    atomic_store(&pool->claim, gen << 16);
    atomic_store(&pool->gen, gen); /* seq_cst: pairs with the sleeper count below */
    if (atomic_load(&pool->sleeping) > 0) {
        pthread_mutex_lock(&pool->mu);
        pthread_cond_broadcast(&pool->cv);
        pthread_mutex_unlock(&pool->mu);
    }
    run_shares(pool, gen);
    /* shares claimed by workers still running: spin, then yield the core to them */
    for (int i = 0; atomic_load_explicit(&pool->done, memory_order_acquire) < pool->n_threads; i++) {
        if (i < SPIN_ROUNDS) CPU_RELAX();
        else sched_yield();
    }
    pthread_mutex_unlock(&pool->run_lock);
}
