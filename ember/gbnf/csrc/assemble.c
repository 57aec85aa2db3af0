/* The final automaton: the rules still called, renumbered; edges into nodes that cannot reach
 * their rule's end dropped (no live state is a dead end); edges by source; and each rule's
 * follow set (bytes that may come right after it somewhere: one byte of lookahead for masks). */
#include <stdlib.h>
#include <string.h>

#include "build.h"

/* ---- keeping the called rules ---- */

/* Rules reachable from the root through calls, root first; their count. */
static int32_t called_rules(builder *b, int32_t *order, int32_t *slot)
{
    int32_t n_rules = b->in->n_rules, count = 0;
    for (int32_t r = 0; r < n_rules; r++)
        slot[r] = -1;
    slot[b->in->root] = 0, order[count++] = b->in->root;
    for (int32_t i = 0; i < count; i++) {
        int32_t r = order[i];
        for (int32_t e = b->elo[r]; e < b->ehi[r]; e++)
            if (b->kind.v[e] == EG_CALL && slot[b->label.v[e]] < 0) {
                slot[b->label.v[e]] = count;
                order[count++] = b->label.v[e];
            }
    }
    return count;
}

/* ---- follow sets ---- */

typedef struct {
    eg_nfa *a;
    const uint8_t *nullable;        /* by emitted rule */
    uint32_t *mark, stamp;
    int32_t *todo;
} follow_ctx;

/* First bytes from node x (calls included, nullable calls passed through); whether the rule's
 * end can be reached without reading. */
static int first_from(follow_ctx *c, int32_t x, uint8_t bits[32], uint8_t (*first)[32])
{
    eg_nfa *a = c->a;
    int32_t n = 0, rule = a->node_rule[x], ends = 0;
    memset(bits, 0, 32);
    c->stamp++;
    c->mark[x] = c->stamp, c->todo[n++] = x;
    while (n) {
        x = c->todo[--n];
        ends |= x == a->rule_end[rule];
        for (int32_t e = a->edge_off[x]; e < a->edge_off[x + 1]; e++) {
            int k = a->edge_kind[e], lab = a->edge_label[e];
            if (k == EG_BYTE)
                for (int i = 0; i < 32; i++)
                    bits[i] |= a->sets[lab][i];
            if (k == EG_CALL)
                for (int i = 0; i < 32; i++)
                    bits[i] |= first[lab][i];
            if ((k == EG_EPS || (k == EG_CALL && c->nullable[lab])) && c->mark[a->edge_dst[e]] != c->stamp) {
                c->mark[a->edge_dst[e]] = c->stamp;
                c->todo[n++] = a->edge_dst[e];
            }
        }
    }
    return ends;
}

static int or_into(uint8_t *to, const uint8_t *from)
{
    int changed = 0;
    for (int i = 0; i < 32; i++) {
        changed |= (from[i] & ~to[i]) != 0;
        to[i] |= from[i];
    }
    return changed;
}

static int follow_sets(eg_nfa *a, const uint8_t *nullable)
{
    int32_t R = a->n_rules;
    uint8_t (*first)[32] = calloc((size_t)R, 32), bits[32];
    follow_ctx c = {a, nullable, calloc((size_t)a->n_nodes, sizeof(uint32_t)), 0,
                    malloc((size_t)a->n_nodes * sizeof(int32_t))};
    int32_t *inherit = malloc(2 * (size_t)a->n_edges * sizeof *inherit + 2), n_inherit = 0;
    a->follow = calloc((size_t)R, 32);
    if (!first || !c.mark || !c.todo || !inherit || !a->follow) {
        free(first), free(c.mark), free(c.todo), free(inherit);
        return -1;
    }
    for (int changed = 1; changed;) { /* first bytes of every rule; calls make it a fixpoint */
        changed = 0;
        for (int32_t r = 0; r < R; r++) {
            first_from(&c, a->rule_start[r], bits, first);
            changed |= or_into(first[r], bits);
        }
    }
    for (int32_t x = 0; x < a->n_nodes; x++)
        for (int32_t e = a->edge_off[x]; e < a->edge_off[x + 1]; e++)
            if (a->edge_kind[e] == EG_CALL) {
                int32_t q = a->edge_label[e];
                if (first_from(&c, a->edge_dst[e], bits, first))
                    inherit[n_inherit++] = a->node_rule[x], inherit[n_inherit++] = q;
                or_into(a->follow[q], bits);
            }
    for (int changed = 1; changed;) {
        changed = 0;
        for (int32_t i = 0; i < n_inherit; i += 2)
            changed |= or_into(a->follow[inherit[i + 1]], a->follow[inherit[i]]);
    }
    free(first), free(c.mark), free(c.todo), free(inherit);
    return 0;
}

/* ---- assembling ---- */

typedef struct {
    int32_t n, *src, *dst, *lab;
    uint8_t *kind;
} edge_list;

static void edges_free(edge_list *el) { free(el->src), free(el->dst), free(el->lab), free(el->kind); }

static int edges_alloc(edge_list *el, int32_t n)
{
    el->n = n;
    el->src = malloc(((size_t)n + 1) * sizeof(int32_t)), el->dst = malloc(((size_t)n + 1) * sizeof(int32_t));
    el->lab = malloc(((size_t)n + 1) * sizeof(int32_t)), el->kind = malloc((size_t)n + 1);
    return el->src && el->dst && el->lab && el->kind ? 0 : -1;
}

static int rule_arrays(eg_nfa *a)
{
    size_t r = (size_t)a->n_rules, n = (size_t)a->n_nodes + 1;
    a->rule_source = malloc(r * sizeof(int32_t)), a->rule_start = malloc(r * sizeof(int32_t));
    a->rule_end = malloc(r * sizeof(int32_t)), a->rule_first_node = malloc((r + 1) * sizeof(int32_t));
    a->node_rule = malloc(n * sizeof(int32_t)), a->canon[0] = malloc(n * sizeof(int32_t));
    a->canon[1] = malloc(n * sizeof(int32_t));
    return a->rule_source && a->rule_start && a->rule_end && a->rule_first_node && a->node_rule && a->canon[0] &&
           a->canon[1] ? 0 : -1;
}

/* Rule i of order gets the nodes right after rule i-1's; calls are renumbered through slot. */
static void renumber(const builder *b, eg_nfa *a, const int32_t *order, const int32_t *slot, edge_list *el,
                     uint8_t *nullable)
{
    int32_t at = 0, ne = 0;
    for (int32_t i = 0; i < a->n_rules; i++) {
        int32_t r = order[i], off = at - b->lo[r];
        a->rule_source[i] = r, a->rule_first_node[i] = at;
        a->rule_start[i] = b->start[r] + off, a->rule_end[i] = b->end[r] + off;
        nullable[i] = b->in->nullable[r];
        for (int32_t x = at; x < at + b->hi[r] - b->lo[r]; x++) {
            a->node_rule[x] = i;
            for (int h = 0; h < 2; h++)
                a->canon[h][x] = b->canon[h].v[x - off] + off;
        }
        for (int32_t e = b->elo[r]; e < b->ehi[r]; e++, ne++) {
            el->src[ne] = b->src.v[e] + off, el->dst[ne] = b->dst.v[e] + off, el->kind[ne] = (uint8_t)b->kind.v[e];
            el->lab[ne] = el->kind[ne] == EG_CALL ? slot[b->label.v[e]] : b->label.v[e];
        }
        at += b->hi[r] - b->lo[r];
    }
    a->rule_first_node[a->n_rules] = at;
}

/* live[x]: node x can reach its rule's end (reverse search from every end). */
static int live_nodes(const eg_nfa *a, const edge_list *el, uint8_t *live)
{
    int32_t n = a->n_nodes, *into_off = calloc((size_t)n + 2, sizeof(int32_t));
    int32_t *into = malloc(((size_t)el->n + 1) * sizeof(int32_t)), *todo = malloc(((size_t)n + 1) * sizeof(int32_t));
    if (!into_off || !into || !todo) {
        free(into_off), free(into), free(todo);
        return -1;
    }
    for (int32_t e = 0; e < el->n; e++) /* edges by destination */
        into_off[el->dst[e] + 1]++;
    for (int32_t x = 0; x < n; x++)
        into_off[x + 1] += into_off[x];
    memcpy(todo, into_off, (size_t)n * sizeof *todo);
    for (int32_t e = 0; e < el->n; e++)
        into[todo[el->dst[e]]++] = e;
    int32_t n_todo = 0;
    for (int32_t r = 0; r < a->n_rules; r++)
        live[a->rule_end[r]] = 1, todo[n_todo++] = a->rule_end[r];
    while (n_todo) {
        int32_t x = todo[--n_todo];
        for (int32_t i = into_off[x]; i < into_off[x + 1]; i++) {
            int32_t s = el->src[into[i]];
            if (!live[s])
                live[s] = 1, todo[n_todo++] = s;
        }
    }
    free(into_off), free(into), free(todo);
    return 0;
}

/* The automaton's edges: live ones only, by source node. */
static int edges_by_source(eg_nfa *a, const edge_list *el, const uint8_t *live)
{
    int32_t n = a->n_nodes, *cursor = malloc(((size_t)n + 1) * sizeof(int32_t));
    a->edge_off = calloc((size_t)n + 1, sizeof(int32_t));
    a->edge_kind = malloc((size_t)el->n + 1);
    a->edge_label = malloc(((size_t)el->n + 1) * sizeof(int32_t));
    a->edge_dst = malloc(((size_t)el->n + 1) * sizeof(int32_t));
    if (!cursor || !a->edge_off || !a->edge_kind || !a->edge_label || !a->edge_dst) {
        free(cursor);
        return -1;
    }
    for (int32_t e = 0; e < el->n; e++)
        if (live[el->src[e]] && live[el->dst[e]])
            a->edge_off[el->src[e] + 1]++;
    for (int32_t x = 0; x < n; x++)
        a->edge_off[x + 1] += a->edge_off[x];
    a->n_edges = a->edge_off[n];
    memcpy(cursor, a->edge_off, (size_t)n * sizeof *cursor);
    for (int32_t e = 0; e < el->n; e++)
        if (live[el->src[e]] && live[el->dst[e]]) {
            int32_t i = cursor[el->src[e]]++;
            a->edge_kind[i] = el->kind[e], a->edge_label[i] = el->lab[e], a->edge_dst[i] = el->dst[e];
        }
    for (int32_t e = 0; e < a->n_edges; e++)
        if (a->edge_kind[e] == EG_TOKEN && a->edge_label[e] + 1 > a->n_toksets)
            a->n_toksets = a->edge_label[e] + 1;
    free(cursor);
    return 0;
}

eg_nfa *b_assemble(builder *b)
{
    const eg_nfa_input *in = b->in;
    eg_nfa *a = calloc(1, sizeof *a);
    int32_t *order = malloc((size_t)in->n_rules * sizeof *order), *slot = malloc((size_t)in->n_rules * sizeof *slot);
    edge_list el = {0};
    uint8_t *live = NULL, *nullable = NULL;
    int ok = 0;
    if (a && order && slot) {
        a->n_rules = called_rules(b, order, slot);
        int32_t n_edges = 0;
        for (int32_t i = 0; i < a->n_rules; i++)
            a->n_nodes += b->hi[order[i]] - b->lo[order[i]], n_edges += b->ehi[order[i]] - b->elo[order[i]];
        live = calloc((size_t)a->n_nodes + 1, 1), nullable = malloc((size_t)a->n_rules + 1);
        a->n_sets = b->n_sets, a->sets = malloc((size_t)b->n_sets * 32 + 1);
        ok = live && nullable && a->sets && !rule_arrays(a) && !edges_alloc(&el, n_edges);
    }
    if (ok) {
        memcpy(a->sets, b->sets, (size_t)b->n_sets * 32);
        renumber(b, a, order, slot, &el, nullable);
        ok = !live_nodes(a, &el, live) && !edges_by_source(a, &el, live) && !follow_sets(a, nullable);
    }
    edges_free(&el);
    free(order), free(slot), free(live), free(nullable);
    if (ok)
        return a;
    eg_nfa_free(a);
    b_fail(b, "out of memory");
    return NULL;
}
