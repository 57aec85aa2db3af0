/* Persistent thread pool: workers spin briefly for the next job, then sleep on a
 * condition variable, so back-to-back kernels pay no thread start-up and an idle
 * pool costs no CPU.
 *
 * A job is nth shares, share i first of all worker i's (the caller's: share 0). Each share
 * has a slot of its own cache line, where the thread that claims it marks it (a CAS that
 * meets no other thread unless the share is being taken over) and, when done, says so:
 * threads share no counter, so a job's start and end cost each thread its own line, on 2
 * cores as on 16. The caller, once its share is done, takes over any share whose worker has
 * not claimed it yet (a worker descheduled on a busy machine), instead of waiting a whole
 * scheduler time slice for it. */
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

/* One share's state, on a cache line of its own: the generation of the last job that claimed it, and
 * of the last in which it was finished. */
typedef struct {
    _Alignas(64) atomic_uint_fast64_t claimed;
    atomic_uint_fast64_t done;
} share_slot;

struct ember_pool {
    int n_threads;
    pthread_t *workers;           /* n_threads - 1 */
    share_slot *slots;            /* n_threads */
    pthread_mutex_t run_lock;     /* one job at a time per pool */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    _Alignas(64) atomic_uint_fast64_t gen; /* bumped for each job; read by every worker */
    atomic_int sleeping;
    atomic_int resting;           /* set between steps: idle workers sleep at once instead of spinning */
    atomic_int stop;
    ember_task_fn fn;
    void *ctx;
};

struct worker_arg { ember_pool *pool; int ith; };

/* Runs share i of job `gen` if no thread has claimed it yet. A thread that read `gen` long ago (it was
 * descheduled) finds the share claimed for that or a later job, and leaves it. */
static void run_share(ember_pool *pool, int i, uint64_t gen) {
    share_slot *slot = &pool->slots[i];
    uint64_t prev = atomic_load_explicit(&slot->claimed, memory_order_relaxed);
    if (prev >= gen || !atomic_compare_exchange_strong(&slot->claimed, &prev, gen)) return;
    pool->fn(pool->ctx, i, pool->n_threads);
    atomic_store_explicit(&slot->done, gen, memory_order_release);
}

static void *worker_main(void *p) {
    struct worker_arg arg = *(struct worker_arg *)p;
    free(p);
    ember_pool *pool = arg.pool;
    (void)ember_fp_enter(); /* for the thread's life */
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
        run_share(pool, arg.ith, g);
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
    pool->slots = aligned_alloc(64, (size_t)n_threads * sizeof(share_slot));
    if (!pool->workers || !pool->slots) {
        free(pool->workers);
        free(pool->slots);
        free(pool);
        return NULL;
    }
    for (int i = 0; i < n_threads; i++) {
        atomic_init(&pool->slots[i].claimed, 0);
        atomic_init(&pool->slots[i].done, 0);
    }
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
    free(pool->slots);
    free(pool);
}

int ember_pool_threads(const ember_pool *pool) { return pool ? pool->n_threads : 1; }

void ember_pool_rest(ember_pool *pool) {
    if (pool) atomic_store_explicit(&pool->resting, 1, memory_order_relaxed);
}

void ember_parallel(ember_pool *pool, ember_task_fn fn, void *ctx) {
    const ember_fp_state fp = ember_fp_enter();
    if (!pool || pool->n_threads == 1) {
        fn(ctx, 0, 1);
        ember_fp_leave(fp);
        return;
    }
    pthread_mutex_lock(&pool->run_lock);
    atomic_store_explicit(&pool->resting, 0, memory_order_relaxed);
    pool->fn = fn;
    pool->ctx = ctx;
    const uint64_t gen = atomic_load(&pool->gen) + 1;
    atomic_store(&pool->gen, gen); /* seq_cst: pairs with the sleeper count below */
    if (atomic_load(&pool->sleeping) > 0) {
        pthread_mutex_lock(&pool->mu);
        pthread_cond_broadcast(&pool->cv);
        pthread_mutex_unlock(&pool->mu);
    }
    run_share(pool, 0, gen);
    /* the workers' shares: wait for each, taking over one its worker has not started; spin, then
     * yield the core to them */
    for (int i = 1, spins = 0; i < pool->n_threads;) {
        if (atomic_load_explicit(&pool->slots[i].done, memory_order_acquire) == gen) {
            i++;
            continue;
        }
        /* a no-op once its worker has claimed it; at once while a worker sleeps (the share would wait
         * for its wake-up, tens of microseconds) */
        if (spins > SPIN_ROUNDS / 16 || atomic_load_explicit(&pool->sleeping, memory_order_relaxed) > 0)
            run_share(pool, i, gen);
        if (++spins < SPIN_ROUNDS) CPU_RELAX();
        else sched_yield();
    }
    pthread_mutex_unlock(&pool->run_lock);
    ember_fp_leave(fp);
}
