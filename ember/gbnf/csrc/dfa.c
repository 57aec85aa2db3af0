/* The lazily built deterministic automaton of each rule.
 *
 * A DFA state is an eps-closed set of NFA nodes of one rule, keeping only the nodes that
 * matter (with a byte, call or token edge, or the rule's end), sorted and interned by content.
 * Its 256-entry row, the return state of each call it makes and the target of each token set
 * are built the first time they are asked for, so a grammar costs nothing for the parts of it
 * a generation never reaches. Bytes that no byte set tells apart share one class, so a row
 * costs one set computation per class instead of per byte. */
#include <stdlib.h>
#include <string.h>
#include <stdio.h>

#include "gbnf.h"

void eg_fail(eg_grammar *g, const char *msg)
{
    if (!g->error[0])
        snprintf(g->error, sizeof g->error, "%s", msg);
}

static void byte_classes(eg_grammar *g)
{
    int16_t in[256], out[256];
    int32_t n = 1;
    memset(g->byte_class, 0, sizeof g->byte_class);
    for (int32_t s = 0; s < g->n_sets && n < 256; s++) {
        for (int i = 0; i < 256; i++)
            in[i] = out[i] = -1;
        int32_t m = 0;
        for (int b = 0; b < 256; b++) {
            int16_t *to = eg_bit(g->sets[s], b) ? in : out;
            uint8_t old = g->byte_class[b];
            if (to[old] < 0)
                to[old] = (int16_t)m++;
            g->byte_class[b] = (uint8_t)to[old];
        }
        n = m;
    }
    for (int b = 255; b >= 0; b--)
        g->class_rep[g->byte_class[b]] = (uint8_t)b;
    g->n_byte_classes = n;
}

int eg_dfa_init(eg_grammar *g)
{
    byte_classes(g);
    g->hash_cap = 1024;
    g->hash = malloc((size_t)g->hash_cap * sizeof *g->hash);
    g->rule_start_state = malloc((size_t)g->n_rules * sizeof *g->rule_start_state);
    g->mark = calloc((size_t)g->n_nodes, sizeof *g->mark);
    if (!g->hash || !g->rule_start_state || !g->mark)
        return -1;
    memset(g->hash, 0xff, (size_t)g->hash_cap * sizeof *g->hash);
    for (int32_t r = 0; r < g->n_rules; r++)
        g->rule_start_state[r] = EG_UNKNOWN;
    return 0;
}

void eg_dfa_free(eg_grammar *g)
{
    for (int32_t s = 0; s < g->n_states; s++)
        free(g->states[s].row);
    free(g->states), free(g->hash), free(g->rule_start_state), free(g->mark);
    free(g->set_pool.v), free(g->call_pool.v), free(g->tok_pool.v);
}

/* ---- node sets ---- */

static void next_stamp(eg_grammar *g)
{
    if (++g->stamp == 0) {
        memset(g->mark, 0, (size_t)g->n_nodes * sizeof *g->mark);
        g->stamp = 1;
    }
}

static void sort_ints(int32_t *a, int32_t n)
{
    for (int32_t i = 1; i < n; i++) { /* sets are small: insertion sort */
        int32_t x = a[i], j = i;
        for (; j > 0 && a[j - 1] > x; j--)
            a[j] = a[j - 1];
        a[j] = x;
    }
}

/* g->members <- the eps-closure of seeds (n,), important nodes only, sorted. */
static int eps_closure(eg_grammar *g, const int32_t *seeds, int32_t n)
{
    next_stamp(g);
    g->members.n = g->todo.n = 0;
    for (int32_t i = 0; i < n; i++)
        if (g->mark[seeds[i]] != g->stamp) {
            g->mark[seeds[i]] = g->stamp;
            if (eg_ints_push(&g->todo, seeds[i]))
                return -1;
        }
    while (g->todo.n) {
        int32_t x = g->todo.v[--g->todo.n];
        if (g->node_important[x] && eg_ints_push(&g->members, x))
            return -1;
        for (int32_t e = g->edge_off[x]; e < g->edge_off[x + 1]; e++) {
            int32_t d = g->edge_dst[e];
            if (g->edge_kind[e] == EG_EPS && g->mark[d] != g->stamp) {
                g->mark[d] = g->stamp;
                if (eg_ints_push(&g->todo, d))
                    return -1;
            }
        }
    }
    sort_ints(g->members.v, g->members.n);
    return 0;
}

static uint32_t hash_set(const int32_t *v, int32_t n)
{
    uint32_t h = 2166136261u ^ (uint32_t)n;
    for (int32_t i = 0; i < n; i++)
        h = (h ^ (uint32_t)v[i]) * 16777619u;
    return h ^ (h >> 15);
}

static int same_set(const eg_grammar *g, const eg_dstate *s, const int32_t *v, int32_t n)
{
    return s->n_nodes == n && !memcmp(g->set_pool.v + s->nodes_off, v, (size_t)n * sizeof *v);
}

static int rehash(eg_grammar *g)
{
    int32_t cap = g->hash_cap * 2;
    int32_t *h = malloc((size_t)cap * sizeof *h);
    if (!h)
        return -1;
    memset(h, 0xff, (size_t)cap * sizeof *h);
    for (int32_t s = 0; s < g->n_states; s++) {
        const eg_dstate *d = &g->states[s];
        uint32_t i = hash_set(g->set_pool.v + d->nodes_off, d->n_nodes) & (uint32_t)(cap - 1);
        while (h[i] >= 0)
            i = (i + 1) & (uint32_t)(cap - 1);
        h[i] = s;
    }
    free(g->hash);
    g->hash = h, g->hash_cap = cap;
    return 0;
}

/* Distinct labels of the members' edges of one kind, as (label, EG_UNKNOWN) pairs in pool. */
static int collect_labels(eg_grammar *g, int kind, eg_ints *pool, int32_t *off, int32_t *count)
{
    *off = pool->n, *count = 0;
    for (int32_t i = 0; i < g->members.n; i++) {
        int32_t x = g->members.v[i];
        for (int32_t e = g->edge_off[x]; e < g->edge_off[x + 1]; e++) {
            if (g->edge_kind[e] != kind)
                continue;
            int32_t lab = g->edge_label[e], dup = 0;
            for (int32_t j = 0; j < *count && !dup; j++)
                dup = pool->v[*off + 2 * j] == lab;
            if (!dup && (eg_ints_push(pool, lab) || eg_ints_push(pool, EG_UNKNOWN)))
                return -1;
            *count += !dup;
        }
    }
    return 0;
}

static int32_t new_state(eg_grammar *g, uint32_t slot)
{
    if (g->n_states >= g->max_dfa_states) {
        eg_fail(g, "grammar too complex: its automaton needs more states than GrammarLimits.max_dfa_states");
        return EG_ERR_LIMIT;
    }
    if (g->n_states == g->cap_states) {
        int32_t cap = g->cap_states;
        eg_dstate *v = eg_grow(g->states, &cap, g->n_states + 1, sizeof *v);
        if (!v)
            return EG_ERR_MEMORY;
        g->states = v, g->cap_states = cap;
    }
    int32_t id = g->n_states;
    eg_dstate *s = &g->states[id];
    memset(s, 0, sizeof *s);
    s->nodes_off = g->set_pool.n, s->n_nodes = g->members.n;
    s->rule = g->node_rule[g->members.v[0]];
    for (int k = 0; k < EG_MAX_CLASSES; k++)
        s->step[k] = EG_UNKNOWN;
    for (int32_t i = 0; i < g->members.n; i++) {
        int32_t x = g->members.v[i];
        s->final |= x == g->rule_end[s->rule];
        for (int32_t e = g->edge_off[x]; e < g->edge_off[x + 1]; e++)
            s->has_bytes |= g->edge_kind[e] == EG_BYTE;
        if (eg_ints_push(&g->set_pool, x))
            return EG_ERR_MEMORY;
    }
    if (collect_labels(g, EG_CALL, &g->call_pool, &s->calls_off, &s->n_calls) ||
        collect_labels(g, EG_TOKEN, &g->tok_pool, &s->toks_off, &s->n_toks))
        return EG_ERR_MEMORY;
    s->has_tokens = s->n_toks > 0;
    s->pure_final = s->final && !s->has_bytes && !s->has_tokens && !s->n_calls;
    g->hash[slot] = id;
    g->n_states++;
    return id;
}

/* The state for g->members (-1 for the empty set), created if new. */
static int32_t intern(eg_grammar *g)
{
    if (g->members.n == 0)
        return -1;
    if (2 * (g->n_states + 1) > g->hash_cap && rehash(g))
        return EG_ERR_MEMORY;
    uint32_t mask = (uint32_t)g->hash_cap - 1;
    uint32_t i = hash_set(g->members.v, g->members.n) & mask;
    for (; g->hash[i] >= 0; i = (i + 1) & mask)
        if (same_set(g, &g->states[g->hash[i]], g->members.v, g->members.n))
            return g->hash[i];
    return new_state(g, i);
}

static int32_t state_of(eg_grammar *g, const int32_t *seeds, int32_t n)
{
    if (eps_closure(g, seeds, n))
        return EG_ERR_MEMORY;
    return intern(g);
}

int32_t eg_rule_start_state(eg_grammar *g, int32_t rule)
{
    if (g->rule_start_state[rule] == EG_UNKNOWN)
        g->rule_start_state[rule] = state_of(g, &g->rule_start[rule], 1);
    return g->rule_start_state[rule];
}

/* ---- transitions ---- */

/* Targets of the state's edges of one kind and label (for bytes: whose set holds byte `label`). */
static int gather(eg_grammar *g, int32_t s, int kind, int32_t label)
{
    g->targets.n = 0;
    const eg_dstate *d = &g->states[s];
    for (int32_t i = 0; i < d->n_nodes; i++) {
        int32_t x = g->set_pool.v[d->nodes_off + i];
        for (int32_t e = g->edge_off[x]; e < g->edge_off[x + 1]; e++) {
            if (g->edge_kind[e] != kind)
                continue;
            int hit = kind == EG_BYTE ? eg_bit(g->sets[g->edge_label[e]], label) : g->edge_label[e] == label;
            if (hit && eg_ints_push(&g->targets, g->edge_dst[e]))
                return -1;
        }
    }
    return 0;
}

const int32_t *eg_row(eg_grammar *g, int32_t s)
{
    if (g->states[s].row)
        return g->states[s].row;
    int32_t *row = malloc(256 * sizeof *row), by_class[256];
    if (!row) {
        eg_fail(g, "out of memory");
        return NULL;
    }
    for (int32_t c = 0; c < g->n_byte_classes; c++) {
        int32_t t = -1;
        if (g->states[s].has_bytes) {
            t = gather(g, s, EG_BYTE, g->class_rep[c]) ? EG_ERR_MEMORY : state_of(g, g->targets.v, g->targets.n);
            if (t == EG_ERR_MEMORY)
                eg_fail(g, "out of memory");
        }
        by_class[c] = t < 0 ? -1 : t;
    }
    for (int b = 0; b < 256; b++)
        row[b] = by_class[g->byte_class[b]];
    g->states[s].row = row;
    g->stats[1]++;
    return row;
}

/* State to return to after the state's k-th call; -1 when nothing follows (a tail call). */
int32_t eg_call_return(eg_grammar *g, int32_t s, int32_t k)
{
    int32_t *pair = g->call_pool.v + g->states[s].calls_off + 2 * k;
    if (pair[1] != EG_UNKNOWN)
        return pair[1];
    if (gather(g, s, EG_CALL, pair[0]))
        return EG_ERR_MEMORY;
    int32_t t = state_of(g, g->targets.v, g->targets.n);
    if (t < -1)
        return t;
    pair = g->call_pool.v + g->states[s].calls_off + 2 * k; /* the pool may have moved */
    pair[1] = t < 0 ? EG_DEAD : g->states[t].pure_final ? -1 : t;
    return pair[1];
}

int32_t eg_token_target(eg_grammar *g, int32_t s, int32_t k)
{
    int32_t *pair = g->tok_pool.v + g->states[s].toks_off + 2 * k;
    if (pair[1] != EG_UNKNOWN)
        return pair[1];
    if (gather(g, s, EG_TOKEN, pair[0]))
        return EG_ERR_MEMORY;
    int32_t t = state_of(g, g->targets.v, g->targets.n);
    if (t < -1)
        return t;
    pair = g->tok_pool.v + g->states[s].toks_off + 2 * k;
    pair[1] = t;
    return t;
}

/* Whether token set `set` matches `token`; end-of-generation tokens never match a negated set. */
int eg_tokset_has(const eg_grammar *g, int32_t set, int32_t token)
{
    int listed = 0;
    for (int32_t i = g->tokset_off[set]; i < g->tokset_off[set + 1] && !listed; i++)
        listed = g->tokset_ids[i] == token;
    if (!g->tokset_negated[set])
        return listed;
    return !listed && !eg_test(g->vocab->eog_bits, token);
}
