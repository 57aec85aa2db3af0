/* Vocabulary: token bytes, the byte trie of the text tokens, and character-class slices.
 *
 * The trie is laid out in preorder: a node's subtree is the index range [node, end[node]),
 * so a walk skips a dead subtree with one assignment. A slice is the set of tokens made
 * only of whole characters of one class (for JSON strings: any character but '"', '\' and
 * controls); a state that reads any such character and comes back to a like state accepts the
 * whole slice at once, and only the other tokens ("rest", a much smaller trie) are walked. */
#include <stdlib.h>
#include <string.h>

#include "gbnf.h"

void *eg_grow(void *p, int32_t *cap, int32_t need, size_t elem)
{
    if (need <= *cap)
        return p;
    int64_t c = *cap ? *cap : 16;
    while (c < need)
        c *= 2;
    if (c > INT32_MAX)
        return NULL;
    void *q = realloc(p, (size_t)c * elem);
    if (q)
        *cap = (int32_t)c;
    return q;
}

int eg_ints_reserve(eg_ints *a, int32_t n)
{
    if (n <= a->cap)
        return 0;
    int32_t cap = a->cap;
    int32_t *v = eg_grow(a->v, &cap, n, sizeof *v);
    if (!v)
        return -1;
    a->v = v, a->cap = cap;
    return 0;
}

int eg_ints_push(eg_ints *a, int32_t x)
{
    if (a->n == a->cap && eg_ints_reserve(a, a->n + 1))
        return -1;
    a->v[a->n++] = x;
    return 0;
}

int eg_cfgs_push(eg_cfgs *a, eg_cfg c)
{
    if (a->n == a->cap) {
        int32_t cap = a->cap;
        eg_cfg *v = eg_grow(a->v, &cap, a->n + 1, sizeof *v);
        if (!v)
            return -1;
        a->v = v, a->cap = cap;
    }
    a->v[a->n++] = c;
    return 0;
}

int32_t eg_frames_push(eg_frames *a, eg_frame f)
{
    if (a->n == a->cap) {
        int32_t cap = a->cap;
        eg_frame *v = eg_grow(a->v, &cap, a->n + 1, sizeof *v);
        if (!v)
            return -1;
        a->v = v, a->cap = cap;
    }
    a->v[a->n] = f;
    return a->n++;
}

/* ---- sorting token ids by a key: bytes of each token, or a suffix of them ---- */

typedef struct {
    const eg_vocab *v;
    const uint16_t *skip; /* (n_vocab,) key = token bytes from this offset on; NULL: from 0 */
} keys;

static const uint8_t *key_bytes(const keys *k, int32_t t, int32_t *len)
{
    int32_t s = k->skip ? k->skip[t] : 0;
    *len = eg_tok_len(k->v, t) - s;
    return eg_tok_bytes(k->v, t) + s;
}

static int cmp_key(const keys *k, int32_t a, int32_t b)
{
    int32_t la, lb;
    const uint8_t *pa = key_bytes(k, a, &la), *pb = key_bytes(k, b, &lb);
    int c = memcmp(pa, pb, (size_t)(la < lb ? la : lb));
    return c ? c : (la > lb) - (la < lb);
}

/* Stable bottom-up merge sort of ids (n,) by key, using tmp (n,). */
static void sort_tokens(const keys *k, int32_t *ids, int32_t n, int32_t *tmp)
{
    for (int32_t w = 1; w < n; w *= 2) {
        for (int32_t lo = 0; lo < n; lo += 2 * w) {
            int32_t mid = lo + w < n ? lo + w : n, hi = lo + 2 * w < n ? lo + 2 * w : n;
            int32_t i = lo, j = mid, o = lo;
            while (i < mid && j < hi)
                tmp[o++] = cmp_key(k, ids[j], ids[i]) < 0 ? ids[j++] : ids[i++];
            while (i < mid)
                tmp[o++] = ids[i++];
            while (j < hi)
                tmp[o++] = ids[j++];
        }
        memcpy(ids, tmp, (size_t)n * sizeof *ids);
    }
}

/* ---- trie ---- */

static void trie_free(eg_trie *t)
{
    free(t->byte), free(t->depth), free(t->end), free(t->tok);
    memset(t, 0, sizeof *t);
}

/* Trie of the ids (n,), sorted by key. Tokens with equal keys are chained through next: filled
 * here when fill_next, else already filled (then equal keys must be chained the same way). */
static int trie_build(const keys *k, const int32_t *ids, int32_t n, eg_trie *t, int32_t *next, int fill_next)
{
    int64_t total = 1;
    int32_t max_len = 0, len;
    for (int32_t i = 0; i < n; i++) {
        key_bytes(k, ids[i], &len);
        total += len;
        max_len = len > max_len ? len : max_len;
    }
    if (total > INT32_MAX || max_len > 65535)
        return -1;
    memset(t, 0, sizeof *t);
    t->next = next;
    t->byte = malloc((size_t)total);
    t->depth = malloc((size_t)total * sizeof *t->depth);
    t->end = malloc((size_t)total * sizeof *t->end);
    t->tok = malloc((size_t)total * sizeof *t->tok);
    int32_t *path = malloc(((size_t)max_len + 1) * sizeof *path);
    if (!t->byte || !t->depth || !t->end || !t->tok || !path) {
        free(path), trie_free(t);
        return -1;
    }
    int32_t nn = 1, depth = 0;
    t->byte[0] = 0, t->depth[0] = 0, t->tok[0] = -1, path[0] = 0;
    const uint8_t *prev = NULL;
    int32_t prev_len = 0;
    for (int32_t i = 0; i < n; i++) {
        const uint8_t *b = key_bytes(k, ids[i], &len);
        int32_t lcp = 0;
        while (lcp < len && lcp < prev_len && b[lcp] == prev[lcp])
            lcp++;
        for (; depth > lcp; depth--)
            t->end[path[depth]] = nn;
        for (; depth < len; depth++) {
            t->byte[nn] = b[depth], t->depth[nn] = (uint16_t)(depth + 1), t->tok[nn] = -1;
            path[depth + 1] = nn++;
        }
        int32_t node = path[len];
        if (fill_next)
            next[ids[i]] = t->tok[node];
        t->tok[node] = ids[i];
        prev = b, prev_len = len;
    }
    for (; depth >= 0; depth--)
        t->end[path[depth]] = nn;
    free(path);
    t->n = nn;
    t->max_depth = max_len;
    return 0;
}

int32_t eg_vocab_trie_nodes(const eg_vocab *v) { return v->trie.n; }

/* ---- character classes and slices ---- */

static int class_dfa(const eg_char_class *c, eg_class_dfa *d)
{
    d->n_nodes = c->n_nodes;
    d->next = malloc((size_t)c->n_nodes * sizeof *d->next);
    if (!d->next)
        return -1;
    for (int32_t i = 0; i < c->n_nodes; i++)
        for (int b = 0; b < 256; b++)
            d->next[i][b] = -1;
    for (int32_t e = 0; e < c->n_edges; e++)
        for (int b = 0; b < 256; b++)
            if (eg_bit(c->bits + 32 * (size_t)e, b)) {
                if (d->next[c->src[e]][b] >= 0 && d->next[c->src[e]][b] != c->dst[e])
                    return -1; /* not deterministic */
                d->next[c->src[e]][b] = (int16_t)c->dst[e];
            }
    return 0;
}

/* Characters of class d at the start of a token; *prefix gets the bytes they take. */
static int32_t class_prefix(const eg_class_dfa *d, const uint8_t *b, int32_t len, int32_t *prefix)
{
    int32_t node = 0, chars = 0;
    *prefix = 0;
    for (int32_t i = 0; i < len; i++) {
        node = d->next[node][b[i]];
        if (node < 0)
            break;
        if (node == 1)
            chars++, node = 0, *prefix = i + 1;
    }
    return chars;
}

static void slice_free(eg_slice *s)
{
    if (!s)
        return;
    if (s->upto)
        for (int32_t r = 0; r <= s->max_chars; r++)
            free(s->upto[r]);
    free(s->upto), free(s->chars), free(s->suffix_next);
    trie_free(&s->rest), trie_free(&s->suffix);
    free(s);
}

/* The slice of class d. Slice tokens: whole class characters only (at most 255 of them). */
static eg_slice *slice_build(eg_vocab *v, const eg_class_dfa *d, const int32_t *sorted, int32_t n_text)
{
    eg_slice *s = calloc(1, sizeof *s);
    int32_t *rest = malloc((size_t)v->n_vocab * sizeof *rest), *tmp = malloc((size_t)v->n_vocab * sizeof *tmp);
    uint16_t *skip = calloc((size_t)v->n_vocab, sizeof *skip);
    if (!s || !rest || !tmp || !skip || !(s->chars = calloc((size_t)v->n_vocab, 1)) ||
        !(s->suffix_next = malloc((size_t)v->n_vocab * sizeof *s->suffix_next)))
        goto fail;
    int32_t n_rest = 0;
    for (int32_t i = 0; i < n_text; i++) { /* in byte order, so the rest stays sorted */
        int32_t t = sorted[i], prefix, len = eg_tok_len(v, t);
        int32_t c = class_prefix(d, eg_tok_bytes(v, t), len, &prefix);
        if (prefix == len && c < 256) {
            s->chars[t] = (uint8_t)c, s->n_tokens++;
            s->max_chars = c > s->max_chars ? c : s->max_chars;
        } else {
            rest[n_rest++] = t, skip[t] = (uint16_t)(prefix < 65535 ? prefix : 0);
        }
    }
    keys by_bytes = {v, NULL}, by_suffix = {v, skip};
    if (!(s->upto = calloc((size_t)s->max_chars + 1, sizeof *s->upto)) ||
        trie_build(&by_bytes, rest, n_rest, &s->rest, v->tok_next, 0))
        goto fail;
    sort_tokens(&by_suffix, rest, n_rest, tmp);
    if (trie_build(&by_suffix, rest, n_rest, &s->suffix, s->suffix_next, 1))
        goto fail;
    free(rest), free(tmp), free(skip);
    return s;
fail:
    free(rest), free(tmp), free(skip), slice_free(s);
    return NULL;
}

const eg_slice *eg_vocab_slice(eg_vocab *v, int32_t k)
{
    return k >= 0 && k < v->n_classes ? v->slices[k] : NULL;
}

/* Bitmask of the slice's tokens of at most r characters (all of them for r >= max_chars). */
const uint32_t *eg_slice_upto(eg_vocab *v, int32_t k, int32_t r)
{
    eg_slice *s = v->slices[k];
    if (r > s->max_chars)
        r = s->max_chars;
    pthread_mutex_lock(&v->lock);
    if (!s->upto[r] && (s->upto[r] = calloc((size_t)v->n_words, sizeof(uint32_t))))
        for (int32_t t = 0; t < v->n_vocab; t++)
            if (s->chars[t] && s->chars[t] <= r)
                eg_set(s->upto[r], t);
    const uint32_t *bits = s->upto[r];
    pthread_mutex_unlock(&v->lock);
    return bits;
}

void eg_part_free(eg_part *p)
{
    if (p)
        free(p->dense), free(p->ids), free(p->unc), free(p);
}

/* ---- vocabulary ---- */

void eg_vocab_free(eg_vocab *v)
{
    if (!v)
        return;

    for (int32_t k = 0; k < v->n_classes; k++) {
        free(v->classes[k].next);
        slice_free(v->slices[k]);
    }
    trie_free(&v->trie);
    free(v->bytes), free(v->off), free(v->is_text), free(v->tok_next), free(v->eog_bits);
    pthread_mutex_destroy(&v->lock);
    free(v);
}

eg_vocab *eg_vocab_new(int32_t n_vocab, const uint8_t *bytes, const int64_t *offsets,
                       const uint8_t *is_text, const int32_t *eog_ids, int32_t n_eog,
                       const eg_char_class *classes, int32_t n_classes)
{
    if (n_vocab <= 0 || n_classes < 0 || n_classes > EG_MAX_CLASSES)
        return NULL;
    eg_vocab *v = calloc(1, sizeof *v);
    if (!v)
        return NULL;
    pthread_mutex_init(&v->lock, NULL);
    v->n_vocab = n_vocab, v->n_words = (n_vocab + 31) / 32;

    size_t nb = (size_t)offsets[n_vocab];
    v->bytes = malloc(nb ? nb : 1);
    v->off = malloc(((size_t)n_vocab + 1) * sizeof *v->off);
    v->is_text = malloc((size_t)n_vocab);
    v->tok_next = malloc((size_t)n_vocab * sizeof *v->tok_next);
    v->eog_bits = calloc((size_t)v->n_words, sizeof *v->eog_bits);
    int32_t *ids = malloc((size_t)n_vocab * sizeof *ids), *tmp = malloc((size_t)n_vocab * sizeof *tmp);
    if (!v->bytes || !v->off || !v->is_text || !v->tok_next || !v->eog_bits || !ids || !tmp)
        goto fail;
    memcpy(v->bytes, bytes, nb);
    memcpy(v->off, offsets, ((size_t)n_vocab + 1) * sizeof *v->off);
    int32_t n_text = 0;
    for (int32_t t = 0; t < n_vocab; t++) {
        v->tok_next[t] = -1;
        v->is_text[t] = is_text[t] && eg_tok_len(v, t) > 0;
        if (v->is_text[t])
            ids[n_text++] = t;
    }
    for (int32_t i = 0; i < n_eog; i++)
        if (eog_ids[i] >= 0 && eog_ids[i] < n_vocab)
            eg_set(v->eog_bits, eog_ids[i]);
    keys by_bytes = {v, NULL};
    sort_tokens(&by_bytes, ids, n_text, tmp);
    if (trie_build(&by_bytes, ids, n_text, &v->trie, v->tok_next, 1))
        goto fail;
    for (int32_t k = 0; k < n_classes; k++) {
        v->n_classes = k + 1;
        if (class_dfa(&classes[k], &v->classes[k]) || !(v->slices[k] = slice_build(v, &v->classes[k], ids, n_text)))
            goto fail;
    }
    free(ids), free(tmp);
    return v;
fail:
    free(ids), free(tmp);
    eg_vocab_free(v);
    return NULL;
}
