/* Token masks: per-state partitions of the vocabulary, built by walking the token trie.
 *
 * Walking from state s with the bottom frame being s's rule, each token is
 *   accepted  - some path reads all its bytes (valid on any stack below),
 *   uncertain - paths only get through by returning from s's rule, and the byte after the
 *               return can follow the rule somewhere (the rule's follow set), or
 *   rejected.
 * The partition is cached on the state; a mask ORs the accepted sets of the stack tops and
 * checks the uncertain tokens against each real stack.
 *
 * A state that reads any character of a slice class and goes to one same state (again and
 * again: a loop, or a chain of r states, as x{0,r} gives) accepts all slice tokens of at most r
 * characters at once and rejects longer ones; only the tokens outside the slice are walked. */
#include <stdlib.h>
#include <string.h>

#include "gbnf.h"

static void add_chain(const eg_trie *t, eg_ints *list, int32_t tok)
{
    for (; tok >= 0; tok = t->next[tok])
        eg_ints_push(list, tok);
}

static void mark_subtree(eg_grammar *g, const eg_trie *t, int32_t i)
{
    for (int32_t j = i + 1; j < t->end[i]; j++)
        if (t->tok[j] >= 0)
            add_chain(t, &g->unc, t->tok[j]);
}

/* Walk for a rule without calls: one state per trie depth. */
static void walk_dfa(eg_grammar *g, const eg_trie *t, int32_t s)
{
    const uint8_t *follow = g->follow[g->states[s].rule];
    const int32_t **rowp = g->lv_row;
    uint8_t *ex = g->lv_exit, *un = g->lv_unc;
    rowp[0] = eg_row(g, s), ex[0] = un[0] = 0;
    int64_t visited = 0;
    for (int32_t i = 1; i < t->n;) {
        int d = t->depth[i], b = t->byte[i];
        const int32_t *pr = rowp[d - 1];
        int32_t nx = pr ? pr[b] : -1, tok = t->tok[i];
        int unc = un[d - 1] | (ex[d - 1] & eg_bit(follow, b));
        visited++;
        if (nx < 0) {
            if (unc) {
                add_chain(t, &g->unc, tok);
                mark_subtree(g, t, i);
            }
            i = t->end[i];
            continue;
        }
        add_chain(t, &g->acc, tok);
        int has_bytes = g->states[nx].has_bytes;
        ex[d] = g->states[nx].final, un[d] = (uint8_t)unc;
        rowp[d] = has_bytes ? eg_row(g, nx) : NULL;
        if (!has_bytes && !ex[d] && !unc)
            i = t->end[i];
        else
            i++;
    }
    g->stats[4] += visited;
}

/* One step of the general walk for a level holding a single configuration, with its row. */
static int walk_single(eg_grammar *g, eg_cfgs *cf, eg_cfg c, const int32_t *row, int b, int32_t from, int *flags)
{
    int32_t nx = row ? row[b] : -1;
    if (nx < 0)
        return 0;
    const eg_dstate *st = &g->states[nx];
    if (!st->n_calls && !st->final) { /* no call, no return: the configuration just moves */
        if (st->has_bytes)
            eg_cfgs_push(cf, (eg_cfg){nx, c.local, 0});
    } else {
        *flags |= eg_closure(g, (eg_cfg){nx, c.local, 0}, NULL, cf, from);
    }
    return 1;
}

/* Walk for a rule with calls: a few configurations (state + frames pushed) per trie depth;
 * a level with one configuration keeps its row at hand (the common case). */
static void walk_general(eg_grammar *g, const eg_trie *t, int32_t s)
{
    const uint8_t *follow = g->follow[g->states[s].rule];
    eg_cfgs *cf = &g->walk_cfgs;
    int32_t *start = g->lv_start, *fmark = g->lv_frames;
    uint8_t *ex = g->lv_exit, *un = g->lv_unc;
    const int32_t **rowp = g->lv_row;
    g->frames.n = 0, cf->n = 0;
    eg_cfgs_push(cf, (eg_cfg){s, -1, 0});
    start[0] = 0, start[1] = 1, fmark[0] = fmark[1] = 0, ex[0] = un[0] = 0;
    rowp[0] = eg_row(g, s);
    int64_t visited = 0;
    for (int32_t i = 1; i < t->n;) {
        int d = t->depth[i], b = t->byte[i], alive = 0, flags = 0;
        cf->n = start[d], g->frames.n = fmark[d];
        int unc = un[d - 1] | (ex[d - 1] & eg_bit(follow, b));
        visited++;
        if (start[d] - start[d - 1] == 1)
            alive = walk_single(g, cf, cf->v[start[d - 1]], rowp[d - 1], b, start[d], &flags);
        else
            for (int32_t j = start[d - 1]; j < start[d]; j++)
                alive |= walk_single(g, cf, cf->v[j], eg_row(g, cf->v[j].state), b, start[d], &flags);
        start[d + 1] = cf->n, fmark[d + 1] = g->frames.n;
        ex[d] = (flags & EG_EXITED) != 0, un[d] = (uint8_t)unc;
        rowp[d] = cf->n - start[d] == 1 ? eg_row(g, cf->v[start[d]].state) : NULL;
        if (alive)
            add_chain(t, &g->acc, t->tok[i]);
        else if (unc)
            add_chain(t, &g->unc, t->tok[i]);
        if (cf->n > start[d] || (ex[d] && !unc)) {
            i++; /* children: read further, or only via a return (then each child by its byte) */
            continue;
        }
        if (unc)
            mark_subtree(g, t, i);
        i = t->end[i];
    }
    g->stats[4] += visited;
}

/* ---- slices ---- */

/* The state every character of class k leads s to: a state, EG_MIXED or EG_BLOCKED. */
static int32_t class_step(eg_grammar *g, int32_t s, int32_t k)
{
    if (g->states[s].step[k] != EG_UNKNOWN)
        return g->states[s].step[k];
    const eg_class_dfa *cd = &g->vocab->classes[k];
    int32_t pk[256], pg[256], np = 1, target = -1;
    int ok = 0, dead = 0, mixed = 0;
    pk[0] = 0, pg[0] = s;
    for (int32_t i = 0; i < np && !mixed; i++) {
        const int32_t *row = g->states[pg[i]].has_bytes ? eg_row(g, pg[i]) : NULL;
        for (int b = 0; b < 256 && !mixed; b++) {
            int32_t kn = cd->next[pk[i]][b];
            if (kn < 0)
                continue;
            int32_t gn = row ? row[b] : -1;
            if (gn < 0) {
                dead = 1, mixed = ok;
            } else if (kn == 1) {
                mixed = dead || (target >= 0 && target != gn);
                ok = 1, target = gn;
            } else {
                int32_t j = 0;
                while (j < np && (pk[j] != kn || pg[j] != gn))
                    j++;
                if (j == np) {
                    if (np == 256)
                        mixed = 1;
                    else
                        pk[np] = kn, pg[np++] = gn;
                }
            }
        }
    }
    int32_t r = mixed || (ok && dead) ? EG_MIXED : !ok ? EG_BLOCKED : target;
    g->states[s].step[k] = r;
    return r;
}

/* A chain state may not call rules nor return where a class character may follow the rule:
 * either would let longer runs of class characters through. */
static int chain_closed(eg_grammar *g, const int32_t *chain, int32_t r, int32_t k)
{
    const eg_class_dfa *cd = &g->vocab->classes[k];
    for (int32_t j = 0; j <= r; j++) {
        const eg_dstate *s = &g->states[chain[j]];
        if (s->n_calls)
            return 0;
        if (s->final)
            for (int b = 0; b < 256; b++)
                if (cd->next[0][b] >= 0 && eg_bit(g->follow[s->rule], b))
                    return 0;
    }
    return 1;
}

/* Slice usable from s: class *k, whose tokens of at most *r characters s accepts; *self when
 * every class character leads s back to s (then the suffix trie may be walked). */
static int pick_slice(eg_grammar *g, int32_t s, int32_t *k_out, int32_t *r_out, int *self)
{
    int32_t chain[258];
    for (int32_t k = 0; k < g->vocab->n_classes; k++) {
        const eg_slice *sl = eg_vocab_slice(g->vocab, k);
        if (!sl || !sl->n_tokens)
            continue;
        int32_t r = 0, ok = 0, all = sl->max_chars;
        chain[0] = s;
        for (;;) {
            int32_t nx = class_step(g, chain[r], k);
            if (nx == EG_BLOCKED) {
                ok = r > 0 && chain_closed(g, chain, r, k);
                break;
            }
            if (nx < 0)
                break;
            int32_t j = 0;
            while (j <= r && chain[j] != nx)
                j++;
            if (j <= r || r + 1 >= all) { /* a loop, or longer than any slice token */
                r = all, ok = 1;
                break;
            }
            chain[++r] = nx;
        }
        if (ok) {
            *k_out = k, *r_out = r, *self = class_step(g, s, k) == s;
            return 1;
        }
    }
    return 0;
}

/* ---- sharing partitions between states that behave alike ---- */

struct eg_part_slot {
    uint64_t hash;
    int32_t off, len;               /* canonical node set in g->key_pool */
    const eg_part *part;            /* NULL: empty slot */
};

static uint64_t hash_ints(const int32_t *v, int32_t n)
{
    uint64_t h = 0xcbf29ce484222325ull ^ (uint64_t)n;
    for (int32_t i = 0; i < n; i++)
        h = (h ^ (uint32_t)v[i]) * 0x100000001b3ull;
    return h ^ (h >> 31);
}

/* g->keybuf <- the state's nodes mapped to their canonical nodes, sorted, without repeats. */
static int canonical_nodes(eg_grammar *g, int32_t s)
{
    const eg_dstate *d = &g->states[s];
    g->keybuf.n = 0;
    if (eg_ints_reserve(&g->keybuf, d->n_nodes))
        return -1;
    for (int32_t i = 0; i < d->n_nodes; i++) {
        int32_t x = g->set_pool.v[d->nodes_off + i], c = g->canon[x], j = g->keybuf.n;
        while (j > 0 && g->keybuf.v[j - 1] > c) /* insertion: sets are small */
            j--;
        if (j > 0 && g->keybuf.v[j - 1] == c)
            continue;
        memmove(g->keybuf.v + j + 1, g->keybuf.v + j, (size_t)(g->keybuf.n - j) * sizeof(int32_t));
        g->keybuf.v[j] = c, g->keybuf.n++;
    }
    return 0;
}

static struct eg_part_slot *part_slot(eg_grammar *g, uint64_t h, const int32_t *key, int32_t len)
{
    uint32_t mask = (uint32_t)g->part_cap - 1, i = (uint32_t)h & mask;
    for (; g->part_map[i].part; i = (i + 1) & mask) {
        const struct eg_part_slot *e = &g->part_map[i];
        if (e->hash == h && e->len == len && !memcmp(g->key_pool.v + e->off, key, (size_t)len * sizeof *key))
            break;
    }
    return &g->part_map[i];
}

static int part_map_grow(eg_grammar *g)
{
    int32_t old_cap = g->part_cap, cap = old_cap ? 2 * old_cap : 256;
    struct eg_part_slot *old = g->part_map;
    if (!(g->part_map = calloc((size_t)cap, sizeof *g->part_map))) {
        g->part_map = old;
        return -1;
    }
    g->part_cap = cap;
    for (int32_t i = 0; i < old_cap; i++)
        if (old[i].part)
            *part_slot(g, old[i].hash, g->key_pool.v + old[i].off, old[i].len) = old[i];
    free(old);
    return 0;
}

/* The partition of a state with the same canonical nodes, or the slot to store one in. */
static struct eg_part_slot *find_shared(eg_grammar *g, int32_t s)
{
    if (!g->canon || canonical_nodes(g, s))
        return NULL;
    if (2 * (g->n_parts + 1) > g->part_cap && part_map_grow(g))
        return NULL;
    return part_slot(g, hash_ints(g->keybuf.v, g->keybuf.n), g->keybuf.v, g->keybuf.n);
}

/* ---- partitions ---- */

static void token_edges(eg_grammar *g, int32_t s)
{
    const eg_vocab *v = g->vocab;
    for (int32_t k = 0; k < g->states[s].n_toks; k++) {
        int32_t set = g->tok_pool.v[g->states[s].toks_off + 2 * k];
        if (g->tokset_negated[set]) {
            for (int32_t t = 0; t < v->n_vocab; t++)
                if (eg_tokset_has(g, set, t))
                    eg_ints_push(&g->acc, t);
        } else {
            for (int32_t i = g->tokset_off[set]; i < g->tokset_off[set + 1]; i++)
                if (!eg_test(v->eog_bits, g->tokset_ids[i]))
                    eg_ints_push(&g->acc, g->tokset_ids[i]);
        }
    }
}

/* The walk's result as a partition (g->acc, g->unc, an optional slice bitmask); *bytes its size. */
static eg_part *make_part(eg_grammar *g, const uint32_t *shared, int64_t *bytes)
{
    int32_t w = g->vocab->n_words, n = g->acc.n;
    eg_part *p = calloc(1, sizeof *p);
    if (!p)
        return NULL;
    p->shared = shared;
    *bytes = sizeof *p;
    if (n > w) { /* a list longer than a bitmask: keep the bitmask */
        if (!(p->dense = malloc((size_t)w * sizeof *p->dense)))
            goto oom;
        if (shared)
            memcpy(p->dense, shared, (size_t)w * sizeof *p->dense);
        else
            memset(p->dense, 0, (size_t)w * sizeof *p->dense);
        for (int32_t i = 0; i < n; i++)
            eg_set(p->dense, g->acc.v[i]);
        p->shared = NULL;
        *bytes += (int64_t)w * 4;
    } else if (n) {
        if (!(p->ids = malloc((size_t)n * sizeof *p->ids)))
            goto oom;
        memcpy(p->ids, g->acc.v, (size_t)n * sizeof *p->ids);
        p->n_ids = n;
        *bytes += (int64_t)n * 4;
    }
    if (g->unc.n) {
        if (!(p->unc = malloc((size_t)g->unc.n * sizeof *p->unc)))
            goto oom;
        memcpy(p->unc, g->unc.v, (size_t)g->unc.n * sizeof *p->unc);
        p->n_unc = g->unc.n;
        *bytes += (int64_t)g->unc.n * 4;
    }
    return p;
oom:
    eg_part_free(p);
    return NULL;
}

static eg_part *compute_part(eg_grammar *g, int32_t s, int64_t *bytes)
{
    eg_vocab *v = g->vocab;
    g->acc.n = g->unc.n = 0;
    token_edges(g, s);
    const eg_trie *t = &v->trie;
    const uint32_t *shared = NULL;
    int32_t k, r;
    int self;
    if (g->states[s].has_bytes) {
        if (pick_slice(g, s, &k, &r, &self)) {
            t = self ? &v->slices[k]->suffix : &v->slices[k]->rest;
            shared = eg_slice_upto(v, k, r);
            g->stats[6]++;
        }
        if (g->rule_has_calls[g->states[s].rule])
            walk_general(g, t, s);
        else
            walk_dfa(g, t, s);
    }
    g->stats[3]++;
    return make_part(g, shared, bytes);
}

const eg_part *eg_partition(eg_grammar *g, int32_t s)
{
    if (g->states[s].part)
        return g->states[s].part;
    struct eg_part_slot *slot = find_shared(g, s);
    if (slot && slot->part) {
        g->stats[8]++;
        return g->states[s].part = slot->part;
    }
    uint64_t hash = slot ? hash_ints(g->keybuf.v, g->keybuf.n) : 0;
    int32_t off = g->key_pool.n, len = g->keybuf.n;
    if (slot && eg_ints_reserve(&g->key_pool, off + len))
        slot = NULL;
    if (slot)
        memcpy(g->key_pool.v + off, g->keybuf.v, (size_t)len * sizeof(int32_t));
    int64_t bytes;
    eg_part *p = compute_part(g, s, &bytes);
    if (!p) {
        eg_fail(g, "out of memory");
        return NULL;
    }
    g->n_parts++;
    p->next_owned = g->owned, g->owned = p;
    if (slot) {
        g->key_pool.n = off + len;
        *slot = (struct eg_part_slot){hash, off, len, p};
    }
    return g->states[s].part = p;
}

void eg_parts_free(eg_grammar *g)
{
    for (eg_part *p = g->owned, *next; p; p = next)
        next = p->next_owned, eg_part_free(p);
    free(g->part_map), free(g->key_pool.v), free(g->keybuf.v);
}

/* ---- masks ---- */

static void put_part(uint32_t *out, const eg_part *p, int32_t w, int first)
{
    const uint32_t *src = p->dense ? p->dense : p->shared;
    if (first) {
        if (src)
            memcpy(out, src, (size_t)w * sizeof *out);
        else
            memset(out, 0, (size_t)w * sizeof *out);
    } else if (src) {
        for (int32_t i = 0; i < w; i++)
            out[i] |= src[i];
    }
    for (int32_t i = 0; i < p->n_ids; i++)
        eg_set(out, p->ids[i]);
}

/* ---- uncertain tokens, checked per stack and remembered per stack ---- */

struct eg_unc_entry {
    uint64_t hash;
    int32_t len, stack_off, res_off, n_res;  /* len -1: empty slot */
};

enum { UC_SLOTS = 4096, UC_POOL = 1 << 22 };

static uint64_t hash_stack64(const int32_t *v, int32_t n)
{
    uint64_t h = 0xcbf29ce484222325ull ^ (uint64_t)n;
    for (int32_t i = 0; i < n; i++)
        h = (h ^ (uint32_t)v[i]) * 0x100000001b3ull;
    return h ^ (h >> 29);
}

static void uc_clear(eg_grammar *g)
{
    for (int32_t i = 0; i < g->uc_cap; i++)
        g->uc[i].len = -1;
    g->uc_n = 0, g->uc_stacks.n = 0, g->uc_results.n = 0;
}

static struct eg_unc_entry *uc_slot(eg_grammar *g, const int32_t *stack, int32_t len, uint64_t h)
{
    if (!g->uc) {
        if (!(g->uc = malloc(UC_SLOTS * sizeof *g->uc)))
            return NULL;
        g->uc_cap = UC_SLOTS;
        uc_clear(g);
    }
    uint32_t mask = (uint32_t)g->uc_cap - 1, i = (uint32_t)h & mask;
    for (; g->uc[i].len >= 0; i = (i + 1) & mask) {
        struct eg_unc_entry *e = &g->uc[i];
        if (e->hash == h && e->len == len && !memcmp(g->uc_stacks.v + e->stack_off, stack, (size_t)len * sizeof *stack))
            return e;
    }
    return &g->uc[i];
}

/* Sets the uncertain tokens of p that the stack reads, from the cache or by checking them. */
static void put_uncertain(eg_grammar *g, uint32_t *out, const eg_part *p, const int32_t *stack, int32_t len)
{
    uint64_t h = hash_stack64(stack, len);
    struct eg_unc_entry *e = uc_slot(g, stack, len, h);
    if (e && e->len >= 0) {
        g->stats[7]++;
        for (int32_t j = 0; j < e->n_res; j++)
            eg_set(out, g->uc_results.v[e->res_off + j]);
        return;
    }
    int32_t res_off = g->uc_results.n, n_res = 0;
    for (int32_t j = 0; j < p->n_unc; j++) {
        int32_t u = p->unc[j];
        if (eg_check_token(g, stack, len, u)) {
            eg_set(out, u);
            n_res += !eg_ints_push(&g->uc_results, u);
        }
    }
    if (!e || g->uc_results.n != res_off + n_res)
        return;
    if (2 * (g->uc_n + 1) > g->uc_cap || g->uc_stacks.n + len > UC_POOL || g->uc_results.n > UC_POOL) {
        uc_clear(g); /* full: start over */
        return;
    }
    int32_t stack_off = g->uc_stacks.n;
    if (eg_ints_reserve(&g->uc_stacks, stack_off + len))
        return;
    memcpy(g->uc_stacks.v + stack_off, stack, (size_t)len * sizeof *stack);
    g->uc_stacks.n += len;
    *e = (struct eg_unc_entry){h, len, stack_off, res_off, n_res};
    g->uc_n++;
}

void eg_unc_free(eg_grammar *g)
{
    free(g->uc), free(g->uc_stacks.v), free(g->uc_results.v);
}

int eg_fill_mask(eg_matcher *m, uint32_t *out)
{
    eg_grammar *g = m->g;
    int32_t w = g->vocab->n_words;
    if (m->n_stacks == 0)
        memset(out, 0, (size_t)w * sizeof *out);
    for (int32_t i = 0; i < m->n_stacks; i++) {
        const int32_t *stack = m->st + m->off[i];
        int32_t len = m->off[i + 1] - m->off[i];
        const eg_part *p = eg_partition(g, stack[len - 1]);
        if (!p)
            return EG_ERR_MEMORY;
        put_part(out, p, w, i == 0);
        if (p->n_unc)
            put_uncertain(g, out, p, stack, len);
    }
    if (m->ended)
        for (int32_t i = 0; i < w; i++)
            out[i] |= g->vocab->eog_bits[i];
    return m->n_stacks;
}
