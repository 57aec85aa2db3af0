/* Grammar engine: what Python may call (plain declarations, parsed by cffi and included by
 * the C sources).
 *
 * eg_vocab    a vocabulary: token bytes, which tokens are text, end-of-generation ids, and
 *             a byte trie of the text tokens; built once per tokenizer.
 * eg_grammar  a checked byte automaton (from ember/gbnf/nfa.py) bound to a vocabulary, with
 *             the lazily built deterministic states and the per-state token masks cached.
 * eg_matcher  one sequence's parse state: a small set of stacks of automaton states.
 *
 * Calls on matchers of one grammar are serialized by the grammar's lock; a matcher itself
 * must not be used by two threads at once. Functions returning int give a negative
 * EG_ERR_* code on failure, with eg_grammar_error() saying why. */

typedef struct eg_vocab eg_vocab;
typedef struct eg_grammar eg_grammar;
typedef struct eg_matcher eg_matcher;

typedef struct eg_nfa eg_nfa;

/* Rules to build a byte automaton from. Each rule is a postfix program over int32 ops:
 *   1 LIT n s_1..s_n    n bytes, each given as its one-byte set id
 *   2 CLASS c           class fragment c
 *   3 REF r             rule r: copied in when inline_rule[r], else a call
 *   4 TOKEN t           token set t
 *   5 SEQ n / 6 ALT n   the last n fragments in sequence / as alternatives
 *   7 REP min max       the last fragment repeated (max -1: unbounded)
 * A class fragment is n_nodes then n_edges then (src, set, dst) triples; node 0 starts it and
 * node 1 ends it. Rules are built in build_order, which puts every inlined rule before its
 * callers. */
typedef struct {
    int32_t n_rules, root, n_sets, n_classes;
    const int32_t *ops;             /* all programs */
    const int32_t *rule_ops;        /* (n_rules+1,) offsets of each rule's program */
    const int32_t *build_order;     /* (n_build,) rules to build; others are never used */
    int32_t n_build;
    const uint8_t *inline_rule;     /* (n_rules,) 0 a call, 1 copied in, 2 copied in more than once (shrunk first) */
    const uint8_t *nullable;        /* (n_rules,) */
    const uint8_t *sets;            /* (n_sets, 32) byte bitmaps, bit b in byte b>>3 */
    const int32_t *class_off;       /* (n_classes+1,) offsets into class_data */
    const int32_t *class_data;
    int64_t max_states;             /* automaton nodes, all rules together */
    int32_t max_rule_states;        /* a rule stops inlining past this many nodes */
} eg_nfa_input;

/* NULL on failure, with a message in err (errlen bytes) and *bad_rule set when one rule is at fault. */
eg_nfa *eg_nfa_build(const eg_nfa_input *in, char *err, int32_t errlen, int32_t *bad_rule);
void eg_nfa_free(eg_nfa *nfa);
int32_t eg_nfa_nodes(const eg_nfa *nfa);
int32_t eg_nfa_edges(const eg_nfa *nfa);
/* rules that remain call targets, root first: fills out (up to cap) with rule indices */
int32_t eg_nfa_rules(const eg_nfa *nfa, int32_t *out, int32_t cap);

/* Token sets of a grammar, resolved against a vocabulary. */
typedef struct {
    int32_t n_toksets;
    const int32_t *tokset_off;      /* (n_toksets+1,) */
    const int32_t *tokset_ids;      /* token ids of each set */
    const uint8_t *tokset_negated;  /* (n_toksets,) 1: the set matches every other token */
    int32_t max_stack_depth, max_stacks, max_dfa_states;
} eg_binding;

/* One character class used to cut whole groups of tokens out of mask walks: a byte
 * automaton for one character of the class, node 0 the start and node 1 the end. */
typedef struct {
    int32_t n_nodes, n_edges;
    const int32_t *src;             /* (n_edges,) */
    const int32_t *dst;             /* (n_edges,) */
    const uint8_t *bits;            /* (n_edges, 32) byte bitmaps */
} eg_char_class;

eg_vocab *eg_vocab_new(int32_t n_vocab, const uint8_t *bytes, const int64_t *offsets,
                       const uint8_t *is_text, const int32_t *eog_ids, int32_t n_eog,
                       const eg_char_class *classes, int32_t n_classes);
void eg_vocab_free(eg_vocab *v);
int32_t eg_vocab_trie_nodes(const eg_vocab *v);

eg_grammar *eg_grammar_new(eg_vocab *v, const eg_nfa *nfa, const eg_binding *b);
void eg_grammar_free(eg_grammar *g);
const char *eg_grammar_error(const eg_grammar *g);
/* out: (10,) dfa states, rows built, partitions computed, mask walks, trie nodes walked,
 * uncertain tokens checked, slice uses, cache hits of uncertain-token results, partitions
 * found in the vocabulary's cache, reserved */
void eg_grammar_stats(eg_grammar *g, int64_t *out);

eg_matcher *eg_matcher_new(eg_grammar *g);
eg_matcher *eg_matcher_clone(const eg_matcher *m);
void eg_matcher_free(eg_matcher *m);
/* 1 accepted (state advanced), 0 rejected (state unchanged), <0 error */
int eg_matcher_accept_token(eg_matcher *m, int32_t token);
int eg_matcher_accept_bytes(eg_matcher *m, const uint8_t *data, int32_t n);
/* Allowed tokens as a bitmask out ((n_vocab+31)/32,); end-of-generation tokens when the grammar
 * can end. Returns the number of stacks looked at, <0 on error. */
int eg_matcher_fill_mask(eg_matcher *m, uint32_t *out);
int eg_matcher_can_end(const eg_matcher *m);
/* 1 when no stack can read anything more (only the end remains) */
int eg_matcher_at_end(const eg_matcher *m);
int eg_matcher_n_stacks(const eg_matcher *m);
/* 1 once parses were dropped because they outnumbered max_stacks (masks stay sound, not complete) */
int eg_matcher_saturated(const eg_matcher *m);
/* Bytes every continuation must start with (up to cap); stops at a choice or at the end. */
int eg_matcher_forced_bytes(eg_matcher *m, uint8_t *out, int32_t cap);
