/* The automaton builder, shared by nfa.c (construction), shrink.c (minimizing copied fragments)
 * and assemble.c (the final, renumbered automaton). */
#ifndef EMBER_GBNF_BUILD_H
#define EMBER_GBNF_BUILD_H

#include "gbnf.h"

enum { OP_LIT = 1, OP_CLASS, OP_REF, OP_TOKEN, OP_SEQ, OP_ALT, OP_REP };

typedef struct { int32_t start, end, lo, elo; } frag;   /* nodes [lo, now), edges [elo, now) */

typedef struct {
    const eg_nfa_input *in;
    int32_t n;                      /* nodes so far */
    eg_ints canon[2];               /* (n,) canonical node per horizon, see eg_nfa.canon */
    eg_ints src, kind, label, dst;  /* edges so far */
    frag *stack;
    int32_t sp, cap;
    uint8_t (*sets)[32];            /* byte sets: the input's, then those made by shrinking */
    int32_t n_sets, cap_sets;
    int32_t *set_hash, set_cap;     /* open addressing over sets */
    int32_t *lo, *hi, *elo, *ehi, *start, *end;  /* (n_rules,) ranges of built rules, lo -1 if not built */
    int32_t rule_begin;
    char *err;
    int32_t errlen, failed;
} builder;

int b_fail(builder *b, const char *msg);
/* Reserves k new nodes, each its own canonical node; returns the first, or -1. */
int32_t b_nodes(builder *b, int32_t k);
int b_edge(builder *b, int32_t s, int32_t k, int32_t lab, int32_t d);
/* The id of a byte set, added if new. */
int32_t b_set_of(builder *b, const uint8_t bits[32]);
/* Replaces the fragment on top of the stack by its minimal DFA when that is worth it. */
int b_shrink_top(builder *b);
/* The automaton of the rules still called, root first; NULL on failure. */
eg_nfa *b_assemble(builder *b);

#endif
