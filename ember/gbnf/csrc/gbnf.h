/* Internal structures of the grammar engine.
 *
 * The grammar is one byte-level NFA per rule (edges: eps, byte set, call, token). A rule's
 * NFA is made deterministic lazily: a DFA state is the eps-closed set of NFA nodes of one rule,
 * interned by content. A parse is a stack of DFA states (return states below, the current
 * state on top); ambiguity across calls gives a set of stacks.
 *
 * Token masks come from walking the vocabulary's byte trie from a DFA state. The walk's
 * verdict per token is cached per state: accepted (the token is read without leaving the
 * state's rule, so it is valid whatever the stack below), uncertain (it can only be read by
 * returning from the rule, so it is checked against the real stack each time) or rejected.
 * States equal up to copies in long repetitions (eg_nfa.canon) share one cached verdict.
 *
 * Files: vocab.c (trie, slices), nfa.c + shrink.c + assemble.c (building the automaton),
 * dfa.c (lazy determinization), match.c (closures, stacks, matchers), mask.c (walks, masks),
 * grammar.c (binding an automaton to a vocabulary). */
#ifndef EMBER_GBNF_H
#define EMBER_GBNF_H

#include <stdint.h>
#include <stddef.h>
#include <pthread.h>

#include "api_gbnf.h"

enum { EG_EPS = 0, EG_BYTE = 1, EG_CALL = 2, EG_TOKEN = 3 };
enum { EG_ERR_MEMORY = -10, EG_ERR_LIMIT = -11 };
enum { EG_MAX_CLASSES = 8 };
#define EG_UNKNOWN (-2)
#define EG_DEAD (-3)       /* a call whose return leads nowhere */
#define EG_MIXED (-1)      /* class step: characters of the class lead to different states */
#define EG_BLOCKED (-4)    /* class step: no character of the class can be read */

/* ---- vocabulary ---- */

typedef struct {
    int32_t n;            /* nodes; node 0 is the root (empty prefix) */
    uint8_t *byte;        /* (n,) byte leading into the node */
    uint16_t *depth;      /* (n,) bytes from the root */
    int32_t *end;         /* (n,) one past the node's subtree (preorder layout) */
    int32_t *tok;         /* (n,) a token whose key ends here, or -1 */
    const int32_t *next;  /* (n_vocab,) the next token with the same key, or -1 */
    int32_t max_depth;
} eg_trie;

/* Tokens made only of whole characters of one class; the trie of all other text tokens; and
 * the trie of those tokens keyed by what follows their longest prefix of class characters
 * (from a state that returns to itself on every class character, only that part matters). */
typedef struct {
    uint8_t *chars;       /* (n_vocab,) characters in the token if it is in the slice, else 0 */
    int32_t max_chars;
    uint32_t **upto;      /* (max_chars+1,) lazily: bitmask of slice tokens of <= r characters */
    eg_trie rest;
    eg_trie suffix;
    int32_t *suffix_next; /* (n_vocab,) chains tokens with the same suffix */
    int32_t n_tokens;
} eg_slice;

typedef struct {
    int32_t n_nodes;
    int16_t (*next)[256]; /* (n_nodes, 256) next node or -1; node 1 = a whole character read */
} eg_class_dfa;

struct eg_vocab {
    int32_t n_vocab, n_words;       /* n_words = (n_vocab+31)/32 */
    uint8_t *bytes;                 /* all token bytes */
    int64_t *off;                   /* (n_vocab+1,) */
    uint8_t *is_text;               /* (n_vocab,) may be read by text rules */
    int32_t *tok_next;              /* (n_vocab,) next text token with the same bytes, or -1 */
    uint32_t *eog_bits;             /* (n_words,) */
    eg_trie trie;                   /* all text tokens */
    int32_t n_classes;
    eg_class_dfa classes[EG_MAX_CLASSES];
    eg_slice *slices[EG_MAX_CLASSES];
    pthread_mutex_t lock;           /* guards the lazily built slice bitmasks (upto) */
};

/* ---- automaton (vocabulary-independent) ---- */

struct eg_nfa {
    int32_t n_nodes, n_edges, n_rules, n_sets, n_toksets;
    int32_t *edge_off;              /* (n_nodes+1,) CSR by source node */
    uint8_t *edge_kind;             /* (n_edges,) */
    int32_t *edge_label, *edge_dst; /* (n_edges,) */
    int32_t *rule_source;           /* (n_rules,) index of the rule as written; 0 is the root */
    int32_t *rule_start, *rule_end; /* (n_rules,) */
    int32_t *rule_first_node;       /* (n_rules+1,) */
    int32_t *node_rule;             /* (n_nodes,) */
    uint8_t (*sets)[32];            /* (n_sets, 32) */
    uint8_t (*follow)[32];          /* (n_rules, 32) bytes that may come right after each rule */
    /* canon[k][x]: a node whose next EG_HORIZONS[k] bytes behave as x's do (x itself, or the same
     * node in an earlier copy of a long repetition), so states equal up to it share masks */
    int32_t *canon[2];
};

static const int32_t EG_HORIZONS[2] = {64, 128};

/* ---- grammar ---- */

struct eg_part;

typedef struct {
    int32_t nodes_off, n_nodes;     /* sorted NFA nodes in g->set_pool */
    int32_t rule;
    uint8_t final, has_bytes, has_tokens, pure_final;
    int32_t *row;                   /* (256,) next state or -1, NULL until built */
    int32_t calls_off, n_calls;     /* (callee, return state) pairs in g->call_pool */
    int32_t toks_off, n_toks;       /* (token set, target state) pairs in g->tok_pool */
    const struct eg_part *part;     /* cached mask partition, NULL until built */
    int32_t step[EG_MAX_CLASSES];   /* state after any one character of class k, EG_MIXED, EG_BLOCKED or EG_UNKNOWN */
} eg_dstate;

typedef struct eg_part {
    const uint32_t *shared;         /* (n_words,) slice bitmask owned by the vocabulary, or NULL */
    uint32_t *dense;                /* (n_words,) own bitmask (includes `shared`), or NULL */
    int32_t *ids, n_ids;            /* accepted tokens besides `shared` (when not dense) */
    int32_t *unc, n_unc;            /* tokens to check against the stack */
    struct eg_part *next_owned;     /* grammar-owned partitions, for freeing */
} eg_part;

typedef struct { int32_t state, parent, depth; } eg_frame;   /* a pushed return state */
typedef struct { int32_t state, local, base; } eg_cfg;       /* top state, pushed frames, base stack height */

typedef struct { eg_cfg *v; int32_t n, cap; } eg_cfgs;
typedef struct { eg_frame *v; int32_t n, cap; } eg_frames;
typedef struct { int32_t *v; int32_t n, cap; } eg_ints;

struct eg_grammar {
    eg_vocab *vocab;
    /* the automaton: arrays borrowed from the eg_nfa, which must outlive the grammar */
    int32_t n_nodes, n_rules, n_toksets, n_sets;
    const int32_t *edge_off, *edge_label, *edge_dst;
    const uint8_t *edge_kind;
    const int32_t *rule_start, *rule_end, *node_rule;
    const uint8_t (*follow)[32];
    const uint8_t (*sets)[32];
    uint8_t *node_important;        /* (n_nodes,) has a non-eps edge or ends its rule */
    uint8_t *rule_has_calls;        /* (n_rules,) */
    int32_t *tokset_off, *tokset_ids;
    uint8_t *tokset_negated;
    uint8_t byte_class[256];        /* bytes no byte set tells apart share a class */
    uint8_t class_rep[256];         /* a byte of each class */
    int32_t n_byte_classes;
    int32_t max_stack_depth, max_stacks, max_dfa_states;
    /* lazily built automaton */
    eg_dstate *states;
    int32_t n_states, cap_states;
    eg_ints set_pool, call_pool, tok_pool;
    int32_t *hash;                  /* open addressing: state ids, -1 empty */
    int32_t hash_cap;
    int32_t *rule_start_state;      /* (n_rules,) EG_UNKNOWN until built */
    /* cached masks, by the canonical node set of the state (see eg_nfa.canon) */
    eg_part *owned;
    const int32_t *canon;           /* (n_nodes,) the NFA's canonical nodes for this vocabulary, or NULL */
    struct eg_part_slot *part_map;
    int32_t part_cap, n_parts;
    eg_ints keybuf, key_pool;
    /* scratch, used under the lock */
    uint32_t *mark;                 /* (n_nodes,) visit stamps */
    uint32_t stamp;
    eg_ints todo, members, targets;
    eg_frames frames;
    eg_cfgs work, seen, cfg_a, cfg_b, walk_cfgs;
    eg_ints acc, unc;
    int32_t *lv_start, *lv_frames;  /* (max_depth+2,) walk levels */
    uint8_t *lv_exit, *lv_unc;
    const int32_t **lv_row;
    /* uncertain-token results by whole stack (the tokens may read anything below the top) */
    struct eg_unc_entry *uc;
    int32_t uc_cap, uc_n;
    eg_ints uc_stacks, uc_results;
    /* errors and counters */
    char error[256];
    int64_t stats[10];
    pthread_mutex_t lock;
};

struct eg_matcher {
    eg_grammar *g;
    int32_t n_stacks;
    int32_t *off;                   /* (n_stacks+1,) */
    int32_t *st;                    /* (off[n_stacks],) stacks, bottom first */
    int32_t cap_stacks, cap_st;
    uint8_t ended;                  /* some parse has finished: the grammar may end here */
    uint8_t saturated;              /* parses were dropped at GrammarLimits.max_stacks */
};

/* vec helpers */
int eg_ints_push(eg_ints *a, int32_t x);
int eg_ints_reserve(eg_ints *a, int32_t n);
int eg_cfgs_push(eg_cfgs *a, eg_cfg c);
int32_t eg_frames_push(eg_frames *a, eg_frame f);
void *eg_grow(void *p, int32_t *cap, int32_t need, size_t elem);

/* vocab.c */
void eg_part_free(struct eg_part *p);
const eg_slice *eg_vocab_slice(eg_vocab *v, int32_t k);
const uint32_t *eg_slice_upto(eg_vocab *v, int32_t k, int32_t r);
static inline int32_t eg_tok_len(const eg_vocab *v, int32_t t) { return (int32_t)(v->off[t + 1] - v->off[t]); }
static inline const uint8_t *eg_tok_bytes(const eg_vocab *v, int32_t t) { return v->bytes + v->off[t]; }

/* dfa.c */
int eg_dfa_init(eg_grammar *g);
void eg_dfa_free(eg_grammar *g);
int32_t eg_rule_start_state(eg_grammar *g, int32_t rule);
const int32_t *eg_row(eg_grammar *g, int32_t s);
int32_t eg_call_return(eg_grammar *g, int32_t s, int32_t k);
int32_t eg_token_target(eg_grammar *g, int32_t s, int32_t k);
int eg_tokset_has(const eg_grammar *g, int32_t set, int32_t token);
void eg_fail(eg_grammar *g, const char *msg);

/* match.c */
enum { EG_EXITED = 1, EG_OVERFLOW = 2 };
int eg_closure(eg_grammar *g, eg_cfg c, const int32_t *base, eg_cfgs *out, int32_t from);
int eg_check_token(eg_grammar *g, const int32_t *stack, int32_t len, int32_t token);

/* mask.c */
const eg_part *eg_partition(eg_grammar *g, int32_t s);
void eg_parts_free(eg_grammar *g);
int eg_fill_mask(eg_matcher *m, uint32_t *out);
void eg_unc_free(eg_grammar *g);

static inline int eg_bit(const uint8_t *bits, int b) { return (bits[b >> 3] >> (b & 7)) & 1; }
static inline void eg_set(uint32_t *w, int32_t t) { w[t >> 5] |= 1u << (t & 31); }
static inline int eg_test(const uint32_t *w, int32_t t) { return (w[t >> 5] >> (t & 31)) & 1; }

#endif
