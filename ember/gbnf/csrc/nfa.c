/* Building the byte automaton from the rules' postfix programs (see eg_nfa_input).
 *
 * Thompson construction with a stack of fragments. A fragment's nodes and edges are the
 * contiguous ranges created since it began, so repeating it or inlining a finished rule is a
 * copy of two ranges with an offset. Afterwards only the rules still called are kept,
 * renumbered, nodes that cannot reach their rule's end lose their edges (no live state is a
 * dead end), edges are sorted by source, and each rule gets the set of bytes that may follow
 * it somewhere (one byte of lookahead for the mask walks). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "build.h"

int b_fail(builder *b, const char *msg)
{
    if (!b->failed)
        snprintf(b->err, (size_t)b->errlen, "%s", msg);
    b->failed = 1;
    return -1;
}

/* Reserves k new nodes, each its own canonical node; returns the first or -1. */
int32_t b_nodes(builder *b, int32_t k)
{
    if ((int64_t)b->n + k > b->in->max_states) {
        b_fail(b, "the grammar's automaton is larger than GrammarLimits.max_nfa_states");
        return -1;
    }
    for (int h = 0; h < 2; h++) {
        if (eg_ints_reserve(&b->canon[h], b->n + k)) {
            b_fail(b, "out of memory");
            return -1;
        }
        for (int32_t i = 0; i < k; i++)
            b->canon[h].v[b->n + i] = b->n + i;
        b->canon[h].n = b->n + k;
    }
    b->n += k;
    return b->n - k;
}


int b_edge(builder *b, int32_t s, int32_t k, int32_t lab, int32_t d)
{
    if (s < 0 || d < 0)
        return -1;
    if (eg_ints_push(&b->src, s) || eg_ints_push(&b->kind, k) || eg_ints_push(&b->label, lab) || eg_ints_push(&b->dst, d))
        return b_fail(b, "out of memory");
    return 0;
}

static int push(builder *b, frag f)
{
    if (b->sp == b->cap) {
        int32_t cap = b->cap;
        frag *v = eg_grow(b->stack, &cap, b->sp + 1, sizeof *v);
        if (!v)
            return b_fail(b, "out of memory");
        b->stack = v, b->cap = cap;
    }
    b->stack[b->sp++] = f;
    return 0;
}

/* Copies nodes [lo, hi) and edges [elo, ehi); returns the offset added to node ids. */
static int32_t copy_range(builder *b, int32_t lo, int32_t hi, int32_t elo, int32_t ehi)
{
    int32_t off = b->n - lo, need = b->src.n + (ehi - elo);
    if (b_nodes(b, hi - lo) < 0)
        return -1;
    for (int h = 0; h < 2; h++) /* a copy is canonical where its source is, inside the copy */
        for (int32_t x = lo; x < hi; x++) {
            int32_t c = b->canon[h].v[x];
            b->canon[h].v[x + off] = c >= lo && c < hi ? c + off : c;
        }
    if (eg_ints_reserve(&b->src, need) || eg_ints_reserve(&b->kind, need) || eg_ints_reserve(&b->label, need) ||
        eg_ints_reserve(&b->dst, need)) {
        b_fail(b, "out of memory");
        return -1;
    }
    for (int32_t e = elo; e < ehi; e++) {
        int32_t i = b->src.n++;
        b->kind.n++, b->label.n++, b->dst.n++;
        b->src.v[i] = b->src.v[e] + off, b->kind.v[i] = b->kind.v[e];
        b->label.v[i] = b->label.v[e], b->dst.v[i] = b->dst.v[e] + off;
    }
    return off;
}

static int op_lit(builder *b, const int32_t *sets, int32_t n)
{
    int32_t elo = b->src.n, s = b_nodes(b, 1), cur = s;
    for (int32_t i = 0; i < n && cur >= 0; i++) {
        int32_t nx = b_nodes(b, 1);
        if (b_edge(b, cur, EG_BYTE, sets[i], nx))
            return -1;
        cur = nx;
    }
    return cur < 0 ? -1 : push(b, (frag){s, cur, s, elo});
}

static int op_class(builder *b, int32_t c)
{
    const int32_t *d = b->in->class_data + b->in->class_off[c];
    int32_t nn = d[0], ne = d[1], elo = b->src.n, base = b_nodes(b, nn);
    if (base < 0)
        return -1;
    for (int32_t i = 0; i < ne; i++)
        if (b_edge(b, base + d[2 + 3 * i], EG_BYTE, d[3 + 3 * i], base + d[4 + 3 * i]))
            return -1;
    return push(b, (frag){base, base + 1, base, elo});
}

static int op_ref(builder *b, int32_t q)
{
    int32_t lo = b->lo[q], elo = b->src.n;
    int fits = lo >= 0 && (int64_t)(b->n - b->rule_begin) + (b->hi[q] - lo) <= b->in->max_rule_states;
    if (b->in->inline_rule[q] && fits) {
        int32_t nlo = b->n, off = copy_range(b, lo, b->hi[q], b->elo[q], b->ehi[q]);
        return b->failed ? -1 : push(b, (frag){b->start[q] + off, b->end[q] + off, nlo, elo});
    }
    int32_t s = b_nodes(b, 1), e = b_nodes(b, 1);
    return b_edge(b, s, EG_CALL, q, e) ? -1 : push(b, (frag){s, e, s, elo});
}

static int op_token(builder *b, int32_t t)
{
    int32_t elo = b->src.n, s = b_nodes(b, 1), e = b_nodes(b, 1);
    return b_edge(b, s, EG_TOKEN, t, e) ? -1 : push(b, (frag){s, e, s, elo});
}

static int op_seq(builder *b, int32_t n)
{
    if (n == 0) {
        int32_t elo = b->src.n, s = b_nodes(b, 1);
        return s < 0 ? -1 : push(b, (frag){s, s, s, elo});
    }
    frag *f = b->stack + b->sp - n;
    for (int32_t i = 0; i + 1 < n; i++)
        if (b_edge(b, f[i].end, EG_EPS, 0, f[i + 1].start))
            return -1;
    frag r = {f[0].start, f[n - 1].end, f[0].lo, f[0].elo};
    b->sp -= n;
    return push(b, r);
}

static int op_alt(builder *b, int32_t n)
{
    frag *f = b->stack + b->sp - n;
    frag r = {b_nodes(b, 1), b_nodes(b, 1), f[0].lo, f[0].elo};
    for (int32_t i = 0; i < n; i++)
        if (b_edge(b, r.start, EG_EPS, 0, f[i].start) || b_edge(b, f[i].end, EG_EPS, 0, r.end))
            return -1;
    b->sp -= n;
    return push(b, r);
}

/* Whether the item (nodes [lo, hi), edges [elo, ehi)) can be crossed without a byte, or calls. */
static int may_be_empty(builder *b, frag f, int32_t hi, int32_t ehi)
{
    if (ehi - f.elo > 4096) /* large items: not worth proving (no sharing then) */
        return 1;
    for (int32_t e = f.elo; e < ehi; e++)
        if (b->kind.v[e] == EG_CALL || b->kind.v[e] == EG_TOKEN)
            return 1;
    uint8_t *seen = calloc((size_t)(hi - f.lo), 1);
    int32_t *todo = malloc((size_t)(hi - f.lo) * sizeof *todo), n = 0, reached = 0;
    if (!seen || !todo) {
        free(seen), free(todo);
        return 1;
    }
    seen[f.start - f.lo] = 1, todo[n++] = f.start;
    while (n && !reached) { /* eps edges only; items are small enough to scan their edges */
        int32_t x = todo[--n];
        reached = x == f.end;
        for (int32_t e = f.elo; e < ehi; e++)
            if (b->src.v[e] == x && b->kind.v[e] == EG_EPS && !seen[b->dst.v[e] - f.lo])
                seen[b->dst.v[e] - f.lo] = 1, todo[n++] = b->dst.v[e];
    }
    free(seen), free(todo);
    return reached;
}

/* Copies i and r of a repetition whose next `horizon` bytes behave alike: make i's nodes
 * canonical where r's are. Zone A: every exit allowed and `horizon` more copies exist;
 * zone B: no exit within reach. Items must read a byte each (else the horizon means nothing). */
static void canon_zones(builder *b, frag f, int32_t hi, const int32_t *off, int32_t copies, int32_t min, int32_t max)
{
    for (int h = 0; h < 2; h++) {
        int32_t H = EG_HORIZONS[h], zones[2][3] = {
            {min > 1 ? min - 1 : 0, max >= 0 ? copies - 1 - H : -1, min > 1 ? min - 1 : 0},  /* lo, hi, rep */
            {0, min - 2 - H, 0},
        };
        for (int z = 0; z < 2; z++)
            for (int32_t i = zones[z][0]; i <= zones[z][1] && i < copies; i++) {
                int32_t r = zones[z][2];
                if (i == r)
                    continue;
                for (int32_t x = f.lo; x < hi; x++)
                    b->canon[h].v[x + off[i]] = b->canon[h].v[x + off[r]];
            }
    }
}

static int op_rep(builder *b, int32_t min, int32_t max)
{
    if ((max > 1 || (max < 0 && min > 1)) && b_shrink_top(b))
        return -1;
    frag f = b->stack[--b->sp];
    int32_t hi = b->n, ehi = b->src.n, copies = max >= 0 ? max : (min > 1 ? min : 1);
    int32_t first_start = f.start, prev_end = -1;
    if (copies == 0) { /* x{0}: the item stays unreachable */
        int32_t s = b_nodes(b, 1);
        return s < 0 ? -1 : push(b, (frag){s, s, f.lo, f.elo});
    }
    if (max < 0 && min == 0) { /* x*: a hub enters the item and is re-entered after it */
        int32_t hub = b_nodes(b, 1);
        if (b_edge(b, hub, EG_EPS, 0, f.start) || b_edge(b, f.end, EG_EPS, 0, hub))
            return -1;
        return push(b, (frag){hub, hub, f.lo, f.elo});
    }
    int32_t s = max >= 0 ? b_nodes(b, 1) : first_start, e = max >= 0 ? b_nodes(b, 1) : -1, cur = s;
    int32_t *offs = malloc((size_t)copies * sizeof *offs);
    if (!offs)
        return b_fail(b, "out of memory");
    for (int32_t i = 0; i < copies; i++) {
        int32_t cs = f.start, ce = f.end;
        offs[i] = 0;
        if (i > 0) {
            int32_t off = copy_range(b, f.lo, hi, f.elo, ehi);
            if (b->failed) {
                free(offs);
                return -1;
            }
            cs += off, ce += off, offs[i] = off;
        }
        if (max >= 0) { /* x{m,n}: m copies, then each further one optional */
            if ((i >= min && b_edge(b, cur, EG_EPS, 0, e)) || b_edge(b, cur, EG_EPS, 0, cs))
                return -1;
        } else if (i > 0 && b_edge(b, prev_end, EG_EPS, 0, cs)) {
            return -1;
        }
        cur = prev_end = ce;
        if (max < 0 && i == copies - 1 && b_edge(b, ce, EG_EPS, 0, cs)) /* x{m,}: the last copy loops */
            return -1;
    }
    if (copies > EG_HORIZONS[0] && !may_be_empty(b, f, hi, ehi))
        canon_zones(b, f, hi, offs, copies, min, max);
    free(offs);
    if (max >= 0)
        return b_edge(b, cur, EG_EPS, 0, e) ? -1 : push(b, (frag){s, e, f.lo, f.elo});
    return push(b, (frag){first_start, prev_end, f.lo, f.elo});
}

static int build_rule(builder *b, int32_t r)
{
    const int32_t *p = b->in->ops + b->in->rule_ops[r], *end = b->in->ops + b->in->rule_ops[r + 1];
    b->sp = 0, b->rule_begin = b->n;
    int32_t elo = b->src.n, lo = b->n;
    while (p < end && !b->failed) {
        int rc;
        switch (p[0]) {
        case OP_LIT: rc = op_lit(b, p + 2, p[1]), p += 2 + p[1]; break;
        case OP_CLASS: rc = op_class(b, p[1]), p += 2; break;
        case OP_REF: rc = op_ref(b, p[1]), p += 2; break;
        case OP_TOKEN: rc = op_token(b, p[1]), p += 2; break;
        case OP_SEQ: rc = op_seq(b, p[1]), p += 2; break;
        case OP_ALT: rc = op_alt(b, p[1]), p += 2; break;
        case OP_REP: rc = op_rep(b, p[1], p[2]), p += 3; break;
        default: return b_fail(b, "bad grammar program");
        }
        if (rc)
            return b_fail(b, "out of memory");
    }
    if (b->failed || b->sp != 1)
        return b_fail(b, "bad grammar program");
    if (b->in->inline_rule[r] == 2 && b_shrink_top(b)) /* only rules copied more than once */
        return -1;
    b->lo[r] = lo, b->hi[r] = b->n, b->elo[r] = elo, b->ehi[r] = b->src.n;
    b->start[r] = b->stack[0].start, b->end[r] = b->stack[0].end;
    return 0;
}

static void builder_free(builder *b)
{
    free(b->src.v), free(b->kind.v), free(b->label.v), free(b->dst.v), free(b->stack);
    free(b->canon[0].v), free(b->canon[1].v), free(b->sets), free(b->set_hash);
    free(b->lo), free(b->hi), free(b->elo), free(b->ehi), free(b->start), free(b->end);
}

eg_nfa *eg_nfa_build(const eg_nfa_input *in, char *err, int32_t errlen, int32_t *bad_rule)
{
    builder b = {0};
    b.in = in, b.err = err, b.errlen = errlen;
    *bad_rule = -1;
    if (errlen > 0)
        err[0] = 0;
    size_t n = (size_t)in->n_rules;
    b.lo = malloc(n * sizeof(int32_t)), b.hi = malloc(n * sizeof(int32_t)), b.elo = malloc(n * sizeof(int32_t));
    b.ehi = malloc(n * sizeof(int32_t)), b.start = malloc(n * sizeof(int32_t)), b.end = malloc(n * sizeof(int32_t));
    if (!b.lo || !b.hi || !b.elo || !b.ehi || !b.start || !b.end) {
        builder_free(&b);
        b_fail(&b, "out of memory");
        return NULL;
    }
    for (int32_t r = 0; r < in->n_rules; r++)
        b.lo[r] = -1;
    b.cap_sets = in->n_sets + 64;
    if (!(b.sets = malloc((size_t)b.cap_sets * 32))) {
        builder_free(&b);
        b_fail(&b, "out of memory");
        return NULL;
    }
    memcpy(b.sets, in->sets, (size_t)in->n_sets * 32);
    b.n_sets = in->n_sets;
    for (int32_t i = 0; i < in->n_build; i++) {
        if (build_rule(&b, in->build_order[i])) {
            *bad_rule = in->build_order[i];
            builder_free(&b);
            return NULL;
        }
    }
    eg_nfa *a = b.lo[in->root] >= 0 ? b_assemble(&b) : NULL;
    if (!a && !b.failed)
        b_fail(&b, "the root rule was not built");
    builder_free(&b);
    return a;
}

void eg_nfa_free(eg_nfa *a)
{
    if (!a)
        return;
    free(a->edge_off), free(a->edge_kind), free(a->edge_label), free(a->edge_dst);
    free(a->rule_source), free(a->rule_start), free(a->rule_end), free(a->rule_first_node), free(a->node_rule);
    free(a->sets), free(a->follow), free(a->canon[0]), free(a->canon[1]);
    free(a);
}

int32_t eg_nfa_nodes(const eg_nfa *a) { return a->n_nodes; }
int32_t eg_nfa_edges(const eg_nfa *a) { return a->n_edges; }

int32_t eg_nfa_rules(const eg_nfa *a, int32_t *out, int32_t cap)
{
    for (int32_t i = 0; i < a->n_rules && i < cap; i++)
        out[i] = a->rule_source[i];
    return a->n_rules;
}
