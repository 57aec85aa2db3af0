/* Parsing: closures over calls and returns, reading bytes, and the matcher's stack set.
 *
 * While reading one token a configuration is (state, frames pushed during the token, height
 * of the matcher stack still below): the stack is never copied until the token is over, and
 * then each surviving configuration becomes one stack of the new set. Every loop here is
 * iterative and bounded by GrammarLimits (stack depth, number of stacks). */
#include <stdlib.h>
#include <string.h>

#include "gbnf.h"

static int same_frames(const eg_frames *f, int32_t a, int32_t b)
{
    while (a != b) {
        if (a < 0 || b < 0 || f->v[a].state != f->v[b].state || f->v[a].depth != f->v[b].depth)
            return 0;
        a = f->v[a].parent, b = f->v[b].parent;
    }
    return 1;
}

static int same_cfg(const eg_grammar *g, eg_cfg x, eg_cfg y)
{
    return x.state == y.state && x.base == y.base && same_frames(&g->frames, x.local, y.local);
}

static int has_cfg(const eg_grammar *g, const eg_cfgs *a, int32_t from, eg_cfg c)
{
    for (int32_t i = from; i < a->n; i++)
        if (same_cfg(g, a->v[i], c))
            return 1;
    return 0;
}

static int32_t frame_depth(const eg_grammar *g, int32_t local)
{
    return local < 0 ? 0 : g->frames.v[local].depth;
}

/* Adds to out[from:] each configuration reachable from c by calls and returns that can read a
 * byte or a token. Returns EG_EXITED when some path returned past the bottom (base NULL: left
 * the state's rule; otherwise: the whole parse finished) and EG_OVERFLOW when a limit cut a path. */
int eg_closure(eg_grammar *g, eg_cfg c, const int32_t *base, eg_cfgs *out, int32_t from)
{
    int flags = 0;
    g->work.n = g->seen.n = 0;
    if (eg_cfgs_push(&g->work, c))
        return EG_OVERFLOW;
    while (g->work.n) {
        c = g->work.v[--g->work.n];
        if (g->seen.n && has_cfg(g, &g->seen, 0, c))
            continue;
        if (eg_cfgs_push(&g->seen, c))
            return flags | EG_OVERFLOW;
        const eg_dstate *s = &g->states[c.state];
        if ((s->has_bytes || s->has_tokens) && !has_cfg(g, out, from, c)) {
            if (out->n - from >= g->max_stacks || eg_cfgs_push(out, c))
                flags |= EG_OVERFLOW;
        }
        int32_t n_calls = s->n_calls, final = s->final;
        for (int32_t k = 0; k < n_calls; k++) {
            int32_t callee = g->call_pool.v[g->states[c.state].calls_off + 2 * k];
            int32_t ret = eg_call_return(g, c.state, k), start = eg_rule_start_state(g, callee);
            if (ret < -1 || start < 0)
                continue;
            int32_t local = c.local, depth = frame_depth(g, local) + c.base;
            if (ret >= 0) {
                if (depth + 1 > g->max_stack_depth) {
                    flags |= EG_OVERFLOW;
                    continue;
                }
                local = eg_frames_push(&g->frames, (eg_frame){ret, c.local, frame_depth(g, c.local) + 1});
                if (local < 0)
                    return flags | EG_OVERFLOW;
            }
            if (eg_cfgs_push(&g->work, (eg_cfg){start, local, c.base}))
                return flags | EG_OVERFLOW;
        }
        if (!final)
            continue;
        eg_cfg up;
        if (c.local >= 0)
            up = (eg_cfg){g->frames.v[c.local].state, g->frames.v[c.local].parent, c.base};
        else if (c.base > 0)
            up = (eg_cfg){base[c.base - 1], -1, c.base - 1};
        else {
            flags |= EG_EXITED;
            continue;
        }
        if (eg_cfgs_push(&g->work, up))
            return flags | EG_OVERFLOW;
    }
    return flags;
}

/* Reads bytes (n,) from the configurations in *cur (swapping buffers); returns 1 when the last
 * byte was read by some configuration; *ended tells whether the parse may finish right after. */
static int read_bytes(eg_grammar *g, const int32_t *base, eg_cfgs **cur, eg_cfgs **nxt,
                      const uint8_t *bytes, int32_t n, int *ended)
{
    int read = 0, flags = 0, cut = 0;
    int32_t i = 0;
    for (; i < n && (*cur)->n; i++) {
        read = flags = 0;
        (*nxt)->n = 0;
        for (int32_t j = 0; j < (*cur)->n; j++) {
            eg_cfg c = (*cur)->v[j];
            const int32_t *row = eg_row(g, c.state);
            int32_t t = row ? row[bytes[i]] : -1;
            if (t < 0)
                continue;
            read = 1;
            flags |= eg_closure(g, (eg_cfg){t, c.local, c.base}, base, *nxt, 0);
        }
        cut |= flags & EG_OVERFLOW;
        eg_cfgs *tmp = *cur;
        *cur = *nxt, *nxt = tmp;
        if (!read)
            break;
    }
    read = read && i == n;
    *ended = (read && (flags & EG_EXITED) ? 1 : 0) | (cut ? 2 : 0);
    return read;
}

/* Whether a text token can be read from the stack (len,), top last. */
int eg_check_token(eg_grammar *g, const int32_t *stack, int32_t len, int32_t token)
{
    eg_cfgs *cur = &g->cfg_a, *nxt = &g->cfg_b;
    int ended;
    g->frames.n = 0, cur->n = 0;
    eg_cfgs_push(cur, (eg_cfg){stack[len - 1], -1, len - 1});
    g->stats[5]++;
    return read_bytes(g, stack, &cur, &nxt, eg_tok_bytes(g->vocab, token), eg_tok_len(g->vocab, token), &ended);
}

/* ---- stack sets ---- */

typedef struct {
    int32_t n_stacks, cap_stacks, cap_st;
    int32_t *off, *st;
    int32_t *slots;  /* open addressing over stacks for dedup */
    int32_t cap_slots;
} stack_set;

static uint32_t hash_stack(const int32_t *v, int32_t n)
{
    uint32_t h = 0x9e3779b9u ^ (uint32_t)n;
    for (int32_t i = 0; i < n; i++)
        h = (h ^ (uint32_t)v[i]) * 0x01000193u;
    return h ^ (h >> 16);
}

static void set_free(stack_set *s) { free(s->off), free(s->st), free(s->slots); }

static int set_init(stack_set *s, int32_t max_stacks)
{
    memset(s, 0, sizeof *s);
    s->cap_slots = 16;
    while (s->cap_slots < 2 * max_stacks)
        s->cap_slots *= 2;
    s->slots = malloc((size_t)s->cap_slots * sizeof *s->slots);
    s->off = malloc(sizeof *s->off);
    if (!s->slots || !s->off)
        return -1;
    memset(s->slots, 0xff, (size_t)s->cap_slots * sizeof *s->slots);
    s->off[0] = 0, s->cap_stacks = 0;
    return 0;
}

/* Adds base (base_len,) + the configuration's frames + its state, unless already there.
 * Returns 0, 1 if it was a duplicate, 2 if dropped (max_stacks reached), -1 on memory. */
static int set_add(eg_grammar *g, stack_set *s, const int32_t *base, eg_cfg c)
{
    int32_t depth = frame_depth(g, c.local), len = c.base + depth + 1;
    int32_t start = s->off[s->n_stacks];
    int32_t cap = s->cap_st, caps = s->cap_stacks;
    int32_t *st = eg_grow(s->st, &cap, start + len, sizeof *st);
    if (!st)
        return -1;
    s->st = st, s->cap_st = cap;
    int32_t *off = eg_grow(s->off, &caps, s->n_stacks + 2, sizeof *off);
    if (!off)
        return -1;
    s->off = off, s->cap_stacks = caps;
    int32_t *v = s->st + start;
    if (c.base)
        memcpy(v, base, (size_t)c.base * sizeof *v);
    for (int32_t f = c.local, i = c.base + depth - 1; f >= 0; f = g->frames.v[f].parent, i--)
        v[i] = g->frames.v[f].state;
    v[len - 1] = c.state;
    uint32_t mask = (uint32_t)s->cap_slots - 1, i = hash_stack(v, len) & mask;
    for (; s->slots[i] >= 0; i = (i + 1) & mask) {
        int32_t o = s->off[s->slots[i]], l = s->off[s->slots[i] + 1] - o;
        if (l == len && !memcmp(s->st + o, v, (size_t)len * sizeof *v))
            return 1;
    }
    if (s->n_stacks >= g->max_stacks)
        return 2;
    s->slots[i] = s->n_stacks++;
    s->off[s->n_stacks] = start + len;
    return 0;
}

/* Moves the set into the matcher. */
static void set_install(eg_matcher *m, stack_set *s, int ended)
{
    free(m->off), free(m->st);
    m->off = s->off, m->st = s->st, m->n_stacks = s->n_stacks;
    m->cap_stacks = s->cap_stacks, m->cap_st = s->cap_st;
    m->ended = (uint8_t)ended;
    free(s->slots);
}

/* Adds every configuration; -1 on memory, else 2 when some were dropped (too many parses), 0. */
static int add_all(eg_grammar *g, stack_set *s, const int32_t *base, const eg_cfgs *cfgs)
{
    int dropped = 0;
    for (int32_t i = 0; i < cfgs->n; i++) {
        int rc = set_add(g, s, base, cfgs->v[i]);
        if (rc < 0)
            return -1;
        dropped |= rc == 2;
    }
    return dropped ? 2 : 0;
}

/* ---- matcher ---- */

static int lock(eg_grammar *g)
{
    pthread_mutex_lock(&g->lock);
    if (g->error[0]) {
        pthread_mutex_unlock(&g->lock);
        return EG_ERR_LIMIT;
    }
    return 0;
}

static int unlock(eg_grammar *g, int rc)
{
    if (g->error[0] && rc >= 0)
        rc = EG_ERR_LIMIT;
    pthread_mutex_unlock(&g->lock);
    return rc;
}

eg_matcher *eg_matcher_new(eg_grammar *g)
{
    eg_matcher *m = calloc(1, sizeof *m);
    stack_set s;
    if (!m || lock(g)) {
        free(m);
        return NULL;
    }
    m->g = g;
    int rc = -1;
    int32_t start = eg_rule_start_state(g, 0);
    if (start >= 0 && !set_init(&s, g->max_stacks)) {
        g->frames.n = 0, g->cfg_a.n = 0;
        int flags = eg_closure(g, (eg_cfg){start, -1, 0}, NULL, &g->cfg_a, 0);
        rc = add_all(g, &s, NULL, &g->cfg_a);
        if (rc >= 0) {
            m->saturated = rc == 2 || (flags & EG_OVERFLOW);
            set_install(m, &s, flags & EG_EXITED);
            rc = 0;
        }
        else
            set_free(&s);
    }
    if (unlock(g, rc) < 0) {
        eg_matcher_free(m);
        return NULL;
    }
    return m;
}

eg_matcher *eg_matcher_clone(const eg_matcher *m)
{
    eg_matcher *c = calloc(1, sizeof *c);
    if (!c)
        return NULL;
    *c = *m;
    int32_t n_st = m->off[m->n_stacks];
    c->off = malloc(((size_t)m->n_stacks + 1) * sizeof *c->off);
    c->st = malloc(((size_t)n_st + 1) * sizeof *c->st);
    if (!c->off || !c->st) {
        eg_matcher_free(c);
        return NULL;
    }
    memcpy(c->off, m->off, ((size_t)m->n_stacks + 1) * sizeof *c->off);
    memcpy(c->st, m->st, (size_t)n_st * sizeof *c->st);
    c->cap_stacks = m->n_stacks + 1, c->cap_st = n_st + 1;
    return c;
}

void eg_matcher_free(eg_matcher *m)
{
    if (m)
        free(m->off), free(m->st), free(m);
}

/* Reads bytes, or a whole token (bytes NULL), from every stack into a new set. When the parses
 * would outnumber max_stacks the extra ones are dropped (the matcher is then `saturated`): the
 * kept ones are all valid, so nothing invalid is ever allowed, but some valid text may be lost. */
static int advance(eg_matcher *m, int32_t token, const uint8_t *bytes, int32_t n)
{
    eg_grammar *g = m->g;
    const eg_vocab *v = g->vocab;
    int text = bytes || v->is_text[token];
    if (!bytes && text)
        bytes = eg_tok_bytes(v, token), n = eg_tok_len(v, token);
    stack_set s;
    if (set_init(&s, g->max_stacks))
        return EG_ERR_MEMORY;
    int ended = 0, cut = 0, rc;
    for (int32_t i = 0; i < m->n_stacks; i++) {
        const int32_t *stack = m->st + m->off[i];
        int32_t len = m->off[i + 1] - m->off[i], top = stack[len - 1];
        eg_cfgs *cur = &g->cfg_a, *nxt = &g->cfg_b;
        int e = 0;
        g->frames.n = 0, cur->n = 0;
        eg_cfgs_push(cur, (eg_cfg){top, -1, len - 1});
        if (text && read_bytes(g, stack, &cur, &nxt, bytes, n, &e)) {
            ended |= e & 1, cut |= e & 2;
            if ((rc = add_all(g, &s, stack, cur)) < 0)
                goto oom;
            cut |= rc;
        }
        for (int32_t k = 0; token >= 0 && k < g->states[top].n_toks; k++) {
            if (!eg_tokset_has(g, g->tok_pool.v[g->states[top].toks_off + 2 * k], token))
                continue;
            int32_t t = eg_token_target(g, top, k);
            if (t < 0)
                continue;
            g->frames.n = 0, g->cfg_a.n = 0;
            int flags = eg_closure(g, (eg_cfg){t, -1, len - 1}, stack, &g->cfg_a, 0);
            ended |= (flags & EG_EXITED) != 0, cut |= flags & EG_OVERFLOW;
            if ((rc = add_all(g, &s, stack, &g->cfg_a)) < 0)
                goto oom;
            cut |= rc;
        }
    }
    if (s.n_stacks == 0 && !ended) {
        set_free(&s);
        return 0;
    }
    int saturated = m->saturated || cut;
    set_install(m, &s, ended);
    m->saturated = (uint8_t)saturated;
    return 1;
oom:
    set_free(&s);
    return EG_ERR_MEMORY;
}

int eg_matcher_accept_token(eg_matcher *m, int32_t token)
{
    eg_grammar *g = m->g;
    if (token < 0 || token >= g->vocab->n_vocab)
        return 0;
    if (eg_test(g->vocab->eog_bits, token))
        return m->ended;
    if (lock(g))
        return EG_ERR_LIMIT;
    return unlock(g, advance(m, token, NULL, 0));
}

int eg_matcher_accept_bytes(eg_matcher *m, const uint8_t *data, int32_t n)
{
    if (n <= 0)
        return 1;
    if (lock(m->g))
        return EG_ERR_LIMIT;
    return unlock(m->g, advance(m, -1, data, n));
}

int eg_matcher_can_end(const eg_matcher *m) { return m->ended; }
int eg_matcher_at_end(const eg_matcher *m) { return m->n_stacks == 0; }
int eg_matcher_n_stacks(const eg_matcher *m) { return m->n_stacks; }
int eg_matcher_saturated(const eg_matcher *m) { return m->saturated; }

/* The one byte every stack top reads, or -1 when there is a choice (or the end is possible). */
static int only_byte(eg_matcher *m)
{
    int found = -1;
    if (m->ended)
        return -1;
    for (int32_t i = 0; i < m->n_stacks; i++) {
        int32_t top = m->st[m->off[i + 1] - 1];
        if (m->g->states[top].has_tokens)
            return -1;
        const int32_t *row = eg_row(m->g, top);
        for (int b = 0; row && b < 256; b++)
            if (row[b] >= 0) {
                if (found >= 0 && found != b)
                    return -1;
                found = b;
            }
    }
    return found;
}

int eg_matcher_forced_bytes(eg_matcher *m, uint8_t *out, int32_t cap)
{
    eg_matcher *c = eg_matcher_clone(m);
    if (!c)
        return EG_ERR_MEMORY;
    int32_t n = 0;
    if (lock(m->g)) {
        eg_matcher_free(c);
        return EG_ERR_LIMIT;
    }
    while (n < cap) {
        int b = only_byte(c);
        if (b < 0)
            break;
        uint8_t byte = (uint8_t)b;
        if (advance(c, -1, &byte, 1) != 1)
            break;
        out[n++] = byte;
    }
    eg_matcher_free(c);
    return unlock(m->g, n);
}
