/* Shrinking call-free fragments to their minimal DFA before they are copied (a repetition's
 * item, a rule inlined at several places): JSON's `char`, about a hundred Thompson nodes, becomes
 * about twenty-five, so `char{1,5000}` stays small. Subset construction over the fragment's byte
 * classes, then Moore's refinement when the DFA is small enough for it. */
#include <stdlib.h>
#include <string.h>

#include "build.h"

enum { SHRINK_MAX = 512 };     /* larger fragments are rarely copied: not worth the time */

static uint32_t hash_set(const uint8_t bits[32])
{
    uint32_t h = 2166136261u;
    for (int i = 0; i < 32; i++)
        h = (h ^ bits[i]) * 16777619u;
    return h;
}

/* The id of a byte set, added if new (a hash of the sets made so far finds repeats). */
int32_t b_set_of(builder *b, const uint8_t bits[32])
{
    if (2 * (b->n_sets + 1) > b->set_cap) {
        int32_t cap = b->set_cap ? 2 * b->set_cap : 1024;
        int32_t *h = malloc((size_t)cap * sizeof *h);
        if (!h)
            return -1;
        memset(h, 0xff, (size_t)cap * sizeof *h);
        for (int32_t i = 0; i < b->n_sets; i++) {
            uint32_t j = hash_set(b->sets[i]) & (uint32_t)(cap - 1);
            while (h[j] >= 0)
                j = (j + 1) & (uint32_t)(cap - 1);
            h[j] = i;
        }
        free(b->set_hash);
        b->set_hash = h, b->set_cap = cap;
    }
    uint32_t j = hash_set(bits) & (uint32_t)(b->set_cap - 1);
    for (; b->set_hash[j] >= 0; j = (j + 1) & (uint32_t)(b->set_cap - 1))
        if (!memcmp(b->sets[b->set_hash[j]], bits, 32))
            return b->set_hash[j];
    b->set_hash[j] = b->n_sets;
    if (b->n_sets == b->cap_sets) {
        int32_t cap = b->cap_sets;
        uint8_t (*v)[32] = eg_grow(b->sets, &cap, b->n_sets + 1, 32);
        if (!v)
            return -1;
        b->sets = v, b->cap_sets = cap;
    }
    memcpy(b->sets[b->n_sets], bits, 32);
    return b->n_sets++;
}

typedef struct {
    int32_t nn, nc, lo, end;        /* fragment nodes [lo, lo+nn), its end node */
    int32_t *adj_off, *adj;         /* (nn+1,), edge ids by local source */
    uint8_t cls[256];               /* byte -> class */
    uint8_t rep[256];               /* class -> a byte of it */
    int32_t *pool, n_pool, cap_pool;/* sorted node sets of DFA states */
    int32_t *set_off, n_states, cap_states;
    int32_t *trans;                 /* (n_states, nc) */
    int32_t *hash, cap_hash;
    int32_t *mark, *todo;           /* (nn,) */
    int32_t stamp;
} shrink_ctx;

static void shrink_free(shrink_ctx *c)
{
    free(c->adj_off), free(c->adj), free(c->pool), free(c->set_off), free(c->trans), free(c->hash);
    free(c->mark), free(c->todo);
}

/* Interns the eps-closure of the nodes in todo[0:n] (local ids); returns the state or -1. */
static int32_t shrink_state(builder *b, shrink_ctx *c, int32_t n)
{
    int32_t start = c->n_pool, count = 0;
    c->stamp++;
    for (int32_t i = 0; i < n; i++)
        c->mark[c->todo[i]] = c->stamp;
    while (n) {
        int32_t x = c->todo[--n];
        if (c->n_pool + 1 > c->cap_pool) {
            int32_t cap = c->cap_pool;
            int32_t *v = eg_grow(c->pool, &cap, c->n_pool + 1, sizeof *v);
            if (!v)
                return -1;
            c->pool = v, c->cap_pool = cap;
        }
        c->pool[c->n_pool++] = x, count++;
        for (int32_t i = c->adj_off[x]; i < c->adj_off[x + 1]; i++) {
            int32_t e = c->adj[i], d = b->dst.v[e] - c->lo;
            if (b->kind.v[e] == EG_EPS && c->mark[d] != c->stamp)
                c->mark[d] = c->stamp, c->todo[n++] = d;
        }
    }
    int32_t *set = c->pool + start;
    for (int32_t i = 1; i < count; i++) { /* insertion sort */
        int32_t x = set[i], j = i;
        for (; j > 0 && set[j - 1] > x; j--)
            set[j] = set[j - 1];
        set[j] = x;
    }
    uint32_t h = 2166136261u;
    for (int32_t i = 0; i < count; i++)
        h = (h ^ (uint32_t)set[i]) * 16777619u;
    uint32_t mask = (uint32_t)c->cap_hash - 1, i = h & mask;
    for (; c->hash[i] >= 0; i = (i + 1) & mask) {
        int32_t o = c->set_off[c->hash[i]], l = c->set_off[c->hash[i] + 1] - o;
        if (l == count && !memcmp(c->pool + o, set, (size_t)count * sizeof *set)) {
            c->n_pool = start;
            return c->hash[i];
        }
    }
    if (c->n_states + 1 >= c->cap_states || 2 * (c->n_states + 1) > c->cap_hash)
        return -1; /* too many states: not worth it */
    c->hash[i] = c->n_states;
    c->set_off[++c->n_states] = c->n_pool;
    return c->n_states - 1;
}

/* Subset construction over the fragment's byte classes; fills c->trans. 0 on success. */
static int shrink_determinize(builder *b, shrink_ctx *c, int32_t start)
{
    c->todo[0] = start - c->lo;
    c->set_off[0] = 0;
    if (shrink_state(b, c, 1) != 0)
        return -1;
    int32_t *targets = malloc((size_t)c->nn * sizeof *targets);
    if (!targets)
        return -1;
    for (int32_t s = 0; s < c->n_states; s++) {
        for (int32_t k = 0; k < c->nc; k++) {
            int rep = c->rep[k];
            int32_t n = 0;
            c->stamp++;
            for (int32_t i = c->set_off[s]; i < c->set_off[s + 1]; i++) {
                int32_t x = c->pool[i];
                for (int32_t j = c->adj_off[x]; j < c->adj_off[x + 1]; j++) {
                    int32_t e = c->adj[j], d = b->dst.v[e] - c->lo;
                    if (b->kind.v[e] == EG_BYTE && eg_bit(b->sets[b->label.v[e]], rep) && c->mark[d] != c->stamp)
                        c->mark[d] = c->stamp, targets[n++] = d;
                }
            }
            int32_t t = -1;
            if (n) {
                memcpy(c->todo, targets, (size_t)n * sizeof *targets);
                t = shrink_state(b, c, n);
                if (t < 0) {
                    free(targets);
                    return -1;
                }
            }
            c->trans[(size_t)s * c->nc + k] = t;
        }
    }
    free(targets);
    return 0;
}

static int same_signature(const shrink_ctx *c, const int32_t *block, int32_t s, int32_t t)
{
    if (block[s] != block[t])
        return 0;
    for (int32_t k = 0; k < c->nc; k++) {
        int32_t a = c->trans[(size_t)s * c->nc + k], d = c->trans[(size_t)t * c->nc + k];
        if ((a < 0 ? -1 : block[a]) != (d < 0 ? -1 : block[d]))
            return 0;
    }
    return 1;
}

/* Moore refinement, by hashing each state's (block, successors' blocks); returns the block count. */
static int32_t shrink_minimize(shrink_ctx *c, int32_t *block)
{
    int32_t n = c->n_states, cap = 16, nb = 0, seen[2] = {0, 0};
    while (cap < 2 * n)
        cap *= 2;
    int32_t *next = malloc((size_t)n * sizeof *next), *table = malloc((size_t)cap * sizeof *table);
    if (!next || !table) {
        free(next), free(table);
        return -1;
    }
    for (int32_t s = 0; s < n; s++) {
        int acc = 0;
        for (int32_t i = c->set_off[s]; i < c->set_off[s + 1]; i++)
            acc |= c->pool[i] == c->end;
        block[s] = acc;
        nb += !seen[acc], seen[acc] = 1;
    }
    for (int32_t prev = -1; prev != nb;) {
        prev = nb, nb = 0;
        memset(table, 0xff, (size_t)cap * sizeof *table); /* table: a representative state per new block */
        for (int32_t s = 0; s < n; s++) {
            uint32_t h = 2166136261u ^ (uint32_t)block[s];
            for (int32_t k = 0; k < c->nc; k++) {
                int32_t a = c->trans[(size_t)s * c->nc + k];
                h = (h ^ (uint32_t)(a < 0 ? -1 : block[a])) * 16777619u;
            }
            uint32_t i = h & (uint32_t)(cap - 1);
            while (table[i] >= 0 && !same_signature(c, block, table[i], s))
                i = (i + 1) & (uint32_t)(cap - 1);
            if (table[i] < 0)
                table[i] = s, next[s] = nb++;
            else
                next[s] = next[table[i]];
        }
        memcpy(block, next, (size_t)n * sizeof *block);
    }
    free(next), free(table);
    return nb;
}

/* c->adj: the fragment's edges by local source node. */
static int fragment_adjacency(builder *b, shrink_ctx *c, frag f)
{
    c->adj_off = calloc((size_t)c->nn + 1, sizeof(int32_t));
    c->adj = malloc(((size_t)(b->src.n - f.elo) + 1) * sizeof(int32_t));
    if (!c->adj_off || !c->adj)
        return -1;
    for (int32_t e = f.elo; e < b->src.n; e++)
        c->adj_off[b->src.v[e] - f.lo + 1]++;
    for (int32_t i = 0; i < c->nn; i++)
        c->adj_off[i + 1] += c->adj_off[i];
    for (int32_t e = f.elo; e < b->src.n; e++)
        c->adj[c->adj_off[b->src.v[e] - f.lo]++] = e;
    for (int32_t i = c->nn; i > 0; i--)
        c->adj_off[i] = c->adj_off[i - 1];
    c->adj_off[0] = 0;
    return 0;
}

/* c->cls, c->rep, c->nc: bytes no byte set of the fragment tells apart share a class. */
static int fragment_classes(builder *b, shrink_ctx *c, frag f)
{
    int16_t in[256], out[256];
    int32_t nc = 1;
    uint8_t *used = calloc((size_t)b->n_sets + 1, 1);
    if (!used)
        return -1;
    memset(c->cls, 0, sizeof c->cls);
    for (int32_t e = f.elo; e < b->src.n && nc < 256; e++) {
        if (b->kind.v[e] != EG_BYTE || used[b->label.v[e]])
            continue;
        used[b->label.v[e]] = 1;
        for (int i = 0; i < 256; i++)
            in[i] = out[i] = -1;
        int32_t m = 0;
        for (int x = 0; x < 256; x++) {
            int16_t *to = eg_bit(b->sets[b->label.v[e]], x) ? in : out;
            if (to[c->cls[x]] < 0)
                to[c->cls[x]] = (int16_t)m++;
            c->cls[x] = (uint8_t)to[c->cls[x]];
        }
        nc = m;
    }
    free(used);
    c->nc = nc;
    for (int x = 255; x >= 0; x--)
        c->rep[c->cls[x]] = (uint8_t)x;
    return 0;
}

/* Edges of DFA state s (its block `from`): eps to the end if accepting, one byte-set edge per target. */
static int emit_state(builder *b, const shrink_ctx *c, const int32_t *block, int32_t s, int32_t base, int32_t end,
                      int32_t *slot_of)
{
    uint8_t out_bits[256][32];
    int32_t out_block[256], n_out = 0, from = block[s], nc = c->nc;
    int acc = 0, rc = 0;
    for (int32_t i = c->set_off[s]; i < c->set_off[s + 1]; i++)
        acc |= c->pool[i] == c->end;
    if (acc && b_edge(b, base + from, EG_EPS, 0, end))
        return -1;
    for (int32_t k = 0; k < nc; k++) { /* a slot per target block, then its bytes in one pass */
        int32_t u = c->trans[(size_t)s * nc + k];
        if (u >= 0 && slot_of[block[u]] < 0)
            slot_of[block[u]] = n_out, out_block[n_out] = block[u], memset(out_bits[n_out++], 0, 32);
    }
    for (int x = 0; x < 256; x++) {
        int32_t u = c->trans[(size_t)s * nc + c->cls[x]];
        if (u >= 0)
            out_bits[slot_of[block[u]]][x >> 3] |= (uint8_t)(1 << (x & 7));
    }
    for (int32_t j = 0; j < n_out; j++) {
        slot_of[out_block[j]] = -1;
        int32_t set = rc ? -1 : b_set_of(b, out_bits[j]);
        if (!rc)
            rc = set < 0 ? b_fail(b, "out of memory") : b_edge(b, base + from, EG_BYTE, set, base + out_block[j]);
    }
    return rc;
}

/* Rewinds the fragment f and writes the DFA in its place: a node per block, then the end. */
static int emit_dfa(builder *b, const shrink_ctx *c, const int32_t *block, int32_t nb, frag f)
{
    b->n = f.lo, b->src.n = b->kind.n = b->label.n = b->dst.n = f.elo;
    b->canon[0].n = b->canon[1].n = f.lo;
    int32_t base = b_nodes(b, nb + 1), end = base + nb, rc = 0;
    uint8_t *emitted = calloc((size_t)nb, 1);
    int32_t *slot_of = malloc((size_t)nb * sizeof *slot_of);
    if (base < 0 || !emitted || !slot_of) {
        free(emitted), free(slot_of);
        return base < 0 ? -1 : b_fail(b, "out of memory");
    }
    memset(slot_of, 0xff, (size_t)nb * sizeof *slot_of);
    for (int32_t s = 0; s < c->n_states && rc == 0; s++)
        if (!emitted[block[s]]) {
            emitted[block[s]] = 1;
            rc = emit_state(b, c, block, s, base, end, slot_of);
        }
    free(emitted), free(slot_of);
    b->stack[b->sp - 1] = (frag){base + block[0], end, f.lo, f.elo};
    return rc;
}

/* Replaces the fragment on top of the stack by its minimal DFA, when it is call- and token-free,
 * small, and the DFA is smaller; leaves it alone otherwise. Returns -1 only when the builder fails. */
int b_shrink_top(builder *b)
{
    frag f = b->stack[b->sp - 1];
    int32_t nn = b->n - f.lo;
    if (nn < 4 || nn > SHRINK_MAX)
        return 0;
    for (int32_t e = f.elo; e < b->src.n; e++)
        if (b->kind.v[e] == EG_CALL || b->kind.v[e] == EG_TOKEN)
            return 0;
    shrink_ctx c = {0};
    c.nn = nn, c.lo = f.lo, c.end = f.end - f.lo, c.cap_states = 2 * nn + 2, c.cap_hash = 16;
    while (c.cap_hash < 4 * c.cap_states)
        c.cap_hash *= 2;
    c.set_off = malloc(((size_t)c.cap_states + 1) * sizeof(int32_t)), c.hash = malloc((size_t)c.cap_hash * sizeof(int32_t));
    c.mark = calloc((size_t)nn, sizeof(int32_t)), c.todo = malloc((size_t)nn * 4 * sizeof(int32_t));
    int32_t *block = NULL, nb = 0;
    int rc = 0;
    if (!c.set_off || !c.hash || !c.mark || !c.todo || fragment_adjacency(b, &c, f) || fragment_classes(b, &c, f))
        goto done;
    memset(c.hash, 0xff, (size_t)c.cap_hash * sizeof(int32_t));
    if (!(c.trans = malloc((size_t)c.cap_states * c.nc * sizeof(int32_t))) || shrink_determinize(b, &c, f.start) ||
        !(block = malloc((size_t)c.n_states * sizeof *block)))
        goto done;
    if ((int64_t)c.n_states * c.n_states * c.nc <= (1 << 20)) { /* Moore's refinement is quadratic on chains */
        nb = shrink_minimize(&c, block);
    } else {
        for (int32_t i = 0; i < c.n_states; i++)
            block[i] = i;
        nb = c.n_states;
    }
    if (nb > 0 && nb + 1 < nn)
        rc = emit_dfa(b, &c, block, nb, f);
done:
    free(block);
    shrink_free(&c);
    return rc;
}
