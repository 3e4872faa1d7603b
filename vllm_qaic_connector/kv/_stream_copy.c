/* Copies of many byte ranges, and of strided blocks, with non-temporal stores.
 *
 * A KV handoff writes whole blocks that the decode reads at its next step, not now, so
 * caching the destination only costs bandwidth: an ordinary copy first reads every
 * destination line it writes. Streaming stores skip that read, and walking four ranges
 * at once keeps more loads in flight; together they copy shuffled 32 KiB-256 KiB blocks
 * about 1.5x faster than memcpy per block (see `python -m testbed.handoff_bench`).
 * Without SSE2 this is memcpy per range.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#define WAYS 4
#define STEP 4096 /* bytes of each range per turn: one page */

#if defined(__SSE2__)
/* Streams [off, end) of one range; the caller keeps dst + off 16-byte aligned. */
static void stream_part(char *dst, const char *src, size_t off, size_t end) {
    for (; off + 64 <= end; off += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + off));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + off + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + off + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + off + 48));
        _mm_stream_si128((__m128i *)(dst + off), a);
        _mm_stream_si128((__m128i *)(dst + off + 16), b);
        _mm_stream_si128((__m128i *)(dst + off + 32), c);
        _mm_stream_si128((__m128i *)(dst + off + 48), d);
    }
    if (off < end) memcpy(dst + off, src + off, end - off);
}

/* One range: memcpy up to the first 16-byte aligned destination byte, stream the rest. */
static size_t aligned_head(const char *dst, size_t len) {
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    return head < len ? head : len;
}

static void copy_group(const uint64_t *dst_at, const uint64_t *src_at, const uint64_t *len, size_t n) {
    char *dst[WAYS];
    const char *src[WAYS];
    size_t head[WAYS], longest = 0;
    for (size_t w = 0; w < n; w++) {
        dst[w] = (char *)(uintptr_t)dst_at[w];
        src[w] = (const char *)(uintptr_t)src_at[w];
        head[w] = aligned_head(dst[w], len[w]);
        memcpy(dst[w], src[w], head[w]);
        if (len[w] > longest) longest = len[w];
    }
    /* turn k streams [head + k * STEP, head + (k + 1) * STEP) of every range: aligned */
    for (size_t off = 0; off < longest; off += STEP) {
        for (size_t w = 0; w < n; w++) {
            size_t start = head[w] + off;
            size_t end = start + STEP < len[w] ? start + STEP : len[w];
            if (start < end) stream_part(dst[w], src[w], start, end);
        }
    }
}
#endif

static void copy_ranges(const uint64_t *dst, const uint64_t *src, const uint64_t *len, size_t n) {
#if defined(__SSE2__)
    for (size_t i = 0; i < n; i += WAYS) {
        size_t k = n - i < WAYS ? n - i : WAYS;
        copy_group(dst + i, src + i, len + i, k);
    }
    _mm_sfence(); /* streamed stores are weakly ordered: visible before we return */
#else
    for (size_t i = 0; i < n; i++) memcpy((void *)(uintptr_t)dst[i], (const void *)(uintptr_t)src[i], len[i]);
#endif
}

/* Block i's rows: rows[a][b] of `chunk` bytes at base + a * stride_a + b * stride_b. */
typedef struct {
    Py_ssize_t rows_a, rows_b, chunk, dst_a, dst_b, src_a, src_b;
} rows_t;

static void copy_blocks(const uint64_t *dst, const uint64_t *src, size_t n, const rows_t *r) {
    for (size_t i = 0; i < n; i++) {
        for (Py_ssize_t a = 0; a < r->rows_a; a++) {
            for (Py_ssize_t b = 0; b < r->rows_b; b++) {
                char *d = (char *)(uintptr_t)dst[i] + a * r->dst_a + b * r->dst_b;
                const char *s = (const char *)(uintptr_t)src[i] + a * r->src_a + b * r->src_b;
#if defined(__SSE2__)
                size_t head = aligned_head(d, (size_t)r->chunk);
                memcpy(d, s, head);
                stream_part(d, s, head, (size_t)r->chunk);
#else
                memcpy(d, s, (size_t)r->chunk);
#endif
            }
        }
    }
#if defined(__SSE2__)
    _mm_sfence();
#endif
}

/* Runs copy(dst, src, n, plan) over two uint64 address buffers of one length, the GIL
 * released, where `valid` (the plan's own checks) holds; releases both buffers. */
typedef void (*block_copy_t)(const uint64_t *, const uint64_t *, size_t, const void *);

static PyObject *run_blocks(Py_buffer *dst, Py_buffer *src, int valid, const char *usage,
                            block_copy_t copy, const void *plan) {
    PyObject *result = NULL;
    if (!valid || dst->len != src->len || dst->len % sizeof(uint64_t)) {
        PyErr_SetString(PyExc_ValueError, usage);
    } else {
        Py_BEGIN_ALLOW_THREADS
        copy(dst->buf, src->buf, (size_t)dst->len / sizeof(uint64_t), plan);
        Py_END_ALLOW_THREADS
        result = Py_None;
        Py_INCREF(result);
    }
    PyBuffer_Release(dst);
    PyBuffer_Release(src);
    return result;
}

static void copy_blocks_of(const uint64_t *dst, const uint64_t *src, size_t n, const void *plan) {
    copy_blocks(dst, src, n, (const rows_t *)plan);
}

static PyObject *py_copy_blocks(PyObject *self, PyObject *args) {
    Py_buffer dst, src;
    rows_t r;
    if (!PyArg_ParseTuple(args, "y*y*nnnnnnn", &dst, &src, &r.rows_a, &r.rows_b, &r.chunk,
                          &r.dst_a, &r.dst_b, &r.src_a, &r.src_b))
        return NULL;
    int valid = r.rows_a >= 0 && r.rows_b >= 0 && r.chunk >= 0;
    return run_blocks(&dst, &src, valid, "copy_blocks: two uint64 arrays of one length, counts >= 0",
                      copy_blocks_of, &r);
}

/* Block i's elements [o][r][c] of `item` bytes at base + o * stride_o + r * stride_r +
 * c * stride_c on either side: a transpose (vLLM CPU's K is stored [head_dim, tokens]),
 * which rows cannot express. */
typedef struct {
    Py_ssize_t n_o, n_r, n_c, item, dst_o, dst_r, dst_c, src_o, src_r, src_c;
} tiles_t;

#define TILE 32 /* elements: a square of them keeps both sides' lines in L1 */
#define COPY_TILES(T)                                                                      \
    for (Py_ssize_t r0 = 0; r0 < t->n_r; r0 += TILE) {                                     \
        Py_ssize_t r1 = r0 + TILE < t->n_r ? r0 + TILE : t->n_r;                           \
        for (Py_ssize_t c0 = 0; c0 < t->n_c; c0 += TILE) {                                 \
            Py_ssize_t c1 = c0 + TILE < t->n_c ? c0 + TILE : t->n_c;                       \
            for (Py_ssize_t r = r0; r < r1; r++)                                           \
                for (Py_ssize_t c = c0; c < c1; c++)                                       \
                    *(T *)(d + r * t->dst_r + c * t->dst_c) =                              \
                        *(const T *)(s + r * t->src_r + c * t->src_c);                     \
        }                                                                                  \
    }

static void copy_strided(char *d, const char *s, const tiles_t *t) {
    switch (t->item) {
    case 1: COPY_TILES(uint8_t) break;
    case 2: COPY_TILES(uint16_t) break;
    case 4: COPY_TILES(uint32_t) break;
    default: COPY_TILES(uint64_t) break;
    }
}

#if defined(__SSE2__)
#define BOUNCE 65536

/* A dense n_c x n_r matrix of 2-byte elements (row length n_r) to its dense transpose, 8 x 8
 * at a time: eight 16-byte loads, three rounds of unpacks, eight 16-byte stores. */
static void transpose_2byte(char *d, const char *s, Py_ssize_t n_r, Py_ssize_t n_c) {
    for (Py_ssize_t r0 = 0; r0 < n_r; r0 += 8) {
        for (Py_ssize_t c0 = 0; c0 < n_c; c0 += 8) {
            __m128i a[8], b[8], e[8];
            for (int j = 0; j < 8; j++)
                a[j] = _mm_load_si128((const __m128i *)(s + ((c0 + j) * n_r + r0) * 2));
            for (int j = 0; j < 4; j++) {
                b[j] = _mm_unpacklo_epi16(a[2 * j], a[2 * j + 1]);
                b[j + 4] = _mm_unpackhi_epi16(a[2 * j], a[2 * j + 1]);
            }
            for (int j = 0; j < 2; j++) {
                e[j] = _mm_unpacklo_epi32(b[2 * j], b[2 * j + 1]);
                e[j + 2] = _mm_unpackhi_epi32(b[2 * j], b[2 * j + 1]);
                e[j + 4] = _mm_unpacklo_epi32(b[4 + 2 * j], b[4 + 2 * j + 1]);
                e[j + 6] = _mm_unpackhi_epi32(b[4 + 2 * j], b[4 + 2 * j + 1]);
            }
            for (int j = 0; j < 4; j++) {
                __m128i lo = _mm_unpacklo_epi64(e[2 * j], e[2 * j + 1]);
                __m128i hi = _mm_unpackhi_epi64(e[2 * j], e[2 * j + 1]);
                _mm_store_si128((__m128i *)(d + ((r0 + 2 * j) * n_c + c0) * 2), lo);
                _mm_store_si128((__m128i *)(d + ((r0 + 2 * j + 1) * n_c + c0) * 2), hi);
            }
        }
    }
}

/* Whether one [r][c] matrix of 2-byte elements, read along r and written along c, fits the
 * bounce buffers in 8 x 8 tiles. */
static int transposes_in_cache(const tiles_t *t) {
    return t->item == 2 && t->src_r == 2 && t->dst_c == 2 && t->n_r % 8 == 0 &&
           t->n_c % 8 == 0 && t->n_r * t->n_c * 2 <= BOUNCE;
}

/* Strided 16-byte reads and writes in memory defeat the prefetcher and read every line
 * they write; in L1 they cost little. So: source rows in order into one buffer, transpose
 * into another, stream its rows out. About 4x numpy's strided copy. */
static void transpose_via_cache(char *d, const char *s, const tiles_t *t, char *in, char *out) {
    size_t src_row = (size_t)t->n_r * 2, dst_row = (size_t)t->n_c * 2;
    for (Py_ssize_t c = 0; c < t->n_c; c++) memcpy(in + c * src_row, s + c * t->src_c, src_row);
    transpose_2byte(out, in, t->n_r, t->n_c);
    for (Py_ssize_t r = 0; r < t->n_r; r++) {
        char *row = d + r * t->dst_r;
        size_t head = aligned_head(row, dst_row);
        memcpy(row, out + r * dst_row, head);
        stream_part(row, out + r * dst_row, head, dst_row);
    }
}
#endif

static void copy_tiles(const uint64_t *dst, const uint64_t *src, size_t n, const tiles_t *t) {
#if defined(__SSE2__)
    static __thread char bounce[2][BOUNCE] __attribute__((aligned(64)));
    int fast = transposes_in_cache(t);
#endif
    for (size_t i = 0; i < n; i++) {
        for (Py_ssize_t o = 0; o < t->n_o; o++) {
            char *d = (char *)(uintptr_t)dst[i] + o * t->dst_o;
            const char *s = (const char *)(uintptr_t)src[i] + o * t->src_o;
#if defined(__SSE2__)
            if (fast) {
                transpose_via_cache(d, s, t, bounce[0], bounce[1]);
                continue;
            }
#endif
            copy_strided(d, s, t);
        }
    }
#if defined(__SSE2__)
    _mm_sfence();
#endif
}

static void copy_tiles_of(const uint64_t *dst, const uint64_t *src, size_t n, const void *plan) {
    copy_tiles(dst, src, n, (const tiles_t *)plan);
}

static PyObject *py_copy_tiles(PyObject *self, PyObject *args) {
    Py_buffer dst, src;
    tiles_t t;
    if (!PyArg_ParseTuple(args, "y*y*nnnnnnnnnn", &dst, &src, &t.n_o, &t.n_r, &t.n_c, &t.item,
                          &t.dst_o, &t.dst_r, &t.dst_c, &t.src_o, &t.src_r, &t.src_c))
        return NULL;
    int item_ok = t.item == 1 || t.item == 2 || t.item == 4 || t.item == 8;
    int valid = item_ok && t.n_o >= 0 && t.n_r >= 0 && t.n_c >= 0;
    return run_blocks(&dst, &src, valid,
                      "copy_tiles: two uint64 arrays of one length, counts >= 0, item 1/2/4/8",
                      copy_tiles_of, &t);
}

static PyObject *py_copy_ranges(PyObject *self, PyObject *args) {
    Py_buffer dst, src, len;
    if (!PyArg_ParseTuple(args, "y*y*y*", &dst, &src, &len)) return NULL;
    PyObject *result = NULL;
    size_t n = (size_t)len.len / sizeof(uint64_t);
    if (dst.len != len.len || src.len != len.len || len.len % sizeof(uint64_t)) {
        PyErr_SetString(PyExc_ValueError, "copy_ranges: three uint64 arrays of one length");
    } else {
        Py_BEGIN_ALLOW_THREADS
        copy_ranges(dst.buf, src.buf, len.buf, n);
        Py_END_ALLOW_THREADS
        result = Py_None;
        Py_INCREF(result);
    }
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    PyBuffer_Release(&len);
    return result;
}

static PyMethodDef methods[] = {
    {"copy_ranges", py_copy_ranges, METH_VARARGS,
     "copy_ranges(dst, src, lengths): three uint64 buffers of addresses and byte counts; "
     "copies each range with non-temporal stores, the GIL released."},
    {"copy_blocks", py_copy_blocks, METH_VARARGS,
     "copy_blocks(dst, src, rows_a, rows_b, chunk, dst_a, dst_b, src_a, src_b): for each "
     "pair of block addresses (uint64 buffers), copies chunk bytes at a * stride_a + "
     "b * stride_b for every row (a, b), with non-temporal stores, the GIL released."},
    {"copy_tiles", py_copy_tiles, METH_VARARGS,
     "copy_tiles(dst, src, n_o, n_r, n_c, item, dst_o, dst_r, dst_c, src_o, src_r, src_c): "
     "for each pair of block addresses, copies n_o x n_r x n_c elements of item bytes "
     "between strided positions, in cache-sized tiles, the GIL released."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_stream_copy", NULL, -1, methods};

PyMODINIT_FUNC PyInit__stream_copy(void) { return PyModule_Create(&module); }
