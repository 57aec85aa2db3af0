/* A grammar bound to a vocabulary: copies the program, checks it, owns caches and scratch. */
#include <stdlib.h>
#include <string.h>

#include "gbnf.h"

static void *copy(const void *src, size_t n)
{
    void *p = malloc(n ? n : 1);
    if (p && n)
        memcpy(p, src, n);
    return p;
}

/* Token sets in range, so that a bad binding is refused instead of read out of bounds. */
static int binding_ok(const eg_nfa *a, const eg_binding *b, int32_t n_vocab)
{
    if (b->n_toksets < a->n_toksets || b->tokset_off[0] != 0)
        return 0;
    for (int32_t t = 0; t < b->n_toksets; t++)
        if (b->tokset_off[t] > b->tokset_off[t + 1])
            return 0;
    for (int32_t i = 0; i < b->tokset_off[b->n_toksets]; i++)
        if (b->tokset_ids[i] < 0 || b->tokset_ids[i] >= n_vocab)
            return 0;
    return b->max_stack_depth > 0 && b->max_stacks > 0 && b->max_dfa_states > 0;
}

static int node_tables(eg_grammar *g, const eg_nfa *a)
{
    g->node_important = calloc((size_t)g->n_nodes, 1);
    g->rule_has_calls = calloc((size_t)g->n_rules, 1);
    if (!g->node_important || !g->rule_has_calls)
        return -1;
    for (int32_t r = 0; r < g->n_rules; r++)
        g->node_important[g->rule_end[r]] = 1;
    for (int32_t x = 0; x < g->n_nodes; x++)
        for (int32_t e = g->edge_off[x]; e < g->edge_off[x + 1]; e++) {
            g->node_important[x] |= g->edge_kind[e] != EG_EPS;
            g->rule_has_calls[a->node_rule[x]] |= g->edge_kind[e] == EG_CALL;
        }
    return 0;
}

static int scratch(eg_grammar *g)
{
    int32_t levels = g->vocab->trie.max_depth + 2;
    g->lv_start = malloc((size_t)(levels + 1) * sizeof *g->lv_start);
    g->lv_frames = malloc((size_t)(levels + 1) * sizeof *g->lv_frames);
    g->lv_exit = malloc((size_t)levels);
    g->lv_unc = malloc((size_t)levels);
    g->lv_row = malloc((size_t)levels * sizeof *g->lv_row);
    return g->lv_start && g->lv_frames && g->lv_exit && g->lv_unc && g->lv_row ? 0 : -1;
}

eg_grammar *eg_grammar_new(eg_vocab *v, const eg_nfa *a, const eg_binding *b)
{
    if (!v || !a || !b || !binding_ok(a, b, v->n_vocab))
        return NULL;
    eg_grammar *g = calloc(1, sizeof *g);
    if (!g)
        return NULL;
    pthread_mutex_init(&g->lock, NULL);
    g->vocab = v;
    g->n_nodes = a->n_nodes, g->n_rules = a->n_rules, g->n_sets = a->n_sets, g->n_toksets = b->n_toksets;
    g->edge_off = a->edge_off, g->edge_kind = a->edge_kind, g->edge_label = a->edge_label, g->edge_dst = a->edge_dst;
    g->rule_start = a->rule_start, g->rule_end = a->rule_end, g->node_rule = a->node_rule;
    g->sets = (const uint8_t (*)[32])a->sets, g->follow = (const uint8_t (*)[32])a->follow;
    g->max_stack_depth = b->max_stack_depth, g->max_stacks = b->max_stacks, g->max_dfa_states = b->max_dfa_states;
    for (int k = 0; k < 2 && !g->canon; k++) /* the shortest horizon covering every token */
        if (v->trie.max_depth <= EG_HORIZONS[k])
            g->canon = a->canon[k];
    int32_t n_ids = b->tokset_off[b->n_toksets];
    g->tokset_off = copy(b->tokset_off, ((size_t)b->n_toksets + 1) * sizeof(int32_t));
    g->tokset_ids = copy(b->tokset_ids, (size_t)n_ids * sizeof(int32_t));
    g->tokset_negated = copy(b->tokset_negated, (size_t)b->n_toksets);
    if (!g->tokset_off || !g->tokset_ids || !g->tokset_negated || node_tables(g, a) || eg_dfa_init(g) || scratch(g)) {
        eg_grammar_free(g);
        return NULL;
    }
    return g;
}

void eg_grammar_free(eg_grammar *g)
{
    if (!g)
        return;
    eg_dfa_free(g);
    eg_parts_free(g);
    eg_unc_free(g);
    free(g->node_important), free(g->rule_has_calls);
    free(g->tokset_off), free(g->tokset_ids), free(g->tokset_negated);
    free(g->todo.v), free(g->members.v), free(g->targets.v), free(g->frames.v);
    free(g->work.v), free(g->seen.v), free(g->cfg_a.v), free(g->cfg_b.v), free(g->walk_cfgs.v);
    free(g->acc.v), free(g->unc.v);
    free(g->lv_start), free(g->lv_frames), free(g->lv_exit), free(g->lv_unc), free(g->lv_row);
    pthread_mutex_destroy(&g->lock);
    free(g);
}

const char *eg_grammar_error(const eg_grammar *g) { return g->error; }

void eg_grammar_stats(eg_grammar *g, int64_t *out)
{
    pthread_mutex_lock(&g->lock);
    memcpy(out, g->stats, sizeof g->stats);
    out[0] = g->n_states, out[2] = g->n_parts;
    pthread_mutex_unlock(&g->lock);
}

int eg_matcher_fill_mask(eg_matcher *m, uint32_t *out)
{
    eg_grammar *g = m->g;
    pthread_mutex_lock(&g->lock);
    int rc = g->error[0] ? EG_ERR_LIMIT : eg_fill_mask(m, out);
    if (g->error[0] && rc >= 0)
        rc = EG_ERR_LIMIT;
    pthread_mutex_unlock(&g->lock);
    return rc;
}
