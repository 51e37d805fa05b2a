/* specpipe's token datastore: REST's lookup in one suffix array, compiled (rest_lookup).

   What: the longest suffix of the context (min_span..max_span tokens; tokens the store's keys cannot pack cut the
   context) found in the store; an evenly spaced sample of its occurrences; the distinct non-empty continuations
   after them (cut at a document's end), ranked by the sum of their prefix counts, ties to the row that sorts first;
   the best max_candidates in sorted order. The same answer as
   specpipe.stores.token_datastore.merged_lookup over one shard (see its docstring and _distinct_continuations').

   Why: a REST step looks the context up twice (its longest suffix, then the next shorter one), and in numpy each
   lookup is dozens of small array operations, slow right after a verify forward has streamed the model's weights
   through the caches. This function touches only the suffix-array rows and tokens it reads.

   Plain C (no Python or torch headers): specpipe.stores.suffix_lookup builds it once per machine with the system's
   C compiler into the specpipe cache and calls it through ctypes. Every suffix-array entry it reads is checked
   against the tokens' bounds: a damaged store makes the lookup report the damage (-2), never read outside its
   arrays. */

#include <stdint.h>
#include <stdlib.h>

typedef struct {
    const int32_t *tokens;        /* [n] token ids, a document's end = -1; the last entry is -1 */
    int64_t n_tokens;
    const void *suffix_array;     /* [m] int32 or int64 starts of the suffixes led by a real token */
    int32_t suffix_array_64;      /* 1: int64 entries */
    int64_t n_suffixes;
    const uint64_t *prefix_keys;  /* [m] the first tokens_per_key tokens packed, token + 1 per field */
    int32_t key_bits;
    int32_t tokens_per_key;
    int corrupt;                  /* set when a suffix-array entry points outside the tokens */
} Store;

/* The start of the suffix at `row` (< n_suffixes: every caller's row comes from a range inside the
   array). A damaged store's entry outside [0, n_tokens) marks the store corrupt and reads as 0, so no
   read leaves the arrays; the lookup then reports the damage instead of an answer. */
static int64_t suffix_at(Store *s, int64_t row) {
    if (row < 0 || row >= s->n_suffixes) { s->corrupt = 1; return 0; }
    int64_t start = s->suffix_array_64 ? ((const int64_t *)s->suffix_array)[row]
                                       : ((const int32_t *)s->suffix_array)[row];
    if (start < 0 || start >= s->n_tokens) { s->corrupt = 1; return 0; }
    return start;
}

/* The tokens at start.. against pattern[0..width): <0, 0, >0. A document's end (-1) sorts below every
   token, and a whole store ends with one, so a read stops at the array's end (patterns hold no -1); the
   bound is checked anyway, a damaged store being marked corrupt rather than read past its end. */
static int compare_at(Store *s, int64_t start, const int32_t *pattern, int width) {
    for (int j = 0; j < width; j++) {
        if (start + j < 0 || start + j >= s->n_tokens) { s->corrupt = 1; return -1; }
        int32_t token = s->tokens[start + j];
        if (token != pattern[j]) return token < pattern[j] ? -1 : 1;
    }
    return 0;
}

/* first row in [lo, hi) whose key is >= (upper: >) key */
static int64_t key_bound(const Store *s, int64_t lo, int64_t hi, uint64_t key, int upper) {
    while (lo < hi) {
        int64_t mid = lo + (hi - lo) / 2;
        uint64_t value = s->prefix_keys[mid];
        if (upper ? value <= key : value < key) lo = mid + 1; else hi = mid;
    }
    return lo;
}

/* first row in [lo, hi) whose suffix, from offset on, compares >= (upper: >) the pattern */
static int64_t suffix_bound(Store *s, int64_t lo, int64_t hi, const int32_t *pattern, int width,
                            int offset, int upper) {
    while (lo < hi) {
        int64_t mid = lo + (hi - lo) / 2;
        int order = compare_at(s, suffix_at(s, mid) + offset, pattern, width);
        if (upper ? order <= 0 : order < 0) lo = mid + 1; else hi = mid;
    }
    return lo;
}

/* The range [lo, hi) of the suffixes that start with pattern[0..width) (width >= 1, packable tokens). */
static void find_range(Store *s, const int32_t *pattern, int width, int64_t *lo, int64_t *hi) {
    int head = width < s->tokens_per_key ? width : s->tokens_per_key;
    uint64_t key = 0;
    for (int j = 0; j < head; j++) key = (key << s->key_bits) | (uint64_t)(pattern[j] + 1);
    int free_bits = s->key_bits * (s->tokens_per_key - head);
    uint64_t low = key << free_bits;
    uint64_t high = low | ((((uint64_t)1) << free_bits) - 1);
    *lo = key_bound(s, 0, s->n_suffixes, low, 0);
    *hi = key_bound(s, *lo, s->n_suffixes, high, 1);
    if (width > head && *lo < *hi) {
        int64_t first = suffix_bound(s, *lo, *hi, pattern + head, width - head, head, 0);
        *hi = suffix_bound(s, first, *hi, pattern + head, width - head, head, 1);
        *lo = first;
    }
}

typedef struct { int64_t value; int64_t row; } Ranked;

static int by_value_then_row(const void *a, const void *b) {
    const Ranked *x = (const Ranked *)a, *y = (const Ranked *)b;
    if (x->value != y->value) return x->value > y->value ? -1 : 1;
    return x->row < y->row ? -1 : (x->row > y->row);
}

static int by_row(const void *a, const void *b) {
    const Ranked *x = (const Ranked *)a, *y = (const Ranked *)b;
    return x->row < y->row ? -1 : (x->row > y->row);
}

/* header[4] = match length, occurrences, sampled, candidates c; for i < c: lengths[i], and
   continuations / counts [i * max_length + d] for d < lengths[i]. Returns 0; -1 when out of memory;
   -2 when the store is damaged (a suffix-array entry outside the tokens, arrays that cannot be a store,
   key fields wider than an int32 token needs): then nothing is answered. */
int64_t rest_lookup(const int32_t *tokens, int64_t n_tokens, const void *suffix_array, int32_t suffix_array_64,
                    int64_t n_suffixes, const uint64_t *prefix_keys, int32_t key_bits,
                    const int32_t *context, int32_t context_length, int32_t max_span, int32_t min_span,
                    int32_t max_length, int32_t max_candidates, int32_t max_occurrences,
                    int64_t *header, int32_t *continuations, int32_t *counts, int32_t *lengths) {
    if (n_tokens < 1 || n_suffixes < 0 || n_suffixes > n_tokens || key_bits < 1 || key_bits > 32) return -2;
    Store store = {tokens, n_tokens, suffix_array, suffix_array_64, n_suffixes, prefix_keys, key_bits,
                   64 / key_bits, 0};
    Store *s = &store;
    int64_t token_limit = (((int64_t)1) << key_bits) - 1;
    header[0] = header[1] = header[2] = header[3] = 0;
    /* the window: the last max_span tokens, cut after the last token that cannot be packed */
    int start = context_length > max_span ? context_length - max_span : 0;
    for (int j = context_length - 1; j >= start; j--)
        if (context[j] < 0 || context[j] >= token_limit) { start = j + 1; break; }
    int available = context_length - start;
    if (min_span < 1) min_span = 1;
    if (min_span > available) return 0;
    /* spans that occur are min_span..best (a suffix of an occurring span occurs): binary search */
    int64_t lo = 0, hi = 0;
    int best = 0;
    int low = min_span, high = available;
    while (low <= high) {
        int span = low + (high - low) / 2;
        int64_t span_lo, span_hi;
        find_range(s, context + context_length - span, span, &span_lo, &span_hi);
        if (s->corrupt) return -2;
        if (span_lo < span_hi) { best = span; lo = span_lo; hi = span_hi; low = span + 1; }
        else high = span - 1;
    }
    if (best == 0) return 0;
    int64_t occurrences = hi - lo;
    int64_t sampled = occurrences < max_occurrences ? occurrences : max_occurrences;
    int width = max_length;
    int32_t *rows = (int32_t *)malloc(sizeof(int32_t) * (size_t)(sampled * width));
    int32_t *first_difference = (int32_t *)malloc(sizeof(int32_t) * (size_t)sampled);
    int64_t *prefix = (int64_t *)malloc(sizeof(int64_t) * (size_t)(sampled * width));
    Ranked *ranked = (Ranked *)malloc(sizeof(Ranked) * (size_t)sampled);
    if (!rows || !first_difference || !prefix || !ranked) {
        free(rows); free(first_difference); free(prefix); free(ranked);
        return -1;
    }
    /* the continuations after the sampled occurrences, in suffix-array order (sorted), -1 from a
       document's end on */
    for (int64_t k = 0; k < sampled; k++) {
        int64_t at = suffix_at(s, lo + (k * occurrences) / sampled) + best;
        int32_t *row = rows + k * width;
        int inside = 1;
        for (int d = 0; d < width; d++) {
            int64_t position = at + d < n_tokens ? at + d : n_tokens - 1;
            int32_t token = inside ? tokens[position] : -1;
            if (token == -1) inside = 0;
            row[d] = token;
        }
    }
    if (s->corrupt) {
        free(rows); free(first_difference); free(prefix); free(ranked);
        return -2;
    }
    /* first_difference[k]: the first depth where row k differs from row k - 1 (width: equal rows);
       prefix[k, d]: how many rows share row k's first d + 1 tokens (0 past its end) */
    first_difference[0] = 0;
    for (int64_t k = 1; k < sampled; k++) {
        int d = 0;
        while (d < width && rows[k * width + d] == rows[(k - 1) * width + d]) d++;
        first_difference[k] = d;
    }
    for (int d = 0; d < width; d++) {
        int64_t run_start = 0;
        for (int64_t k = 1; k <= sampled; k++) {
            if (k == sampled || first_difference[k] <= d) {
                for (int64_t r = run_start; r < k; r++)
                    prefix[r * width + d] = rows[r * width + d] == -1 ? 0 : k - run_start;
                run_start = k;
            }
        }
    }
    /* distinct non-empty rows (the first of each run of equal rows), by the sum of their prefix counts */
    int64_t distinct = 0;
    for (int64_t k = 0; k < sampled; k++) {
        if ((k > 0 && first_difference[k] == width) || rows[k * width] == -1) continue;
        int64_t value = 0;
        for (int d = 0; d < width; d++) value += prefix[k * width + d];
        ranked[distinct].value = value;
        ranked[distinct].row = k;
        distinct++;
    }
    qsort(ranked, (size_t)distinct, sizeof(Ranked), by_value_then_row);
    int64_t chosen = distinct < max_candidates ? distinct : max_candidates;
    qsort(ranked, (size_t)chosen, sizeof(Ranked), by_row);
    for (int64_t i = 0; i < chosen; i++) {
        int64_t k = ranked[i].row;
        int length = 0;
        while (length < width && rows[k * width + length] != -1) length++;
        lengths[i] = length;
        for (int d = 0; d < length; d++) {
            continuations[i * width + d] = rows[k * width + d];
            counts[i * width + d] = (int32_t)prefix[k * width + d];
        }
    }
    header[0] = best; header[1] = occurrences; header[2] = sampled; header[3] = chosen;
    free(rows); free(first_difference); free(prefix); free(ranked);
    return 0;
}
